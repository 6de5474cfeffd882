"""GAE and whitening against hand-worked cases, identities and a plain-Python oracle."""

import jax.numpy as jnp
import numpy as np
import pytest

from rlpt.rl import gae, whiten

# float32 accumulations over a handful of steps: a few ulps of values of order 1.
ATOL = 1e-5


def _random_batch(seed, batch=6, length=7, with_holes=True):
    """Random rewards/values and a mask with an empty row, a full row and ragged rows."""
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(batch, length)).astype(np.float32)
    values = rng.normal(size=(batch, length)).astype(np.float32)
    mask = np.zeros((batch, length), np.float32)
    mask[1] = 1.0  # a row that fills the whole length; row 0 stays empty
    for b in range(2, batch):
        mask[b, : rng.integers(1, length)] = 1.0
    if with_holes:
        mask[batch - 1] = (rng.random(length) < 0.6).astype(np.float32)
    return rewards, values, mask


def _gae_oracle(rewards, values, mask, gamma, lam, dones=None, last_values=None):
    """Walks each row's list of real positions; a done anywhere from a real step up to
    (not including) the next real step cuts the chain."""
    batch, length = rewards.shape
    dones = np.zeros((batch, length)) if dones is None else dones
    last_values = np.zeros(batch) if last_values is None else last_values
    adv = np.zeros((batch, length))
    for b in range(batch):
        real = [t for t in range(length) if mask[b, t] > 0]
        next_adv = None
        for k in range(len(real) - 1, -1, -1):
            i = real[k]
            j = real[k + 1] if k + 1 < len(real) else length
            cut = any(dones[b, s] > 0 for s in range(i, j))
            if cut:
                bootstrap, carried = 0.0, 0.0
            elif j < length:
                bootstrap, carried = values[b, j], next_adv
            else:
                bootstrap, carried = last_values[b], 0.0
            delta = rewards[b, i] + gamma * bootstrap - values[b, i]
            adv[b, i] = delta + gamma * lam * carried
            next_adv = adv[b, i]
    returns = np.where(mask > 0, adv + values, 0.0)
    return adv, returns


def test_hand_worked_gamma_lambda(variant):
    # r = [0, 0, 1], V = 0.5 everywhere, γ = 0.9, λ = 0.5, value after the end is 0:
    # δ2 = 1 - 0.5 = 0.5;  δ1 = δ0 = 0 + 0.9*0.5 - 0.5 = -0.05
    # A2 = 0.5;  A1 = -0.05 + 0.45*0.5 = 0.175;  A0 = -0.05 + 0.45*0.175 = 0.02875
    rewards = jnp.array([[0.0, 0.0, 1.0]])
    values = jnp.full((1, 3), 0.5)
    mask = jnp.ones((1, 3))
    adv, ret = variant(gae, gamma=0.9, lam=0.5)(rewards, values, mask)
    np.testing.assert_allclose(adv, [[0.02875, 0.175, 0.5]], atol=ATOL)
    np.testing.assert_allclose(ret, [[0.52875, 0.675, 1.0]], atol=ATOL)


def test_hole_in_mask_is_skipped(variant):
    # mask [1, 0, 1]: the middle position is deleted, garbage there is never read.
    # γ = λ = 1: A2 = 1 - 0.5 = 0.5;  A0 = 0 + 0.5 - 0.5 + 0.5 = 0.5.
    rewards = jnp.array([[0.0, 99.0, 1.0]])
    values = jnp.array([[0.5, jnp.nan, 0.5]])
    mask = jnp.array([[1.0, 0.0, 1.0]])
    adv, ret = variant(gae, gamma=1.0, lam=1.0)(rewards, values, mask)
    np.testing.assert_allclose(adv, [[0.5, 0.0, 0.5]], atol=ATOL)
    np.testing.assert_allclose(ret, [[1.0, 0.0, 1.0]], atol=ATOL)


def test_dones_and_last_values_hand_worked(variant):
    # r = 1 each step, V = 0, γ = λ = 1, done after step 1, bootstrap 2 after step 3:
    # A3 = 1 + 2 = 3;  A2 = 1 + A3 = 4;  A1 = 1 (episode ends);  A0 = 1 + A1 = 2.
    rewards = jnp.ones((1, 4))
    values = jnp.zeros((1, 4))
    mask = jnp.ones((1, 4))
    dones = jnp.array([[0.0, 1.0, 0.0, 0.0]])
    adv, _ = variant(gae, gamma=1.0, lam=1.0)(
        rewards, values, mask, dones=dones, last_values=jnp.array([2.0])
    )
    np.testing.assert_allclose(adv, [[2.0, 1.0, 4.0, 3.0]], atol=ATOL)
    # A done on the final step stops the bootstrap: A3 = 1, A2 = 2.
    dones = jnp.array([[0.0, 1.0, 0.0, 1.0]])
    adv, _ = variant(gae, gamma=1.0, lam=1.0)(
        rewards, values, mask, dones=dones, last_values=jnp.array([2.0])
    )
    np.testing.assert_allclose(adv, [[2.0, 1.0, 2.0, 1.0]], atol=ATOL)


