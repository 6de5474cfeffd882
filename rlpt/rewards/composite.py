"""Per-token rewards for PPO assembled from verifier, learned and rule-based terms.

``assemble_rewards`` builds the ``[B, T]`` reward array PPO consumes:

- sequence terms (verifier ``outcome``, ``reward_model`` score, ``format``,
  ``length``, ``safety``) sit on each row's last real response token;
- ``process`` step rewards sit on each step's last token (the separator), after
  aggregation over future steps (``sum`` or PURE's ``min``);
- ``kl`` is only logged: PPO adds its own KL penalty (``kl_placement``), so
  adding it here would count it twice.

Learned terms pass a guard (non-finite values become 0 and are counted), a
running normalisation (``NormState``, updated per batch) and clipping before
their weight applies. Each term's mean per-sequence contribution is returned as
``reward/NAME``.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
from flax import struct

from rlpt.rl.advantages import last_token_mask

PROCESS_AGGREGATIONS = ("sum", "min")
SEQUENCE_TERMS = ("outcome", "reward_model", "format", "length", "safety")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Weights and treatment of each reward term (hashable: binds a jitted function)."""

    outcome: float = 1.0
    reward_model: float = 0.0
    process: float = 0.0
    format: float = 0.0
    length: float = 0.0
    safety: float = 0.0
    kl: float = 0.0  # the coefficient used for the logged reward/kl term only
    process_aggregation: str = "min"
    normalize: bool = True
    clip: float = 5.0  # learned rewards are clipped to [-clip, clip] after normalisation
    norm_momentum: float = 0.99  # 0 forgets each batch; near 1 averages many
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.process_aggregation not in PROCESS_AGGREGATIONS:
            raise ValueError(
                f"rewards.process_aggregation must be one of {PROCESS_AGGREGATIONS}, "
                f"got {self.process_aggregation!r}"
            )
        if self.clip <= 0:
            raise ValueError(f"rewards.clip must be positive, got {self.clip}")
        if not 0.0 <= self.norm_momentum < 1.0:
            raise ValueError(f"rewards.norm_momentum must be in [0, 1), got {self.norm_momentum}")


@struct.dataclass
class RunningStats:
    """Exponentially weighted mean and variance of one learned reward stream."""

    mean: jax.Array  # [] float32
    var: jax.Array  # [] float32
    count: jax.Array  # [] float32, batches seen (the first batch sets the moments)


@struct.dataclass
class NormState:
    """Normalisation state of the learned terms, carried across PPO steps."""

    reward_model: RunningStats
    process: RunningStats


def _init_stats() -> RunningStats:
    return RunningStats(
        mean=jnp.zeros((), jnp.float32), var=jnp.ones((), jnp.float32),
        count=jnp.zeros((), jnp.float32),
    )  # fmt: skip


def init_norm_state() -> NormState:
    return NormState(reward_model=_init_stats(), process=_init_stats())


def update_running_stats(
    stats: RunningStats, values: jax.Array, mask: jax.Array, *, momentum: float
) -> RunningStats:
    """Blend the masked batch moments into ``stats``; an empty batch changes nothing.

    The first batch replaces the initial moments outright, so early rewards are
    not squashed by the arbitrary (0, 1) start.
    """
    chex.assert_equal_shape([values, mask])
    mask = mask.astype(jnp.float32)
    n = jnp.sum(mask)
    safe_n = jnp.maximum(n, 1.0)
    batch_mean = jnp.sum(values * mask) / safe_n
    batch_var = jnp.sum(jnp.square(values - batch_mean) * mask) / safe_n
    m = jnp.where(stats.count > 0, momentum, 0.0)
    mean = m * stats.mean + (1 - m) * batch_mean
    # Mixture variance: within-batch spread plus the shift between the two means.
    var = m * (stats.var + jnp.square(stats.mean - mean)) + (1 - m) * (
        batch_var + jnp.square(batch_mean - mean)
    )
    has = n > 0
    return RunningStats(
        mean=jnp.where(has, mean, stats.mean),
        var=jnp.where(has, var, stats.var),
        count=stats.count + has.astype(jnp.float32),
    )


def normalize(values: jax.Array, stats: RunningStats, *, eps: float) -> jax.Array:
    """``(x - mean) / sqrt(var + eps)``."""
    return (values - stats.mean) * jax.lax.rsqrt(stats.var + eps)


