"""End-to-end post-training of a language model: supervised warm start, then RL.

Stages, run in ``config.stages`` order with one global ``step`` across them:

1. ``sft``: the policy learns from demonstrations (``rlpt.trainers.sft``) for a
   fixed budget of completion tokens; then the full evaluation (held-out greedy
   pass@1, sampled pass@k, OOD) runs and the policy is frozen as the reference.
2. ``rm`` / ``prm``: a reward model (Bradley-Terry on correctness pairs of the answer
   domains, plus a user's preference JSONL) and a process reward model (Math-Shepherd
   labels from the policy's own continuations), both started from the warm-started
   trunk (``rlpt.trainers.learned_rewards``). ``register_stage`` replaces either.
3. ``ppo``: rollouts from the curriculum loader, verifier rewards (program synthesis
   runs in the sandbox pool), PPO with a critic (``ppo.estimator='gae'``, the value
   trunk starts from the SFT policy) or critic-free GRPO/RLOO, KL to the reference,
   periodic held-out evaluation, curriculum feedback every step. With
   ``rollout.filter_groups`` a step draws prompt batches until the groups it updates on
   all have rewards that differ (DAPO's dynamic sampling).
   ``sft_continued`` instead keeps training SFT for ``sft.continued_wall_s`` seconds
   (the control that gets RL's wall clock as more supervision).
4. The final evaluation, merged into the last step's metrics line; ``summary.json``.

Rewards: ``config.rewards`` weighs the verifier's reward (``outcome``), a format term
and a length penalty (``rlpt.tasks.rewards``), summed per sequence on its last token.
``reward_model`` and ``process`` weigh the learned rewards of the ``rm``/``prm``
stages (the reward-model score on the last token, process rewards on each step's
last token), normalised and clipped, with a per-domain monitor of their agreement
with the verifier that also feeds the curriculum's confidence.

A sample the sandbox failed to run, or whose reward is not finite, is kept in the
batch (shapes stay fixed) with loss weight 0, and counted.

One line per step goes to ``metrics.jsonl``; evaluations at a step join that step's
line, so no step appears twice. ``samples.jsonl`` gets greedy completions with their
rewards and outcomes at every evaluation. Checkpoints (``rlpt.checkpoint``) hold
everything the run needs to continue exactly: rerunning the same command resumes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from rlpt import checkpoint as ckpt_lib
from rlpt.data import CurriculumLoader, Feedback, make_curriculum, make_source
from rlpt.eval import (
    Evaluator,
    Verifier,
    check_sampling,
    decode_response,
    flatten_results,
    format_table,
    make_eval_sets,
)
from rlpt.metrics import (
    METRICS_FILE,
    PROFILE_DIR,
    MetricWriter,
    Progress,
    StepProfiler,
    matmul_peak_flops,
    rl_step_model_flops,
    to_json_value,
)
from rlpt.models import CausalLM, ValueModel, create_model, get_preset
from rlpt.rl import PPOConfig, PPOTrainer, group_varies, init_train_state, new_rollout_batch
from rlpt.sampling import DEFAULT_BUCKETS, Sampler, SamplingParams
from rlpt.tasks import CompositeReward, Domain, LengthPenalty, get_domain
from rlpt.tokenizers import ByteTokenizer, Tokenizer
from rlpt.trainers import learned_rewards
from rlpt.trainers import sft as sft_lib

SAMPLES_FILE = "samples.jsonl"
# A run of a Hugging Face model leaves its result here as an rlpt interop checkpoint
# (``python -m rlpt.interop.hf export DIR/model OUT [--adapter=NAME]``).
MODEL_DIR = "model"
DEFAULT_ADAPTER_NAME = "policy"
SUMMARY_FILE = "summary.json"
RUN_CONFIG_FILE = "run_config.json"
# Fields that steer how a run is executed, not what it computes: a resumed run may
# change them without being "a different config".
RUN_CONTROL_FIELDS = ("overwrite", "stop_after_step", "logging", "profile")
STAGES = ("sft", "rm", "prm", "ppo", "sft_continued")

StageFn = Callable[["PostTrainRun"], None]
_STAGE_HOOKS: dict[str, StageFn] = {}


def register_stage(name: str, fn: StageFn) -> None:
    """Registers an optional stage (``rm``, ``prm``) run between SFT and RL.

    ``fn(run)`` receives the ``PostTrainRun`` (models, loader, writer, step counter)
    and may, for example, train a reward model and set ``run.extra_reward``.
    """
    _STAGE_HOOKS[name] = fn


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Runs (or resumes) the post-training run ``config`` in ``workdir``; returns the summary."""
    run = PostTrainRun(config, workdir)
    try:
        return run.run()
    finally:
        run.close()


# -- configuration helpers ---------------------------------------------------------------------


def _plain(config: Any) -> Any:
    return config.to_dict() if hasattr(config, "to_dict") else config