def test_last_values_pass_through_trailing_padding(variant):
    # The bootstrap reaches the last real step across padding: A1 = 0 + 0.5*4 - 1 = 1.
    rewards = jnp.zeros((1, 3))
    values = jnp.array([[0.0, 1.0, 7.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    adv, _ = variant(gae, gamma=0.5, lam=1.0)(rewards, values, mask, last_values=jnp.array([4.0]))
    # A0 = 0 + 0.5*1 - 0 + 0.5*1 = 1.
    np.testing.assert_allclose(adv, [[1.0, 1.0, 0.0]], atol=ATOL)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.99, 0.0)])
def test_matches_oracle(variant, gamma, lam):
    rewards, values, mask = _random_batch(0)
    adv, ret = variant(gae, gamma=gamma, lam=lam)(rewards, values, mask)
    want_adv, want_ret = _gae_oracle(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(adv, want_adv, atol=ATOL)
    np.testing.assert_allclose(ret, want_ret, atol=ATOL)
    np.testing.assert_array_equal(np.asarray(adv)[0], 0.0)  # the empty row


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_oracle_with_dones(variant, seed):
    rewards, values, mask = _random_batch(seed)
    rng = np.random.default_rng(seed + 100)
    dones = (rng.random(mask.shape) < 0.25).astype(np.float32)
    last_values = rng.normal(size=mask.shape[0]).astype(np.float32)
    adv, ret = variant(gae, gamma=0.9, lam=0.8)(
        rewards, values, mask, dones=dones, last_values=last_values
    )
    want_adv, want_ret = _gae_oracle(rewards, values, mask, 0.9, 0.8, dones, last_values)
    np.testing.assert_allclose(adv, want_adv, atol=ATOL)
    np.testing.assert_allclose(ret, want_ret, atol=ATOL)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_lambda_one_is_return_to_go_minus_value(variant, gamma):
    rewards, values, mask = _random_batch(3, with_holes=False)
    adv, ret = variant(gae, gamma=gamma, lam=1.0)(rewards, values, mask)
    # Discounted return-to-go over the real prefix, computed forwards with powers.
    for b in range(mask.shape[0]):
        n = int(mask[b].sum())
        for t in range(n):
            g = sum(gamma ** (k - t) * rewards[b, k] for k in range(t, n))
            np.testing.assert_allclose(adv[b, t], g - values[b, t], atol=ATOL)
            np.testing.assert_allclose(ret[b, t], g, atol=ATOL)


def test_lambda_zero_is_td_error(variant):
    rewards, values, mask = _random_batch(4, with_holes=False)
    adv, _ = variant(gae, gamma=0.9, lam=0.0)(rewards, values, mask)
    next_values = np.concatenate([values[:, 1:], np.zeros((values.shape[0], 1))], axis=1)
    next_values = next_values * np.concatenate([mask[:, 1:], np.zeros((mask.shape[0], 1))], axis=1)
    td = (rewards + 0.9 * next_values - values) * mask
    np.testing.assert_allclose(adv, td, atol=ATOL)


def test_bfloat16_inputs_compute_in_float32(variant):
    rewards, values, mask = _random_batch(5)
    adv, ret = variant(gae, gamma=0.9, lam=0.9)(
        jnp.asarray(rewards, jnp.bfloat16), jnp.asarray(values, jnp.bfloat16), mask
    )
    assert adv.dtype == jnp.float32 and ret.dtype == jnp.float32
    want, _ = _gae_oracle(
        np.asarray(jnp.asarray(rewards, jnp.bfloat16), np.float32),
        np.asarray(jnp.asarray(values, jnp.bfloat16), np.float32),
        mask,
        0.9,
        0.9,
    )
    np.testing.assert_allclose(adv, want, atol=ATOL)


def test_shape_mismatch_raises():
    with pytest.raises(AssertionError, match="values"):
        gae(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.ones((2, 3)), gamma=1.0, lam=1.0)
    with pytest.raises(AssertionError, match="last_values"):
        gae(
            jnp.zeros((2, 3)),
            jnp.zeros((2, 3)),
            jnp.ones((2, 3)),
            gamma=1.0,
            lam=1.0,
            last_values=jnp.zeros((3,)),
        )


def _whiten_oracle(x, mask, shift_mean, eps):
    picked = np.array([x[i] for i in np.ndindex(x.shape) if mask[i] > 0], np.float64)
    mean, var = picked.mean(), picked.var()
    out = (x - mean) / np.sqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return np.where(mask > 0, out, 0.0)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_oracle(variant, shift_mean):
    x, _, mask = _random_batch(6)
    x = 3.0 * x + 2.0
    out = variant(whiten, shift_mean=shift_mean)(x, mask)
    np.testing.assert_allclose(out, _whiten_oracle(x, mask, shift_mean, 1e-8), atol=ATOL)
    if shift_mean:
        real = np.asarray(out)[mask > 0]
        np.testing.assert_allclose(real.mean(), 0.0, atol=ATOL)
        np.testing.assert_allclose(real.std(), 1.0, atol=ATOL)


def test_whiten_hand_worked_and_empty(variant):
    # Real entries [1, 3]: mean 2, population var 1, so [-1, 1]; padding (even NaN) -> 0.
    out = variant(whiten, eps=0.0)(jnp.array([[1.0, jnp.nan, 3.0]]), jnp.array([[1.0, 0.0, 1.0]]))
    np.testing.assert_allclose(out, [[-1.0, 0.0, 1.0]], atol=ATOL)
    out = variant(whiten)(jnp.ones((2, 3)), jnp.zeros((2, 3)))
    np.testing.assert_array_equal(out, 0.0)
