"""The ``rm`` and ``prm`` stages of a post-training run.

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
step separators; held-out step ROC-AUC on planted errors is logged. With
``process_reward.kind="implicit"`` it is PRIME's implicit PRM instead
(``rlpt.rewards.implicit``): the policy samples ``samples`` completions of each
prompt at the rollout temperature, the verifier labels each by its outcome, and a
copy of the policy ``pi_phi`` learns them by cross-entropy on
``beta * sum log pi_phi / pi_ref``; held-out ROC-AUC of that outcome logit against
the verifier's labels on fresh prompts' samples is logged.

Each stage gets a ``StageContext`` (step counter, keys, metrics sink) and the
``RewardStageInputs`` it reads; the trained models go to ``LearnedRewards``
(``rlpt.rewards.learned``), which PPO's reward role applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from absl import logging

from rlpt.models import ProcessRewardModel, RewardModel, create_model
from rlpt.rewards.data import correctness_pairs, planted_error_solutions
from rlpt.rewards.implicit import ImplicitPRM, encode_implicit_examples, train_implicit_prm
from rlpt.rewards.learned import LearnedRewards, reward_model_trainer
from rlpt.rewards.losses import pairwise_accuracy, roc_auc
from rlpt.rewards.preferences import encode_pairs, encode_sequence, load_preferences
from rlpt.rewards.process import encode_step_examples, math_shepherd_labels
from rlpt.rewards.train import TrainConfig, prm_trainer, sequence_scores, step_logits, with_trunk
from rlpt.sampling import Sampler, SamplingParams
from rlpt.tasks import Domain
from rlpt.tokenizers import Tokenizer, decode_response
from rlpt.trainers.context import StageContext


@dataclasses.dataclass(frozen=True)
class RewardStageInputs:
    """What the ``rm`` and ``prm`` stages read from the run."""

    config: Any  # the run config (reward_model, process_reward, seed, sft.log_every, rollout)
    policy_params: Any  # the current (warm-started) policy's full state
    model_cfg: Any
    tokenizer: Tokenizer
    domains: Mapping[str, Domain]
    levels: Mapping[str, int]
    sampler: Sampler
    learned: LearnedRewards
    mesh: Any = None  # the run's mesh: the reward models train sharded on it
    policy_graph: Any = None  # the policy's graph: an implicit PRM is a copy of the policy


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


def _answer_domains(run: RewardStageInputs, names) -> list[str]:
    picked = [n for n in names if n in run.domains]
    if not picked and not run.config.reward_model.pairs_jsonl:
        raise ValueError(
            f"reward_model.domains {tuple(names)} names none of the run's domains "
            f"{tuple(run.domains)} and reward_model.pairs_jsonl is empty: no pairs to train on"
        )
    return picked


# -- stages ----------------------------------------------------------------------------------


def rm_stage(ctx: StageContext, run: RewardStageInputs) -> None:
    """Trains the reward model from the current policy; sets ``run.learned.rm_params``."""
    c = run.config.reward_model
    seed = run.config.seed
    policy = run.policy_params
    graph, params = create_model(
        lambda rngs: RewardModel(run.model_cfg, likelihood=c.likelihood, rngs=rngs),
        jax.random.fold_in(ctx.keys["init"], 11),
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
    if c.pairs_jsonl:
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
    trainer = reward_model_trainer(c, graph, run.mesh)
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
        ctx, run.config.sft.log_every, "rm", trainer, trainer.init(params), batches, c.steps,
        lambda p: _rm_heldout(graph, p, heldout, run.tokenizer, max_len),
    )  # fmt: skip
    run.learned.set_rm(graph, state.params)
    if run.learned.refreshing:
        run.learned.start_refresh(trainer, state, max_len)
    ctx.meta.setdefault("reward_models", {})["rm"] = {
        k.split("/", 1)[1]: float(v) for k, v in metrics.items() if "heldout" in k
    }


def _train(ctx: StageContext, log_every: int, stage: str, trainer, state, batches, steps: int,
           final):  # fmt: skip
    """``steps`` optimiser steps, one global step each; a metrics line every
    ``log_every`` steps and on the last, which adds ``final(params)``."""
    metrics: dict[str, Any] = {}
    for i, batch in enumerate(batches):
        state, m = trainer.step(state, batch)
        ctx.advance()
        last = i == steps - 1
        if last or (i + 1) % log_every == 0:
            metrics = {f"{stage}/{k}": v for k, v in jax.device_get(m).items()}
            if last:
                metrics.update(final(state.params))
            ctx.write(metrics, stage)
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


def prm_stage(ctx: StageContext, run: RewardStageInputs) -> None:
    """Labels the policy's solutions the Math-Shepherd way and trains the PRM on them
    (or, for ``process_reward.kind="implicit"``, ``implicit_prm_stage``)."""
    c = run.config.process_reward
    if c.kind == "implicit":
        implicit_prm_stage(ctx, run)
        return
    seed = run.config.seed
    dom = run.domains[c.domain]
    tok = run.tokenizer
    max_len = run.model_cfg.max_seq_len
    max_new = run.config.rollout.max_new_tokens
    policy = run.policy_params
    key = jax.random.fold_in(ctx.keys["init"], 12)
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
            likelihood=c.likelihood,
            answer_token_id=tok.answer_id,
            rngs=rngs,
        ),
        jax.random.fold_in(ctx.keys["init"], 13),
    )
    params = with_trunk(params, policy)
    trainer = prm_trainer(TrainConfig(learning_rate=c.learning_rate, warmup_steps=c.warmup_steps),
                          graph, mesh=run.mesh)  # fmt: skip
    rng = np.random.default_rng(seed + 505)
    n = len(examples["tokens"])
    batches = (
        {k: v[pick] for k, v in examples.items()}
        for pick in _batches(n, c.batch_size, c.steps, rng)
    )
    state, metrics = _train(
        ctx, run.config.sft.log_every, "prm", trainer, trainer.init(params), batches, c.steps,
        lambda p: {
            "prm/label_samples": labels.samples, "prm/train_solutions": n,
            "prm/heldout_step_roc_auc": _prm_heldout_auc(
                graph, p, dom, tok, c.heldout_tasks, level, seed, max_len
            ),
        },
    )  # fmt: skip
    run.learned.set_prm(graph, state.params)
    ctx.meta.setdefault("reward_models", {})["prm"] = {
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


# -- the implicit PRM (PRIME) ----------------------------------------------------------------


def implicit_prm_stage(ctx: StageContext, run: RewardStageInputs) -> None:
    """Trains PRIME's implicit PRM on the verifier's outcome labels of the policy's samples;
    sets ``run.learned``'s implicit PRM. One global step per optimiser step, logged as
    ``prm/*`` every ``sft.log_every`` steps and on the last, which adds the held-out
    ``prm/heldout_outcome_roc_auc``."""
    c = run.config.process_reward
    if run.policy_graph is None:
        raise ValueError("process_reward.kind='implicit' needs the policy graph")
    seed = run.config.seed
    dom = run.domains[c.domain]
    level = run.levels[c.domain]
    key = jax.random.fold_in(ctx.keys["init"], 14)
    tasks = [
        t for lv in range(1, level + 1)
        for t in dom.tasks("train", c.label_tasks, lv, seed=seed + 404)
    ]  # fmt: skip
    examples = _outcome_examples(run, tasks, jax.random.fold_in(key, 0))
    if len(examples) < c.batch_size:
        raise ValueError(
            f"implicit process reward model: only {len(examples)} sampled solutions fit "
            f"model.max_seq_len={run.model_cfg.max_seq_len}; need at least "
            f"process_reward.batch_size={c.batch_size}"
        )
    prm, history = train_implicit_prm(
        run.policy_graph, run.policy_params, examples, pad_id=run.tokenizer.pad_id,
        pad_to=run.model_cfg.max_seq_len, steps=c.steps, batch_size=c.batch_size,
        cfg=TrainConfig(learning_rate=c.learning_rate, warmup_steps=c.warmup_steps),
        beta=c.beta, seed=seed + 505, mesh=run.mesh,
    )  # fmt: skip
    held = dom.tasks("heldout", c.heldout_tasks, level, seed=seed + 606)
    heldout = _outcome_examples(run, held, jax.random.fold_in(key, 1))
    # train_implicit_prm runs its steps in one go; each is one global step, logged as
    # the Math-Shepherd stage logs its own.
    log_every = run.config.sft.log_every
    correct = sum(label for _, _, label in examples)
    for i, m in enumerate(history):
        ctx.advance()
        last = i == len(history) - 1
        if last or (i + 1) % log_every == 0:
            metrics = {f"prm/{k}": v for k, v in m.items()}
            if last:
                metrics.update({
                    "prm/train_solutions": len(examples),
                    "prm/train_correct_fraction": correct / len(examples),
                    "prm/heldout_outcome_roc_auc": _implicit_heldout_auc(
                        prm, heldout, run.tokenizer.pad_id, run.model_cfg.max_seq_len
                    ),
                })  # fmt: skip
            ctx.write(metrics, "prm")
    run.learned.set_implicit_prm(prm)
    ctx.meta.setdefault("reward_models", {})["prm"] = {
        "heldout_outcome_roc_auc": float(metrics["prm/heldout_outcome_roc_auc"])
    }


def _outcome_examples(run: RewardStageInputs, tasks, key) -> list[tuple[list, list, float]]:
    """``samples`` completions of each task by the policy at the rollout temperature,
    as ``(prompt ids, response ids, verifier says correct)``; rows that do not fit
    ``model.max_seq_len`` are dropped."""
    c, tok = run.config.process_reward, run.tokenizer
    max_len = run.model_cfg.max_seq_len
    repeated = [t for t in tasks for _ in range(c.samples)]
    prompts = [tok.encode(t.prompt, add_bos=True) for t in repeated]
    out = run.sampler.generate(
        run.policy_params, prompts, key, max_new_tokens=run.config.rollout.max_new_tokens,
        sampling=SamplingParams(temperature=float(run.config.rollout.temperature)),
    )  # fmt: skip
    responses = [
        [int(x) for x in np.asarray(out.tokens[i][: int(out.lengths[i])])]
        for i in range(len(repeated))
    ]
    texts = [decode_response(tok, r) for r in responses]
    verdicts = run.domains[run.config.process_reward.domain].verify_batch(repeated, texts)
    return [
        (p, r, float(v.correct)) for p, r, v in zip(prompts, responses, verdicts, strict=True)
        if r and len(p) + len(r) <= max_len
    ]  # fmt: skip


def _implicit_heldout_auc(prm: ImplicitPRM, examples, pad_id: int, max_len: int) -> float:
    """ROC-AUC of the outcome logit ``r_phi(y)`` against the verifier's labels (NaN when
    the held-out samples are all right or all wrong)."""
    if not examples:
        return float("nan")
    ev = encode_implicit_examples(examples, pad_id=pad_id, pad_to=max_len)
    logits = np.concatenate([
        np.asarray(prm.outcome_logits(
            ev["tokens"][i : i + 64], ev["mask"][i : i + 64], ev["response_mask"][i : i + 64]
        ))
        for i in range(0, len(examples), 64)
    ])  # fmt: skip
    return roc_auc(logits, ev["labels"] > 0.5)