def run_identity(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config as JSON-able data without the run-control fields."""
    data = json.loads(config.to_json_best_effort(sort_keys=True))
    for name in RUN_CONTROL_FIELDS:
        data.pop(name, None)
    return data


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _diff_keys(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def model_config(config: ml_collections.ConfigDict):
    """The model's shape: a Hugging Face checkpoint's (``model.hf_path``) or a preset's."""
    overrides = dict(_plain(config.model.get("overrides", {})) or {})
    hf_path = config.model.get("hf_path")
    if "hf_path" in config.model and not hf_path:
        raise ValueError("model.hf_path is empty: set it to a Hugging Face model directory")
    if hf_path:
        from rlpt.interop import config_from_hf
        from rlpt.interop.model import read_hf_config

        hf_config = read_hf_config(hf_path)
        cfg, _ = config_from_hf(hf_config, source=os.path.join(hf_path, "config.json"))
        return cfg.replace(**overrides) if overrides else cfg
    return get_preset(config.model.preset, **overrides)


def make_tokenizer(config: ml_collections.ConfigDict, model_cfg) -> Tokenizer:
    """The checkpoint's own tokenizer.json for a Hugging Face model, else the byte tokenizer."""
    hf_path = config.model.get("hf_path")
    if hf_path:
        from rlpt.interop import load_hf_tokenizer

        return load_hf_tokenizer(hf_path, model_vocab_size=model_cfg.vocab_size)
    return ByteTokenizer()


def initial_policy(config: ml_collections.ConfigDict, model_cfg, key: jax.Array):
    """(graphdef, params) of the policy before any training: loaded, or randomly initialised."""
    hf_path = config.model.get("hf_path")
    if hf_path:
        from rlpt.interop import load_hf_model

        loaded = load_hf_model(hf_path, max_seq_len=model_cfg.max_seq_len)
        return loaded.graphdef, loaded.state
    return create_model(lambda rngs: CausalLM(model_cfg, rngs=rngs), key)


def lora_config(config: ml_collections.ConfigDict):
    """The policy's LoRA settings (``model.lora``), or None when it trains full weights."""
    spec = config.model.get("lora")
    if spec is None or not spec.get("rank"):
        return None
    from rlpt.models.lora import LoRAConfig

    name = spec.get("name")
    if name is not None and (not name or os.sep in name or name.startswith(".")):
        raise ValueError(f"model.lora.name must be a plain directory name, got {name!r}")
    try:
        return LoRAConfig.from_dict({k: v for k, v in _plain(spec).items() if k != "name"})
    except ValueError as e:
        raise ValueError(f"model.lora: {e}") from None


def adapter_name(config: ml_collections.ConfigDict) -> str:
    spec = config.model.get("lora")
    return (spec.get("name") if spec is not None else None) or DEFAULT_ADAPTER_NAME


def policy_init_key(config: ml_collections.ConfigDict) -> jax.Array:
    return jax.random.fold_in(jax.random.key(config.seed), 0)


def build_policy(config: ml_collections.ConfigDict, model_cfg, key: jax.Array):
    """(graphdef, trainable params, frozen base or None) of the policy before training.

    With ``model.lora.rank > 0`` only the adapters train; the loaded or initialised
    weights are the frozen base, shared by policy and reference, never copied.
    """
    graph, params = initial_policy(config, model_cfg, key)
    lora = lora_config(config)
    if lora is None:
        return graph, params, None
    from rlpt.models.lora import create_lora

    graph, adapters = create_lora(model_cfg, lora, jax.random.fold_in(key, 1))
    return graph, adapters, params


def full_policy(params, base):
    """The state the policy graph runs on: adapters merged with their base, or ``params``."""
    if base is None:
        return params
    from rlpt.models.lora import combine_lora

    return combine_lora(params, base)


def train_levels(config: ml_collections.ConfigDict, domains: Mapping[str, Domain]) -> dict:
    """The highest difficulty each domain trains at (the OOD split is one above)."""
    spec = _plain(config.train_max_level)
    out = {}
    for name, domain in domains.items():
        level = spec.get(name, spec.get("default", 1)) if isinstance(spec, dict) else spec
        out[name] = min(int(level), domain.max_difficulty)
    return out


def make_domains(config: ml_collections.ConfigDict) -> dict[str, Domain]:
    return {name: get_domain(name) for name in config.domains}


def make_eval_data(config, domains):
    return make_eval_sets(
        domains, train_levels(config, domains), heldout_items=config.eval.heldout_items,
        ood_items=config.eval.ood_items, seed=config.eval.seed,
        train_items=int(config.eval.get("train_items", 0) or 0),
    )  # fmt: skip


def ppo_config(config: ml_collections.ConfigDict) -> PPOConfig:
    values = dict(_plain(config.ppo))
    if values.get("num_groups") is None:
        values["num_groups"] = config.rollout.batch_size // config.rollout.group_size
    temperature = config.rollout.temperature
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"rollout.temperature must be a number > 0, got {temperature!r}")
    # The update scores samples under the distribution they were drawn from.
    values["sampling_temperature"] = float(temperature)
    return PPOConfig.from_config(values)


def make_reward(config: ml_collections.ConfigDict) -> CompositeReward:
    """Verifier reward plus format and length terms, weighted by ``config.rewards``."""
    r = config.rewards
    weights = {"correct": r.outcome, "format": r.format, "length": r.length}
    terms = {"length": LengthPenalty(r.length_target_bytes, r.length_scale_bytes)}
    return CompositeReward({k: v for k, v in weights.items() if v}, terms={
        k: v for k, v in terms.items() if weights[k]
    })  # fmt: skip


def check_rollout_config(config: ml_collections.ConfigDict, ppo_cfg: PPOConfig) -> None:
    """Errors in ``config.rollout`` that would otherwise surface mid-run."""
    r = config.rollout
    if r.get("filter_groups", False):
        if ppo_cfg.uses_critic:
            raise ValueError(
                "rollout.filter_groups drops groups whose rewards are all equal, which only "
                "have zero advantage under a group estimator; ppo.estimator is "
                f"{ppo_cfg.estimator!r} (use grpo, dr_grpo or rloo, or set "
                "rollout.filter_groups=False)"
            )
        if int(r.get("filter_max_rounds", 1)) < 1:
            raise ValueError(f"rollout.filter_max_rounds must be >= 1, got {r.filter_max_rounds}")


