"""Policy, value and entropy losses over response tokens, with explicit aggregation.

Every token array is `[B, T]` with a float `mask` (1 real, 0 padding). Values at
masked positions are never read (they may be garbage, even NaN). Computation is
float32 whatever the input dtype.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
_MAX_LOG_RATIO = 20.0


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den, and 0 where den == 0 (no NaN in values or gradients)."""
    nonzero = den != 0
    return jnp.where(nonzero, num / jnp.where(nonzero, den, 1.0), 0.0)


def masked_mean(x: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Σ x·mask / Σ mask over `axis` (all axes if None); 0 where the mask sums to 0.

    Args:
      x: array.
      mask: same shape as `x`, float weights (1 real, 0 padding).
      axis: axis to reduce, or None for all.

    Returns:
      float32 mean with `axis` reduced.
    """
    chex.assert_equal_shape([x, mask], custom_message="masked_mean: `x` and `mask` must match")
    m = mask.astype(jnp.float32)
    xm = jnp.where(m != 0, x.astype(jnp.float32), 0.0) * m
    return _safe_div(jnp.sum(xm, axis=axis), jnp.sum(m, axis=axis))


def aggregate(
    token_losses: jax.Array,
    mask: jax.Array,
    *,
    mode: str,
    seq_weights: jax.Array | None = None,
    norm_len: float | None = None,
) -> jax.Array:
    """Reduce `[B, T]` per-token losses to a scalar.

    With L the token losses, m the mask and w_b the sequence weights (default 1):

      token_mean:          Σ_b w_b Σ_t L m  /  Σ_{b,t} m
                           (every real token counts equally: DAPO, Yu et al. 2025).
      seq_mean_token_mean: Σ_b w_b (Σ_t L m / Σ_t m)  /  #{b : Σ_t m > 0}
                           (each non-empty row's token mean, averaged over those
                           rows: the original GRPO, Shao et al. 2024).
      seq_mean_token_sum:  Σ_b w_b Σ_t L m  /  N,  N = B, or N = norm_len if given
                           (no length normalisation: Dr. GRPO, Liu et al. 2025).
                           With norm_len this is verl's "seq-mean-token-sum-norm"
                           (total over a constant); pass norm_len = B * max_len for
                           Dr. GRPO's per-row constant normaliser.

    Normalisers never include the weights: weight 2 doubles a row's contribution
    and its gradient. Rows with no real tokens contribute 0, and an all-padding
    batch gives 0, never NaN.

    Args:
      token_losses: `[B, T]` per-token losses.
      mask: `[B, T]` response mask.
      mode: one of AGGREGATION_MODES (static).
      seq_weights: optional `[B]` per-sequence weights.
      norm_len: optional constant normaliser for `seq_mean_token_sum` (static).

    Returns:
      float32 scalar.

    Raises:
      ValueError: at trace time, for an unknown mode.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGGREGATION_MODES}")
    chex.assert_rank(token_losses, 2, custom_message="aggregate: `token_losses` must be [B, T]")
    chex.assert_equal_shape(
        [token_losses, mask], custom_message="aggregate: `token_losses` and `mask` must match"
    )
    batch = token_losses.shape[0]
    if seq_weights is None:
        seq_weights = jnp.ones((batch,), jnp.float32)
    else:
        chex.assert_shape(seq_weights, (batch,), custom_message="aggregate: `seq_weights` is [B]")
        seq_weights = seq_weights.astype(jnp.float32)
    m = mask.astype(jnp.float32)  # [B, T]
    masked = jnp.where(m != 0, token_losses.astype(jnp.float32), 0.0) * m  # [B, T]
    row_sum = jnp.sum(masked, axis=1)  # [B]
    row_count = jnp.sum(m, axis=1)  # [B]
    if mode == "token_mean":
        return _safe_div(jnp.sum(seq_weights * row_sum), jnp.sum(row_count))
    if mode == "seq_mean_token_mean":
        row_mean = _safe_div(row_sum, row_count)  # [B]
        non_empty = (row_count != 0).astype(jnp.float32)  # [B]
        return _safe_div(jnp.sum(seq_weights * row_mean * non_empty), jnp.sum(non_empty))
    denominator = float(batch) if norm_len is None else float(norm_len)
    return jnp.sum(seq_weights * row_sum) / denominator


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: str = "token_mean",
    seq_weights: jax.Array | None = None,
    norm_len: float | None = None,
    token_weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped surrogate policy loss: PPO (Schulman et al. 2017, arXiv:1707.06347).

        ρ = exp(clip(logp - old_logp, -20, 20))
        J = min(ρ A, clip(ρ, 1 - clip_low, 1 + clip_high) A)
        J = max(J, c A)  where A < 0, if dual_clip = c > 1 (Ye et al. 2020,
            arXiv:1912.09729: bounds the loss of a bad action with a huge ratio)
        loss = -aggregate(w J)   with w = token_weights (1 without them)

    clip_high defaults to clip_low (symmetric clip); clip_high > clip_low is DAPO's
    "clip-higher" (Yu et al. 2025).

    Diagnostics (float32 scalars, masked over real tokens, 0 if there are none):
      clip_frac: fraction where the clipped branch is strictly the smaller one
        (it then carries no gradient).
      dual_clip_frac: fraction where the dual-clip bound c A is active (0 without
        dual clip).
      approx_kl: mean of k3 = (ρ - 1) - log ρ, an estimate of KL(old || new).
      ratio_mean, ratio_max, ratio_min.

    Args:
      logp: `[B, T]` log-probabilities of the sampled tokens under the current policy.
      old_logp: `[B, T]` the same under the behaviour (sampling) policy.
      advantages: `[B, T]` per-token advantages.
      mask: `[B, T]` response mask.
      clip_low, clip_high: the clip range [1 - clip_low, 1 + clip_high] (static).
      dual_clip: the dual-clip constant c > 1, or None (static).
      aggregation: see `aggregate` (static).
      seq_weights: optional `[B]` per-sequence weights.
      norm_len: see `aggregate` (static).
      token_weights: optional `[B, T]` constant per-token weights of the objective (the
        behaviour correction of `behaviour_weights`); no gradient flows into them.

    Returns:
      `(loss, diagnostics)`.
    """
    chex.assert_rank(logp, 2, custom_message="policy_loss: `logp` must be [B, T]")
    chex.assert_equal_shape(
        [logp, old_logp, advantages, mask],
        custom_message="policy_loss: `logp`, `old_logp`, `advantages`, `mask` must match",
    )
    if clip_high is None:
        clip_high = clip_low
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    real = mask > 0  # [B, T]
    # Zero padding before exp so garbage there cannot overflow or leak NaN, and clamp
    # |log ρ| <= 20 (as verl does) so a sampler/trainer mismatch cannot make ρ inf.
    log_ratio = jnp.where(real, logp.astype(jnp.float32) - old_logp.astype(jnp.float32), 0.0)
    log_ratio = jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [B, T]
    adv = jnp.where(real, advantages.astype(jnp.float32), 0.0)  # [B, T]
    ratio = jnp.exp(log_ratio)  # [B, T]
    unclipped = ratio * adv  # [B, T]
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv  # [B, T]
    objective = jnp.minimum(unclipped, clipped)  # [B, T]
    clip_active = clipped < unclipped
    if dual_clip is None:
        dual_active = jnp.zeros_like(real)
    else:
        bound = dual_clip * adv
        dual_active = (adv < 0) & (bound > objective)
        objective = jnp.where(adv < 0, jnp.maximum(objective, bound), objective)
    if token_weights is not None:
        chex.assert_equal_shape(
            [logp, token_weights], custom_message="policy_loss: `token_weights` must be [B, T]"
        )
        objective = objective * jax.lax.stop_gradient(token_weights.astype(jnp.float32))
    loss = -aggregate(objective, mask, mode=aggregation, seq_weights=seq_weights, norm_len=norm_len)

    any_real = jnp.any(real)
    diagnostics = {
        "clip_frac": masked_mean(clip_active.astype(jnp.float32), mask),
        "dual_clip_frac": masked_mean(dual_active.astype(jnp.float32), mask),
        "approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": jnp.where(any_real, jnp.max(jnp.where(real, ratio, -jnp.inf)), 0.0),
        "ratio_min": jnp.where(any_real, jnp.min(jnp.where(real, ratio, jnp.inf)), 0.0),
    }
    return loss, jax.lax.stop_gradient(diagnostics)


def behaviour_weights(
    old_logp: jax.Array,
    behaviour_logp: jax.Array,
    mask: jax.Array,
    *,
    mode: str,
    cap: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token importance weights from the behaviour policy to the proximal one.

        w = exp(old_logp - behaviour_logp) = pi_old(y_t) / pi_behaviour(y_t)
        "truncate": min(w, cap)         "mask": w if 1/cap <= w <= cap else 0

    Decoupled PPO (Hilton et al. 2021, arXiv:2110.00641) separates the policy that drew
    the samples (behaviour: an older version, or the same weights in the sampler's
    precision) from the proximal policy the clip is centred on; the surrogate of each
    token is weighted by w so the update stays an estimate under the proximal policy.
    Truncation bounds the variance at a small bias (Ionides 2008; Espeholt et al. 2018's
    V-trace uses the same cap); masking drops the tokens where the two policies disagree
    by more than the cap. Weights are constants of the loss (no gradient).

    Diagnostics over real tokens: ``is_weight_mean`` (before truncation or masking),
    ``is_capped_frac`` (tokens truncated or masked), ``mismatch_kl`` (k3 estimate of
    KL(behaviour || old) from the behaviour samples: (w - 1) - log w, always >= 0) and
    ``mismatch_logp_max_abs`` (the largest |old_logp - behaviour_logp|).
    """
    chex.assert_equal_shape(
        [old_logp, behaviour_logp, mask],
        custom_message="behaviour_weights: `old_logp`, `behaviour_logp`, `mask` must match",
    )
    if mode not in ("none", "truncate", "mask"):
        raise ValueError(f"behaviour_weights: mode must be none/truncate/mask, got {mode!r}")
    real = mask > 0  # [B, T]
    log_w = jnp.where(real, old_logp.astype(jnp.float32) - behaviour_logp.astype(jnp.float32), 0.0)
    log_w = jnp.clip(log_w, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [B, T]
    w = jnp.exp(log_w)  # [B, T]
    if mode == "truncate":
        capped = w > cap
        weights = jnp.minimum(w, cap)
    elif mode == "mask":
        capped = (w > cap) | (w < 1.0 / cap)
        weights = jnp.where(capped, 0.0, w)
    else:
        capped = jnp.zeros_like(real)
        weights = jnp.ones_like(w)
    weights = jnp.where(real, weights, 0.0)
    any_real = jnp.any(real)
    diagnostics = {
        "is_weight_mean": masked_mean(w, mask),
        "is_capped_frac": masked_mean((capped & real).astype(jnp.float32), mask),
        "mismatch_kl": masked_mean((w - 1.0) - log_w, mask),
        "mismatch_logp_max_abs": jnp.where(any_real, jnp.max(jnp.abs(log_w)), 0.0),
    }
    return jax.lax.stop_gradient(weights), jax.lax.stop_gradient(diagnostics)


def imitation_loss(
    logp: jax.Array,
    mask: jax.Array,
    imitation_weights: jax.Array,
    *,
    aggregation: str = "token_mean",
    seq_weights: jax.Array | None = None,
    norm_len: float | None = None,
) -> jax.Array:
    """Self-imitation: the negative log-likelihood of the policy's own good samples.

        loss = aggregate(-logp, weights = seq_weights * imitation_weights)

    A supervised term on the rows marked for imitation (the verified-correct
    completions), as in self-imitation learning (Oh et al. 2018, arXiv:1806.05635)
    and reward-ranked fine-tuning (RAFT, Dong et al. 2023, arXiv:2304.06767). Unlike
    the clipped surrogate it is not scaled by a group-relative advantage, so a prompt
    the policy already mostly solves still sharpens towards its correct answer. It
    shares the policy loss's aggregation and denominator, so microbatch accumulation
    and the rows' loss weights treat it exactly alike.

    Args:
      logp: `[B, T]` log-probabilities of the sampled tokens under the current policy.
      mask: `[B, T]` response mask.
      imitation_weights: `[B]` 1 for rows to imitate, 0 elsewhere (any weights >= 0).
      aggregation, seq_weights, norm_len: see `aggregate`.
    """
    chex.assert_rank(logp, 2, custom_message="imitation_loss: `logp` must be [B, T]")
    chex.assert_equal_shape(
        [logp, mask], custom_message="imitation_loss: `logp` and `mask` must match"
    )
    chex.assert_shape(
        imitation_weights, (logp.shape[0],),
        custom_message="imitation_loss: `imitation_weights` must be [B]",
    )  # fmt: skip
    weights = imitation_weights.astype(jnp.float32)
    if seq_weights is not None:
        weights = weights * seq_weights.astype(jnp.float32)
    return aggregate(-logp, mask, mode=aggregation, seq_weights=weights, norm_len=norm_len)


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    *,
    clip_eps: float | None = None,
    aggregation: str = "token_mean",
    seq_weights: jax.Array | None = None,
    norm_len: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Squared-error value loss, optionally clipped around the old values (PPO).

        unclipped: 0.5 (V - R)^2
        clipped:   0.5 max((V - R)^2, (V_old + clip(V - V_old, -ε, ε) - R)^2)

    The clipped form follows OpenAI baselines' PPO2 (see Huang et al. 2022, "The 37
    implementation details of PPO", which notes it rarely helps).

    Diagnostics (float32 scalars over real tokens, 0 if there are none):
      value_clip_frac: fraction where the clipped term is strictly the larger one
        (0 without clipping).
      explained_variance: 1 - Var(R - V) / Var(R) with the current `values`
        (0 when Var(R) is 0).

    Args:
      values: `[B, T]` current value predictions.
      old_values: `[B, T]` value predictions at rollout time.
      returns: `[B, T]` targets (e.g. GAE returns).
      mask: `[B, T]` response mask.
      clip_eps: value clip range ε, or None for no clipping (static).
      aggregation: see `aggregate` (static).
      seq_weights: optional `[B]` per-sequence weights.
      norm_len: see `aggregate` (static).

    Returns:
      `(loss, diagnostics)`.
    """
    chex.assert_rank(values, 2, custom_message="value_loss: `values` must be [B, T]")
    chex.assert_equal_shape(
        [values, old_values, returns, mask],
        custom_message="value_loss: `values`, `old_values`, `returns`, `mask` must match",
    )
    real = mask > 0
    v = jnp.where(real, values.astype(jnp.float32), 0.0)  # [B, T]
    v_old = jnp.where(real, old_values.astype(jnp.float32), 0.0)  # [B, T]
    ret = jnp.where(real, returns.astype(jnp.float32), 0.0)  # [B, T]
    err = jnp.square(v - ret)  # [B, T]
    if clip_eps is None:
        token_losses = 0.5 * err
        clip_active = jnp.zeros_like(real)
    else:
        v_clipped = v_old + jnp.clip(v - v_old, -clip_eps, clip_eps)
        err_clipped = jnp.square(v_clipped - ret)
        token_losses = 0.5 * jnp.maximum(err, err_clipped)
        clip_active = err_clipped > err
    loss = aggregate(
        token_losses, mask, mode=aggregation, seq_weights=seq_weights, norm_len=norm_len
    )

    def _var(x):
        mean = masked_mean(x, mask)
        return masked_mean(jnp.square(x - mean), mask)

    var_returns = _var(ret)
    diagnostics = {
        "value_clip_frac": masked_mean(clip_active.astype(jnp.float32), mask),
        "explained_variance": jnp.where(
            var_returns > 0, 1.0 - _safe_div(_var(ret - v), var_returns), 0.0
        ),
    }
    return loss, jax.lax.stop_gradient(diagnostics)


def token_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of each token's distribution: H = -Σ_v p_v log p_v, `[B, T, V]` -> `[B, T]`.

    Uses log_softmax in float32; vocabulary entries with logit -inf (p = 0)
    contribute 0 rather than 0 · -inf = NaN.
    """
    chex.assert_rank(logits, 3, custom_message="token_entropy: `logits` must be [B, T, V]")
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, T, V]
    p = jnp.exp(logp)
    return -jnp.sum(p * jnp.where(jnp.isfinite(logp), logp, 0.0), axis=-1)  # [B, T]


def entropy_from_logits(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked mean token entropy over real tokens, a float32 scalar (0 if none).

    Args:
      logits: `[B, T, V]` policy logits.
      mask: `[B, T]` response mask.
    """
    chex.assert_rank(logits, 3, custom_message="entropy_from_logits: `logits` is [B, T, V]")
    chex.assert_equal_shape_prefix(
        [logits, mask], 2, custom_message="entropy_from_logits: `mask` must be [B, T]"
    )
    chex.assert_rank(mask, 2, custom_message="entropy_from_logits: `mask` must be [B, T]")
    return masked_mean(token_entropy(logits), mask)
