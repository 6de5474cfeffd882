"""The ``rm`` and ``prm`` stages of a post-training run, and learned rewards inside PPO.

``rm``: a reward model (``RewardModel``: the policy's trunk with a sequence-score
head, started from the warm-started policy) trained with the Bradley-Terry loss
on correctness pairs built from the run's answer domains (a demonstration against
a well-formed wrong variant, ``rlpt.rewards.data``) and, when given, a user's
preference JSONL (``reward_model.pairs_jsonl``). Held-out pairwise accuracy per
domain is logged and kept for the summary.

``prm``: a process reward model labelled the Math-Shepherd way: the current policy
samples solutions of ``process_reward.domain``, and from every step prefix it
samples ``continuations`` completions in one batched job; a step's soft label is
the fraction that reach the verified answer. Planted wrong steps are added so
that wrong steps are well represented. Trained with binary cross-entropy at the
step separators; held-out step ROC-AUC on planted errors is logged.

During PPO, ``LearnedRewards.apply`` scores each rollout batch with whichever
models were trained and replaces the batch's per-token rewards with
``rlpt.rewards.composite.assemble_rewards``: the verifier and rule terms on the
last token, the reward-model score there too, and process rewards at every
step's last token (aggregated by ``rewards.process_aggregation``), the learned
terms under running normalisation and clipping. A ``RewardMonitor`` tracks, per
domain, how often the learned verdict agrees with the verifier; that agreement
is the curriculum's per-domain confidence and its collapse flags reward hacking.

With ``reward_model.refresh_every`` > 0 the reward model follows the policy: every
rollout's verifier and sandbox verdicts join a buffer of the newest
``refresh_buffer`` traces, and every ``refresh_every`` PPO steps
``refresh_steps`` Bradley-Terry steps train it on pairs of one prompt's right and
wrong completions from that buffer (``rlpt.rewards.RewardModelRefresher``). Its
optimiser state and the buffer are checkpointed, so a resumed run refreshes as an
uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from rlpt.models import ProcessRewardModel, RewardModel, create_model
from rlpt.rewards.composite import NormState, RewardConfig, assemble_rewards, init_norm_state
from rlpt.rewards.data import correctness_pairs, planted_error_solutions
from rlpt.rewards.losses import pairwise_accuracy, roc_auc
from rlpt.rewards.monitor import MonitorConfig, RewardMonitor, _DomainStats
from rlpt.rewards.preferences import (
    Trace,
    encode_pairs,
    encode_sequence,
    load_preferences,
    traces_from_results,
)
from rlpt.rewards.process import encode_step_examples, math_shepherd_labels
from rlpt.rewards.scoring import (
    RewardModelRefresher,
    rollout_process_scores,
    rollout_rm_scores,
)
from rlpt.rewards.train import (
    TrainConfig,
    prm_trainer,
    rm_trainer,
    sequence_scores,
    step_logits,
    with_trunk,
)
from rlpt.sampling import SamplingParams
from rlpt.tokenizers import decode_response

if TYPE_CHECKING:
    from rlpt.trainers.post_train import PostTrainRun

RM_KEY, PRM_KEY, NORM_KEY = "reward_model", "process_reward_model", "reward_norm"
RM_STATE_KEY = "reward_model_state"  # parameters and optimiser state, when refreshing


def _batches(n: int, batch_size: int, steps: int, rng: np.random.Generator):
    for _ in range(steps):
        yield rng.integers(0, n, size=batch_size)


def _chunked(fn, params, arrays: Mapping[str, np.ndarray], chunk: int = 256) -> np.ndarray:
    n = len(next(iter(arrays.values())))
    out = [
        np.asarray(fn(params, *(v[i : i + chunk] for v in arrays.values())))
        for i in range(0, n, chunk)
    ]
    return np.concatenate(out)


def _answer_domains(run: PostTrainRun, names) -> list[str]:
    picked = [n for n in names if n in run.domains]
    if not picked and not run.config.reward_model.get("pairs_jsonl"):
        raise ValueError(
            f"reward_model.domains {tuple(names)} names none of the run's domains "
            f"{tuple(run.domains)} and reward_model.pairs_jsonl is empty: no pairs to train on"
        )
    return picked


def check_config(config) -> None:
    """Learned-reward settings that are wrong fail here, before anything compiles."""
    stages = tuple(config.stages)
    r = config.rewards
    if r.get("reward_model", 0.0) and "rm" not in stages:
        raise ValueError(
            f"rewards.reward_model is {r.reward_model} but config.stages {stages} has no 'rm' "
            "stage to train a reward model"
        )
    if r.get("process", 0.0) and "prm" not in stages:
        raise ValueError(
            f"rewards.process is {r.process} but config.stages {stages} has no 'prm' stage "
            "to train a process reward model"
        )
    if "rm" in stages:
        if "reward_model" not in config:
            raise ValueError("stage 'rm' needs a config.reward_model section")
        for field in ("steps", "batch_size", "pairs_per_level", "heldout_pairs"):
            if int(config.reward_model[field]) < 1:
                raise ValueError(f"reward_model.{field} must be >= 1")
        rm = config.reward_model
        if int(rm.get("refresh_every", 0)) < 0:
            raise ValueError(f"reward_model.refresh_every must be >= 0, got {rm.refresh_every}")
        if int(rm.get("refresh_every", 0)):
            for field in ("refresh_steps", "refresh_batch_size", "refresh_buffer"):
                if int(rm.get(field, 0)) < 1:
                    raise ValueError(
                        f"reward_model.{field} must be >= 1 when reward_model.refresh_every > 0"
                    )
    if "prm" in stages:
        if "process_reward" not in config:
            raise ValueError("stage 'prm' needs a config.process_reward section")
        p = config.process_reward
        if p.domain not in tuple(config.domains):
            raise ValueError(
                f"process_reward.domain {p.domain!r} is not one of config.domains "
                f"{tuple(config.domains)}"
            )
        if p.label not in ("soft", "hard"):
            raise ValueError(f"process_reward.label must be 'soft' or 'hard', got {p.label!r}")
        for field in ("steps", "batch_size", "label_tasks", "continuations", "heldout_tasks"):
            if int(p[field]) < 1:
                raise ValueError(f"process_reward.{field} must be >= 1")
    for stage in ("rm", "prm"):
        if stage in stages and ("ppo" in stages and stages.index(stage) > stages.index("ppo")):
            raise ValueError(f"stage {stage!r} must come before 'ppo' in config.stages {stages}")
    RewardConfig(
        process_aggregation=r.get("process_aggregation", "min"), clip=r.get("learned_clip", 5.0)
    )


# -- stages ----------------------------------------------------------------------------------


def rm_stage(run: PostTrainRun) -> None:
    """Trains the reward model from the current policy; sets ``run.learned.rm_params``."""
    c = run.config.reward_model
    seed = run.config.seed
    policy = run._policy_params()
    graph, params = create_model(
        lambda rngs: RewardModel(run.model_cfg, likelihood=c.get("likelihood", False), rngs=rngs),
        jax.random.fold_in(run.keys["init"], 11),
    )
    params = with_trunk(params, policy)
    max_len = run.model_cfg.max_seq_len
    train_pairs, heldout = [], {}
    for name in _answer_domains(run, c.domains):
        dom = run.domains[name]
        for level in range(1, run.levels[name] + 1):
            tasks = dom.tasks("train", c.pairs_per_level, level, seed=seed + 101)
            train_pairs += correctness_pairs(dom, tasks, seed=seed + level)
            held = dom.tasks("heldout", c.heldout_pairs, level, seed=seed + 202)
            heldout.setdefault(name, []).extend(correctness_pairs(dom, held, seed=seed + 7))
    if c.get("pairs_jsonl"):
        user_pairs, skipped = load_preferences(c.pairs_jsonl, on_error="skip")
        if skipped.total:
            logging.warning("reward_model.pairs_jsonl: skipped %s", skipped)
        train_pairs += user_pairs
    arrays, skipped = encode_pairs(train_pairs, run.tokenizer, max_len, on_error="skip",
                                   pad_to=max_len)  # fmt: skip
    if len(arrays) < c.batch_size:
        raise ValueError(
            f"reward model: only {len(arrays)} usable pairs (skipped {skipped}); need at least "
            f"reward_model.batch_size={c.batch_size}"
        )
    trainer = _rm_trainer(c, graph)
    rng = np.random.default_rng(seed + 303)
    batches = (
        {
            "chosen": arrays.chosen[pick], "chosen_mask": arrays.chosen_mask[pick],
            "rejected": arrays.rejected[pick], "rejected_mask": arrays.rejected_mask[pick],
            "margin": arrays.margin[pick], "weight": np.ones(len(pick), np.float32),
        }
        for pick in _batches(len(arrays), c.batch_size, c.steps, rng)
    )  # fmt: skip
    state, metrics = _train(
        run, "rm", trainer, trainer.init(params), batches, c.steps,
        lambda p: _rm_heldout(graph, p, heldout, run.tokenizer, max_len),
    )  # fmt: skip
    run.learned.set_rm(graph, state.params)
    if run.learned.refreshing:
        run.learned.start_refresh(trainer, state, max_len)
    run.meta.setdefault("reward_models", {})["rm"] = {
        k.split("/", 1)[1]: float(v) for k, v in metrics.items() if "heldout" in k
    }


def _rm_trainer(c, graph):
    """The reward model's trainer: the ``rm`` stage's, continued by refreshes in PPO."""
    return rm_trainer(
        TrainConfig(learning_rate=c.learning_rate, warmup_steps=c.warmup_steps), graph,
        margin=c.margin,
    )  # fmt: skip


def _train(run: PostTrainRun, stage: str, trainer, state, batches, steps: int, final):
    """``steps`` optimiser steps, one global step each; a metrics line every
    ``sft.log_every`` steps and on the last, which adds ``final(params)``."""
    metrics: dict[str, Any] = {}
    for i, batch in enumerate(batches):
        state, m = trainer.step(state, batch)
        run.advance_step()
        last = i == steps - 1
        if last or (i + 1) % run.config.sft.log_every == 0:
            metrics = {f"{stage}/{k}": v for k, v in jax.device_get(m).items()}
            if last:
                metrics.update(final(state.params))
            run.write_stage_metrics(metrics, stage)
    return state, metrics


def _rm_heldout(graph, params, heldout, tokenizer, max_len) -> dict[str, float]:
    score = jax.jit(lambda p, t, m: sequence_scores(graph, p, t, m))
    out = {}
    for name, pairs in heldout.items():
        arrays, _ = encode_pairs(pairs, tokenizer, max_len, on_error="skip", pad_to=max_len)
        chosen = _chunked(score, params, {"t": arrays.chosen, "m": arrays.chosen_mask})
        rejected = _chunked(score, params, {"t": arrays.rejected, "m": arrays.rejected_mask})
        out[f"rm/heldout_{name}_pairwise_accuracy"] = pairwise_accuracy(chosen, rejected)
    return out


def prm_stage(run: PostTrainRun) -> None:
    """Labels the policy's solutions the Math-Shepherd way and trains the PRM on them."""
    c = run.config.process_reward
    seed = run.config.seed
    dom = run.domains[c.domain]
    tok = run.tokenizer
    max_len = run.model_cfg.max_seq_len
    max_new = run.config.rollout.max_new_tokens
    policy = run._policy_params()
    key = jax.random.fold_in(run.keys["init"], 12)
    level = run.levels[c.domain]
    tasks = [
        t for lv in range(1, level + 1)
        for t in dom.tasks("train", c.label_tasks, lv, seed=seed + 404)
    ]  # fmt: skip
    prompts = [tok.encode(t.prompt, add_bos=True) for t in tasks]
    out = run.sampler.generate(
        policy, prompts, jax.random.fold_in(key, 0), max_new_tokens=max_new,
        sampling=SamplingParams(temperature=1.0),
    )  # fmt: skip
    sampled = [decode_response(tok, np.asarray(out.tokens[i][: int(out.lengths[i])]))
               for i in range(len(tasks))]  # fmt: skip
    # Planted wrong steps keep wrong steps well represented however good the policy is.
    planted, _ = planted_error_solutions(dom, tasks, seed=seed)
    label_tasks = list(tasks) + [t for t in tasks for _ in (0, 1)]
    completions = sampled + planted
    labels = math_shepherd_labels(
        run.sampler, policy, dom, label_tasks, completions, tok, jax.random.fold_in(key, 1),
        n_continuations=c.continuations, max_new_tokens=max_new,
    )  # fmt: skip
    chosen = labels.soft if c.label == "soft" else labels.hard
    keep = [
        i for i, text in enumerate(completions)
        if chosen[i] and len(encode_sequence(tok, label_tasks[i].prompt, text)) <= max_len
    ]  # fmt: skip
    if len(keep) < c.batch_size:
        raise ValueError(
            f"process reward model: only {len(keep)} labelled solutions fit "
            f"model.max_seq_len={max_len}; need at least process_reward.batch_size={c.batch_size}"
        )
    examples = encode_step_examples(
        tok, [label_tasks[i].prompt for i in keep], [completions[i] for i in keep],
        [chosen[i] for i in keep], max_len=max_len, pad_to=max_len,
    )  # fmt: skip
    graph, params = create_model(
        lambda rngs: ProcessRewardModel(
            run.model_cfg,
            tok.step_id,
            likelihood=c.get("likelihood", False),
            answer_token_id=tok.answer_id,
            rngs=rngs,
        ),
        jax.random.fold_in(run.keys["init"], 13),
    )
    params = with_trunk(params, policy)
    trainer = prm_trainer(TrainConfig(learning_rate=c.learning_rate, warmup_steps=c.warmup_steps),
                          graph)  # fmt: skip
    rng = np.random.default_rng(seed + 505)
    n = len(examples["tokens"])
    batches = (
        {k: v[pick] for k, v in examples.items()}
        for pick in _batches(n, c.batch_size, c.steps, rng)
    )
    state, metrics = _train(
        run, "prm", trainer, trainer.init(params), batches, c.steps,
        lambda p: {
            "prm/label_samples": labels.samples, "prm/train_solutions": n,
            "prm/heldout_step_roc_auc": _prm_heldout_auc(
                graph, p, dom, tok, c.heldout_tasks, level, seed, max_len
            ),
        },
    )  # fmt: skip
    run.learned.set_prm(graph, state.params)
    run.meta.setdefault("reward_models", {})["prm"] = {
        "heldout_step_roc_auc": float(metrics["prm/heldout_step_roc_auc"])
    }


