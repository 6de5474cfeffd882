"""Critic-free group advantages against hand-worked cases, identities and Python loops."""

import jax.numpy as jnp
import numpy as np
import pytest

from rlpt.rl import grpo_advantages, rloo_advantages, sequence_to_tokens

# float32 means and stds over a few values of order 1.
ATOL = 1e-5


def _random_groups(seed, num_groups=4, batch=14):
    """Shuffled (non-contiguous) group ids with uneven sizes, one group of size 1."""
    rng = np.random.default_rng(seed)
    ids = np.concatenate([[0], rng.integers(1, num_groups, size=batch - 1)])
    rng.shuffle(ids)
    rewards = rng.normal(size=batch).astype(np.float32)
    valid = (rng.random(batch) < 0.75).astype(np.float32)
    return rewards, ids.astype(np.int32), valid


def _grpo_oracle(rewards, ids, valid, scale_by_std, eps):
    out = np.zeros(len(rewards))
    for i in range(len(rewards)):
        if valid[i] == 0:
            continue
        members = [rewards[j] for j in range(len(rewards)) if ids[j] == ids[i] and valid[j] > 0]
        mean = sum(members) / len(members)
        std = (sum((m - mean) ** 2 for m in members) / len(members)) ** 0.5
        out[i] = (rewards[i] - mean) / (std + eps) if scale_by_std else rewards[i] - mean
    return out


def _rloo_oracle(rewards, ids, valid):
    out = np.zeros(len(rewards))
    for i in range(len(rewards)):
        others = [
            rewards[j] for j in range(len(rewards)) if j != i and ids[j] == ids[i] and valid[j] > 0
        ]
        if valid[i] > 0 and others:
            out[i] = rewards[i] - sum(others) / len(others)
    return out


def test_grpo_hand_worked(variant):
    # Group 0 rewards [1, 0, 1, 0]: mean 0.5, population std 0.5 -> ±1 (eps = 0).
    # Group 1 rewards [2, 2]: std 0 -> 0, not NaN, with the default eps.
    rewards = np.array([1.0, 0.0, 2.0, 1.0, 0.0, 2.0], np.float32)
    ids = np.array([0, 0, 1, 0, 0, 1], np.int32)
    adv = variant(grpo_advantages, num_groups=2, eps=0.0)(rewards[[0, 1, 3, 4]], ids[[0, 1, 3, 4]])
    np.testing.assert_allclose(adv, [1.0, -1.0, 1.0, -1.0], atol=ATOL)
    adv = variant(grpo_advantages, num_groups=2)(rewards, ids)
    np.testing.assert_allclose(adv, [1.0, -1.0, 0.0, 1.0, -1.0, 0.0], atol=ATOL)
    # Dr. GRPO drops the std: r - mean = ±0.5.
    adv = variant(grpo_advantages, num_groups=2, scale_by_std=False)(rewards, ids)
    np.testing.assert_allclose(adv, [0.5, -0.5, 0.0, 0.5, -0.5, 0.0], atol=ATOL)


def test_rloo_hand_worked(variant):
    # Rewards [1, 0, 0]: A0 = 1 - (0 + 0)/2 = 1;  A1 = A2 = 0 - (1 + 0)/2 = -0.5.
    # A lone sample in group 1 has no baseline: 0.
    adv = variant(rloo_advantages, num_groups=2)(
        jnp.array([1.0, 0.0, 0.0, 5.0]), jnp.array([0, 0, 0, 1])
    )
    np.testing.assert_allclose(adv, [1.0, -0.5, -0.5, 0.0], atol=ATOL)


@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("use_valid", [False, True])
def test_grpo_matches_oracle(variant, scale_by_std, use_valid):
    rewards, ids, valid = _random_groups(0)
    if not use_valid:
        valid = np.ones_like(valid)
    fn = variant(grpo_advantages, num_groups=4, scale_by_std=scale_by_std)
    adv = fn(rewards, ids, valid=valid) if use_valid else fn(rewards, ids)
    want = _grpo_oracle(rewards, ids, valid, scale_by_std, 1e-6)
    np.testing.assert_allclose(adv, want, atol=ATOL)


@pytest.mark.parametrize("use_valid", [False, True])
def test_rloo_matches_oracle(variant, use_valid):
    rewards, ids, valid = _random_groups(1)
    if not use_valid:
        valid = np.ones_like(valid)
    fn = variant(rloo_advantages, num_groups=4)
    adv = fn(rewards, ids, valid=valid) if use_valid else fn(rewards, ids)
    np.testing.assert_allclose(adv, _rloo_oracle(rewards, ids, valid), atol=ATOL)


def test_group_identities(variant):
    rewards, ids, valid = _random_groups(7, batch=20)
    grpo = np.asarray(variant(grpo_advantages, num_groups=4)(rewards, ids, valid=valid))
    rloo = np.asarray(variant(rloo_advantages, num_groups=4)(rewards, ids, valid=valid))
    assert np.all(grpo[valid == 0] == 0) and np.all(rloo[valid == 0] == 0)
    for g in range(4):
        members = (ids == g) & (valid > 0)
        n = members.sum()
        # GRPO and RLOO advantages both sum to zero within a group.
        np.testing.assert_allclose(grpo[members].sum(), 0.0, atol=ATOL)
        np.testing.assert_allclose(rloo[members].sum(), 0.0, atol=ATOL)
        if n >= 2:
            # RLOO = n / (n - 1) * (r - mean).
            r = rewards[members]
            np.testing.assert_allclose(rloo[members], n / (n - 1) * (r - r.mean()), atol=ATOL)


def test_excluded_sample_does_not_move_group_statistics(variant):
    # A failed sample with a wild reward changes nothing for its group mates.
    rewards = np.array([1.0, 0.0, 1000.0, 0.5], np.float32)
    ids = np.array([0, 0, 0, 0], np.int32)
    valid = np.array([1.0, 1.0, 0.0, 1.0], np.float32)
    for fn in (grpo_advantages, rloo_advantages):
        with_bad = np.asarray(variant(fn, num_groups=1)(rewards, ids, valid=valid))
        without = variant(fn, num_groups=1)(rewards[[0, 1, 3]], ids[[0, 1, 3]])
        np.testing.assert_allclose(with_bad[[0, 1, 3]], without, atol=ATOL)
        assert with_bad[2] == 0.0


def test_sequence_to_tokens(variant):
    mask = jnp.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    out = variant(sequence_to_tokens)(jnp.array([2.0, 3.0, -1.0]), mask)
    np.testing.assert_allclose(out, [[2.0, 2.0, 0.0], [0.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    assert out.dtype == jnp.float32


def test_shape_and_dtype_errors_raise():
    with pytest.raises(AssertionError, match="group_ids"):
        grpo_advantages(jnp.zeros(4), jnp.zeros(3, jnp.int32), num_groups=2)
    with pytest.raises(AssertionError, match="group_ids"):
        rloo_advantages(jnp.zeros(4), jnp.zeros(4, jnp.float32), num_groups=2)
    with pytest.raises(AssertionError, match="valid"):
        rloo_advantages(jnp.zeros(4), jnp.zeros(4, jnp.int32), num_groups=2, valid=jnp.ones(3))
    with pytest.raises(AssertionError, match="batch"):
        sequence_to_tokens(jnp.zeros(3), jnp.ones((2, 5)))