def guard_non_finite(values: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Non-finite entries replaced by 0; returns ``(clean, count of bad entries under mask)``.

    A NaN reward would turn every advantage in its row (and, through whitening,
    the batch) into NaN; PPO would then skip the whole update. Zeroing the one
    bad value keeps the rest of the batch's signal and the count says it happened.
    """
    chex.assert_equal_shape([values, mask])
    bad = ~jnp.isfinite(values)
    count = jnp.sum(bad & (mask > 0)).astype(jnp.float32)
    return jnp.where(bad, 0.0, values), count


def aggregate_process_rewards(
    step_rewards: jax.Array,  # [B, T] reward of each step, read at its last token
    step_mask: jax.Array,  # [B, T] 1 at each step's last token
    mode: str,
) -> jax.Array:
    """Per-token rewards [B, T] whose undiscounted return from a step is the aggregate.

    ``sum``: each step keeps its own reward, so the return from step j is
    ``sum_{k >= j} r_k`` (can be hacked by adding steps). ``min`` (PURE, Cheng
    et al. 2025): the return from step j is ``min_{k >= j} r_k``; writing
    ``m_j = min_{k >= j} r_k`` and placing ``m_j - m_{j+1}`` (``m_{last+1} = 0``)
    at step j makes the returns telescope to exactly that minimum.
    """
    chex.assert_equal_shape([step_rewards, step_mask])
    on = step_mask > 0
    if mode == "sum":
        return jnp.where(on, step_rewards, 0.0)
    if mode != "min":
        raise ValueError(f"process aggregation must be one of {PROCESS_AGGREGATIONS}, got {mode!r}")
    inf = jnp.float32(jnp.inf)
    masked = jnp.where(on, step_rewards, inf)  # [B, T]
    suffix_min = jax.lax.cummin(masked, axis=1, reverse=True)  # [B, T] min over s >= t
    after = jnp.concatenate([suffix_min[:, 1:], jnp.full_like(suffix_min[:, :1], inf)], axis=1)
    after = jnp.where(jnp.isinf(after), 0.0, after)  # no later step: m_{last+1} = 0
    return jnp.where(on, suffix_min - after, 0.0)


def _learned(
    values: jax.Array, mask: jax.Array, stats: RunningStats, cfg: RewardConfig
) -> tuple[jax.Array, RunningStats, jax.Array]:
    """Guard, update the running moments, normalise and clip one learned stream."""
    clean, bad = guard_non_finite(values, mask)
    if cfg.normalize:
        finite_mask = mask * jnp.isfinite(values)
        stats = update_running_stats(stats, clean, finite_mask, momentum=cfg.norm_momentum)
        clean = normalize(clean, stats, eps=cfg.norm_eps)
    return jnp.clip(clean, -cfg.clip, cfg.clip) * mask, stats, bad


def assemble_rewards(
    cfg: RewardConfig,
    norm: NormState,
    response_mask: jax.Array,  # [B, T]
    *,
    outcome: jax.Array | None = None,  # [B] verifier reward
    reward_model: jax.Array | None = None,  # [B] learned sequence score
    process: jax.Array | None = None,  # [B, T] learned step score at step tokens
    step_mask: jax.Array | None = None,  # [B, T] 1 at each step's last token
    format: jax.Array | None = None,  # [B]
    length: jax.Array | None = None,  # [B]
    safety: jax.Array | None = None,  # [B]
    kl: jax.Array | None = None,  # [B, T] per-token KL estimate, logged only
) -> tuple[jax.Array, NormState, dict[str, jax.Array]]:
    """The per-token reward [B, T], the updated ``NormState`` and ``reward/*`` metrics.

    ``reward[b, t] = sum_k w_k * term_k[b, t]`` over the terms given (see the
    module docstring for where each sits). Terms left as None contribute
    nothing and are not logged. Pure and jittable (the set of terms is static).
    """
    chex.assert_rank(response_mask, 2)
    mask = (response_mask > 0).astype(jnp.float32)
    batch = mask.shape[0]
    last = last_token_mask(mask)  # [B, T]
    total = jnp.zeros_like(mask)
    metrics: dict[str, jax.Array] = {}
    non_finite = jnp.zeros((), jnp.float32)
    row_has = (jnp.sum(mask, axis=1) > 0).astype(jnp.float32)  # [B]

    sequence = {
        "outcome": outcome, "reward_model": reward_model, "format": format,
        "length": length, "safety": safety,
    }  # fmt: skip
    for name in SEQUENCE_TERMS:
        values = sequence[name]
        if values is None:
            continue
        chex.assert_shape(values, (batch,))
        values = values.astype(jnp.float32)
        if name == "reward_model":
            values, stats, bad = _learned(values, row_has, norm.reward_model, cfg)
            norm = norm.replace(reward_model=stats)
            non_finite += bad
        else:
            # Verifier and rule terms are trusted but still must not poison the batch.
            values, bad = guard_non_finite(values, row_has)
            non_finite += bad
        term = getattr(cfg, name) * values[:, None] * last  # [B, T]
        total = total + term
        metrics[f"reward/{name}"] = jnp.sum(term) / batch

    if process is not None:
        if step_mask is None:
            raise ValueError("process rewards need step_mask (1 at each step's last token)")
        chex.assert_equal_shape([process, mask, step_mask])
        steps = step_mask.astype(jnp.float32) * mask
        values, stats, bad = _learned(process.astype(jnp.float32), steps, norm.process, cfg)
        norm = norm.replace(process=stats)
        non_finite += bad
        term = cfg.process * aggregate_process_rewards(values, steps, cfg.process_aggregation)
        total = total + term
        metrics["reward/process"] = jnp.sum(term) / batch
        metrics["reward/process_step_mean"] = jnp.sum(values) / jnp.maximum(jnp.sum(steps), 1.0)

    if kl is not None:
        chex.assert_equal_shape([kl, mask])
        metrics["reward/kl"] = (
            -cfg.kl * jnp.sum(jnp.where(jnp.isfinite(kl), kl, 0.0) * mask) / batch
        )

    total = total * mask
    metrics["reward/total"] = jnp.sum(total) / batch
    metrics["reward/non_finite"] = non_finite
    return total, norm, metrics