def _prm_heldout_auc(graph, params, dom, tok, n_tasks, level, seed, max_len) -> float:
    held = dom.tasks("heldout", n_tasks, level, seed=seed + 606)
    texts, step_labels = planted_error_solutions(dom, held, seed=seed + 7)
    prompts = [t.prompt for t in held for _ in (0, 1)]
    keep = [i for i, t in enumerate(texts)
            if len(encode_sequence(tok, prompts[i], t)) <= max_len]  # fmt: skip
    ev = encode_step_examples(
        tok, [prompts[i] for i in keep], [texts[i] for i in keep],
        [step_labels[i] for i in keep], max_len=max_len, pad_to=max_len,
    )  # fmt: skip
    probs_fn = jax.jit(lambda p, t, m, r: jax.nn.sigmoid(step_logits(graph, p, t, m, r)))
    probs = _chunked(
        probs_fn, params, {"t": ev["tokens"], "m": ev["mask"], "r": ev["response_mask"]}
    )
    on = ev["label_mask"] > 0
    return roc_auc(probs[on], ev["labels"][on])


# -- inside PPO ------------------------------------------------------------------------------


@dataclasses.dataclass
class LearnedRewards:
    """The learned reward models of a run and their use on PPO batches."""

    reward_config: RewardConfig
    monitor: RewardMonitor
    step_id: int
    answer_id: int
    rm_graph: Any = None
    rm_params: Any = None
    prm_graph: Any = None
    prm_params: Any = None
    norm: NormState = dataclasses.field(default_factory=init_norm_state)
    rm_likelihood: bool = False  # the reward model adds the policy's log-likelihood
    rm_config: Any = None  # the config's reward_model section (refresh settings)
    tokenizer: Any = None
    rm_state: Any = None  # ModelTrainState while refreshing
    refresher: RewardModelRefresher | None = None
    prm_likelihood: bool = False  # the process reward model adds each step's log-likelihood

    @classmethod
    def from_config(cls, config, tokenizer) -> LearnedRewards:
        r = config.rewards
        cfg = RewardConfig(
            outcome=1.0, reward_model=r.get("reward_model", 0.0), process=r.get("process", 0.0),
            process_aggregation=r.get("process_aggregation", "min"),
            clip=r.get("learned_clip", 5.0),
        )  # fmt: skip
        rm = config.get("reward_model") or {}
        prm = config.get("process_reward") or {}
        return cls(
            cfg, RewardMonitor(MonitorConfig()), tokenizer.step_id, tokenizer.answer_id,
            rm_likelihood=bool(rm.get("likelihood", False)),
            prm_likelihood=bool(prm.get("likelihood", False)),
            rm_config=rm or None, tokenizer=tokenizer,
        )  # fmt: skip

    @property
    def refreshing(self) -> bool:
        """Whether the reward model is retrained on the newest traces during PPO."""
        return bool(self.rm_config and int(self.rm_config.get("refresh_every", 0)))

    def start_refresh(self, trainer, state, max_len: int) -> None:
        """Keep the reward model's trainer and state (parameters and optimiser) to refresh."""
        c = self.rm_config
        self.rm_state = state
        self.refresher = RewardModelRefresher(
            trainer, self.tokenizer, max_len=max_len,
            every=int(c.refresh_every), steps=int(c.refresh_steps),
            batch_size=int(c.refresh_batch_size), buffer_size=int(c.refresh_buffer),
        )  # fmt: skip

    def observe(self, step: int, tasks, texts, results, key) -> dict[str, float]:
        """Add a rollout's verdicts to the trace buffer; refresh the reward model when due."""
        if self.refresher is None:
            return {}
        self.refresher.add(traces_from_results(tasks, texts, results))
        self.rm_state, metrics = self.refresher.maybe_refresh(step, self.rm_state, key)
        self.rm_params = self.rm_state.params
        metrics["rm/refresh_buffer"] = float(len(self.refresher.traces))
        return metrics

    def trace_state(self) -> list[dict[str, str]]:
        """The refresh buffer as JSON-ready records (for the checkpoint's metadata)."""
        if self.refresher is None:
            return []
        return [dataclasses.asdict(t) for t in self.refresher.traces]

    def set_trace_state(self, records) -> None:
        if self.refresher is not None:
            self.refresher.traces = [Trace(**r) for r in records]

    @property
    def active(self) -> bool:
        """Whether PPO's rewards include a learned term."""
        return (self.rm_params is not None and self.reward_config.reward_model != 0) or (
            self.prm_params is not None and self.reward_config.process != 0
        )

    def set_rm(self, graph, params) -> None:
        self.rm_graph, self.rm_params = graph, params

    def set_prm(self, graph, params) -> None:
        self.prm_graph, self.prm_params = graph, params

    # Checkpointed arrays and their restore templates.
    def items(self) -> dict[str, Any]:
        out: dict[str, Any] = {NORM_KEY: self.norm}
        if self.rm_state is not None:
            out[RM_STATE_KEY] = self.rm_state
        elif self.rm_params is not None:
            out[RM_KEY] = self.rm_params
        if self.prm_params is not None:
            out[PRM_KEY] = self.prm_params
        return out

    def templates(self, names, model_cfg, step_id: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if NORM_KEY in names:
            out[NORM_KEY] = init_norm_state()
        if RM_KEY in names or RM_STATE_KEY in names:
            self.rm_graph, params = create_model(
                lambda rngs: RewardModel(model_cfg, likelihood=self.rm_likelihood, rngs=rngs),
                jax.random.key(0),
            )
            if RM_KEY in names:
                out[RM_KEY] = params
            else:
                trainer = _rm_trainer(self.rm_config, self.rm_graph)
                out[RM_STATE_KEY] = jax.eval_shape(trainer.init, params)
                self.start_refresh(trainer, None, model_cfg.max_seq_len)
        if PRM_KEY in names:
            self.prm_graph, params = create_model(
                lambda rngs: ProcessRewardModel(
                    model_cfg,
                    step_id,
                    likelihood=self.prm_likelihood,
                    answer_token_id=self.answer_id,
                    rngs=rngs,
                ),
                jax.random.key(0),
            )
            out[PRM_KEY] = params
        return out

    def set_items(self, items: Mapping[str, Any]) -> None:
        self.norm = items.get(NORM_KEY, self.norm)
        self.rm_params = items.get(RM_KEY, self.rm_params)
        if RM_STATE_KEY in items:
            self.rm_state = items[RM_STATE_KEY]
            self.rm_params = self.rm_state.params
        self.prm_params = items.get(PRM_KEY, self.prm_params)

    def monitor_state(self) -> dict[str, Any]:
        return {name: dataclasses.asdict(s) for name, s in self.monitor.stats.items()}

    def set_monitor_state(self, state: Mapping[str, Any]) -> None:
        self.monitor.stats = {name: _DomainStats(**s) for name, s in state.items()}

    def apply(self, batch, domain_names, success, valid):
        """The batch with learned terms in its rewards, ``reward/*`` and ``monitor/*``
        metrics, and the per-domain confidence for the curriculum."""
        rm_scores = process = steps = None
        if self.rm_params is not None and self.reward_config.reward_model:
            rm_scores = _rm_scores(self.rm_graph, self.rm_params, batch)
        if self.prm_params is not None and self.reward_config.process:
            process, steps = _process_scores(
                self.prm_graph, self.prm_params, batch, self.step_id, self.answer_id
            )
        outcome = jnp.sum(batch.rewards, axis=1)  # [B] verifier and rule terms, already weighted
        total, self.norm, metrics = _assemble(
            self.reward_config, self.norm, batch.response_mask, outcome, rm_scores, process, steps
        )
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        # The monitor compares the learned verdict with the verifier's: the RM score, or
        # the weakest step's PRM probability (centred so 0.5 is the threshold).
        if rm_scores is not None:
            learned = np.asarray(rm_scores)
        else:
            p = np.where(np.asarray(steps) > 0, np.asarray(process), np.inf).min(axis=1)
            learned = np.where(np.isfinite(p), p, 0.0) - 0.5
        metrics.update(self.monitor.update(domain_names, learned, success, valid > 0))
        return batch.replace(rewards=total), metrics, dict(self.monitor.confidence())


@functools.partial(jax.jit, static_argnums=0)
def _rm_scores(graph, params, batch):
    return rollout_rm_scores(graph, params, batch)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _process_scores(graph, params, batch, step_id, answer_id):
    return rollout_process_scores(graph, params, batch, step_id=step_id, answer_id=answer_id)


@functools.partial(jax.jit, static_argnums=0)
def _assemble(cfg, norm, response_mask, outcome, rm_scores, process, steps):
    return assemble_rewards(
        cfg, norm, response_mask, outcome=outcome, reward_model=rm_scores, process=process,
        step_mask=steps,
    )  # fmt: skip
