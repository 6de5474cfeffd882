"""Typed run configuration: one frozen dataclass per section, parsed and checked once.

An experiment file (``experiments/NAME.py``) stays a plain ``get_config(arg)`` returning an
``ml_collections.ConfigDict``; ``parse_config`` turns it (or a run's stored JSON) into the
typed config of its trainer before anything is compiled or written:

    cfg = parse_config(get_config("runlocal"))   # PostTrainConfig
    cfg.rollout.batch_size, cfg.ppo.total_steps  # derived when left None

Every default lives in the dataclass fields below; ``default_config(trainer)`` builds the
ConfigDict an experiment file starts from, so every field can be overridden from the command
line and a misspelt key is refused. Every range and cross-field check raises ``ConfigError``,
whose message is one line naming the full dotted path:
``ppo.clip_low must be in (0, 1), got -1``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
from ml_collections import config_dict

from rlpt.data.curriculum import CurriculumConfig, DifficultyConfig
from rlpt.rl.kl import KL_KINDS
from rlpt.rl.ppo import PPOConfig

STAGES = ("sft", "rm", "prm", "ppo", "sft_continued")
# Fields that steer how a run is executed, not what it computes: a resumed run may
# change them without being "a different config".
RUN_CONTROL_FIELDS = ("overwrite", "stop_after_step", "logging", "profile")
SANDBOX_BACKENDS = ("local", "ray")
ENGINE_PLACEMENTS = ("local", "process", "ray")  # async_rl.engine
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
DEMO_DOMAINS = ("arithmetic", "stepwise_math", "program_synthesis")
# Keys that were once config keys and are now something else: the error says where they went.
_MOVED_KEYS = {
    "distributed": "multi-process JAX starts from flags of rlpt.train: "
    "--coordinator_address=HOST:PORT --num_processes=N --process_id=I, or --distributed",
}


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the full dotted path."""


# -- checks ------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    """``-1`` for -1.0 (the flag parser turns ``=-1`` into a float), repr otherwise."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return repr(int(value))
    return repr(value)


