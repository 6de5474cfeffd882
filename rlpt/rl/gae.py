"""Generalised advantage estimation and masked whitening over response tokens.

Every array is `[B, T]` over response tokens with a float `mask` (1 real, 0 padding).
Computation is float32 whatever the input dtype.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def gae(
    rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    *,
    gamma: float,
    lam: float,
    dones: jax.Array | None = None,
    last_values: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438).

    Over the real (mask > 0) steps of a row, with t+1 meaning the next REAL step:

        δ_t = r_t + γ V_{t+1} (1 - done_t) - V_t
        A_t = δ_t + γ λ (1 - done_t) A_{t+1}
        returns_t = A_t + V_t

    Masked-out positions are skipped over, not treated as episode ends: they emit
    zero, their rewards and values are ignored, and the chain (next value and next
    advantage) passes through them unchanged, with no discount for the gap. So a row
    with a hole in its mask behaves as if the hole were deleted, and trailing padding
    after a left-aligned response changes nothing. Rows with no real tokens give
    all zeros.

    Episode ends:
      * Default (`dones` and `last_values` both None): the value after the last real
        token of a row is 0, i.e. the episode ends with the response.
      * `dones` `[B, T]`: 1 where an episode ends AFTER step t (so our `dones[t]`
        is CleanRL's `dones[t + 1]`, which marks the first step of the next
        episode): no bootstrap and no advantage flows across it. A done is
        honoured at every position, masked ones included, so an episode boundary
        inside padding still cuts.
      * `last_values` `[B]`: the bootstrap value after the final position of the
        row; it reaches the last real step unless a done cuts it first.

    Args:
      rewards: `[B, T]` per-token rewards.
      values: `[B, T]` value estimates V(s_t).
      mask: `[B, T]` 1 for real response tokens, 0 for padding.
      gamma: discount γ.
      lam: GAE λ.
      dones: optional `[B, T]` episode-end flags (after the step).
      last_values: optional `[B]` bootstrap values after the row's final step.

    Returns:
      `(advantages, returns)`, both `[B, T]` float32 and zero where mask is 0.
    """
    chex.assert_rank(rewards, 2, custom_message="gae: `rewards` must be [B, T]")
    chex.assert_equal_shape(
        [rewards, values, mask], custom_message="gae: `rewards`, `values`, `mask` must match"
    )
    batch, _ = rewards.shape
    rewards = rewards.astype(jnp.float32)  # [B, T]
    values = values.astype(jnp.float32)  # [B, T]
    real = mask > 0  # [B, T]
    if dones is None:
        dones = jnp.zeros_like(rewards)
    else:
        chex.assert_equal_shape([rewards, dones], custom_message="gae: `dones` must be [B, T]")
        dones = dones.astype(jnp.float32)
    if last_values is None:
        last_values = jnp.zeros((batch,), jnp.float32)
    else:
        chex.assert_shape(last_values, (batch,), custom_message="gae: `last_values` must be [B]")
        last_values = last_values.astype(jnp.float32)

    def step(carry, xs):
        next_value, next_adv = carry  # [B], [B]: of the next real step in this episode
        r, v, d, m = xs  # [B] each
        cont = 1.0 - d
        next_value = next_value * cont
        next_adv = next_adv * cont
        delta = r + gamma * next_value - v
        adv = delta + gamma * lam * next_adv
        # A masked step passes the (possibly cut) chain through untouched.
        carry = (jnp.where(m, v, next_value), jnp.where(m, adv, next_adv))
        return carry, jnp.where(m, adv, 0.0)

    xs = (rewards.T, values.T, dones.T, real.T)  # time-major [T, B]
    init = (last_values, jnp.zeros((batch,), jnp.float32))
    _, adv_t = jax.lax.scan(step, init, xs, reverse=True)  # [T, B]
    advantages = adv_t.T  # [B, T]
    returns = jnp.where(real, advantages + values, 0.0)  # [B, T]
    return advantages, returns


def whiten(
    x: jax.Array, mask: jax.Array, *, shift_mean: bool = True, eps: float = 1e-8
) -> jax.Array:
    """Masked whitening: (x - mean) / sqrt(var + eps) over the real entries only.

    The mean and the population variance (ddof=0) are taken over entries with
    mask > 0 across the whole batch, the usual PPO advantage normalisation
    (e.g. Huang et al. 2022, "The 37 implementation details of PPO"). With
    `shift_mean=False` the mean is added back, so only the scale changes. If the
    mask has no real entries the result is all zeros.

    Args:
      x: `[...]` values, usually `[B, T]` advantages.
      mask: same shape as `x`.
      shift_mean: subtract the mean (True) or keep it (False).
      eps: added to the variance before the square root.

    Returns:
      float32 array shaped like `x`, zero where mask is 0.
    """
    chex.assert_equal_shape([x, mask], custom_message="whiten: `x` and `mask` must match")
    real = mask > 0
    x = jnp.where(real, x.astype(jnp.float32), 0.0)
    count = jnp.sum(real.astype(jnp.float32))
    safe_count = jnp.maximum(count, 1.0)
    mean = jnp.sum(x) / safe_count
    var = jnp.sum(jnp.where(real, jnp.square(x - mean), 0.0)) / safe_count
    out = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return jnp.where(real, out, 0.0)
