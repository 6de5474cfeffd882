"""Domain mixing and difficulty curricula, updated from training feedback every step.

The curriculum holds one row of statistics per domain in numpy arrays, so the
per-batch work (weights, sampling, updates) is a handful of vectorised calls and
stays well under a millisecond with hundreds of domains. It runs in the main
process on top of the per-domain iterators, which is why its weights may change
every step (Grain's own ``mix`` fixes them when the pipeline is built).

Mixing strategies (``strategy``):

- ``uniform``: ``p_d = 1 / K``.
- ``fixed``: ``p_d = w_d`` from ``fixed_weights``.
- ``schedule``: piecewise-constant weights, ``[(step, {domain: w}), ...]``;
  the entry with the largest ``step <= t`` applies at step ``t``.
- ``bandit`` (DUMP, Wang et al. 2025; SEC 2025): score
  ``s_d = c_d^beta * g_d / max_j g_j + lambda * sqrt(2 ln(N + 1) / (n_d + 1))``,
  ``p = softmax(s / tau)``. The learning signal ``g_d`` is either the EMA of
  mean ``|advantage|`` (``signal='abs_advantage'``) or the absolute learning
  progress ``max(0, |fast EMA - slow EMA| - z sd)`` of the domain's competence
  ``(level - 1) + success`` (``signal='progress'``), where ``sd`` is the
  standard deviation that difference has on a stationary Bernoulli domain with
  the same success rate: ``s (1 - s) (a/(2-a) + b/(2-b) - 2ab/(a+b-ab))`` for
  per-sample rates ``a``, ``b``. |advantage| peaks on a domain whose success
  sits near 0.5 by pure noise; learning progress stays near zero there, which
  is why it is the default. ``c_d`` is the reward
  model's confidence for the domain (1 when none is supplied).
- ``exp3`` (EXP3 as in ODM, Albalak et al. 2023):
  ``p_d = (1 - K eps_t) softmax(eps_{t-1} W)_d + eps_t`` with
  ``eps_t = min(1/K, sqrt(ln K / (K t)))``; a domain drawn in the batch gets the
  importance-weighted reward ``W_d <- a W_d + (1 - a) r_d / p_d`` where ``r_d`` is
  its learning signal normalised to [0, 1] (times its confidence).

Learned strategies then divide by ``(1 + epochs_d)^size_power``, where
``epochs_d = drawn_d / size_d`` (zero for procedural domains), so a small
domain is not re-read until it is memorised. Every strategy finally applies the
floor ``p_d <- floor + (1 - K floor) p_d``, so no domain starves.

Difficulty: each domain has a level in ``1..max_level``. Feedback at the current
level accumulates in blocks of ``window`` samples; at the end of a block the
level rises if the block's success rate is above ``upper`` and falls if below
``lower``. With ``review`` > 0 that share of a domain's prompts comes from the
levels below its current one (the loader draws them); their feedback is left out
of the level control and of the mixing signal.

Loss weights (``loss_weighting='lagging'``): ``w_d = clip(exp(scale (l_d - sum_j
p_j l_j)), 1/max, max)`` with lag ``l_d = 1 - success_d``, so a lagging domain's
rows weigh more in the PPO loss while the average weight stays near one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

STRATEGIES = ("uniform", "fixed", "schedule", "bandit", "exp3")
SIGNALS = ("progress", "abs_advantage")
LOSS_WEIGHTINGS = ("none", "lagging")
_DIST_TOL = 1e-6


@dataclasses.dataclass(frozen=True)
class DifficultyConfig:
    """Thresholds of the per-domain difficulty curriculum (see module docstring)."""

    start: int = 1
    upper: float = 0.8
    lower: float = 0.2
    window: int = 64
    # Share of a domain's prompts drawn from a level below its current one (uniformly
    # over 1..level - 1): rehearsal, since training only at the top level can make the
    # policy forget the lower ones (a 7-digit echo learnt as 9 digits once the control
    # moved echo to level 2). These samples move neither the level nor the mixing signal.
    review: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.review < 1.0:
            raise ValueError(f"difficulty.review must be in [0, 1), got {self.review}")
        if not 0.0 <= self.lower < self.upper <= 1.0:
            raise ValueError(
                f"difficulty thresholds need 0 <= lower < upper <= 1, got "
                f"lower={self.lower}, upper={self.upper}"
            )
        if self.window < 1 or self.start < 1:
            raise ValueError(
                f"difficulty.window and difficulty.start must be >= 1, got "
                f"window={self.window}, start={self.start}"
            )


@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
    """Every knob of ``Curriculum``; ``make_curriculum`` fills it from a ConfigDict."""

    strategy: str = "bandit"
    temperature: float = 0.2
    floor: float = 0.01
    fixed_weights: Mapping[str, float] | None = None
    schedule: Sequence[tuple[int, Mapping[str, float]]] = ()
    signal: str = "progress"
    exploration: float = 0.1
    # Per-sample EMA rates: a domain seeing m samples in a step moves by 1 - (1 - a)^m.
    success_alpha: float = 0.01
    slow_alpha: float = 0.005
    advantage_alpha: float = 1.0 / 300.0
    progress_noise_z: float = 1.0
    exp3_smoothing: float = 0.9
    confidence_power: float = 1.0
    size_power: float = 1.0
    loss_weighting: str = "none"
    loss_weight_scale: float = 1.0
    loss_weight_max: float = 4.0
    difficulty: DifficultyConfig = DifficultyConfig()

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"curriculum.strategy must be one of {STRATEGIES}, got {self.strategy!r}"
            )
        if self.signal not in SIGNALS:
            raise ValueError(f"curriculum.signal must be one of {SIGNALS}, got {self.signal!r}")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(
                f"curriculum.loss_weighting must be one of {LOSS_WEIGHTINGS}, "
                f"got {self.loss_weighting!r}"
            )
        if not self.temperature > 0:
            raise ValueError(f"curriculum.temperature must be > 0, got {self.temperature}")
        if not 0.0 <= self.floor < 1.0:
            raise ValueError(f"curriculum.floor must be in [0, 1), got {self.floor}")
        for field in ("success_alpha", "slow_alpha", "advantage_alpha"):
            value = getattr(self, field)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"curriculum.{field} must be in (0, 1], got {value}")
        if self.loss_weight_max < 1.0:
            raise ValueError(f"curriculum.loss_weight_max must be >= 1, got {self.loss_weight_max}")


@dataclasses.dataclass
class Feedback:
    """What one training step tells the curriculum, one entry per sample.

    ``domain_index`` [N] int, ``success`` [N] in {0, 1} (or a rate in [0, 1]),
    ``reward`` [N] (accepted so trainers pass one record; no built-in strategy
    reads it yet), ``abs_advantage`` [N] (optional, needed by
    ``signal='abs_advantage'``), ``difficulty`` [N] the level each sample was
    drawn at (optional; samples from a stale level do not count towards the
    difficulty controller), ``confidence`` the reward model's per-domain
    confidence in [0, 1] (optional; domains it omits keep their last value).
    """

    domain_index: Any
    success: Any
    reward: Any = None
    abs_advantage: Any = None
    difficulty: Any = None
    confidence: Mapping[str, float] | None = None


def check_distribution(weights: Mapping[str, float], names: Sequence[str], what: str) -> np.ndarray:
    """``weights`` as an array in ``names`` order; raises unless they form a distribution."""
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"{what}: unknown domain(s) {unknown}; known domains: {list(names)}")
    out = np.zeros(len(names))
    for i, name in enumerate(names):
        w = float(weights.get(name, 0.0))
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"{what}: weight of domain {name!r} must be finite and >= 0, got {w}")
        out[i] = w
    total = out.sum()
    if abs(total - 1.0) > _DIST_TOL:
        raise ValueError(
            f"{what}: weights must sum to 1 (a distribution over domains), got {total:.6g} "
            f"from {dict(zip(names, out.tolist()))}"
        )
    return out


class Curriculum:
    """Per-domain sampling weights, difficulty levels and loss weights.

    ``weights()`` gives the sampling distribution for the next batch,
    ``record_draws`` counts what the loader drew, ``update(feedback)`` learns
    from a finished step. ``get_state`` / ``set_state`` round-trip everything
    through JSON exactly (floats are written with ``repr`` precision).
    """

    def __init__(
        self,
        names: Sequence[str],
        config: CurriculumConfig | None = None,
        *,
        max_levels: Sequence[int] | None = None,
        sizes: Sequence[float] | None = None,
    ):
        self.config = config = config or CurriculumConfig()
        self.names = list(names)
        k = len(self.names)
        if k == 0:
            raise ValueError("the curriculum needs at least one domain")
        if len(set(self.names)) != k:
            raise ValueError(f"duplicate domain names in {self.names}")
        if config.floor * k > 1.0 + _DIST_TOL:
            raise ValueError(
                f"curriculum.floor={config.floor} times {k} domains exceeds 1; "
                f"use floor <= {1.0 / k:.4g}"
            )
        self.max_levels = np.asarray(max_levels if max_levels is not None else [1] * k, np.int64)
        self.sizes = np.asarray(sizes if sizes is not None else [math.inf] * k, np.float64)
        if self.max_levels.shape != (k,) or self.sizes.shape != (k,):
            raise ValueError("max_levels and sizes need one entry per domain")
        bad = [n for n, m in zip(self.names, self.max_levels) if m < 1]
        if bad:
            raise ValueError(f"domains {bad}: max_level must be >= 1")
        self._fixed = None
        if config.strategy == "fixed":
            if config.fixed_weights is None:
                raise ValueError("curriculum.strategy='fixed' needs curriculum.fixed_weights")
            self._fixed = check_distribution(config.fixed_weights, self.names, "fixed_weights")
        self._schedule: list[tuple[int, np.ndarray]] = []
        if config.strategy == "schedule":
            if not config.schedule:
                raise ValueError("curriculum.strategy='schedule' needs curriculum.schedule")
            for step, weights in sorted(config.schedule, key=lambda e: int(e[0])):
                what = f"schedule entry at step {int(step)}"
                self._schedule.append((int(step), check_distribution(weights, self.names, what)))
            if self._schedule[0][0] > 0:
                raise ValueError("curriculum.schedule must have an entry at step 0")
        self._index = {n: i for i, n in enumerate(self.names)}
        self.reset()

    # -- state ---------------------------------------------------------------------------------

    def reset(self) -> None:
        k = len(self.names)
        self.step = 0
        self.level = np.minimum(np.full(k, self.config.difficulty.start, np.int64), self.max_levels)
        self.block_sum = np.zeros(k)
        self.block_count = np.zeros(k)
        self.drawn = np.zeros(k)
        self.seen = np.zeros(k)  # samples with feedback: the n_d of the exploration bonus
        self.success = np.zeros(k)
        self.competence_fast = np.zeros(k)
        self.competence_slow = np.zeros(k)
        self.abs_adv = np.zeros(k)
        self.exp3_w = np.zeros(k)
        self.confidence = np.ones(k)
        self.last_probs = np.full(k, 1.0 / k)

    _ARRAYS = (
        "level",
        "block_sum",
        "block_count",
        "drawn",
        "seen",
        "success",
        "competence_fast",
        "competence_slow",
        "abs_adv",
        "exp3_w",
        "confidence",
        "last_probs",
    )

    def get_state(self) -> dict[str, Any]:
        """Plain-Python (JSON-able) state: the step and every per-domain array as a list."""
        state: dict[str, Any] = {"step": int(self.step), "names": list(self.names)}
        for field in self._ARRAYS:
            state[field] = getattr(self, field).tolist()
        return state

    def set_state(self, state: Mapping[str, Any]) -> None:
        if list(state["names"]) != self.names:
            raise ValueError(
                f"curriculum state is for domains {list(state['names'])}, not {self.names}"
            )
        self.step = int(state["step"])
        for field in self._ARRAYS:
            old = getattr(self, field)
            setattr(self, field, np.asarray(state[field], old.dtype).reshape(old.shape))

    # -- weights -------------------------------------------------------------------------------

    def index(self, name: str) -> int:
        if name not in self._index:
            raise ValueError(f"unknown domain {name!r}; known domains: {self.names}")
        return self._index[name]

    def _signal(self) -> np.ndarray:
        cfg = self.config
        if cfg.signal == "abs_advantage":
            g = self.abs_adv
        else:
            # A stationary Bernoulli domain's EMAs still differ by chance; only the
            # part of |fast - slow| beyond z noise standard deviations counts.
            a, b = cfg.success_alpha, cfg.slow_alpha
            var = a / (2 - a) + b / (2 - b) - 2 * a * b / (a + b - a * b)
            noise_sd = np.sqrt(np.clip(self.success * (1 - self.success), 0, None) * var)
            g = (
                np.abs(self.competence_fast - self.competence_slow)
                - cfg.progress_noise_z * noise_sd
            )
            g = np.maximum(g, 0.0)
        top = g.max()
        g = g / top if top > 0 else np.zeros_like(g)
        return g * self.confidence**cfg.confidence_power

    def weights(self) -> np.ndarray:
        """Sampling probabilities [K] for the next batch (sums to 1, each >= floor)."""
        cfg = self.config
        k = len(self.names)
        if cfg.strategy == "uniform":
            p = np.full(k, 1.0 / k)
        elif cfg.strategy == "fixed":
            p = self._fixed
        elif cfg.strategy == "schedule":
            p = self._schedule[0][1]
            for step, weights in self._schedule:
                if step <= self.step:
                    p = weights
        elif cfg.strategy == "bandit":
            bonus = np.sqrt(2.0 * math.log(self.seen.sum() + 1.0) / (self.seen + 1.0))
            p = _softmax((self._signal() + cfg.exploration * bonus) / cfg.temperature)
        else:
            eps_prev = _exp3_eps(k, self.step)
            eps = _exp3_eps(k, self.step + 1)
            p = (1.0 - k * eps) * _softmax(eps_prev * self.exp3_w) + eps
        if cfg.strategy in ("bandit", "exp3") and cfg.size_power > 0:
            epochs = np.where(np.isfinite(self.sizes), self.drawn / self.sizes, 0.0)
            p = p * (1.0 + epochs) ** -cfg.size_power
            p = p / p.sum()
        p = cfg.floor + (1.0 - k * cfg.floor) * p
        return p / p.sum()

    def loss_weights(self, probs: np.ndarray | None = None) -> np.ndarray:
        """Per-domain weights [K] for the PPO loss (ones unless ``loss_weighting='lagging'``)."""
        cfg = self.config
        if cfg.loss_weighting == "none":
            return np.ones(len(self.names))
        probs = self.last_probs if probs is None else probs
        lag = 1.0 - self.success
        w = np.exp(cfg.loss_weight_scale * (lag - probs @ lag))
        return np.clip(w, 1.0 / cfg.loss_weight_max, cfg.loss_weight_max)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Domain indices [n] for the next batch and the probabilities [K] they came from."""
        p = self.weights()
        self.last_probs = p
        # Inverse-CDF sampling: one searchsorted instead of rng.choice's checks.
        cdf = np.cumsum(p)
        idx = np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")
        return np.minimum(idx, len(p) - 1), p

    def record_draws(self, domain_index: np.ndarray) -> None:
        self.drawn += np.bincount(domain_index, minlength=len(self.names))

    # -- learning ------------------------------------------------------------------------------

    def update(self, feedback: Feedback | Mapping[str, Any]) -> None:
        """Learn from one finished step's per-sample feedback, then advance the step."""
        if isinstance(feedback, Mapping):
            feedback = Feedback(**feedback)
        cfg = self.config
        k = len(self.names)
        d = np.asarray(feedback.domain_index, np.int64).reshape(-1)
        success = np.asarray(feedback.success, np.float64).reshape(-1)
        if success.shape != d.shape:
            raise ValueError(f"feedback.success has shape {success.shape}, domain_index {d.shape}")
        if d.size and (d.min() < 0 or d.max() >= k):
            raise ValueError(f"feedback.domain_index out of range [0, {k})")
        if feedback.confidence is not None:
            for name, c in feedback.confidence.items():
                c = float(c)
                if not 0.0 <= c <= 1.0:
                    raise ValueError(f"confidence of domain {name!r} must be in [0, 1], got {c}")
                self.confidence[self.index(name)] = c

        if cfg.difficulty.review > 0 and feedback.difficulty is not None:
            # Review prompts (below the domain's level) are rehearsal, not a measure of
            # where the domain stands: the signal and the levels see the others only.
            level = np.asarray(feedback.difficulty, np.int64).reshape(-1)
            keep = level >= self.level[d]
            adv = feedback.abs_advantage
            feedback = dataclasses.replace(
                feedback, domain_index=d[keep], success=success[keep], difficulty=level[keep],
                abs_advantage=None if adv is None else np.asarray(adv).reshape(-1)[keep],
            )  # fmt: skip
            d, success = d[keep], success[keep]
        count = np.bincount(d, minlength=k).astype(np.float64)
        present = count > 0
        safe = np.maximum(count, 1.0)
        mean_success = np.bincount(d, success, minlength=k) / safe
        first = present & (self.seen == 0)
        self.success = _ema(self.success, mean_success, count, cfg.success_alpha, first)
        competence = (self.level - 1) + mean_success
        self.competence_fast = _ema(
            self.competence_fast, competence, count, cfg.success_alpha, first
        )
        self.competence_slow = _ema(self.competence_slow, competence, count, cfg.slow_alpha, first)
        if feedback.abs_advantage is not None:
            adv = np.abs(np.asarray(feedback.abs_advantage, np.float64).reshape(-1))
            mean_adv = np.bincount(d, adv, minlength=k) / safe
            self.abs_adv = _ema(self.abs_adv, mean_adv, count, cfg.advantage_alpha, first)
        elif cfg.signal == "abs_advantage" and cfg.strategy in ("bandit", "exp3"):
            raise ValueError("signal='abs_advantage' needs feedback.abs_advantage")
        self.seen += count

        if cfg.strategy == "exp3":
            # Rewards of the domains drawn this step, importance-weighted by the
            # probability they were drawn with; undrawn domains only decay.
            reward = self._signal()
            est = np.where(present, reward / self.last_probs, 0.0)
            a = cfg.exp3_smoothing
            self.exp3_w = np.where(present, a * self.exp3_w + (1 - a) * est, self.exp3_w)

        self._update_levels(d, success, feedback.difficulty)
        self.step += 1

    def _update_levels(self, d: np.ndarray, success: np.ndarray, difficulty: Any) -> None:
        k = len(self.names)
        dc = self.config.difficulty
        if difficulty is not None:
            current = np.asarray(difficulty, np.int64).reshape(-1) == self.level[d]
            d, success = d[current], success[current]
        self.block_sum += np.bincount(d, success, minlength=k)
        self.block_count += np.bincount(d, minlength=k)
        full = self.block_count >= dc.window
        if not full.any():
            return
        rate = self.block_sum / np.maximum(self.block_count, 1.0)
        up = full & (rate > dc.upper) & (self.level < self.max_levels)
        down = full & (rate < dc.lower) & (self.level > 1)
        self.level = self.level + up - down
        self.block_sum[full] = 0.0
        self.block_count[full] = 0.0

    def metrics(self) -> dict[str, float]:
        """``curriculum/DOMAIN/{weight,difficulty,success,loss_weight}`` for every domain."""
        loss_w = self.loss_weights()
        out: dict[str, float] = {}
        for i, name in enumerate(self.names):
            out[f"curriculum/{name}/weight"] = float(self.last_probs[i])
            out[f"curriculum/{name}/difficulty"] = int(self.level[i])
            out[f"curriculum/{name}/success"] = float(self.success[i])
            out[f"curriculum/{name}/loss_weight"] = float(loss_w[i])
        return out


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max())
    return z / z.sum()