@dataclasses.dataclass
class _Samples:
    """Generated samples, one row each: ``[N]`` arrays, ``[N, max_new_tokens]`` for
    ``tokens``/``mask``, and per-row lists."""

    ids: list
    tasks: list
    names: list
    texts: list
    results: list
    tokens: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    truncated: np.ndarray
    rewards: np.ndarray
    weight: np.ndarray
    success: np.ndarray
    valid: np.ndarray
    loss_weight: np.ndarray
    domain_index: np.ndarray
    difficulty: np.ndarray

    def take(self, rows: np.ndarray) -> _Samples:
        """The rows ``rows`` (indices into this set), in that order."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value[rows] if isinstance(value, np.ndarray) else [
                value[i] for i in rows
            ]  # fmt: skip
        return _Samples(**out)

    @staticmethod
    def concat(parts: list[_Samples]) -> _Samples:
        out = {}
        for f in dataclasses.fields(_Samples):
            values = [getattr(p, f.name) for p in parts]
            out[f.name] = (
                np.concatenate(values) if isinstance(values[0], np.ndarray)
                else [v for vs in values for v in vs]
            )  # fmt: skip
        return _Samples(**out)


@dataclasses.dataclass
class _Rollout:
    """One PPO step's samples: ``generated`` holds every row sampled for the step,
    ``update`` the rows the update sees (groups consecutive, ids ``group_id``) and
    ``left_out`` the uniform groups it does not (their advantage is exactly zero)."""

    generated: _Samples
    update: _Samples
    left_out: _Samples
    group_id: np.ndarray
    rounds: int
    informative_frac: float  # generated groups whose valid rewards vary
    update_informative_frac: float  # groups in the update whose valid rewards vary
    generate_s: float
    verify_s: float


# -- the run -----------------------------------------------------------------------------------


class PostTrainRun:
    """Everything one post-training run holds; ``run()`` executes or resumes it."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        self.config = config
        self.workdir = os.path.abspath(workdir)
        self.start_time = time.perf_counter()
        for stage in config.stages:
            if stage not in STAGES:
                raise ValueError(f"unknown stage {stage!r}; allowed: {STAGES}")
        # Config errors surface before the workdir is claimed by this config.
        self.reward_fn = make_reward(config)
        learned_rewards.check_config(config)
        lora_config(config)
        self.ppo_cfg = ppo_config(config)
        check_rollout_config(config, self.ppo_cfg)
        check_sampling(config.eval.n_samples, config.eval.k)
        self.model_cfg = model_config(config)
        self.domains = make_domains(config)
        self._check_workdir()

        self.tokenizer = make_tokenizer(config, self.model_cfg)
        self.levels = train_levels(config, self.domains)
        self.extra_reward: Callable | None = None  # a registered stage hook may set it
        self.learned = learned_rewards.LearnedRewards.from_config(config, self.tokenizer)
        self.pool = None
        if any(d.needs_sandbox for d in self.domains.values()):
            from rlpt.sandbox import SandboxPool

            sb = config.sandbox
            self.pool = SandboxPool(workers=sb.workers, timeout_s=sb.timeout_s,
                                    memory_mb=sb.memory_mb)  # fmt: skip
        self.verifier = Verifier(self.domains, self.pool)

        key = jax.random.key(config.seed)
        self.keys = {
            name: jax.random.fold_in(key, i)
            for i, name in enumerate(("init", "value_init", "rollout", "eval", "ppo", "rm_refresh"))
        }
        self.lora = lora_config(config)
        # `init_params` is what trains (the adapters under LoRA); `base_params` the frozen rest.
        self.policy_graph, self.init_params, self.base_params = build_policy(
            config, self.model_cfg, self.keys["init"]
        )
        buckets = tuple(config.rollout.get("buckets", DEFAULT_BUCKETS))
        self.sampler = Sampler(
            self.policy_graph, self.model_cfg, eos_id=self.tokenizer.eos_id,
            pad_id=self.tokenizer.pad_id, buckets=buckets,
        )  # fmt: skip
        self.evaluator = Evaluator(
            self.sampler, self.tokenizer, self.verifier,
            max_new_tokens=config.rollout.max_new_tokens, chunk_size=config.eval.batch_size,
        )  # fmt: skip
        self.eval_sets = make_eval_data(config, self.domains)

        # SFT data and its fixed length (the token budget decides the step count).
        s = config.sft
        examples = sft_lib.read_jsonl_examples(s.jsonl) if s.get("jsonl") else None
        self.sft_stream = sft_lib.ExampleStream(
            self.tokenizer, batch_size=s.batch_size, max_len=s.max_len, domains=self.domains,
            levels=self.levels, examples=examples, seed=config.seed,
        )  # fmt: skip
        self.sft_steps = sft_lib.steps_for_budget(self.sft_stream, s.token_budget)
        self.sft_trainer = sft_lib.sft_trainer(
            sft_lib.train_config(s.learning_rate, s.warmup_steps, s.weight_decay),
            self.policy_graph, frozen=self.base_params,
        )  # fmt: skip
        heldout_pairs = [
            (t.prompt, self.domains[t.domain].demonstration(t))
            for tasks in self.eval_sets["heldout"].values()
            for t in tasks[: s.heldout_items]
        ] if examples is None else examples[: s.heldout_items]  # fmt: skip
        self.sft_heldout = sft_lib.heldout_batch(self.tokenizer, heldout_pairs, s.max_len)

        self.n_policy_params = sum(
            int(np.prod(x.shape)) for x in jax.tree.leaves(full_policy(self.init_params,
                                                                      self.base_params))
        )  # fmt: skip
        self._peak: float | None = None
        self.value_graph = None
        if self.ppo_cfg.uses_critic:
            self.value_graph, _ = create_model(
                lambda rngs: ValueModel(self.model_cfg, rngs=rngs), self.keys["value_init"]
            )
        self.trainer = PPOTrainer(
            self.ppo_cfg, self.policy_graph, self.value_graph, frozen=self.base_params
        )
        self.loader = self._make_loader()

        self.ckpt = ckpt_lib.Checkpointer(
            os.path.join(self.workdir, ckpt_lib.CHECKPOINT_DIR),
            keep=config.checkpoint.keep, async_save=config.checkpoint.async_save,
        )  # fmt: skip
        self.writer = self._metric_writer()
        self.profiler = StepProfiler(
            _plain(config.get("profile", {})).get("steps", ()),
            _plain(config.get("profile", {})).get("dir") or os.path.join(self.workdir, PROFILE_DIR),
        )
        # What the checkpoint's JSON record carries besides arrays.
        self.meta: dict[str, Any] = {
            "step": 0, "stage": "", "stage_index": 0, "stage_step": 0,
            "sft_position": 0, "counters": {"sandbox_failures": 0, "nonfinite_rewards": 0},
            "eval": {}, "elapsed_s": 0.0,
        }  # fmt: skip
        self.state: Any = None  # SupervisedState (SFT) or rl.TrainState (PPO)
        self.ref_params: Any = None

    # -- workdir: refuse a different run, resume the same one -------------------------------

    def _check_workdir(self) -> None:
        path = os.path.join(self.workdir, RUN_CONFIG_FILE)
        identity = run_identity(self.config)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                stored = json.load(f)
            if stored != identity:
                if not self.config.get("overwrite", False):
                    # train.py already wrote the new config.json; put the run's own back.
                    with open(os.path.join(self.workdir, "config.json"), "w",
                              encoding="utf-8") as f:  # fmt: skip
                        json.dump(stored, f, indent=2, sort_keys=True)
                    raise ValueError(
                        f"workdir {self.workdir} holds a run with a different config "
                        f"(differs in {_diff_keys(stored, identity)[:10]}); use another workdir "
                        "or pass --config.overwrite=True to replace it"
                    )
                logging.warning("Overwriting the run in %s (config.overwrite)", self.workdir)
                for name in (ckpt_lib.CHECKPOINT_DIR,):
                    shutil.rmtree(os.path.join(self.workdir, name), ignore_errors=True)
                for name in (METRICS_FILE, SAMPLES_FILE, SUMMARY_FILE):
                    if os.path.exists(os.path.join(self.workdir, name)):
                        os.remove(os.path.join(self.workdir, name))
        os.makedirs(self.workdir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(identity, f, indent=2, sort_keys=True)

    def _make_loader(self) -> CurriculumLoader:
        c = self.config
        sources = {
            name: make_source(name, {"kind": "procedural", "seed": c.seed}) for name in c.domains
        }
        curriculum = make_curriculum(
            c.curriculum, list(sources), max_levels=[self.levels[n] for n in sources],
            sizes=[s.size for s in sources.values()],
        )  # fmt: skip
        return CurriculumLoader(
            sources, curriculum, self.tokenizer, batch_size=c.rollout.batch_size,
            group_size=c.rollout.group_size, buckets=self.sampler.buckets, seed=c.seed,
            shard_index=0, shard_count=1,
        )  # fmt: skip

    def _peak_flops(self) -> float:
        """FLOP/s that ``time/mfu`` divides by: ``logging.peak_flops`` (per device,
        times the devices) if set, else a matmul rate measured once on this device."""
        if self._peak is None:
            per_device = _plain(self.config.get("logging", {})).get("peak_flops") or 0.0
            self._peak = (
                per_device * jax.device_count() if per_device
                # Host "devices" of the CPU backend share the same cores: count them once.
                else matmul_peak_flops()
                * (1 if jax.default_backend() == "cpu" else jax.local_device_count())
            )  # fmt: skip
        return self._peak

    def _metric_writer(self) -> MetricWriter:
        log = _plain(self.config.get("logging", {}))
        return MetricWriter(
            self.workdir, tensorboard=log.get("tensorboard", True),
            wandb_project=log.get("wandb_project", ""), run_config=run_identity(self.config),
        )  # fmt: skip

    def _progress(self, total: int | None, desc: str) -> Progress:
        enabled = _plain(self.config.get("logging", {})).get("progress_bar", None)
        return Progress(total, desc, initial=self.meta["stage_step"], enabled=enabled)

    # -- checkpoints --------------------------------------------------------------------------

    def _items(self) -> dict[str, Any]:
        stage = self.meta["stage"]
        if stage in ("sft", "sft_continued"):
            return {"sft": self.state}
        items = {"ppo": self.state, **self.learned.items()}
        if self.ref_params is not None:
            items["ref"] = self.ref_params
        return items

    def save(self) -> None:
        self.meta["loader"] = self.loader.get_state()
        self.meta["sft_position"] = self.sft_stream.position
        self.meta["elapsed_s"] = self._elapsed()
        self.meta["config"] = run_identity(self.config)
        self.meta["reward_monitor"] = self.learned.monitor_state()
        self.meta["reward_model_traces"] = self.learned.trace_state()
        self.ckpt.save(self.meta["step"], self._items(), self.meta)

    def _elapsed(self) -> float:
        return self._elapsed_before + (time.perf_counter() - self.start_time)

    def _sft_state_template(self):
        return self.sft_trainer.init(self.init_params)

    def _ppo_state_template(self):
        value = None
        if self.ppo_cfg.uses_critic:
            value = jax.eval_shape(lambda: self._value_init(self.init_params))
        return jax.eval_shape(
            lambda: init_train_state(self.ppo_cfg, self.init_params, value,
                                     jax.random.key_data(self.keys["ppo"]))
        )  # fmt: skip

    def restore(self) -> bool:
        step = self.ckpt.latest_step()
        self._elapsed_before = 0.0
        if step is None:
            # A run that died before its first checkpoint starts over from nothing.
            self.writer.close()
            for name in (METRICS_FILE, SAMPLES_FILE, SUMMARY_FILE):
                if os.path.exists(os.path.join(self.workdir, name)):
                    os.remove(os.path.join(self.workdir, name))
            self.writer = self._metric_writer()
            return False
        meta = self.ckpt.read_meta(step)
        targets = {}
        if "sft" in meta["items"]:
            targets["sft"] = self._sft_state_template()
        if "ppo" in meta["items"]:
            targets["ppo"] = self._ppo_state_template()
        if "ref" in meta["items"]:
            targets["ref"] = self.init_params
        targets.update(
            self.learned.templates(meta["items"], self.model_cfg, self.tokenizer.step_id)
        )
        items, meta = self.ckpt.restore(step, targets)
        self.learned.set_items(items)
        self.learned.set_monitor_state(meta.get("reward_monitor", {}))
        self.learned.set_trace_state(meta.get("reward_model_traces", []))
        self.meta = meta
        self.state = items.get("sft", items.get("ppo"))
        self.ref_params = items.get("ref")
        self.loader.set_state(meta["loader"])
        self.sft_stream.position = int(meta["sft_position"])
        self._elapsed_before = float(meta["elapsed_s"])
        self.writer.resume(step)
        _truncate_jsonl(os.path.join(self.workdir, SAMPLES_FILE), step)
        print(f"Resumed from checkpoint at step {step} (stage {meta['stage']}).", flush=True)
        return True

    # -- stages -------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.restore()
        stages = list(self.config.stages)
        stop = self.config.get("stop_after_step")
        while self.meta["stage_index"] < len(stages):
            stage = stages[self.meta["stage_index"]]
            step_at_start = self.meta["step"]
            if self.meta["stage"] != stage:
                self._enter_stage(stage)
            if stage == "sft":
                finished = self._sft(stop, self.sft_steps)
            elif stage == "sft_continued":
                finished = self._sft(stop, None)
            elif stage == "ppo":
                finished = self._ppo(stop)
            else:
                hook = _STAGE_HOOKS.get(stage) or {
                    "rm": learned_rewards.rm_stage, "prm": learned_rewards.prm_stage
                }[stage]  # fmt: skip
                hook(self)
                finished = True
            if not finished:
                logging.info("Stopping after step %d (config.stop_after_step).", stop)
                self.ckpt.wait()
                return {"stopped_at_step": self.meta["step"]}
            self.meta["stage_index"] += 1
            more = self.meta["stage_index"] < len(stages)
            if more and stop is not None and step_at_start < stop <= self.meta["step"]:
                # The stage ended on the requested step (its last step is checkpointed):
                # stop at the boundary rather than one step into the next stage.
                logging.info("Stopping after step %d (config.stop_after_step).", stop)
                self.ckpt.wait()
                return {"stopped_at_step": self.meta["step"]}
        self.ckpt.wait()
        self._save_model_outputs()
        summary = self._summary()
        self._write_plots()
        return summary

    def _write_plots(self) -> None:
        """Learning curves as ``DIR/plots/*.png`` (``rlpt.plot``); a plotting failure
        is logged, never fatal to a finished run."""
        if not _plain(self.config.get("logging", {})).get("plots", True):
            return
        if jax.process_index() != 0:
            return
        from rlpt import plot

        try:
            plot.write_plots(self.workdir)
        except Exception as e:  # noqa: BLE001 (any plotting error: the run's results stand)
            logging.warning("Could not write plots to %s: %s", self.workdir, e)

    def _save_model_outputs(self) -> None:
        """The trained adapter as ``DIR/adapters/NAME``; for a Hugging Face model, also an
        interop checkpoint ``DIR/model`` (base weights plus that adapter) to export."""
        name = adapter_name(self.config)
        if self.lora is not None:
            from rlpt.interop.checkpoint import save_adapter

            path = save_adapter(self.workdir, name, self.lora, self._trained_params())
            logging.info("Saved LoRA adapter %r to %s", name, path)
        hf_path = self.config.model.get("hf_path")
        if hf_path:
            from rlpt.interop import config_from_hf
            from rlpt.interop.checkpoint import save_adapter, save_checkpoint
            from rlpt.interop.model import read_hf_config

            hf_config = read_hf_config(hf_path)
            _, family = config_from_hf(hf_config, source=os.path.join(hf_path, "config.json"))
            out = os.path.join(self.workdir, MODEL_DIR)
            weights = self.base_params if self.lora is not None else self._trained_params()
            save_checkpoint(out, self.model_cfg, weights, family=family, hf_config=hf_config,
                            tokenizer_dir=hf_path)  # fmt: skip
            if self.lora is not None:
                save_adapter(out, name, self.lora, self._trained_params())
            logging.info("Saved the post-trained model to %s", out)

    def _enter_stage(self, stage: str) -> None:
        self.meta["stage"] = stage
        self.meta["stage_step"] = 0
        self.meta["stage_done"] = False
        self.meta["stage_elapsed_s"] = 0.0
        if stage == "sft" and self.state is None:
            self.state = self.sft_trainer.init(self.init_params)
        elif stage == "ppo":
            # After SFT (and any rm/prm stage) the state is still SFT's; a run without
            # SFT starts from the initial (or Hugging Face) weights.
            params = self.state.params if hasattr(self.state, "params") else self.init_params
            # The reference is a copy: the policy's buffers are donated to each update.
            self.ref_params = jax.tree.map(jnp.copy, params)
            value = self._value_init(params) if self.ppo_cfg.uses_critic else None
            self.state = init_train_state(
                self.ppo_cfg, params, value, jax.random.key_data(self.keys["ppo"])
            )
            self.meta["rl_start_elapsed_s"] = self._elapsed()

    def _value_init(self, policy_params):
        """The critic's trunk starts as the policy's trunk; its head starts at zero output."""
        _, value = create_model(
            lambda rngs: ValueModel(self.model_cfg, rngs=rngs), self.keys["value_init"]
        )
        if self.lora is not None:
            from rlpt.models.lora import merge_lora

            # The critic trains in full: it starts from the adapted policy, adapters folded in.
            policy_params = merge_lora(self.lora, policy_params, self.base_params)
        value["trunk"] = jax.tree.map(jnp.copy, policy_params["trunk"])
        return value

    def _policy_params(self):
        """The policy's full state (adapters merged with the base under LoRA)."""
        params = self.state.params if hasattr(self.state, "params") else self.state.policy
        return full_policy(params, self.base_params)

    def _trained_params(self):
        return self.state.params if hasattr(self.state, "params") else self.state.policy

    def _sft_heldout_loss(self):
        tokens, loss_mask = self.sft_heldout
        return self.sft_trainer.evaluate(
            self.state.params, {"tokens": tokens, "loss_mask": loss_mask}
        )["loss"]

    def _sft(self, stop: int | None, total: int | None) -> bool:
        """SFT for ``total`` steps (``None``: for ``sft.continued_wall_s`` seconds).

        The last step's line carries the held-out loss and the stage's evaluation
        (``sft`` after the warm start, ``final`` after continued SFT).
        """
        c = self.config.sft
        continued = total is None
        # A wall-clock budget counts the time spent before an interruption too.
        began = time.perf_counter() - self.meta.get("stage_elapsed_s", 0.0)
        window = time.perf_counter()
        progress = self._progress(total, "sft_continued" if continued else "sft")
        try:
            return self._sft_loop(stop, total, c, continued, began, window, progress)
        finally:
            progress.close()

    def _sft_loop(self, stop, total, c, continued, began, window, progress) -> bool:
        window_steps = window_tokens = 0
        while not self.meta.get("stage_done", False):
            if total is not None and self.meta["stage_step"] >= total:
                break
            tokens, mask, n_tokens = self.sft_stream.next_batch()
            window_steps += 1
            window_tokens += n_tokens
            self.profiler.start(self.meta["step"] + 1)
            self.state, m = self.sft_trainer.step(self.state, {"tokens": tokens, "loss_mask": mask})
            self.profiler.stop(self.meta["step"] + 1, m)
            self.meta["step"] += 1
            self.meta["stage_step"] += 1
            step = self.meta["step"]
            if continued:
                self.meta["stage_elapsed_s"] = time.perf_counter() - began
                last = self.meta["stage_elapsed_s"] >= c.continued_wall_s
            else:
                last = self.meta["stage_step"] >= total
            metrics: dict[str, Any] = {}
            if last or self.meta["stage_step"] % c.log_every == 0:
                m = jax.device_get(m)
                metrics.update({f"sft/{k}": v for k, v in m.items()})
                metrics["sft/lr"] = self.sft_trainer.learning_rate_at(int(self.state.step) - 1)
                metrics["sft/examples"] = self.sft_stream.position
                # Steps are dispatched asynchronously: only a window's average is meaningful.
                now = time.perf_counter()
                metrics["time/step_s"] = (now - window) / window_steps
                metrics["time/tokens_per_s"] = window_tokens / (now - window)
                window, window_steps, window_tokens = now, 0, 0
            if last:
                self.meta["stage_done"] = True
                metrics["sft/heldout_loss"] = self._sft_heldout_loss()
                metrics.update(self._full_eval("final" if continued else "sft"))
            elif c.get("eval_every", 0) and self.meta["stage_step"] % c.eval_every == 0:
                # The held-out learning curve of supervised training, comparable with RL's.
                metrics["sft/heldout_loss"] = self._sft_heldout_loss()
                metrics.update(self._periodic_eval())
            if metrics:
                self._write(step, metrics, "sft")
            progress.update({k: metrics[k] for k in ("sft/loss",) if k in metrics})
            if last or step % self.config.checkpoint.every == 0:
                self.save()
            if stop is not None and step >= stop and not last:
                return False
        return True

    def _ppo(self, stop: int | None) -> bool:
        c = self.config
        total = c.ppo_steps
        progress = self._progress(total, "ppo")
        try:
            return self._ppo_loop(stop, total, progress)
        finally:
            progress.close()

    def _ppo_loop(self, stop: int | None, total: int, progress: Progress) -> bool:
        c = self.config
        sampling = SamplingParams(temperature=c.rollout.temperature)
        while self.meta["stage_step"] < total:
            t0 = time.perf_counter()
            step = self.meta["step"] + 1
            self.profiler.start(step)
            ro = self._collect_rollout(step, sampling)
            up = ro.update
            t_collected = time.perf_counter()
            prompt_tokens, prompt_mask = self.sampler.prepare(up.ids, c.rollout.max_new_tokens)
            sampled_prompt_len = prompt_tokens.shape[1]
            scored_tokens = None  # padded rows: the whole [B, P + T] batch
            if self.ppo_cfg.pack_sequences:
                scored_tokens = int(prompt_mask.sum()) + int(up.lengths.sum())
                # Packed rows carry real tokens only, so padding is free: one batch shape
                # (the widest prompt bucket, every response column) compiles once.
                extra = max(max(self.sampler.buckets) - prompt_tokens.shape[1], 0)
                prompt_tokens = np.pad(
                    prompt_tokens, ((0, 0), (extra, 0)), constant_values=self.tokenizer.pad_id
                )
                prompt_mask = np.pad(prompt_mask, ((0, 0), (extra, 0)))
                width = c.rollout.max_new_tokens
            else:
                # Most responses stop well before max_new_tokens, and the update's cost
                # grows with the padded width: cut to the longest response, rounded up to a
                # multiple of 8 so at most a few widths compile. Masked positions add
                # nothing to any loss.
                width = min(c.rollout.max_new_tokens, -(-max(int(up.lengths.max()), 1) // 8) * 8)
            batch = new_rollout_batch(
                prompt_tokens, prompt_mask, up.tokens[:, :width], up.mask[:, :width],
                sequence_rewards=up.rewards,
                loss_weight=up.loss_weight * up.weight, group_id=ro.group_id,
                truncated=up.truncated, step_token_id=self.tokenizer.step_id,
                imitation_weight=up.success,
            )  # fmt: skip
            batch = self.trainer.score(self.state, self.ref_params, batch)
            learned_metrics, confidence = {}, None
            if self.learned.active:
                batch, learned_metrics, confidence = self.learned.apply(
                    batch, up.names, up.success, up.valid
                )
            batch = self.trainer.advantages(self.state, batch)
            jax.block_until_ready(batch.advantages)
            t_score = time.perf_counter()
            self.state, update_metrics = self.trainer.update(self.state, batch)
            adv = np.asarray(batch.advantages)
            mask = np.asarray(batch.response_mask)
            abs_adv = np.abs(adv * mask).sum(1) / np.maximum(mask.sum(1), 1.0)
            # The curriculum hears of every valid sample in the update and of the uniform
            # groups left out of it, whose advantage is exactly zero.
            fed = _Samples.concat([up, ro.left_out])
            keep = fed.valid > 0
            fed_abs_adv = np.concatenate([abs_adv, np.zeros(len(ro.left_out.ids))])
            self.loader.update(Feedback(
                domain_index=fed.domain_index[keep], success=fed.success[keep],
                reward=fed.rewards[keep], abs_advantage=fed_abs_adv[keep],
                difficulty=fed.difficulty[keep], confidence=confidence,
            ))  # fmt: skip
            update_metrics = jax.device_get(update_metrics)
            # The reward model learns from this rollout's verdicts; refreshed, it scores the next.
            learned_metrics.update(self.learned.observe(
                step, up.tasks, up.texts, up.results,
                jax.random.fold_in(self.keys["rm_refresh"], step),
            ))  # fmt: skip
            self.profiler.stop(step, self.state)
            t_upd = time.perf_counter()
            self.meta["step"] = step
            self.meta["stage_step"] += 1
            metrics = {f"ppo/{k}": v for k, v in update_metrics.items()}
            metrics.update(self._rollout_metrics(ro))
            metrics.update(learned_metrics)
            metrics.update(self.loader.metrics())
            flops = rl_step_model_flops(
                self.n_policy_params, len(up.ids), sampled_prompt_len, width,
                int(up.lengths.sum()), epochs=self.ppo_cfg.epochs,
                critic=self.ppo_cfg.uses_critic, scored_tokens=scored_tokens,
            )  # fmt: skip
            metrics.update({
                "time/generate_s": ro.generate_s, "time/verify_s": ro.verify_s,
                "time/score_s": t_score - t_collected, "time/update_s": t_upd - t_score,
                "time/step_s": t_upd - t0,
                "time/tokens_per_s": float(up.lengths.sum()) / (t_upd - t0),
                "time/model_flops_per_s": flops / (t_upd - t0),
                "time/mfu": flops / (t_upd - t0) / self._peak_flops(),
            })  # fmt: skip
            last = self.meta["stage_step"] == total
            if last:
                metrics.update(self._full_eval("final"))
            elif c.eval.every and self.meta["stage_step"] % c.eval.every == 0:
                metrics.update(self._periodic_eval())
            self._write(step, metrics, "ppo")
            progress.update({k: metrics[k] for k in ("ppo/success", "ppo/kl") if k in metrics})
            if last or step % c.checkpoint.every == 0:
                self.save()
            if stop is not None and step >= stop and not last:
                return False
        return True

    def _collect_rollout(self, step: int, sampling: SamplingParams) -> _Rollout:
        """Samples, decodes and scores one step's rollouts.

        With ``rollout.filter_groups`` (DAPO's dynamic sampling), a group whose valid
        rewards are all equal (all right or all wrong) has zero advantage under a
        group-relative estimator and only costs update time; prompt batches are drawn
        until the update's ``batch_size / group_size`` groups all vary, or for at most
        ``rollout.filter_max_rounds`` rounds, after which uniform groups fill the rest.
        """
        c = self.config
        group_size = c.rollout.group_size
        need = c.rollout.batch_size // group_size
        rounds = c.rollout.get("filter_max_rounds", 1) if c.rollout.get("filter_groups") else 1
        key = jax.random.fold_in(self.keys["rollout"], step)
        parts: list[_Samples] = []
        generate_s = verify_s = 0.0
        informative: list[int] = []  # groups (over all rounds) in generation order
        uniform: list[int] = []
        for r in range(rounds):
            t0 = time.perf_counter()
            pb = self.loader.next()
            ids = [row[m] for row, m in zip(pb.tokens, pb.mask)]
            out = self.sampler.generate(
                full_policy(self.state.policy, self.base_params), ids,
                key if r == 0 else jax.random.fold_in(key, r),
                max_new_tokens=c.rollout.max_new_tokens, sampling=sampling,
            )  # fmt: skip
            tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
            t1 = time.perf_counter()
            texts = [decode_response(self.tokenizer, tokens[i, : lengths[i]])
                     for i in range(len(ids))]  # fmt: skip
            names = [self.loader.names[d] for d in pb.domain_index]
            results = self.verifier.verify(names, pb.tasks, texts)
            rewards, weight, success, valid = self._rewards(pb.tasks, texts, results)
            verify_s += time.perf_counter() - t1
            generate_s += t1 - t0
            first = sum(len(p.ids) for p in parts) // group_size
            varied = group_varies(
                rewards, np.arange(len(rewards)) // group_size,
                num_groups=len(rewards) // group_size, valid=valid,
            )  # fmt: skip
            for g, varies in enumerate(varied, start=first):
                (informative if varies else uniform).append(g)
            parts.append(_Samples(
                ids=ids, tasks=list(pb.tasks), names=names, texts=texts, results=results,
                tokens=tokens, mask=np.asarray(out.mask), lengths=lengths,
                truncated=np.asarray(out.truncated), rewards=rewards, weight=weight,
                success=success, valid=valid, loss_weight=pb.loss_weight,
                domain_index=pb.domain_index, difficulty=pb.difficulty,
            ))  # fmt: skip
            if len(informative) >= need:
                break
        generated = _Samples.concat(parts)
        chosen = sorted(informative[:need] + uniform[: max(need - len(informative), 0)])
        # Surplus varying groups of the last round are dropped unseen.
        left_out = sorted(set(uniform) - set(chosen))

        def rows(groups: list[int]) -> np.ndarray:
            return (np.asarray(groups, int)[:, None] * group_size
                    + np.arange(group_size)).reshape(-1)  # fmt: skip

        return _Rollout(
            generated=generated, update=generated.take(rows(chosen)),
            left_out=generated.take(rows(left_out)),
            group_id=np.repeat(np.arange(len(chosen)), group_size).astype(np.int32),
            rounds=len(parts),
            informative_frac=len(informative) / max(len(informative) + len(uniform), 1),
            update_informative_frac=min(len(informative), need) / need,
            generate_s=generate_s, verify_s=verify_s,
        )  # fmt: skip

    def _rewards(self, tasks, texts, results):
        """Per-sequence reward, loss-weight factor, success and validity arrays [B]."""
        n = len(tasks)
        rewards = np.zeros(n, np.float32)
        weight = np.ones(n, np.float32)
        success = np.zeros(n, np.float32)
        valid = np.ones(n, np.float32)
        counters = self.meta["counters"]
        for i, (task, text, res) in enumerate(zip(tasks, texts, results)):
            if not res.valid:
                counters["sandbox_failures"] += 1
                weight[i] = valid[i] = 0.0
                continue
            total = self.reward_fn(task, text, res).total
            if self.extra_reward is not None:
                total += float(self.extra_reward(task, text, res))
            if not math.isfinite(total):
                counters["nonfinite_rewards"] += 1
                weight[i] = valid[i] = 0.0
                continue
            rewards[i] = total
            success[i] = float(res.correct)
        return rewards, weight, success, valid

    def _rollout_metrics(self, ro: _Rollout) -> dict[str, Any]:
        """What the policy did this step: over every sample generated, whether or not
        group filtering kept it for the update."""
        gen = ro.generated
        valid, success = gen.valid > 0, gen.success
        m: dict[str, Any] = {
            "ppo/score": float(gen.rewards[valid].mean()) if valid.any() else float("nan"),
            "ppo/success": float(success[valid].mean()) if valid.any() else float("nan"),
            "ppo/truncated_frac": float(np.mean(gen.truncated)),
            "ppo/sandbox_failures": self.meta["counters"]["sandbox_failures"],
            "ppo/nonfinite_rewards": self.meta["counters"]["nonfinite_rewards"],
            "ppo/dropped_samples": int((ro.update.valid == 0).sum()),
            "ppo/varying_groups_frac": ro.informative_frac,
        }
        if self.config.rollout.get("filter_groups", False):
            m["ppo/rollout_rounds"] = ro.rounds
            m["ppo/update_varying_groups_frac"] = ro.update_informative_frac
        for d, name in enumerate(self.loader.names):
            rows = (gen.domain_index == d) & valid
            if rows.any():
                m[f"ppo/{name}/success"] = float(success[rows].mean())
        return m

    # -- evaluation ---------------------------------------------------------------------------

    def _eval_key(self):
        return jax.random.fold_in(self.keys["eval"], self.meta["step"])

    def _full_eval(self, which: str) -> dict[str, Any]:
        e = self.config.eval
        t0 = time.perf_counter()
        results, samples = self.evaluator.evaluate(
            self._policy_params(), self.eval_sets, self._eval_key(), n_samples=e.n_samples,
            k=e.k, log_samples=e.log_samples,
        )  # fmt: skip
        self.meta["eval"][which] = results
        logging.info("Evaluation (%s) at step %d:\n%s", which, self.meta["step"],
                     format_table(results, e.k))  # fmt: skip
        self._write_samples(samples, which)
        out = flatten_results(results, e.k)
        out["time/eval_s"] = time.perf_counter() - t0
        return out

    def _periodic_eval(self) -> dict[str, Any]:
        e = self.config.eval
        t0 = time.perf_counter()
        held = {"heldout": self.eval_sets["heldout"]}
        results, samples = self.evaluator.evaluate(
            self._policy_params(), held, self._eval_key(), n_samples=0, k=e.k,
            max_items=e.periodic_items or None, log_samples=e.log_samples,
        )  # fmt: skip
        self._write_samples(samples, "periodic")
        out = flatten_results(results, e.k)
        out["time/eval_s"] = time.perf_counter() - t0
        return out

    def _write_samples(self, samples, which: str) -> None:
        path = os.path.join(self.workdir, SAMPLES_FILE)
        with open(path, "a", encoding="utf-8") as f:
            for s in samples:
                record = {"step": self.meta["step"], "eval": which, **s}
                f.write(json.dumps(to_json_value(record)) + "\n")

    def advance_step(self) -> None:
        """Counts one step of the current stage (stage hooks call it per optimiser step)."""
        self.meta["step"] += 1
        self.meta["stage_step"] += 1

    def write_stage_metrics(self, metrics: Mapping[str, Any], stage: str) -> None:
        """One metrics line at the current global step."""
        self._write(self.meta["step"], metrics, stage)

    def _write(self, step: int, metrics: Mapping[str, Any], stage: str) -> None:
        self.writer.write(step, {k: to_json_value(v) for k, v in metrics.items()}, stage=stage)

    # -- the end ------------------------------------------------------------------------------

    def _summary(self) -> dict[str, Any]:
        e = self.config.eval
        ev = self.meta["eval"]
        k = e.k

        def pick(which, split, key):
            return {d: r.get(key) for d, r in ev.get(which, {}).get(split, {}).items()}

        curriculum = self.loader.curriculum
        summary = {
            "eval": {
                "sft": pick("sft", "heldout", "pass@1"),
                "final": pick("final", "heldout", "pass@1"),
                "sft_pass_at_k": pick("sft", "heldout", f"pass@{k}"),
                "final_pass_at_k": pick("final", "heldout", f"pass@{k}"),
                "k": k,
                "ood": {
                    "sft": pick("sft", "ood", "pass@1"),
                    "final": pick("final", "ood", "pass@1"),
                    "sft_pass_at_k": pick("sft", "ood", f"pass@{k}"),
                    "final_pass_at_k": pick("final", "ood", f"pass@{k}"),
                    "levels": {d: self.levels[d] + 1 for d in ev.get("final", {}).get("ood", {})},
                },
            },
            "curriculum": {
                "weights": dict(zip(curriculum.names, map(float, curriculum.last_probs))),
                "difficulty": dict(zip(curriculum.names, map(int, curriculum.level))),
            },
            "wall_s": float(self.meta["elapsed_s"]),
        }
        if ev.get("final", {}).get("train"):
            # The memorisation gap: the same greedy score on training-partition items.
            summary["eval"]["train"] = {
                "sft": pick("sft", "train", "pass@1"),
                "final": pick("final", "train", "pass@1"),
            }
        if self.meta.get("reward_models"):
            summary["reward_models"] = self.meta["reward_models"]
        with open(os.path.join(self.workdir, SUMMARY_FILE), "w", encoding="utf-8") as f:
            json.dump(to_json_value(summary), f, indent=2, sort_keys=True)
        return summary

    def close(self) -> None:
        self.profiler.close()
        self.ckpt.close()
        self.writer.close()
        self.loader.close()
        if self.pool is not None:
            self.pool.close()


def _truncate_jsonl(path: str, step: int) -> None:
    """Drops lines with a step after ``step`` (the resume rule, applied to samples.jsonl)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        kept = []
        for line in f:
            try:
                if int(json.loads(line).get("step", 0)) <= step:
                    kept.append(line)
            except (json.JSONDecodeError, ValueError):
                continue
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


@dataclasses.dataclass(frozen=True)
class RestoredPolicy:
    """A run's trained policy, read back from its latest checkpoint."""

    config: ml_collections.ConfigDict
    model_cfg: Any
    tokenizer: Tokenizer
    graph: Any  # the policy's nnx graph definition
    params: Any  # the full policy state (LoRA adapters merged with the base)
    trained: Any  # what trained: the adapters under LoRA, else the same as ``params``
    base: Any  # the frozen base under LoRA, else None
    step: int
    stage: str

    def sampler(self, **kwargs) -> Sampler:
        """A ``Sampler`` for this policy with the run's tokenizer and prompt buckets."""
        kwargs.setdefault("buckets", tuple(self.config.rollout.get("buckets", DEFAULT_BUCKETS)))
        return Sampler(self.graph, self.model_cfg, eos_id=self.tokenizer.eos_id,
                       pad_id=self.tokenizer.pad_id, **kwargs)  # fmt: skip


def restore_policy(workdir: str) -> RestoredPolicy:
    """The policy of ``workdir``'s latest checkpoint (read only: the run is not touched)."""
    with open(os.path.join(workdir, RUN_CONFIG_FILE), encoding="utf-8") as f:
        config = ml_collections.ConfigDict(json.load(f))
    config.overwrite = False
    mcfg = model_config(config)
    tokenizer = make_tokenizer(config, mcfg)
    graph, params, base = build_policy(config, mcfg, policy_init_key(config))
    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR), async_save=False)
    try:
        step = ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {workdir}")
        meta = ckpt.read_meta(step)
        if "sft" in meta["items"]:
            sft_cfg = sft_lib.train_config(config.sft.learning_rate, config.sft.warmup_steps,
                                           config.sft.weight_decay)  # fmt: skip
            template = sft_lib.sft_trainer(sft_cfg, graph).init(params)
            items, _ = ckpt.restore(step, {"sft": template}, only=True)
            policy = items["sft"].params
        else:
            cfg = ppo_config(config)
            value = None
            if cfg.uses_critic:
                value = create_model(lambda rngs: ValueModel(mcfg, rngs=rngs),
                                     jax.random.key(1))[1]  # fmt: skip
            template = init_train_state(cfg, params, value, jax.random.key_data(jax.random.key(0)))
            items, _ = ckpt.restore(step, {"ppo": template}, only=True)
            policy = items["ppo"].policy
    finally:
        ckpt.close()
    return RestoredPolicy(config, mcfg, tokenizer, graph, full_policy(policy, base), policy,
                          base, step, meta["stage"])  # fmt: skip


# What `evaluate_checkpoint(eval_overrides=...)` may change: the item draw and how each
# item is scored, never which domains or levels (those are the run's own).
EVAL_OVERRIDES = (
    "seed",
    "heldout_items",
    "ood_items",
    "train_items",
    "n_samples",
    "k",
    "batch_size",
)


def evaluate_checkpoint(
    workdir: str, *, adapter: str | None = None, eval_overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Evaluates the policy in ``workdir``'s latest checkpoint with the run's own eval config.

    ``adapter``: a LoRA adapter name (``workdir/adapters/NAME``) or an adapter directory,
    evaluated over the run's frozen base (over its trained policy if the run trained
    full weights) in place of the checkpoint's own adapter.
    ``eval_overrides``: ``config.eval`` fields (of ``EVAL_OVERRIDES``) to change, e.g.
    ``{"seed": 7}`` for a second draw of held-out items.
    """
    overrides = dict(eval_overrides or {})
    unknown = sorted(set(overrides) - set(EVAL_OVERRIDES))
    if unknown:
        raise ValueError(f"eval_overrides: unknown field(s) {unknown}; allowed: {EVAL_OVERRIDES}")
    run = restore_policy(workdir)
    config, mcfg = run.config, run.model_cfg
    if overrides:
        config = ml_collections.ConfigDict(config.to_dict())
        config.eval.update(overrides)  # the Evaluator checks n_samples and k
    graph, params = run.graph, run.params
    if adapter is not None:
        from rlpt.interop.checkpoint import load_adapter

        _, graph, adapter_state = load_adapter(workdir, adapter, mcfg)
        base = run.base if run.base is not None else run.trained
        params = full_policy(adapter_state, base)
    results = evaluate_policy(config, make_domains(config), mcfg, run.tokenizer, graph,
                              params, run.step)  # fmt: skip
    return {"step": run.step, "stage": run.stage, "adapter": adapter, "k": config.eval.k,
            "results": results, **flatten_results(results, config.eval.k)}  # fmt: skip


def evaluate_policy(
    config: ml_collections.ConfigDict,
    domains: Mapping[str, Domain],
    model_cfg,
    tokenizer: Tokenizer,
    graph,
    state,
    step: int = 0,
) -> dict[str, Any]:
    """Held-out and OOD results of the policy ``(graph, state)`` under ``config.eval``."""
    pool = None
    if any(d.needs_sandbox for d in domains.values()):
        from rlpt.sandbox import SandboxPool

        pool = SandboxPool(workers=config.sandbox.workers, timeout_s=config.sandbox.timeout_s,
                           memory_mb=config.sandbox.memory_mb)  # fmt: skip
    try:
        buckets = tuple(config.rollout.get("buckets", DEFAULT_BUCKETS))
        sampler = Sampler(
            graph, model_cfg, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, buckets=buckets
        )
        evaluator = Evaluator(sampler, tokenizer, Verifier(domains, pool),
                              max_new_tokens=config.rollout.max_new_tokens,
                              chunk_size=config.eval.batch_size)  # fmt: skip
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed), 3), step)
        results, _ = evaluator.evaluate(
            state, make_eval_data(config, domains), key, n_samples=config.eval.n_samples,
            k=config.eval.k,
        )  # fmt: skip
    finally:
        if pool is not None:
            pool.close()
    return results


__all__ = [
    "PostTrainRun",
    "RUN_CONTROL_FIELDS",
    "check_rollout_config",
    "build_policy",
    "evaluate_checkpoint",
    "evaluate_policy",
    "full_policy",
    "lora_config",
    "register_stage",
    "restore_policy",
    "RestoredPolicy",
    "run_identity",
    "train_and_evaluate",
]