def _check(ok: bool, path: str, requirement: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{path} must be {requirement}, got {_fmt(value)}")


def _at_least(path: str, value: float, low: float) -> None:
    _check(value >= low, path, f">= {_fmt(low)}", value)


def _positive(path: str, value: float) -> None:
    _check(value > 0, path, "> 0", value)


def _unit(path: str, value: float) -> None:
    _check(0.0 <= value <= 1.0, path, "in [0, 1]", value)


def _choice(path: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{path} must be one of {tuple(allowed)}, got {value!r}")


def _existing_file(path: str, value: str) -> None:
    if value and not os.path.isfile(value):
        raise ConfigError(f"{path} {value!r} is not a file")


def unknown_key_message(path: str, known: Sequence[str]) -> str:
    """``unknown config key ppo.clip_lo; did you mean ppo.clip_low?`` (one line)."""
    prefix, _, key = path.rpartition(".")
    if not prefix and key in _MOVED_KEYS:
        return f"unknown config key {path}: {_MOVED_KEYS[key]}"
    match = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    where = f"{prefix}." if prefix else ""
    if match:
        return f"unknown config key {path}; did you mean {where}{match[0]}?"
    section = f"of {prefix}" if prefix else "at the top level"
    return f"unknown config key {path}; keys {section}: {', '.join(sorted(known))}"


# -- sections of the post-training config ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoRASection:
    """``model.lora``: rank 0 trains full weights; rank > 0 trains adapters only."""

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = ("wq", "wk", "wv", "wo")
    name: str = "policy"  # the adapter is saved as DIR/adapters/NAME

    def __post_init__(self):
        _at_least("model.lora.rank", self.rank, 0)
        _positive("model.lora.alpha", self.alpha)
        if not self.name or os.sep in self.name or self.name.startswith("."):
            raise ConfigError(f"model.lora.name must be a plain directory name, got {self.name!r}")
        from rlpt.models.lora import LORA_TARGETS

        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets:
            raise ConfigError(
                f"model.lora.targets must be a non-empty subset of {LORA_TARGETS}, "
                f"got {self.targets}"
            )

    def lora_config(self):
        """The ``rlpt.models.lora.LoRAConfig``, or None when ``rank`` is 0."""
        if not self.rank:
            return None
        from rlpt.models.lora import LoRAConfig

        return LoRAConfig(rank=self.rank, alpha=self.alpha, targets=self.targets)


@dataclasses.dataclass(frozen=True)
class ModelSection:
    preset: str = "mini"
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)  # ModelConfig fields
    lora: LoRASection = dataclasses.field(default_factory=LoRASection)
    # A Hugging Face model directory (config.json, *.safetensors, tokenizer.json) to start
    # from instead of the preset. None: not a Hugging Face run; "": required but not given.
    hf_path: str | None = None
    # A post_train run directory whose latest checkpoint's policy (SFT's kept parameters or
    # PPO's policy) this run starts from: one warm start shared by several arms.
    init_from: str = ""

    def __post_init__(self):
        from rlpt.models.config import PRESETS, ModelConfig

        _choice("model.preset", self.preset, sorted(PRESETS))
        known = [f.name for f in dataclasses.fields(ModelConfig)]
        for key in self.overrides:
            if key not in known:
                raise ConfigError(unknown_key_message(f"model.overrides.{key}", known))
        try:
            PRESETS[self.preset].replace(**self.overrides)
        except (ValueError, TypeError) as e:
            raise ConfigError(_with_path("model.overrides", e)) from None
        if self.hf_path is not None:
            if not self.hf_path:
                raise ConfigError(
                    "model.hf_path is empty: set it to a Hugging Face model directory"
                )
            if not os.path.isdir(self.hf_path):
                raise ConfigError(f"model.hf_path {self.hf_path!r} is not a directory")
        if self.init_from:
            if self.hf_path is not None:
                raise ConfigError("model.init_from and model.hf_path are exclusive starts")
            if not os.path.isfile(os.path.join(self.init_from, "run_config.json")):
                raise ConfigError(
                    f"model.init_from {self.init_from!r} is not a run directory "
                    "(no run_config.json)"
                )


@dataclasses.dataclass(frozen=True)
class SandboxSection:
    """The code-execution pool's ceilings (a request may ask for less, never more)."""

    workers: int = 2
    timeout_s: float = 1.0
    memory_mb: int = 256
    # True: run where the isolation features (namespaces) are missing, unisolated.
    allow_unisolated: bool = False
    backend: str = "local"  # "ray": workers on a Ray cluster

    def __post_init__(self):
        _at_least("sandbox.workers", self.workers, 1)
        _positive("sandbox.timeout_s", self.timeout_s)
        _at_least("sandbox.memory_mb", self.memory_mb, 1)
        _choice("sandbox.backend", self.backend, SANDBOX_BACKENDS)


@dataclasses.dataclass(frozen=True)
class SFTSection:
    jsonl: str = ""  # a JSONL of {"prompt", "completion"} replaces the demonstrations
    batch_size: int = 32
    max_len: int = 64
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    token_budget: int = 150_000  # completion tokens: the fixed warm-start rule
    heldout_items: int = 64
    log_every: int = 10
    continued_wall_s: float = 0.0  # only the sft_continued control stage reads it
    eval_every: int = 0  # > 0: held-out loss and greedy evaluation every this many steps
    # > 0: a fixed set of this many demonstrations per domain, cycled in epochs (the regime
    # RL is for: few demonstrations, unlimited verifiable prompts); 0: a fresh one each time.
    demonstrations: int = 0
    # Leave SFT with the parameters of its best periodic evaluation (mean greedy pass@1 over
    # domains on eval.heldout_split, which should then be "validation"), not its last step.
    keep_best: bool = False

    def __post_init__(self):
        _existing_file("sft.jsonl", self.jsonl)
        for name in ("batch_size", "max_len", "token_budget", "heldout_items", "log_every"):
            _at_least(f"sft.{name}", getattr(self, name), 1)
        _positive("sft.learning_rate", self.learning_rate)
        for name in ("warmup_steps", "weight_decay", "continued_wall_s", "eval_every",
                     "demonstrations"):  # fmt: skip
            _at_least(f"sft.{name}", getattr(self, name), 0)
        if self.keep_best and not self.eval_every:
            raise ConfigError(
                "sft.keep_best needs sft.eval_every > 0 (the evaluations it picks from)"
            )
        if self.demonstrations and self.jsonl:
            raise ConfigError(
                "sft.demonstrations draws from the domains; it cannot be set with sft.jsonl"
            )


@dataclasses.dataclass(frozen=True)
class ChunkedReasoningSection:
    """``rollout.chunked_reasoning``: Delethink's chunked reasoning (arXiv:2510.06557).

    The policy reasons in chunks of ``chunk_tokens``; at each boundary the context is reset
    to the prompt plus the last ``carry_tokens`` of the reasoning, for at most
    ``max_chunks`` chunks (``rlpt.sampling.chunked``). Each chunk is one row of the PPO
    batch and shares its trace's advantage, so no forward pass sees more than one window.

    The length curriculum: ``budgets`` are chunk budgets used in turn, the first from the
    start of the PPO stage and budget ``i + 1`` from PPO step ``budget_steps[i]`` on; empty
    ``budgets`` means ``max_chunks`` throughout. ``max_chunks`` bounds every budget and
    sets the evaluation's budget.
    """

    enabled: bool = False
    chunk_tokens: int = 64
    carry_tokens: int = 32
    max_chunks: int = 4
    budgets: tuple[int, ...] = ()
    budget_steps: tuple[int, ...] = ()

    def __post_init__(self):
        path = "rollout.chunked_reasoning"
        _at_least(f"{path}.chunk_tokens", self.chunk_tokens, 1)
        _at_least(f"{path}.carry_tokens", self.carry_tokens, 0)
        # The carry is the state a chunk hands on; at C or more a chunk could only copy.
        _check(self.carry_tokens < self.chunk_tokens, f"{path}.carry_tokens",
               f"< {path}.chunk_tokens ({self.chunk_tokens})", self.carry_tokens)  # fmt: skip
        _at_least(f"{path}.max_chunks", self.max_chunks, 1)
        for i, budget in enumerate(self.budgets):
            _check(1 <= budget <= self.max_chunks, f"{path}.budgets[{i}]",
                   f"in [1, {path}.max_chunks = {self.max_chunks}]", budget)  # fmt: skip
        want = max(len(self.budgets) - 1, 0)
        _check(len(self.budget_steps) == want, f"{path}.budget_steps",
               f"{want} PPO steps (one per budget after the first)", self.budget_steps)  # fmt: skip
        steps = list(self.budget_steps)
        ok = all(x >= 1 for x in steps) and steps == sorted(set(steps))
        _check(ok, f"{path}.budget_steps", "strictly increasing steps >= 1", self.budget_steps)

    def budget(self, stage_step: int) -> int:
        """The chunk budget of PPO step ``stage_step`` (0-based within the PPO stage)."""
        if not self.budgets:
            return self.max_chunks
        passed = sum(stage_step >= s for s in self.budget_steps)
        return self.budgets[passed]


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    batch_size: int = 64  # sequences per PPO step
    group_size: int = 8  # samples per prompt (GRPO groups)
    max_new_tokens: int = 40
    temperature: float = 1.4
    buckets: tuple[int, ...] = (16, 32, 64)  # prompt lengths are padded to one of these
    # DAPO's dynamic sampling: draw more prompt batches (at most filter_max_rounds per step)
    # until every group in the update has rewards that vary.
    filter_groups: bool = True
    filter_max_rounds: int = 4
    # "engine": continuous batching over `slots` decode slots with shared prompt blocks;
    # "static": the batch decodes in lockstep until its longest row is done.
    sampler: str = "engine"
    slots: int = 64
    chunked_reasoning: ChunkedReasoningSection = dataclasses.field(
        default_factory=ChunkedReasoningSection
    )
    # Multi-turn rollouts (``rlpt.roles.multiturn``): a row not yet correct gets the
    # verifier's feedback ("\nfeedback: f(3) gave 7, expected 10\n", at most
    # feedback_tokens tokens) appended and the model answers again, up to `turns` turns of
    # max_new_tokens each. 1: single-turn rollouts. The row's reward is its last verdict's
    # times turn_discount ** (turns used - 1).
    turns: int = 1
    feedback_tokens: int = 64
    turn_discount: float = 1.0

    def __post_init__(self):
        for name in ("batch_size", "group_size", "max_new_tokens", "filter_max_rounds", "slots",
                     "turns", "feedback_tokens"):  # fmt: skip
            _at_least(f"rollout.{name}", getattr(self, name), 1)
        _check(0.0 < self.turn_discount <= 1.0, "rollout.turn_discount", "in (0, 1]",
               self.turn_discount)  # fmt: skip
        if self.sampler not in ("engine", "static"):
            raise ConfigError(f"rollout.sampler must be 'engine' or 'static', got {self.sampler!r}")
        if not self.temperature > 0:
            raise ConfigError(f"rollout.temperature must be a number > 0, got {self.temperature!r}")
        if self.batch_size % self.group_size:
            raise ConfigError(
                f"rollout.batch_size must be a multiple of rollout.group_size "
                f"({self.group_size}), got {self.batch_size}"
            )
        if not self.buckets or any(b < 1 for b in self.buckets):
            raise ConfigError(
                f"rollout.buckets must be a non-empty tuple of positive lengths, got {self.buckets}"
            )
        if list(self.buckets) != sorted(set(self.buckets)):
            raise ConfigError(f"rollout.buckets must be strictly increasing, got {self.buckets}")

    @property
    def response_width(self) -> int:
        """Response columns of a rollout row: every turn's completion and feedback."""
        return self.turns * self.max_new_tokens + (self.turns - 1) * self.feedback_tokens


@dataclasses.dataclass(frozen=True)
class PPOSection(PPOConfig):
    """``ppo``: a ``PPOConfig`` with the post-training defaults, usable as one directly.

    ``total_steps`` (optimiser steps of the learning-rate schedule), ``num_groups`` and
    ``sampling_temperature`` are filled in by ``PostTrainConfig`` from ``ppo_steps`` and
    ``rollout`` when left None; fields not redeclared keep ``PPOConfig``'s defaults.
    """

    epochs: int = 2
    num_minibatches: int = 2
    estimator: str = "grpo"  # "gae" trains the value model (critic) as well
    clip_high: float | None = 0.28
    kl_placement: str = "loss"
    learning_rate: float = 4e-4
    value_learning_rate: float = 1e-4
    schedule: str = "warmup_cosine"
    warmup_steps: int = 10
    total_steps: int | None = None  # None: ppo_steps * epochs * num_minibatches
    end_lr_fraction: float = 0.0
    pack_sequences: bool = True
    imitation_coef: float = 0.25

    def __post_init__(self):
        _check(0.0 < self.clip_low < 1.0, "ppo.clip_low", "in (0, 1)", self.clip_low)
        if self.clip_high is not None:
            _positive("ppo.clip_high", self.clip_high)
        if self.dual_clip is not None:
            _check(self.dual_clip > 1.0, "ppo.dual_clip", "> 1 (or None)", self.dual_clip)
        if self.value_clip is not None:
            _positive("ppo.value_clip", self.value_clip)
        _positive("ppo.learning_rate", self.learning_rate)
        _positive("ppo.value_learning_rate", self.value_learning_rate)
        _unit("ppo.gamma", self.gamma)
        _unit("ppo.lam", self.lam)
        _at_least("ppo.kl_coef", self.kl_coef, 0)
        if self.kl_adaptive:
            _positive("ppo.kl_target", self.kl_target)
            _positive("ppo.kl_horizon", self.kl_horizon)
        for name in ("epochs", "num_minibatches", "grad_accum"):
            _at_least(f"ppo.{name}", getattr(self, name), 1)
        _at_least("ppo.warmup_steps", self.warmup_steps, 0)
        if self.num_groups is not None:
            _at_least("ppo.num_groups", self.num_groups, 1)
        _unit("ppo.end_lr_fraction", self.end_lr_fraction)
        _positive("ppo.max_grad_norm", self.max_grad_norm)
        for name in ("weight_decay", "vf_coef", "ent_coef", "imitation_coef", "overlong_penalty"):
            _at_least(f"ppo.{name}", getattr(self, name), 0)
        _positive("ppo.adaptive_lr_target", self.adaptive_lr_target)
        low, high = self.adaptive_lr_bounds
        if not 0 < low <= 1 <= high:
            raise ConfigError(
                f"ppo.adaptive_lr_bounds must be (low, high) with 0 < low <= 1 <= high, "
                f"got {self.adaptive_lr_bounds}"
            )
        _check(self.adaptive_lr_factor > 1, "ppo.adaptive_lr_factor", "> 1",
               self.adaptive_lr_factor)  # fmt: skip
        _choice("ppo.kl_kind", self.kl_kind, KL_KINDS)
        try:  # the choices (estimator, schedule, ...) and their combinations
            super().__post_init__()
        except ValueError as e:
            raise ConfigError(_with_path("ppo", e)) from None


@dataclasses.dataclass(frozen=True)
class RewardsSection:
    outcome: float = 1.0  # the domain verifier's reward (code: hidden-test pass rate)
    format: float = 0.1
    length: float = 0.0
    length_target_bytes: int = 64
    length_scale_bytes: float = 100.0
    # Learned rewards: weights > 0 need the 'rm' / 'prm' stage in stages.
    reward_model: float = 0.0
    process: float = 0.0
    process_aggregation: str = "min"  # or "sum" over future steps
    learned_clip: float = 5.0  # learned terms: running normalisation, then this clip

    def __post_init__(self):
        for name in ("outcome", "format", "length"):
            value = getattr(self, name)
            _check(math.isfinite(value), f"rewards.{name}", "a finite number", value)
        _at_least("rewards.length_target_bytes", self.length_target_bytes, 0)
        _positive("rewards.length_scale_bytes", self.length_scale_bytes)
        _at_least("rewards.reward_model", self.reward_model, 0)
        _at_least("rewards.process", self.process, 0)
        _choice("rewards.process_aggregation", self.process_aggregation, ("min", "sum"))
        _positive("rewards.learned_clip", self.learned_clip)


@dataclasses.dataclass(frozen=True)
class RewardModelSection:
    """The 'rm' stage: Bradley-Terry on correctness pairs (and optionally a user's JSONL)."""

    domains: tuple[str, ...] = ("arithmetic", "stepwise_math")
    pairs_jsonl: str = ""  # {"prompt", "chosen", "rejected"} per line
    pairs_per_level: int = 1500
    heldout_pairs: int = 100  # per domain and level
    steps: int = 400
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    margin: float = 0.0
    likelihood: bool = True  # add the policy's log-likelihood of the row to the score
    refresh_every: int = 0  # > 0: Bradley-Terry steps on fresh rollout pairs during PPO
    refresh_steps: int = 4
    refresh_batch_size: int = 16
    refresh_buffer: int = 1024  # newest traces kept

    def __post_init__(self):
        _existing_file("reward_model.pairs_jsonl", self.pairs_jsonl)
        for name in ("pairs_per_level", "heldout_pairs", "steps", "batch_size",
                     "refresh_steps", "refresh_batch_size", "refresh_buffer"):  # fmt: skip
            _at_least(f"reward_model.{name}", getattr(self, name), 1)
        _positive("reward_model.learning_rate", self.learning_rate)
        for name in ("warmup_steps", "margin", "refresh_every"):
            _at_least(f"reward_model.{name}", getattr(self, name), 0)


@dataclasses.dataclass(frozen=True)
class ProcessRewardSection:
    """The 'prm' stage: Math-Shepherd labels from the policy's own continuations, or
    (``kind="implicit"``) PRIME's implicit PRM trained on outcome labels alone."""

    kind: str = "math_shepherd"  # or "implicit" (rlpt.rewards.implicit)
    domain: str = "stepwise_math"
    label: str = "hard"  # "soft": the fraction of continuations that reach the answer
    label_tasks: int = 192  # per level
    continuations: int = 4
    heldout_tasks: int = 150
    steps: int = 400
    batch_size: int = 64
    learning_rate: float = 3e-5
    warmup_steps: int = 50
    likelihood: bool = True  # add each step's log-likelihood under the policy to its score
    beta: float = 0.05  # implicit: r = beta * log(pi_phi / pi_ref) (PRIME's value)
    samples: int = 4  # implicit: completions per prompt, labelled by the verifier
    # implicit: PRIME's online update, one step of pi_phi on every PPO rollout batch (its
    # outcome labels), after the batch is scored; 0 keeps pi_phi fixed after the stage.
    online_learning_rate: float = 0.0

    def __post_init__(self):
        _choice("process_reward.kind", self.kind, ("math_shepherd", "implicit"))
        _at_least("process_reward.online_learning_rate", self.online_learning_rate, 0.0)
        if self.online_learning_rate and self.kind != "implicit":
            raise ConfigError(
                "process_reward.online_learning_rate > 0 updates the implicit PRM online; it "
                f"needs process_reward.kind='implicit', got {self.kind!r}"
            )
        _choice("process_reward.label", self.label, ("soft", "hard"))
        for name in ("label_tasks", "continuations", "heldout_tasks", "steps", "batch_size"):
            _at_least(f"process_reward.{name}", getattr(self, name), 1)
        _at_least("process_reward.samples", self.samples, 2)
        _positive("process_reward.beta", self.beta)
        _positive("process_reward.learning_rate", self.learning_rate)
        _at_least("process_reward.warmup_steps", self.warmup_steps, 0)


@dataclasses.dataclass(frozen=True)
class DifficultySection(DifficultyConfig):
    """``curriculum.difficulty`` with the post-training defaults."""

    upper: float = 0.7
    lower: float = 0.1

    def __post_init__(self):
        _at_least("curriculum.difficulty.start", self.start, 1)
        _at_least("curriculum.difficulty.window", self.window, 1)
        if not 0.0 <= self.review < 1.0:
            raise ConfigError(
                f"curriculum.difficulty.review must be in [0, 1), got {_fmt(self.review)}"
            )
        if not 0.0 <= self.lower < self.upper <= 1.0:
            raise ConfigError(
                "curriculum.difficulty needs 0 <= lower < upper <= 1, got "
                f"lower={_fmt(self.lower)}, upper={_fmt(self.upper)}"
            )


@dataclasses.dataclass(frozen=True)
class CurriculumSection(CurriculumConfig):
    """``curriculum``: a ``CurriculumConfig`` (``rlpt.data.Curriculum`` takes it as is)."""

    temperature: float = 0.5
    floor: float = 0.05
    difficulty: DifficultySection = DifficultySection()

    def __post_init__(self):
        try:
            super().__post_init__()
        except ValueError as e:
            raise ConfigError(_with_path("curriculum", e)) from None
        for name in ("exploration", "progress_noise_z", "confidence_power", "size_power",
                     "loss_weight_scale"):  # fmt: skip
            _at_least(f"curriculum.{name}", getattr(self, name), 0)
        _unit("curriculum.exp3_smoothing", self.exp3_smoothing)
        if self.strategy == "fixed" and self.fixed_weights is None:
            raise ConfigError("curriculum.fixed_weights must be set for strategy 'fixed'")
        if self.strategy == "schedule" and not self.schedule:
            raise ConfigError("curriculum.schedule must be set for strategy 'schedule'")


@dataclasses.dataclass(frozen=True)
class EvalSection:
    heldout_items: int = 200
    ood_items: int = 100
    train_items: int = 0  # > 0: also score this many training-partition items per domain
    n_samples: int = 4  # at temperature 1, for pass@k
    k: int = 4
    every: int = 40  # PPO steps between periodic held-out greedy evaluations; 0: never
    periodic_items: int = 100
    batch_size: int = 200
    log_samples: int = 8
    seed: int = 1234
    # Where the held-out set is drawn from: the whole held-out partition, or its
    # "validation" half (choose settings on it) or "test" half (report on it, once).
    heldout_split: str = "heldout"

    def __post_init__(self):
        for name in ("heldout_items", "ood_items", "train_items", "n_samples", "every",
                     "periodic_items", "log_samples"):  # fmt: skip
            _at_least(f"eval.{name}", getattr(self, name), 0)
        _choice("eval.heldout_split", self.heldout_split, ("heldout", "validation", "test"))
        _at_least("eval.batch_size", self.batch_size, 1)
        # As rlpt.eval.check_sampling: pass@1 is the greedy score, so sampled k starts at 2.
        if self.n_samples and self.k < 2:
            raise ConfigError(
                f"eval.k must be >= 2 when eval.n_samples > 0, got {_fmt(self.k)}: pass@1 is "
                "the greedy score and the sampled pass@1 is reported as sample_pass@1"
            )
        if self.n_samples and self.n_samples < self.k:
            raise ConfigError(f"eval.n_samples ({self.n_samples}) must be >= eval.k ({self.k})")


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every: int = 40
    keep: int = 2
    async_save: bool = True

    def __post_init__(self):
        _at_least("checkpoint.every", self.every, 1)
        _at_least("checkpoint.keep", self.keep, 1)


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    """How the run reports; none of it changes what the run computes."""

    tensorboard: bool = True  # event files in DIR/tensorboard
    wandb_project: str = ""  # a Weights & Biases project, if wandb is installed
    plots: bool = True  # learning-curve PNGs in DIR/plots at the end
    progress_bar: bool | None = None  # None: only on a terminal
    peak_flops: float | None = None  # per-device peak FLOP/s for time/mfu; None: measured

    def __post_init__(self):
        if self.peak_flops is not None:
            _positive("logging.peak_flops", self.peak_flops)


@dataclasses.dataclass(frozen=True)
class ProfileSection:
    steps: tuple[int, ...] = ()  # global steps to trace with the JAX profiler
    dir: str = ""  # default DIR/profile

    def __post_init__(self):
        for i, step in enumerate(self.steps):
            _at_least(f"profile.steps[{i}]", step, 0)


@dataclasses.dataclass(frozen=True)
class AsyncSection:
    """``async_rl``: actors and a learner that overlap (``rlpt.asyncrl``); off by default.

    The rollout engine runs on ``actor_devices`` of the devices (-1: half), the learner on
    the rest; every token of a batch is at most ``max_staleness`` policy versions old
    (admission control, nothing discarded). Set ``ppo.behaviour_correction`` for decoupled
    PPO; "none" is naive PPO on stale samples.

    ``token_budget`` > 0 sizes batches by tokens rather than by a fixed count: a learner
    batch takes the due groups, then groups by priority while their response tokens fit
    the budget, from ``rollout.batch_size / rollout.group_size`` groups (the rate the
    staleness rule admits them; fewer would let groups pile up until more fall due at once
    than a batch holds) to ``max_batch_groups`` (0: twice that): short responses make
    larger batches. The update always sees ``max_batch_groups`` groups, the missing ones
    as rows of zero loss weight, so one program serves every batch; their compute is spent.

    ``engine`` places the rollout engine: "local" on ``actor_devices`` of this process;
    "process" in every JAX process but 0 of a multi-process ``rlpt.train`` (flags
    ``--coordinator_address --num_processes=N --process_id``), an engine on all of each
    process's devices (N - 1 replicas), while process 0 runs everything else on its own
    (``rlpt.asyncrl.remote``);
    "ray" on Ray actors (``ray.init()`` with ``RAY_ADDRESS`` or a local cluster), each
    with ``ray_num_gpus`` accelerators (``rlpt.asyncrl.ray_engine``). ``engines`` > 1
    runs that many data-parallel replicas (``rlpt.asyncrl.replicated``), each with
    ``rollout.slots`` slots: "local" splits the actor devices evenly among them, "ray"
    starts one actor per replica.
    """

    enabled: bool = False
    max_staleness: int = 2
    actor_devices: int = -1
    priority: str = "uniform"
    alpha: float = 1.0
    beta: float = 1.0
    max_reuse: int = 1
    pool_capacity_tokens: int = 1 << 20
    reward_threads: int = 4
    in_flight: str = "continue"
    token_budget: int = 0  # > 0: a learner batch closes at this many response tokens
    max_batch_groups: int = 0  # with token_budget: groups per batch at most (0: twice the base)
    # "sync": the same parts strictly in turn (generate the batch, judge it, update), the
    # synchronous baseline that max_staleness = 0 reproduces step for step.
    mode: str = "async"
    engine: str = "local"
    engines: int = 1  # data-parallel engine replicas ("local": over the actor devices; "ray")
    ray_num_gpus: float = 0.0

    def __post_init__(self):
        from rlpt.asyncrl.pool import PRIORITIES

        _at_least("async_rl.max_staleness", self.max_staleness, 0)
        _check(self.actor_devices == -1 or self.actor_devices >= 1, "async_rl.actor_devices",
               "a positive integer or -1", self.actor_devices)  # fmt: skip
        _choice("async_rl.priority", self.priority, PRIORITIES)
        _positive("async_rl.alpha", self.alpha)
        _unit("async_rl.beta", self.beta)
        _at_least("async_rl.max_reuse", self.max_reuse, 1)
        _at_least("async_rl.pool_capacity_tokens", self.pool_capacity_tokens, 1)
        _at_least("async_rl.reward_threads", self.reward_threads, 1)
        _choice("async_rl.in_flight", self.in_flight, ("continue", "requeue"))
        _choice("async_rl.mode", self.mode, ("async", "sync"))
        _at_least("async_rl.token_budget", self.token_budget, 0)
        _at_least("async_rl.max_batch_groups", self.max_batch_groups, 0)
        _choice("async_rl.engine", self.engine, ENGINE_PLACEMENTS)
        _at_least("async_rl.engines", self.engines, 1)
        if self.engine == "process" and self.engines != 1:
            raise ConfigError(
                "async_rl.engines must be 1 with async_rl.engine 'process' (each engine "
                f"process serves one; start more processes for more), got {self.engines}"
            )
        _at_least("async_rl.ray_num_gpus", self.ray_num_gpus, 0)


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """Device mesh sizes (``rlpt.parallel.make_mesh``); one of them may be -1: the rest.

    ``sequence`` > 1 splits each row's tokens over that many devices (context parallelism:
    ``rlpt.parallel.context``) for the passes without a KV cache (scoring and the update)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    sequence: int = 1

    def __post_init__(self):
        sizes = {
            "data": self.data, "fsdp": self.fsdp, "tensor": self.tensor,
            "sequence": self.sequence,
        }  # fmt: skip
        for name, size in sizes.items():
            _check(size == -1 or size >= 1, f"mesh.{name}", "a positive integer or -1", size)
        free = [f"mesh.{name}" for name, size in sizes.items() if size == -1]
        if len(free) > 1:
            raise ConfigError(f"at most one mesh axis may be -1, got {' and '.join(free)}")

    def shape(self, num_devices: int) -> tuple[int, int, int, int]:
        """(data, fsdp, tensor, sequence) on ``num_devices``; ConfigError if they do not fit."""
        from rlpt.parallel.mesh import resolve_mesh_shape

        try:
            return resolve_mesh_shape(num_devices, self.data, self.fsdp, self.tensor, self.sequence)
        except ValueError as e:
            raise ConfigError(_with_path("mesh", e)) from None


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Where each domain's prompts come from: ``sources[DOMAIN]`` is a source spec
    (``rlpt.data.make_source``): ``{"kind": "array_record" | "tfds" | "jsonl", "path": ...}``
    or ``{"kind": "procedural", ...}``. A domain without an entry is generated
    procedurally from the run's seed."""

    sources: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        from rlpt.data.sources import SOURCE_KINDS

        for name, spec in self.sources.items():
            path = f"data.sources.{name}"
            if not isinstance(spec, Mapping):
                raise ConfigError(f"{path} must be a source spec (a mapping), got {_fmt(spec)}")
            kind = spec.get("kind", "procedural")
            _choice(f"{path}.kind", kind, SOURCE_KINDS)
            if kind != "procedural":
                if not spec.get("path"):
                    raise ConfigError(f"{path}.path must be set for a {kind} source")
                paths = spec["path"] if isinstance(spec["path"], list | tuple) else [spec["path"]]
                for file in paths:
                    if "://" not in str(file) and not os.path.exists(str(file)):
                        raise ConfigError(f"{path}.path {file!r} does not exist")


def _default_domains() -> tuple[str, ...]:
    return DEMO_DOMAINS


@dataclasses.dataclass(frozen=True)
class PostTrainConfig:
    """The ``post_train`` trainer's config: SFT, optional reward models, then PPO.

    After construction, ``ppo.total_steps``, ``ppo.num_groups`` and
    ``ppo.sampling_temperature`` hold their derived values, so ``ppo`` binds
    ``rlpt.rl.PPOTrainer`` as it is.
    """

    trainer: str = "post_train"
    seed: int = 0
    overwrite: bool = False  # True: replace a different run found in the workdir
    stop_after_step: int | None = None  # stop (as if interrupted) after this global step
    stages: tuple[str, ...] = ("sft", "ppo")
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    domains: tuple[str, ...] = dataclasses.field(default_factory=_default_domains)
    # Highest level trained per domain ("default" for the rest); OOD is one level above.
    train_max_level: dict[str, int] = dataclasses.field(default_factory=lambda: {"default": 2})
    sandbox: SandboxSection = dataclasses.field(default_factory=SandboxSection)
    sft: SFTSection = dataclasses.field(default_factory=SFTSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    ppo_steps: int = 420
    ppo: PPOSection = dataclasses.field(default_factory=PPOSection)
    rewards: RewardsSection = dataclasses.field(default_factory=RewardsSection)
    reward_model: RewardModelSection = dataclasses.field(default_factory=RewardModelSection)
    process_reward: ProcessRewardSection = dataclasses.field(default_factory=ProcessRewardSection)
    curriculum: CurriculumSection = dataclasses.field(default_factory=CurriculumSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    logging: LoggingSection = dataclasses.field(default_factory=LoggingSection)
    profile: ProfileSection = dataclasses.field(default_factory=ProfileSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    async_rl: AsyncSection = dataclasses.field(default_factory=AsyncSection)

    def __post_init__(self):
        _choice("trainer", self.trainer, ("post_train",))
        if self.stop_after_step is not None:
            _at_least("stop_after_step", self.stop_after_step, 0)
        self._check_stages()
        self._check_domains()
        for name in self.data.sources:
            if name not in self.domains:
                raise ConfigError(f"data.sources.{name} names no domain of domains {self.domains}")
        _at_least("ppo_steps", self.ppo_steps, 0)
        if self.ppo.total_steps is not None:  # after ppo_steps: it may be derived from it
            _at_least("ppo.total_steps", self.ppo.total_steps, 0)
        self._check_ppo_against_rollout()
        self._check_learned_rewards()
        self._check_chunked_reasoning()
        self._check_turns()
        if self.async_rl.enabled and self.reward_model.refresh_every:
            raise ConfigError(
                "reward_model.refresh_every > 0 does not run with async_rl.enabled yet (the "
                "refresh reads verifier results the pool does not keep): set it to 0"
            )
        k = len(self.domains)
        if self.curriculum.floor * k > 1.0 + 1e-6:
            raise ConfigError(
                f"curriculum.floor must be <= 1 / {k} (the number of domains), "
                f"got {_fmt(self.curriculum.floor)}"
            )
        for name in ("fixed_weights",):
            weights = getattr(self.curriculum, name)
            if weights is not None and set(weights) != set(self.domains):
                raise ConfigError(
                    f"curriculum.{name} must have one weight per domain {self.domains}, "
                    f"got {sorted(weights)}"
                )
        # Derived values, filled in so the section is complete as it stands.
        ppo = self.ppo
        updates = {
            "total_steps": self.derived_total_steps if ppo.total_steps is None else None,
            "num_groups": self.learner_groups if ppo.num_groups is None else None,
            "sampling_temperature": float(self.rollout.temperature),
        }
        updates = {k: v for k, v in updates.items() if v is not None}
        object.__setattr__(self, "ppo", dataclasses.replace(ppo, **updates))

    @property
    def learner_groups(self) -> int:
        """Groups in a learner batch: ``rollout.batch_size / rollout.group_size``, or
        ``async_rl.max_batch_groups`` when batching by ``async_rl.token_budget``."""
        a, base = self.async_rl, self.rollout.batch_size // self.rollout.group_size
        if a.enabled and a.token_budget:
            return a.max_batch_groups or 2 * base
        return base

    @property
    def derived_total_steps(self) -> int:
        """Optimiser steps over the whole PPO stage: ``ppo_steps * epochs * num_minibatches``."""
        return self.ppo_steps * self.ppo.epochs * self.ppo.num_minibatches

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; ``parse_config`` of it gives an equal config."""
        return _plain(self)

    def _check_stages(self) -> None:
        if not self.stages:
            raise ConfigError(f"stages must name at least one of {STAGES}, got ()")
        for i, stage in enumerate(self.stages):
            _choice(f"stages[{i}]", stage, STAGES)
        if len(set(self.stages)) != len(self.stages):
            raise ConfigError(f"stages must not repeat a stage, got {self.stages}")
        for stage in ("rm", "prm"):
            ordered = stage not in self.stages or "ppo" not in self.stages
            if not ordered and self.stages.index(stage) > self.stages.index("ppo"):
                raise ConfigError(f"stages must put {stage!r} before 'ppo', got {self.stages}")

    def _check_domains(self) -> None:
        if not self.domains:
            raise ConfigError("domains must name at least one domain, got ()")
        if len(set(self.domains)) != len(self.domains):
            raise ConfigError(f"domains must not repeat a domain, got {self.domains}")
        for i, name in enumerate(self.domains):
            check_domain_name(f"domains[{i}]", name)
        for key, level in self.train_max_level.items():
            if key != "default" and key not in self.domains:
                raise ConfigError(
                    f"train_max_level.{key} names no domain of domains {self.domains} "
                    "(use 'default' for the rest)"
                )
            _at_least(f"train_max_level.{key}", level, 1)

    def _check_ppo_against_rollout(self) -> None:
        r, ppo = self.rollout, self.ppo
        if ppo.estimator in GROUP_ESTIMATORS:
            _check(r.group_size >= 2, "rollout.group_size",
                   f">= 2 for ppo.estimator {ppo.estimator!r} (a group of one has no "
                   "advantage)", r.group_size)  # fmt: skip
        if r.filter_groups and ppo.uses_critic:
            raise ConfigError(
                "rollout.filter_groups must be False with ppo.estimator 'gae': only a group "
                "estimator (grpo, dr_grpo, rloo) gives a group of equal rewards zero advantage"
            )
        if r.batch_size % ppo.num_minibatches:
            raise ConfigError(
                f"ppo.num_minibatches must divide rollout.batch_size ({r.batch_size}), "
                f"got {ppo.num_minibatches}"
            )
        minibatch = r.batch_size // ppo.num_minibatches
        if minibatch % ppo.grad_accum:
            raise ConfigError(
                f"ppo.grad_accum must divide the minibatch of {minibatch} sequences "
                f"(rollout.batch_size / ppo.num_minibatches), got {ppo.grad_accum}"
            )
        groups = self.learner_groups
        if ppo.num_groups is not None and ppo.num_groups != groups:
            source = (
                "rollout.batch_size / rollout.group_size"
                if groups == r.batch_size // r.group_size
                else "the learner batch's groups with async_rl.token_budget"
            )
            raise ConfigError(
                f"ppo.num_groups must be {source} = {groups} (or None), got {ppo.num_groups}"
            )
        a = self.async_rl
        if a.engine != "local" and not a.enabled:
            raise ConfigError(f"async_rl.engine {a.engine!r} needs async_rl.enabled")
        if a.token_budget and not a.enabled:
            raise ConfigError("async_rl.token_budget batches the asynchronous learner; it needs "
                              "async_rl.enabled")  # fmt: skip
        if a.enabled and a.token_budget:
            if a.max_batch_groups:
                _at_least(
                    "async_rl.max_batch_groups", a.max_batch_groups, r.batch_size // r.group_size
                )
            rows = self.learner_groups * r.group_size
            if rows % (ppo.num_minibatches * ppo.grad_accum):
                raise ConfigError(
                    f"async_rl.max_batch_groups * rollout.group_size ({rows} rows) must split "
                    f"into ppo.num_minibatches * ppo.grad_accum "
                    f"({ppo.num_minibatches * ppo.grad_accum})"
                )
        if ppo.sampling_temperature != PPOConfig.sampling_temperature and (
            ppo.sampling_temperature != r.temperature
        ):
            raise ConfigError(
                "ppo.sampling_temperature is taken from rollout.temperature "
                f"({_fmt(r.temperature)}); set that instead, got {_fmt(ppo.sampling_temperature)}"
            )

    def _check_chunked_reasoning(self) -> None:
        if not self.rollout.chunked_reasoning.enabled:
            return
        path = "rollout.chunked_reasoning.enabled"
        if self.ppo.estimator not in GROUP_ESTIMATORS or self.ppo.step_advantages:
            raise ConfigError(
                f"{path} needs ppo.estimator one of {GROUP_ESTIMATORS} without "
                f"ppo.step_advantages (chunks share their trace's advantage), got "
                f"{self.ppo.estimator!r}"
                + (" with step_advantages" if self.ppo.step_advantages else "")
            )
        if self.async_rl.enabled:
            raise ConfigError(f"{path} does not run with async_rl.enabled yet")
        if self.rewards.reward_model > 0 or self.rewards.process > 0:
            raise ConfigError(
                f"{path} does not take learned reward terms yet: set rewards.reward_model "
                "and rewards.process to 0"
            )

    def _check_turns(self) -> None:
        """Multi-turn rollouts run in the synchronous PPO stage, on verifier rewards."""
        turns = self.rollout.turns
        if turns == 1:
            return
        if self.rollout.chunked_reasoning.enabled:
            _check(False, "rollout.turns", "1 with rollout.chunked_reasoning.enabled", turns)
        if self.async_rl.enabled:
            _check(False, "rollout.turns", "1 with async_rl.enabled (not yet)", turns)
        if self.rewards.reward_model > 0 or self.rewards.process > 0:
            _check(False, "rollout.turns", "1 with learned reward terms (rewards.reward_model "
                   "or rewards.process > 0; not yet)", turns)  # fmt: skip

    def _check_learned_rewards(self) -> None:
        for weight, stage in (("reward_model", "rm"), ("process", "prm")):
            value = getattr(self.rewards, weight)
            if value > 0 and stage not in self.stages:
                raise ConfigError(
                    f"rewards.{weight} is {_fmt(value)} but stages {self.stages} has no "
                    f"{stage!r} stage to train it"
                )
        if "prm" in self.stages and self.process_reward.domain not in self.domains:
            raise ConfigError(
                f"process_reward.domain must be one of domains {self.domains}, "
                f"got {self.process_reward.domain!r}"
            )
        rm = self.reward_model
        no_pairs = not rm.pairs_jsonl and not set(rm.domains) & set(self.domains)
        if "rm" in self.stages and no_pairs:
            raise ConfigError(
                f"reward_model.domains {rm.domains} names none of domains {self.domains} "
                "and reward_model.pairs_jsonl is empty: no pairs to train on"
            )


def check_domain_name(path: str, name: str) -> None:
    """A registered domain, ``family/arg`` of a registered family, or ``pkg.module:attr``.

    Import paths are checked for their form only: importing user code belongs to the run.
    """
    from rlpt.tasks import registered_domains

    known = registered_domains()
    if name in known:
        return
    if ":" in name:
        module, _, attr = name.partition(":")
        if module and attr and all(p.isidentifier() for p in module.split(".") + attr.split(".")):
            return
        raise ConfigError(f"{path} must be an import path 'pkg.module:attr', got {name!r}")
    family, sep, arg = name.partition("/")
    if sep and family in known and arg:
        return
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {match[0]!r}? " if match else ""
    raise ConfigError(
        f"{path} names an unknown domain {name!r}; {hint}registered: {', '.join(known)} "
        "(or an import path 'pkg.module:attr')"
    )


# -- the gymnasium PPO config ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GymConfig:
    """The ``ppo_gym`` trainer's config (CleanRL's CartPole hyperparameters by default)."""

    trainer: str = "ppo_gym"
    seed: int = 0
    env_id: str = "CartPole-v1"
    num_envs: int = 8
    num_steps: int = 128  # per env per rollout
    total_env_steps: int = 500_000
    hidden_size: int = 64
    learning_rate: float = 2.5e-4
    anneal_lr: bool = True
    adam_eps: float = 1e-5
    max_grad_norm: float = 0.5
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_epochs: int = 4
    num_minibatches: int = 4
    clip_eps: float = 0.2
    value_clip_eps: float | None = None  # None: no value clipping
    normalize_advantages: bool = True
    reward_scale: float = 0.1  # keeps value targets O(1) so the tanh critic does not saturate
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    log_every: int = 10  # updates between metrics.jsonl lines
    return_window: int = 20  # finished episodes averaged into train/episode_return
    target_return: float = 475.0
    eval_episodes: int = 16
    eval_seed_offset: int = 10_000

    def __post_init__(self):
        _choice("trainer", self.trainer, ("ppo_gym",))
        if not self.env_id:
            raise ConfigError("env_id must name a gymnasium environment, got ''")
        for name in ("num_envs", "num_steps", "hidden_size", "num_epochs", "num_minibatches",
                     "log_every", "return_window"):  # fmt: skip
            _at_least(name, getattr(self, name), 1)
        for name in ("learning_rate", "adam_eps", "max_grad_norm", "reward_scale"):
            _positive(name, getattr(self, name))
        _unit("gamma", self.gamma)
        _unit("gae_lambda", self.gae_lambda)
        _check(0.0 < self.clip_eps < 1.0, "clip_eps", "in (0, 1)", self.clip_eps)
        if self.value_clip_eps is not None:
            _positive("value_clip_eps", self.value_clip_eps)
        for name in ("ent_coef", "vf_coef", "eval_episodes"):
            _at_least(name, getattr(self, name), 0)
        rollout = self.num_envs * self.num_steps
        if rollout % self.num_minibatches:
            raise ConfigError(
                f"num_minibatches must divide num_envs * num_steps ({rollout}), "
                f"got {self.num_minibatches}"
            )
        _at_least("total_env_steps", self.total_env_steps, rollout)

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


CONFIG_TYPES: dict[str, type] = {"post_train": PostTrainConfig, "ppo_gym": GymConfig}
TypedConfig = PostTrainConfig | GymConfig


# -- parsing -----------------------------------------------------------------------------------


def parse_config(config: ml_collections.ConfigDict | Mapping[str, Any] | TypedConfig) -> Any:
    """The typed config of ``config.trainer``, every value checked; raises ``ConfigError``.

    Accepts an experiment's ConfigDict, a plain mapping (a run's stored ``config.json``) or
    an already typed config (returned as it is).
    """
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return config
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if "trainer" not in data:
        raise ConfigError(f"trainer must be set, one of {tuple(CONFIG_TYPES)}")
    trainer = data["trainer"]
    if trainer not in CONFIG_TYPES:
        raise ConfigError(f"trainer must be one of {tuple(CONFIG_TYPES)}, got {trainer!r}")
    return _build(CONFIG_TYPES[trainer], data, "")


def default_config(trainer: str) -> ml_collections.ConfigDict:
    """The ConfigDict of every field of ``trainer``'s config at its default.

    Experiment files start from it, so a field they do not set still exists (and can be
    overridden on the command line) and the defaults are written once, in the dataclasses.
    """
    if trainer not in CONFIG_TYPES:
        raise ConfigError(f"trainer must be one of {tuple(CONFIG_TYPES)}, got {trainer!r}")
    config = _defaults_dict(CONFIG_TYPES[trainer])
    if trainer == "post_train":
        # The same rule as PostTrainConfig.derived_total_steps, as a lazy reference: code
        # that reads the ConfigDict itself sees the derived value, and it follows
        # ppo_steps, epochs and num_minibatches wherever they are set. Setting
        # ppo.total_steps replaces it.
        config.ppo.total_steps = (
            config.get_ref("ppo_steps")
            * config.ppo.get_ref("epochs")
            * config.ppo.get_ref("num_minibatches")
        )
    return config


def _defaults_dict(cls: type) -> ml_collections.ConfigDict:
    hints = typing.get_type_hints(cls)
    out = ml_collections.ConfigDict()
    for f in dataclasses.fields(cls):
        if f.name in _DERIVED_ONLY.get(cls, ()) + _ADDED_BY_EXPERIMENT.get(cls, ()):
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()
        hint = hints[f.name]
        if dataclasses.is_dataclass(default):
            out[f.name] = _defaults_dict(type(default))
        elif default is None:
            out[f.name] = config_dict.placeholder(_placeholder_type(hint))
        else:
            out[f.name] = default
    return out


# Fields set only from other fields: not in the ConfigDict an experiment starts from.
_DERIVED_ONLY: dict[type, tuple[str, ...]] = {PPOSection: ("sampling_temperature",)}
# Fields an experiment adds when it uses them: the trainers read model.hf_path's presence
# as "start from a Hugging Face checkpoint" (experiments/hf_post_train.py adds it).
_ADDED_BY_EXPERIMENT: dict[type, tuple[str, ...]] = {ModelSection: ("hf_path",)}


def _placeholder_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = typing.get_origin(args[0]) or args[0] if args else object
    if base in (Mapping, dict):
        return dict
    return base if isinstance(base, type) else object


def _with_path(section: str, error: Exception) -> str:
    """A foreign check's message, prefixed with the section unless it names it already."""
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    return message if message.startswith(f"{section}.") else f"{section}: {message}"


def _build(cls: type, data: Any, prefix: str) -> Any:
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a section, got {data!r}")
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in data:
        if key not in names:
            raise ConfigError(unknown_key_message(f"{prefix}{key}", names))
    hints = typing.get_type_hints(cls)
    kwargs = {
        name: _coerce(f"{prefix}{name}", data[name], hints[name]) for name in names if name in data
    }
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # a check of a library dataclass
        raise ConfigError(_with_path(prefix.rstrip(".") or "config", e)) from None


def _coerce(path: str, value: Any, hint: Any) -> Any:
    """``value`` as type ``hint``, or a ConfigError naming ``path`` and the expected type."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(path, value, option)
            except ConfigError as e:
                errors.append(e)
        if len(options) == 1:
            raise errors[0]
        raise ConfigError(f"{path} must be one of the types {options}, got {_fmt(value)}")
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, f"{path}.")
    if hint is bool:
        _check(isinstance(value, bool), path, "true or false", value)
        return value
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        _check(ok, path, "an integer", value)
        return value
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        _check(ok, path, "a number", value)
        return float(value)
    if hint is str:
        _check(isinstance(value, str), path, "a string", value)
        return value
    if origin is tuple or origin in (Sequence, list):
        _check(isinstance(value, list | tuple), path, "a tuple", value)
        if origin is tuple and args and args[-1] is not Ellipsis:
            _check(len(value) == len(args), path, f"a tuple of {len(args)}", value)
            return tuple(_coerce(f"{path}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        return tuple(_coerce(f"{path}[{i}]", v, item) for i, v in enumerate(value))
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        _check(isinstance(value, Mapping), path, "a mapping", value)
        item = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(f"{path}.{k}", v, item) for k, v in value.items()}
    return value


def _plain(obj: Any) -> Any:
    """Dataclasses to dicts and tuples to lists, as ``json`` writes and reads them back."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj


__all__ = [
    "CONFIG_TYPES",
    "RUN_CONTROL_FIELDS",
    "STAGES",
    "CheckpointSection",
    "ChunkedReasoningSection",
    "ConfigError",
    "CurriculumSection",
    "DifficultySection",
    "EvalSection",
    "GymConfig",
    "LoRASection",
    "LoggingSection",
    "MeshSection",
    "ModelSection",
    "PPOSection",
    "PostTrainConfig",
    "ProcessRewardSection",
    "ProfileSection",
    "RewardModelSection",
    "RewardsSection",
    "RolloutSection",
    "SFTSection",
    "SandboxSection",
    "default_config",
    "parse_config",
    "unknown_key_message",
]