def _exp3_eps(k: int, t: int) -> float:
    if k == 1:
        return 1.0
    return min(1.0 / k, math.sqrt(math.log(k) / (k * max(t, 1))))


def _ema(
    old: np.ndarray, obs: np.ndarray, count: np.ndarray, alpha: float, first: np.ndarray
) -> np.ndarray:
    """EMA with per-sample rate ``alpha`` over ``count`` samples whose mean is ``obs``.

    ``m`` samples at once move the average by ``1 - (1 - alpha)^m``, the same as
    ``m`` single updates with the same value. The first observation replaces
    the zero initial value, so the average is not biased towards zero.
    """
    keep = (1.0 - alpha) ** count
    new = keep * old + (1.0 - keep) * obs
    return np.where(first, obs, new)


def make_curriculum(
    config: Any,
    names: Sequence[str],
    *,
    max_levels: Sequence[int] | None = None,
    sizes: Sequence[float] | None = None,
) -> Curriculum:
    """A ``Curriculum`` from a ConfigDict (or dict) of ``CurriculumConfig`` fields.

    ``config.difficulty`` may hold ``start``, ``upper``, ``lower``, ``window``;
    ``config.schedule`` is a list of ``(step, {domain: weight})`` pairs.
    """
    raw = _to_dict(config)
    known = {f.name for f in dataclasses.fields(CurriculumConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown curriculum config field(s) {unknown}; known: {sorted(known)}")
    difficulty = _to_dict(raw.pop("difficulty", {}) or {})
    dknown = {f.name for f in dataclasses.fields(DifficultyConfig)}
    dunknown = sorted(set(difficulty) - dknown)
    if dunknown:
        raise ValueError(
            f"unknown curriculum.difficulty field(s) {dunknown}; known: {sorted(dknown)}"
        )
    if raw.get("fixed_weights") is not None:
        raw["fixed_weights"] = _to_dict(raw["fixed_weights"])
    if raw.get("schedule"):
        raw["schedule"] = tuple((int(s), _to_dict(w)) for s, w in raw["schedule"])
    cfg = CurriculumConfig(**raw, difficulty=DifficultyConfig(**difficulty))
    return Curriculum(names, cfg, max_levels=max_levels, sizes=sizes)


def _to_dict(obj: Any) -> dict[str, Any]:
    if hasattr(obj, "to_dict"):
        return dict(obj.to_dict())
    return dict(obj)
