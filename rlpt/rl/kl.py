"""KL regularisation against a reference policy: estimators, placements, controller.

Token arrays are `[B, T]` log-probabilities of the SAMPLED tokens (samples drawn
from the current policy π) with a float `mask` (1 real, 0 padding).
"""

from __future__ import annotations

import chex
import flax.struct
import jax
import jax.numpy as jnp

from rlpt.rl.losses import aggregate

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")


def kl_estimate(logp: jax.Array, ref_logp: jax.Array, *, kind: str) -> jax.Array:
    """Per-token estimators of KL(π || π_ref) from samples of π.

    Schulman, "Approximating KL divergence" (2020, joschu.net/blog/kl-approx.html),
    with r = π_ref / π, so log r = ref_logp - logp:

      k1 = -log r                  unbiased, high variance, can be negative.
      k2 = (log r)^2 / 2           biased, low variance, never negative.
      k3 = (r - 1) - log r         unbiased, low variance, never negative.
      low_var_kl = clip(k3, -10, 10) with log r first clipped to [-20, 20]
                   so exp cannot overflow (verl's "low_var_kl").

    Args:
      logp: `[...]` log π of the sampled tokens.
      ref_logp: same shape, log π_ref of the same tokens.
      kind: one of KL_KINDS (static).

    Returns:
      float32 array shaped like `logp`.

    Raises:
      ValueError: at trace time, for an unknown kind.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_KINDS}")
    chex.assert_equal_shape(
        [logp, ref_logp], custom_message="kl_estimate: `logp` and `ref_logp` must match"
    )
    log_r = ref_logp.astype(jnp.float32) - logp.astype(jnp.float32)
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * jnp.square(log_r)
    if kind == "k3":
        return jnp.expm1(log_r) - log_r
    log_r = jnp.clip(log_r, -20.0, 20.0)
    return jnp.clip(jnp.expm1(log_r) - log_r, -10.0, 10.0)


def kl_penalty_rewards(
    rewards: jax.Array,
    logp: jax.Array,
    ref_logp: jax.Array,
    mask: jax.Array,
    *,
    coef: float | jax.Array,
    kind: str,
) -> jax.Array:
    """KL as a per-token reward penalty (Ziegler et al. 2019; Ouyang et al. 2022).

        r'_t = r_t - coef · kl_t       on real tokens, 0 on padding

    The penalty then flows through the advantage estimator (e.g. `gae`).

    Args:
      rewards: `[B, T]` per-token rewards (often the score on the last token).
      logp: `[B, T]` log π of the sampled tokens (treat as a constant: rollout time).
      ref_logp: `[B, T]` log π_ref of the same tokens.
      mask: `[B, T]` response mask.
      coef: KL coefficient β, a float or a scalar array (e.g. a controller's coef).
      kind: KL estimator, see `kl_estimate` (static).

    Returns:
      `[B, T]` float32 penalised rewards, zero where mask is 0.
    """
    chex.assert_rank(rewards, 2, custom_message="kl_penalty_rewards: `rewards` must be [B, T]")
    chex.assert_equal_shape(
        [rewards, logp, ref_logp, mask],
        custom_message="kl_penalty_rewards: `rewards`, `logp`, `ref_logp`, `mask` must match",
    )
    real = mask > 0
    kl = kl_estimate(
        jnp.where(real, logp, 0.0), jnp.where(real, ref_logp, 0.0), kind=kind
    )  # [B, T]
    penalised = rewards.astype(jnp.float32) - jnp.asarray(coef, jnp.float32) * kl
    return jnp.where(real, penalised, 0.0)


def kl_loss(
    logp: jax.Array,
    ref_logp: jax.Array,
    mask: jax.Array,
    *,
    kind: str,
    aggregation: str = "token_mean",
    seq_weights: jax.Array | None = None,
    norm_len: float | None = None,
) -> jax.Array:
    """KL as a loss term (GRPO's placement, Shao et al. 2024): aggregate(kl_t).

    The caller multiplies by its coefficient. k3 is GRPO's choice; its gradient
    with respect to logp is the one that matters, so logp must be the current
    policy's (differentiable) log-probabilities.

    Args:
      logp: `[B, T]` log π of the sampled tokens (current policy).
      ref_logp: `[B, T]` log π_ref of the same tokens.
      mask: `[B, T]` response mask.
      kind: KL estimator, see `kl_estimate` (static).
      aggregation: see `rlpt.rl.losses.aggregate` (static).
      seq_weights: optional `[B]` per-sequence weights.
      norm_len: see `rlpt.rl.losses.aggregate` (static).

    Returns:
      float32 scalar.
    """
    chex.assert_rank(logp, 2, custom_message="kl_loss: `logp` must be [B, T]")
    chex.assert_equal_shape(
        [logp, ref_logp, mask], custom_message="kl_loss: `logp`, `ref_logp`, `mask` must match"
    )
    real = mask > 0
    kl = kl_estimate(
        jnp.where(real, logp, 0.0), jnp.where(real, ref_logp, 0.0), kind=kind
    )  # [B, T]
    return aggregate(kl, mask, mode=aggregation, seq_weights=seq_weights, norm_len=norm_len)


@flax.struct.dataclass
class KLControllerState:
    """KL coefficient β as a pytree, so it lives in the train state and crosses jit.

    Attributes:
      coef: float32 scalar array, the current β.
    """

    coef: jax.Array


def init_kl_controller(init_coef: float | jax.Array) -> KLControllerState:
    """A controller starting at β = init_coef."""
    return KLControllerState(coef=jnp.asarray(init_coef, jnp.float32))


def update_kl_controller(
    state: KLControllerState,
    observed_kl: float | jax.Array,
    *,
    n_steps: int | jax.Array,
    target: float,
    horizon: float,
    adaptive: bool,
) -> KLControllerState:
    """One controller update; fixed (returns `state` unchanged) unless `adaptive`.

    Adaptive KL controller (Ziegler et al. 2019, arXiv:1909.08593):

        e = clip(observed_kl / target - 1, -0.2, 0.2)
        β ← β · (1 + e · n_steps / horizon)

    Args:
      state: current controller state.
      observed_kl: scalar, the measured KL(π || π_ref) (e.g. mean per-sequence KL).
      n_steps: samples (or steps) seen since the last update.
      target: the KL target.
      horizon: how many samples it takes to move β by the full error (static).
      adaptive: adapt (True) or keep β fixed (False) (static).

    Returns:
      the new state.
    """
    if not adaptive:
        return state
    observed_kl = jnp.asarray(observed_kl, jnp.float32)
    chex.assert_rank(observed_kl, 0, custom_message="`observed_kl` must be a scalar")
    error = jnp.clip(observed_kl / target - 1.0, -0.2, 0.2)
    factor = 1.0 + error * jnp.asarray(n_steps, jnp.float32) / horizon
    return state.replace(coef=state.coef * factor)
