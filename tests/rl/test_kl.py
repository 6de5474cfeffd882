"""KL estimators, penalty placements and the KL controller."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlpt.rl import (
    KL_KINDS,
    KLControllerState,
    init_kl_controller,
    kl_estimate,
    kl_loss,
    kl_penalty_rewards,
    update_kl_controller,
)

# float32 logs and exps of values of order 1.
ATOL = 1e-5


def _kl_oracle(logp, ref_logp, kind):
    out = np.zeros(np.shape(logp))
    for i in np.ndindex(out.shape):
        ratio = math.exp(ref_logp[i] - logp[i])  # r = π_ref / π
        if kind == "k1":
            out[i] = -math.log(ratio)
        elif kind == "k2":
            out[i] = 0.5 * math.log(ratio) ** 2
        else:
            out[i] = ratio - 1 - math.log(ratio)
    return out


def _random_batch(seed, batch=5, length=6):
    rng = np.random.default_rng(seed)
    mask = np.zeros((batch, length), np.float32)
    mask[1] = 1.0  # full row; row 0 empty
    for b in range(2, batch):
        mask[b, : rng.integers(1, length)] = 1.0
    logp = np.log(rng.uniform(0.05, 1.0, size=mask.shape)).astype(np.float32)
    ref_logp = np.log(rng.uniform(0.05, 1.0, size=mask.shape)).astype(np.float32)
    rewards = rng.normal(size=mask.shape).astype(np.float32)
    return rewards, logp, ref_logp, mask


def test_estimators_hand_worked(variant):
    # π = 0.5, π_ref = 0.25: r = 0.5, log r = -ln 2.
    # k1 = ln 2 = 0.693147;  k2 = (ln 2)^2 / 2 = 0.240227;  k3 = -0.5 + ln 2 = 0.193147
    logp = jnp.log(jnp.array([0.5]))
    ref = jnp.log(jnp.array([0.25]))
    want = {"k1": 0.693147, "k2": 0.240227, "k3": 0.193147, "low_var_kl": 0.193147}
    for kind in KL_KINDS:
        got = variant(kl_estimate, kind=kind)(logp, ref)
        np.testing.assert_allclose(got, [want[kind]], atol=ATOL)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_estimators_match_oracle(variant, kind):
    _, logp, ref, _ = _random_batch(0)
    got = variant(kl_estimate, kind=kind)(logp, ref)
    np.testing.assert_allclose(got, _kl_oracle(logp, ref, kind), atol=ATOL)


def test_k3_and_k2_never_negative(variant):
    rng = np.random.default_rng(1)
    logp = rng.normal(scale=3.0, size=(64, 8)).astype(np.float32)
    ref = rng.normal(scale=3.0, size=(64, 8)).astype(np.float32)
    assert np.all(np.asarray(variant(kl_estimate, kind="k3")(logp, ref)) >= 0)
    assert np.all(np.asarray(variant(kl_estimate, kind="k2")(logp, ref)) >= 0)


def test_k1_and_k3_are_unbiased_in_exact_expectation(variant):
    # E_{x~π}[k(x)] over a whole vocabulary equals KL(π || π_ref) for k1 and k3.
    rng = np.random.default_rng(2)
    p = rng.dirichlet(np.ones(6))
    q = rng.dirichlet(np.ones(6))
    true_kl = float(np.sum(p * np.log(p / q)))
    logp = np.log(p).astype(np.float32)
    ref = np.log(q).astype(np.float32)
    for kind in ("k1", "k3"):
        est = np.asarray(variant(kl_estimate, kind=kind)(logp, ref))
        np.testing.assert_allclose(np.sum(p * est), true_kl, atol=ATOL)


def test_low_var_kl_is_clamped(variant):
    # log r = 30 would give exp(30) ~ 1e13; clamps to 10.
    got = variant(kl_estimate, kind="low_var_kl")(jnp.array([0.0, 0.0]), jnp.array([30.0, 0.1]))
    np.testing.assert_allclose(got, [10.0, math.exp(0.1) - 1 - 0.1], atol=ATOL)


def test_unknown_kind_lists_kinds():
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(jnp.zeros(2), jnp.zeros(2), kind="kl")


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_kl_penalty_rewards_matches_oracle(variant, kind):
    rewards, logp, ref, mask = _random_batch(3)
    logp[mask == 0] = np.nan  # padding is never read
    got = variant(kl_penalty_rewards, coef=0.1, kind=kind)(rewards, logp, ref, mask)
    want = np.where(mask > 0, rewards - 0.1 * _kl_oracle(np.nan_to_num(logp), ref, kind), 0.0)
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_kl_penalty_rewards_takes_controller_coef():
    rewards, logp, ref, mask = _random_batch(4)
    state = init_kl_controller(0.05)
    fn = jax.jit(functools.partial(kl_penalty_rewards, kind="k1"))
    got = fn(rewards, logp, ref, mask, coef=state.coef)
    want = np.where(mask > 0, rewards - 0.05 * (logp - ref), 0.0)
    np.testing.assert_allclose(got, want, atol=ATOL)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_kl_loss_matches_oracle(variant, aggregation):
    _, logp, ref, mask = _random_batch(5)
    got = variant(kl_loss, kind="k3", aggregation=aggregation)(logp, ref, mask)
    kl = _kl_oracle(logp, ref, "k3")
    if aggregation == "token_mean":
        want = kl[mask > 0].mean()
    else:
        want = np.mean([kl[b][mask[b] > 0].mean() for b in range(len(mask)) if mask[b].any()])
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_kl_loss_gradient(variant):
    # d k3 / d logp = d/dlogp [exp(ref - logp) - 1 - (ref - logp)] = 1 - r; token_mean over 2.
    logp = jnp.log(jnp.array([[0.5, 0.4]]))
    ref = jnp.log(jnp.array([[0.25, 0.4]]))
    loss_fn = variant(kl_loss, kind="k3")
    grad = jax.grad(lambda lp: loss_fn(lp, ref, jnp.ones((1, 2))))(logp)
    np.testing.assert_allclose(grad, [[(1 - 0.5) / 2, 0.0]], atol=ATOL)


def test_fixed_controller_keeps_coef(variant):
    state = init_kl_controller(0.1)
    new = variant(update_kl_controller, n_steps=64, target=6.0, horizon=1000.0, adaptive=False)(
        state, 100.0
    )
    np.testing.assert_allclose(new.coef, 0.1, rtol=1e-6)


def test_adaptive_controller_hand_worked(variant):
    fn = variant(update_kl_controller, n_steps=64, target=1.0, horizon=128.0, adaptive=True)
    state = init_kl_controller(0.1)
    assert isinstance(state, KLControllerState) and state.coef.dtype == jnp.float32
    # KL = 2 × target: e = clip(1, -0.2, 0.2) = 0.2;  β = 0.1 × (1 + 0.2 × 64/128) = 0.11
    np.testing.assert_allclose(fn(state, jnp.float32(2.0)).coef, 0.11, rtol=1e-6)
    # KL = 0.9 × target: e = -0.1;  β = 0.1 × (1 - 0.1 × 0.5) = 0.095
    np.testing.assert_allclose(fn(state, jnp.float32(0.9)).coef, 0.095, rtol=1e-6)
    # KL = 0: e = -0.2 (clipped);  β = 0.1 × 0.9 = 0.09
    np.testing.assert_allclose(fn(state, jnp.float32(0.0)).coef, 0.09, rtol=1e-6)


def test_controller_is_a_pytree():
    state = init_kl_controller(0.2)
    leaves = jax.tree_util.tree_leaves(state)
    assert len(leaves) == 1 and leaves[0].shape == ()


def test_shape_mismatch_raises():
    with pytest.raises(AssertionError, match="ref_logp"):
        kl_estimate(jnp.zeros((2, 3)), jnp.zeros((2, 4)), kind="k3")
    with pytest.raises(AssertionError, match="mask"):
        kl_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((3, 2)), kind="k3")
    with pytest.raises(AssertionError, match="rewards"):
        kl_penalty_rewards(
            jnp.zeros((2,)),
            jnp.zeros((2, 3)),
            jnp.zeros((2, 3)),
            jnp.ones((2, 3)),
            coef=0.1,
            kind="k1",
        )
