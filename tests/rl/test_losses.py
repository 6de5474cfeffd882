"""Aggregation, PPO policy/value losses and entropy against hand-worked cases and loops."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlpt.rl import (
    AGGREGATION_MODES,
    aggregate,
    behaviour_weights,
    entropy_from_logits,
    imitation_loss,
    masked_mean,
    policy_loss,
    token_entropy,
    value_loss,
)

# float32 sums over a few dozen values of order 1.
ATOL = 1e-5


def _random_mask(rng, batch=6, length=7):
    """Row 0 empty, row 1 full, the rest ragged prefixes, the last one with holes."""
    mask = np.zeros((batch, length), np.float32)
    mask[1] = 1.0
    for b in range(2, batch):
        mask[b, : rng.integers(1, length)] = 1.0
    mask[batch - 1] = (rng.random(length) < 0.6).astype(np.float32)
    return mask


def _aggregate_oracle(losses, mask, mode, weights=None, norm_len=None):
    batch, length = losses.shape
    weights = np.ones(batch) if weights is None else weights
    rows = [[losses[b, t] for t in range(length) if mask[b, t] > 0] for b in range(batch)]
    if mode == "token_mean":
        n = sum(len(r) for r in rows)
        return sum(w * sum(r) for w, r in zip(weights, rows)) / n if n else 0.0
    if mode == "seq_mean_token_mean":
        means = [(w, sum(r) / len(r)) for w, r in zip(weights, rows) if r]
        return sum(w * m for w, m in means) / len(means) if means else 0.0
    total = sum(w * sum(r) for w, r in zip(weights, rows))
    return total / (batch if norm_len is None else norm_len)


def _policy_oracle(logp, old_logp, adv, mask, clip_low, clip_high, dual_clip):
    """Per-token PPO objective written with scalar math; returns J and the flags."""
    objective = np.zeros(logp.shape)
    clipped = np.zeros(logp.shape)
    dual = np.zeros(logp.shape)
    for i in np.ndindex(logp.shape):
        if mask[i] == 0:
            continue
        ratio = math.exp(logp[i] - old_logp[i])
        a = adv[i]
        surr1 = ratio * a
        surr2 = min(max(ratio, 1 - clip_low), 1 + clip_high) * a
        j = min(surr1, surr2)
        clipped[i] = surr2 < surr1
        if dual_clip is not None and a < 0 and dual_clip * a > j:
            j = dual_clip * a
            dual[i] = 1.0
        objective[i] = j
    return objective, clipped, dual


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("weighted", [False, True])
def test_aggregate_matches_oracle(variant, mode, weighted):
    rng = np.random.default_rng(0)
    mask = _random_mask(rng)
    losses = rng.normal(size=mask.shape).astype(np.float32)
    losses[mask == 0] = np.nan  # padding is never read
    weights = rng.uniform(0.5, 2.0, size=mask.shape[0]).astype(np.float32) if weighted else None
    got = variant(aggregate, mode=mode)(losses, mask, seq_weights=weights)
    np.testing.assert_allclose(got, _aggregate_oracle(losses, mask, mode, weights), atol=ATOL)


def test_aggregate_hand_worked(variant):
    # Row 0: [1, 2] real; row 1: [3] real; row 2 empty.
    # token_mean = 6 / 3 = 2;  seq_mean_token_mean = (1.5 + 3) / 2 = 2.25;
    # seq_mean_token_sum = (3 + 3) / 3 rows = 2, or (3 + 3) / 4 = 1.5 with norm_len 4.
    losses = jnp.array([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert variant(aggregate, mode="token_mean")(losses, mask) == pytest.approx(2.0)
    assert variant(aggregate, mode="seq_mean_token_mean")(losses, mask) == pytest.approx(2.25)
    assert variant(aggregate, mode="seq_mean_token_sum")(losses, mask) == pytest.approx(2.0)
    got = variant(aggregate, mode="seq_mean_token_sum", norm_len=4)(losses, mask)
    assert got == pytest.approx(1.5)
    # Weight 2 on row 1 adds its contribution once more; normalisers stay the same:
    # token_mean = (3 + 6) / 3 = 3;  seq_mean_token_mean = (1.5 + 6) / 2 = 3.75.
    weights = jnp.array([1.0, 2.0, 5.0])
    got = variant(aggregate, mode="token_mean")(losses, mask, seq_weights=weights)
    assert got == pytest.approx(3.0)
    got = variant(aggregate, mode="seq_mean_token_mean")(losses, mask, seq_weights=weights)
    assert got == pytest.approx(3.75)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_empty_batch_is_zero_with_finite_grad(variant, mode):
    losses = jnp.ones((2, 3))
    mask = jnp.zeros((2, 3))
    assert variant(aggregate, mode=mode)(losses, mask) == 0.0
    grad = jax.grad(lambda x: variant(aggregate, mode=mode)(x, mask))(losses)
    np.testing.assert_array_equal(grad, 0.0)


def test_aggregate_unknown_mode_names_allowed():
    with pytest.raises(ValueError, match="token_mean"):
        aggregate(jnp.ones((1, 2)), jnp.ones((1, 2)), mode="mean")
    with pytest.raises(ValueError, match="seq_mean_token_sum"):
        jax.jit(functools.partial(aggregate, mode="sum"))(jnp.ones((1, 2)), jnp.ones((1, 2)))


def test_masked_mean(variant):
    x = jnp.array([[1.0, 2.0, jnp.nan], [4.0, 5.0, 6.0]])
    mask = jnp.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert variant(masked_mean)(x, mask) == pytest.approx(1.5)
    np.testing.assert_allclose(variant(masked_mean, axis=1)(x, mask), [1.5, 0.0])
    assert variant(masked_mean)(x, jnp.zeros_like(x)) == 0.0


def test_policy_loss_hand_worked(variant):
    # clip 0.2, dual clip 3, token_mean over 3 tokens:
    #   ρ = 1.5, A = +1: min(1.5, 1.2) = 1.2 (clipped branch active)
    #   ρ = 0.5, A = -1: min(-0.5, -0.8) = -0.8 (clipped branch active)
    #   ρ = 5.0, A = -1: min(-5, -1.2) = -5, dual bound max(-5, -3) = -3
    # loss = -(1.2 - 0.8 - 3) / 3 = 0.8667;  clip_frac = 2/3;  dual_clip_frac = 1/3
    ratio = np.array([[1.5, 0.5, 5.0]], np.float32)
    logp = np.log(ratio)
    old = np.zeros_like(logp)
    adv = np.array([[1.0, -1.0, -1.0]], np.float32)
    mask = np.ones_like(adv)
    loss, diag = variant(policy_loss, clip_low=0.2, dual_clip=3.0)(logp, old, adv, mask)
    np.testing.assert_allclose(loss, 2.6 / 3, atol=ATOL)
    np.testing.assert_allclose(diag["clip_frac"], 2 / 3, atol=ATOL)
    np.testing.assert_allclose(diag["dual_clip_frac"], 1 / 3, atol=ATOL)
    np.testing.assert_allclose(diag["ratio_max"], 5.0, atol=ATOL)
    np.testing.assert_allclose(diag["ratio_min"], 0.5, atol=ATOL)
    np.testing.assert_allclose(diag["ratio_mean"], 7.0 / 3, atol=ATOL)
    # k3 per token: (ρ - 1) - log ρ.
    k3 = np.mean((ratio - 1) - np.log(ratio))
    np.testing.assert_allclose(diag["approx_kl"], k3, atol=ATOL)


def test_asymmetric_clip(variant):
    # ρ = 1.25, A = 1: symmetric 0.2 clips to 1.2; clip_high 0.28 leaves 1.25.
    logp = np.log(np.array([[1.25]], np.float32))
    args = (logp, np.zeros_like(logp), np.ones_like(logp), np.ones_like(logp))
    loss, diag = variant(policy_loss, clip_low=0.2)(*args)
    np.testing.assert_allclose(loss, -1.2, atol=ATOL)
    assert diag["clip_frac"] == 1.0
    loss, diag = variant(policy_loss, clip_low=0.2, clip_high=0.28)(*args)
    np.testing.assert_allclose(loss, -1.25, atol=ATOL)
    assert diag["clip_frac"] == 0.0


def _policy_batch(seed):
    rng = np.random.default_rng(seed)
    mask = _random_mask(rng)
    logp = rng.normal(scale=0.5, size=mask.shape).astype(np.float32)
    old = rng.normal(scale=0.5, size=mask.shape).astype(np.float32)
    adv = rng.normal(size=mask.shape).astype(np.float32)
    logp[mask == 0] = np.nan  # garbage in padding must not leak
    weights = rng.uniform(0.5, 2.0, size=mask.shape[0]).astype(np.float32)
    return logp, old, adv, mask, weights


@pytest.mark.parametrize("clip_high,dual_clip", [(None, None), (0.28, 3.0)])
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_policy_loss_matches_oracle(variant, clip_high, dual_clip, mode):
    logp, old, adv, mask, weights = _policy_batch(0)
    fn = variant(
        policy_loss, clip_low=0.2, clip_high=clip_high, dual_clip=dual_clip, aggregation=mode
    )
    loss, diag = fn(logp, old, adv, mask, seq_weights=weights)
    high = 0.2 if clip_high is None else clip_high
    objective, clipped, dual = _policy_oracle(logp, old, adv, mask, 0.2, high, dual_clip)
    want = -_aggregate_oracle(objective, mask, mode, weights)
    np.testing.assert_allclose(loss, want, atol=ATOL)
    n = mask.sum()
    np.testing.assert_allclose(diag["clip_frac"], clipped.sum() / n, atol=ATOL)
    np.testing.assert_allclose(diag["dual_clip_frac"], dual.sum() / n, atol=ATOL)
    ratios = np.exp(logp - old)[mask > 0]
    np.testing.assert_allclose(diag["ratio_max"], ratios.max(), rtol=1e-5)
    np.testing.assert_allclose(diag["ratio_min"], ratios.min(), rtol=1e-5)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_policy_loss_grad_is_finite_and_zero_on_padding(mode):
    logp, old, adv, mask, weights = _policy_batch(1)
    fn = functools.partial(policy_loss, dual_clip=3.0, aggregation=mode)
    grad = jax.jit(jax.grad(lambda lp: fn(lp, old, adv, mask, seq_weights=weights)[0]))(logp)
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[mask == 0] == 0)


def test_ratio_one_gives_minus_mean_advantage(variant):
    rng = np.random.default_rng(3)
    mask = _random_mask(rng)
    logp = rng.normal(size=mask.shape).astype(np.float32)
    adv = rng.normal(size=mask.shape).astype(np.float32)
    fn = variant(policy_loss, dual_clip=3.0)
    loss, diag = fn(logp, logp, adv, mask)
    np.testing.assert_allclose(loss, -adv[mask > 0].mean(), atol=ATOL)
    assert diag["clip_frac"] == 0.0 and diag["dual_clip_frac"] == 0.0
    np.testing.assert_allclose(diag["approx_kl"], 0.0, atol=ATOL)
    np.testing.assert_allclose(diag["ratio_mean"], 1.0, atol=ATOL)
    # At ρ = 1 the gradient is the policy gradient: dL/dlogp = -A / (number of real tokens).
    grad = jax.grad(lambda lp: fn(lp, logp, adv, mask)[0])(logp)
    np.testing.assert_allclose(grad, -adv * mask / mask.sum(), atol=ATOL)


def test_dual_clip_only_bounds_negative_advantages(variant):
    # Huge ratios everywhere; A > 0 is handled by the ordinary clip (1.2 A), A < 0 by c A.
    logp = np.full((1, 4), np.log(10.0), np.float32)
    adv = np.array([[2.0, 0.5, -0.5, -2.0]], np.float32)
    mask = np.ones_like(adv)
    _, plain = variant(policy_loss)(logp, np.zeros_like(logp), adv, mask)
    loss, diag = variant(policy_loss, dual_clip=3.0)(logp, np.zeros_like(logp), adv, mask)
    # J = [2.4, 0.6, -1.5, -6]: loss = -(2.4 + 0.6 - 1.5 - 6) / 4 = 1.125
    np.testing.assert_allclose(loss, 1.125, atol=ATOL)
    assert diag["dual_clip_frac"] == 0.5 and plain["dual_clip_frac"] == 0.0
    # A ratio below c leaves the dual bound inactive even for A < 0.
    small = np.full((1, 4), np.log(2.0), np.float32)
    _, diag = variant(policy_loss, dual_clip=3.0)(small, np.zeros_like(small), adv, mask)
    assert diag["dual_clip_frac"] == 0.0


def test_policy_loss_empty_batch_and_bad_config():
    zeros = jnp.zeros((2, 3))
    loss, diag = policy_loss(zeros, zeros, zeros, zeros)
    assert loss == 0.0 and all(float(v) == 0.0 for v in diag.values())
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(zeros, zeros, zeros, zeros, dual_clip=0.5)


def _value_oracle(values, old, returns, mask, clip_eps):
    losses = np.zeros(values.shape)
    clipped = np.zeros(values.shape)
    for i in np.ndindex(values.shape):
        if mask[i] == 0:
            continue
        err = (values[i] - returns[i]) ** 2
        if clip_eps is not None:
            v_c = old[i] + min(max(values[i] - old[i], -clip_eps), clip_eps)
            err_c = (v_c - returns[i]) ** 2
            clipped[i] = err_c > err
            err = max(err, err_c)
        losses[i] = 0.5 * err
    return losses, clipped


def test_value_loss_hand_worked(variant):
    # ε = 0.5:
    #   V = 2,   V_old = 1, R = 0:   0.5*4 = 2 vs V_c = 1.5 -> 0.5*2.25 = 1.125: 2
    #   V = 0.2, V_old = 1, R = 1.5: 0.5*1.69 = 0.845 vs V_c = 0.5 -> 0.5*1 = 0.5: 0.845
    #   V = 2,   V_old = 1, R = 3:   0.5*1 = 0.5 vs V_c = 1.5 -> 0.5*2.25 = 1.125 (clipped)
    values = jnp.array([[2.0, 0.2, 2.0]])
    old = jnp.array([[1.0, 1.0, 1.0]])
    returns = jnp.array([[0.0, 1.5, 3.0]])
    mask = jnp.ones((1, 3))
    loss, diag = variant(value_loss, clip_eps=0.5)(values, old, returns, mask)
    np.testing.assert_allclose(loss, (2.0 + 0.845 + 1.125) / 3, atol=ATOL)
    np.testing.assert_allclose(diag["value_clip_frac"], 1 / 3, atol=ATOL)
    loss, diag = variant(value_loss)(values, old, returns, mask)
    np.testing.assert_allclose(loss, (2.0 + 0.845 + 0.5) / 3, atol=ATOL)
    assert diag["value_clip_frac"] == 0.0


@pytest.mark.parametrize("clip_eps", [None, 0.2])
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_value_loss_matches_oracle(variant, clip_eps, mode):
    rng = np.random.default_rng(4)
    mask = _random_mask(rng)
    values, old, returns = (rng.normal(size=mask.shape).astype(np.float32) for _ in range(3))
    loss, diag = variant(value_loss, clip_eps=clip_eps, aggregation=mode)(
        values, old, returns, mask
    )
    losses, clipped = _value_oracle(values, old, returns, mask, clip_eps)
    np.testing.assert_allclose(loss, _aggregate_oracle(losses, mask, mode), atol=ATOL)
    np.testing.assert_allclose(diag["value_clip_frac"], clipped.sum() / mask.sum(), atol=ATOL)
    r, v = returns[mask > 0], values[mask > 0]
    np.testing.assert_allclose(diag["explained_variance"], 1 - np.var(r - v) / np.var(r), atol=ATOL)


def test_explained_variance_perfect_prediction(variant):
    returns = jnp.array([[1.0, 2.0, 4.0]])
    _, diag = variant(value_loss)(returns, returns, returns, jnp.ones((1, 3)))
    np.testing.assert_allclose(diag["explained_variance"], 1.0, atol=ATOL)


def test_imitation_loss_hand_worked(variant):
    # Rows 0 and 2 are marked; row 1 is not, and row 2 is weighted 0.5 by its loss weight.
    logp = jnp.array([[-1.0, -2.0, 9.0], [-3.0, -4.0, -5.0], [-0.5, 9.0, 9.0]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    marked = jnp.array([1.0, 0.0, 1.0])
    seq_weights = jnp.array([1.0, 1.0, 0.5])
    loss = variant(functools.partial(imitation_loss, aggregation="token_mean"))(
        logp, mask, marked, seq_weights=seq_weights
    )
    # Token mean over all 6 real tokens: (1 + 2 + 0.5 * 0.5) / 6.
    np.testing.assert_allclose(loss, (1.0 + 2.0 + 0.25) / 6.0, atol=ATOL)
    loss = variant(functools.partial(imitation_loss, aggregation="seq_mean_token_mean"))(
        logp, mask, marked, seq_weights=seq_weights
    )
    # Mean over the 3 non-empty rows of each row's token mean: (1.5 + 0 + 0.5 * 0.5) / 3.
    np.testing.assert_allclose(loss, (1.5 + 0.25) / 3.0, atol=ATOL)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_imitation_loss_matches_oracle_and_ignores_unmarked_rows(variant, mode):
    rng = np.random.default_rng(11)
    mask = _random_mask(rng)
    logp = -rng.exponential(size=mask.shape).astype(np.float32)
    marked = (rng.random(mask.shape[0]) < 0.5).astype(np.float32)
    marked[1] = 1.0
    seq_weights = rng.uniform(0.5, 1.5, size=mask.shape[0]).astype(np.float32)
    fn = variant(functools.partial(imitation_loss, aggregation=mode))
    loss = fn(jnp.asarray(logp), jnp.asarray(mask), jnp.asarray(marked), seq_weights=seq_weights)
    expected = _aggregate_oracle(-logp, mask, mode, weights=marked * seq_weights)
    np.testing.assert_allclose(loss, expected, atol=ATOL)
    # The gradient reaches the marked rows' real tokens only.
    grad = jax.grad(lambda lp: imitation_loss(lp, jnp.asarray(mask), jnp.asarray(marked),
                                              aggregation=mode))(jnp.asarray(logp))  # fmt: skip
    reached = np.asarray(grad) != 0
    np.testing.assert_array_equal(reached, (mask > 0) & (marked[:, None] > 0))


def test_imitation_loss_rejects_per_token_weights():
    with pytest.raises(AssertionError, match="imitation_weights"):
        imitation_loss(jnp.zeros((2, 3)), jnp.ones((2, 3)), jnp.ones((2, 3)))


def test_entropy_hand_worked_and_oracle(variant):
    # Uniform over 4 tokens: ln 4.  A one-hot (others -inf): 0, not NaN.
    logits = np.zeros((2, 3, 4), np.float32)
    logits[0, 1] = [0.0, -np.inf, -np.inf, -np.inf]
    rng = np.random.default_rng(5)
    logits[1] = rng.normal(size=(3, 4)) * 3
    ent = np.asarray(variant(token_entropy)(logits))
    np.testing.assert_allclose(ent[0], [math.log(4), 0.0, math.log(4)], atol=ATOL)
    for t in range(3):
        z = logits[1, t].astype(np.float64)
        p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        np.testing.assert_allclose(ent[1, t], -sum(q * math.log(q) for q in p), atol=ATOL)
    mask = np.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
    got = variant(entropy_from_logits)(logits, mask)
    np.testing.assert_allclose(got, math.log(4) / 2, atol=ATOL)
    grad = jax.jit(jax.grad(lambda x: entropy_from_logits(x, mask)))(logits)
    assert np.all(np.isfinite(grad))


def test_entropy_bfloat16_computes_in_float32(variant):
    logits = jnp.asarray(np.random.default_rng(6).normal(size=(2, 3, 5)), jnp.bfloat16)
    ent = variant(token_entropy)(logits)
    assert ent.dtype == jnp.float32
    want = variant(token_entropy)(logits.astype(jnp.float32))
    np.testing.assert_allclose(ent, want, atol=ATOL)


def test_shape_mismatch_raises():
    with pytest.raises(AssertionError, match="advantages"):
        policy_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((2,)), jnp.ones((2, 3)))
    with pytest.raises(AssertionError, match="returns"):
        value_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((3, 2)), jnp.ones((2, 3)))
    with pytest.raises(AssertionError, match="seq_weights"):
        aggregate(jnp.zeros((2, 3)), jnp.ones((2, 3)), mode="token_mean", seq_weights=jnp.ones(3))
    with pytest.raises(AssertionError, match="mask"):
        entropy_from_logits(jnp.zeros((2, 3, 4)), jnp.ones((2, 4)))


def test_extreme_log_ratio_stays_finite():
    # log ρ = ±200 would overflow exp in float32; the clamp at |log ρ| <= 20 keeps it finite.
    logp = jnp.array([[200.0, -200.0, 0.0]])
    adv = jnp.array([[-1.0, 1.0, 1.0]])
    fn = jax.jit(lambda lp: policy_loss(lp, jnp.zeros_like(lp), adv, jnp.ones_like(lp))[0])
    assert np.isfinite(fn(logp))
    assert np.all(np.isfinite(jax.jit(jax.grad(fn))(logp)))


def test_behaviour_weights_hand_worked(variant):
    # w = pi_old / pi_behaviour = 3, 0.25, 1.2 and a padded token; cap 2:
    #   truncate: 2, 0.25, 1.2 (one capped)   mask: 0, 0, 1.2 (two outside [0.5, 2])
    w = np.array([[3.0, 0.25, 1.2, 7.0]], np.float32)
    behaviour = np.log(np.array([[0.1, 0.4, 0.5, 0.01]], np.float32))
    old = behaviour + np.log(w)
    mask = np.array([[1.0, 1.0, 1.0, 0.0]], np.float32)
    weights, diag = variant(behaviour_weights, mode="truncate", cap=2.0)(old, behaviour, mask)
    np.testing.assert_allclose(weights, [[2.0, 0.25, 1.2, 0.0]], atol=ATOL)
    np.testing.assert_allclose(diag["is_capped_frac"], 1 / 3, atol=ATOL)
    np.testing.assert_allclose(diag["is_weight_mean"], (3.0 + 0.25 + 1.2) / 3, atol=ATOL)
    k3 = np.mean([(x - 1) - math.log(x) for x in (3.0, 0.25, 1.2)])
    np.testing.assert_allclose(diag["mismatch_kl"], k3, atol=ATOL)
    np.testing.assert_allclose(diag["mismatch_logp_max_abs"], math.log(4.0), atol=ATOL)
    weights, diag = variant(behaviour_weights, mode="mask", cap=2.0)(old, behaviour, mask)
    np.testing.assert_allclose(weights, [[0.0, 0.0, 1.2, 0.0]], atol=ATOL)
    np.testing.assert_allclose(diag["is_capped_frac"], 2 / 3, atol=ATOL)
    weights, _ = variant(behaviour_weights, mode="none", cap=2.0)(old, behaviour, mask)
    np.testing.assert_allclose(weights, [[1.0, 1.0, 1.0, 0.0]], atol=0)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_policy_loss_token_weights_match_oracle(variant, mode):
    """Each token's objective is scaled by its weight; no gradient reaches the weights."""
    rng = np.random.default_rng(11)
    mask = _random_mask(rng)
    logp = rng.normal(scale=0.3, size=mask.shape).astype(np.float32)
    old = rng.normal(scale=0.3, size=mask.shape).astype(np.float32)
    adv = rng.normal(size=mask.shape).astype(np.float32)
    w = rng.uniform(0.0, 2.0, size=mask.shape).astype(np.float32)
    loss, _ = variant(policy_loss, clip_low=0.2, aggregation=mode)(
        logp, old, adv, mask, token_weights=w
    )
    objective, _, _ = _policy_oracle(logp, old, adv, mask, 0.2, 0.2, None)
    expected = -_aggregate_oracle(objective * w, mask, mode)
    np.testing.assert_allclose(loss, expected, atol=ATOL)
    grad_w = jax.grad(
        lambda w: policy_loss(logp, old, adv, mask, aggregation=mode, token_weights=w)[0]
    )(jnp.asarray(w))
    assert not np.any(np.asarray(grad_w))
    unweighted, _ = policy_loss(logp, old, adv, mask, aggregation=mode)
    ones, _ = policy_loss(logp, old, adv, mask, aggregation=mode, token_weights=np.ones_like(w))
    assert float(unweighted) == float(ones)
