"""Bradley-Terry and BCE against hand-worked values; ROC-AUC and pairwise accuracy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlpt.rewards import (
    binary_cross_entropy,
    bradley_terry_loss,
    pairwise_accuracy,
    roc_auc,
)

JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def _maybe_jit(fn, jit):
    return jax.jit(fn) if jit else fn


@JIT
def test_bradley_terry_hand_worked(jit):
    # softplus(-1) = log(1 + e^-1) = 0.3132617, softplus(1) = 1.3132617.
    fn = _maybe_jit(lambda c, r: bradley_terry_loss(c, r), jit)
    loss, m = fn(jnp.array([1.0, 0.0]), jnp.array([0.0, 1.0]))
    np.testing.assert_allclose(loss, (0.3132617 + 1.3132617) / 2, rtol=1e-6)
    np.testing.assert_allclose(m["accuracy"], 0.5)
    np.testing.assert_allclose(m["margin"], 0.0)


@JIT
def test_bradley_terry_margin_hand_worked(jit):
    # -log sigmoid(d - 0.5): d = 1 -> softplus(-0.5) = 0.4740770;
    # d = -1 -> softplus(1.5) = 1.7014133.
    fn = _maybe_jit(lambda c, r, m: bradley_terry_loss(c, r, m), jit)
    loss, _ = fn(jnp.array([1.0, 0.0]), jnp.array([0.0, 1.0]), jnp.array([0.5, 0.5]))
    np.testing.assert_allclose(loss, (0.4740770 + 1.7014133) / 2, rtol=1e-6)


def test_bradley_terry_weights_drop_padding_pairs_and_is_stable():
    loss, m = bradley_terry_loss(
        jnp.array([1.0, 500.0]), jnp.array([0.0, -500.0]), weights=jnp.array([1.0, 0.0])
    )
    np.testing.assert_allclose(loss, 0.3132617, rtol=1e-6)
    big, _ = bradley_terry_loss(jnp.array([-500.0]), jnp.array([500.0]))
    np.testing.assert_allclose(big, 1000.0)  # exact, no overflow to inf
    with pytest.raises(AssertionError):
        bradley_terry_loss(jnp.zeros(3), jnp.zeros(2))


@JIT
def test_binary_cross_entropy_hand_worked(jit):
    # (x=0, y=1): log 2 = 0.6931472; (x=ln 3 so p=0.75, y=0.5): -(0.5 ln .75 + 0.5 ln .25)
    # = 0.8369882; the third position is masked out.
    logits = jnp.array([[0.0, np.log(3.0), 7.0]])
    labels = jnp.array([[1.0, 0.5, 0.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    loss = _maybe_jit(binary_cross_entropy, jit)(logits, labels, mask)
    np.testing.assert_allclose(loss, (0.6931472 + 0.8369882) / 2, rtol=1e-6)


def test_binary_cross_entropy_matches_numpy_oracle():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5)) * 4
    y = rng.uniform(size=(3, 5))
    mask = rng.uniform(size=(3, 5)) > 0.3
    p = 1 / (1 + np.exp(-x))
    want = -(y * np.log(p) + (1 - y) * np.log(1 - p))[mask].mean()
    got = binary_cross_entropy(jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_roc_auc_hand_worked_with_ties():
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == 0.75
    assert roc_auc([0.5, 0.5], [0, 1]) == 0.5
    assert roc_auc([1, 2, 3], [0, 1, 1]) == 1.0
    assert np.isnan(roc_auc([1, 2], [1, 1]))


def test_pairwise_accuracy_counts_ties_as_wrong():
    assert pairwise_accuracy(np.array([1.0, 2.0, 3.0]), np.array([0.0, 2.0, 4.0])) == 1 / 3
