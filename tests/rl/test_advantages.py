"""Critic-free group advantages against hand-worked cases, identities and Python loops."""

import jax.numpy as jnp
import numpy as np
import pytest

from rlpt.rl import (
    group_varies,
    grpo_advantages,
    last_token_mask,
    process_group_advantages,
    rloo_advantages,
    sequence_to_tokens,
)

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


def _process_oracle(rewards, positions, mask, ids, valid, scale_by_std, eps):
    """Plain loops: normalise every reward entry by its group's entries, then sum to go."""
    b, t = rewards.shape
    entries = {}
    for i in range(b):
        for j in range(t):
            if valid[i] > 0 and mask[i, j] > 0 and positions[i, j] > 0:
                entries.setdefault(ids[i], []).append(rewards[i, j])
    out = np.zeros((b, t))
    for i in range(b):
        if valid[i] == 0:
            continue
        group = entries.get(ids[i], [])
        mean = sum(group) / len(group)
        std = (sum((g - mean) ** 2 for g in group) / len(group)) ** 0.5
        for j in range(t):
            if mask[i, j] == 0:
                continue
            total = 0.0
            for k in range(j, t):
                if mask[i, k] > 0 and positions[i, k] > 0:
                    total += (
                        (rewards[i, k] - mean) / (std + eps)
                        if scale_by_std
                        else (rewards[i, k] - mean)
                    )
            out[i, j] = total
    return out


def test_process_advantages_hand_worked(variant):
    # One group of two samples, three tokens each. Sample 0: step reward 1 at token 0 and
    # outcome 1 at token 2; sample 1: step reward 0 at token 0, outcome 0 at token 2.
    # Entries [1, 1, 0, 0]: mean 0.5, std 0.5 -> normalised ±1.
    rewards = np.array([[1.0, 9.0, 1.0], [0.0, 9.0, 0.0]], np.float32)  # 9: not an entry
    positions = np.array([[1, 0, 1], [1, 0, 1]], np.float32)
    mask = np.ones((2, 3), np.float32)
    ids = np.array([0, 0], np.int32)
    adv = variant(process_group_advantages, num_groups=1, eps=0.0)(rewards, positions, mask, ids)
    np.testing.assert_allclose(adv, [[2.0, 1.0, 1.0], [-2.0, -1.0, -1.0]], atol=ATOL)


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_process_advantages_match_oracle(variant, scale_by_std):
    rng = np.random.default_rng(3)
    seq_rewards, ids, valid = _random_groups(5)
    b, t = len(ids), 7
    lengths = rng.integers(1, t + 1, size=b)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    positions = (rng.random((b, t)) < 0.4).astype(np.float32)
    positions[np.arange(b), lengths - 1] = 1.0
    rewards = rng.normal(size=(b, t)).astype(np.float32)
    fn = variant(process_group_advantages, num_groups=4, scale_by_std=scale_by_std)
    got = fn(rewards, positions, mask, ids, valid=valid)
    want = _process_oracle(rewards, positions, mask, ids, valid, scale_by_std, 1e-6)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_process_advantages_with_outcome_only_are_grpo(variant):
    rewards_seq, ids, valid = _random_groups(6)
    b, t = len(ids), 5
    lengths = np.random.default_rng(0).integers(1, t + 1, size=b)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    last = np.zeros((b, t), np.float32)
    last[np.arange(b), lengths - 1] = 1.0
    got = variant(process_group_advantages, num_groups=4)(
        rewards_seq[:, None] * last, last, mask, ids, valid=valid
    )
    want = grpo_advantages(rewards_seq, ids, num_groups=4, valid=valid)
    np.testing.assert_allclose(got, np.asarray(want)[:, None] * mask, atol=ATOL)


def test_group_varies_by_hand():
    # Groups of 3: mixed; all equal; equal once the invalid sample is ignored;
    # one valid sample only; partial rewards that differ.
    rewards = np.array([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 0.5, 0.25, 0.5], np.float32)
    valid = np.array([1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1], np.float32)
    group_ids = np.arange(15) // 3
    got = group_varies(rewards, group_ids, num_groups=5, valid=valid)
    assert got.tolist() == [True, False, False, False, True]
    # Without `valid` the third group varies; groups need not be consecutive, and a group
    # with no samples does not vary.
    assert group_varies(rewards, group_ids, num_groups=5).tolist()[2] is True
    shuffled = np.array([2, 0, 0, 2, 1, 1])
    got = group_varies(np.array([1.0, 1, 1, 0, 0.5, 0.5]), shuffled, num_groups=4)
    assert got.tolist() == [False, False, True, False]
    with pytest.raises(ValueError, match="group_ids"):
        group_varies(rewards, group_ids[:-1], num_groups=5)


def test_last_token_mask_by_hand():
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 1, 1]], jnp.float32)
    want = [[0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1]]
    got = last_token_mask(mask)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), want)
