"""Per-token reward assembly, process aggregation, running normalisation, non-finite guard."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlpt.rewards import (
    RewardConfig,
    aggregate_process_rewards,
    assemble_rewards,
    guard_non_finite,
    init_norm_state,
    update_running_stats,
)
from rlpt.rl import PPOConfig, compute_advantages, init_kl_controller, new_rollout_batch

MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)
STEPS = np.array([[1, 0, 1, 0], [0, 1, 0, 1]], np.float32)
SCORES = np.array([[0.2, 9.0, 0.8, 9.0], [9.0, 0.6, 9.0, 0.3]], np.float32)


def test_min_aggregation_returns_are_the_minimum_over_future_steps():
    placed = np.asarray(aggregate_process_rewards(jnp.asarray(SCORES), jnp.asarray(STEPS), "min"))
    # Row 0: m = (0.2, 0.8): place 0.2 - 0.8 and 0.8. Row 1: m = (0.3, 0.3): place 0 and 0.3.
    np.testing.assert_allclose(placed, [[-0.6, 0, 0.8, 0], [0, 0, 0, 0.3]], atol=1e-6)
    returns = np.cumsum(placed[:, ::-1], axis=1)[:, ::-1]
    np.testing.assert_allclose(returns[0, [0, 2]], [0.2, 0.8], atol=1e-6)
    np.testing.assert_allclose(returns[1, [1, 3]], [0.3, 0.3], atol=1e-6)


def test_sum_aggregation_keeps_each_step_reward():
    placed = np.asarray(aggregate_process_rewards(jnp.asarray(SCORES), jnp.asarray(STEPS), "sum"))
    np.testing.assert_allclose(placed, [[0.2, 0, 0.8, 0], [0, 0.6, 0, 0.3]], atol=1e-6)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate_process_rewards(jnp.asarray(SCORES), jnp.asarray(STEPS), "mean")


def test_min_aggregation_matches_a_numpy_loop():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(4, 9)).astype(np.float32)
    steps = (rng.uniform(size=(4, 9)) < 0.4).astype(np.float32)
    placed = np.asarray(aggregate_process_rewards(jnp.asarray(scores), jnp.asarray(steps), "min"))
    for b in range(4):
        idx = np.flatnonzero(steps[b])
        for k, t in enumerate(idx):
            assert np.isclose(placed[b, t:].sum(), scores[b, idx[k:]].min(), atol=1e-5)


def test_assembly_per_token_against_a_hand_built_array():
    cfg = RewardConfig(
        outcome=1.0, process=2.0, format=0.1, length=1.0, process_aggregation="min",
        normalize=False,
    )  # fmt: skip
    rewards, _, metrics = jax.jit(
        lambda n: assemble_rewards(
            cfg,
            n,
            jnp.asarray(MASK),
            outcome=jnp.array([1.0, 0.0]),
            process=jnp.asarray(SCORES),
            step_mask=jnp.asarray(STEPS),
            format=jnp.array([1.0, 0.0]),
            length=jnp.array([-0.5, -0.2]),
        )  # fmt: skip
    )(init_norm_state())
    # Row 0: process 2 * (-0.6, 0.8) at its steps; outcome 1 + format 0.1 - length 0.5 at the
    # last real token (column 2). Row 1: process 2 * (0, 0.3), -0.2 at column 3.
    expected = np.array([[-1.2, 0, 1.6 + 1 + 0.1 - 0.5, 0], [0, 0, 0, 0.6 - 0.2]], np.float32)
    np.testing.assert_allclose(np.asarray(rewards), expected, atol=1e-6)
    np.testing.assert_allclose(metrics["reward/outcome"], 0.5)
    np.testing.assert_allclose(metrics["reward/format"], 0.05)
    np.testing.assert_allclose(metrics["reward/length"], -0.35)
    np.testing.assert_allclose(metrics["reward/process"], (0.4 + 0.6) / 2, atol=1e-6)
    np.testing.assert_allclose(metrics["reward/total"], expected.sum() / 2, atol=1e-6)
    assert "reward/reward_model" not in metrics and float(metrics["reward/non_finite"]) == 0


def test_learned_rewards_are_clipped_and_kl_is_only_logged():
    cfg = RewardConfig(outcome=0.0, reward_model=1.0, kl=0.5, clip=0.5, normalize=False)
    kl = jnp.full(MASK.shape, 0.1) * MASK
    rewards, _, metrics = assemble_rewards(
        cfg, init_norm_state(), jnp.asarray(MASK), reward_model=jnp.array([3.0, -3.0]), kl=kl
    )
    np.testing.assert_allclose(np.asarray(rewards), [[0, 0, 0.5, 0], [0, 0, 0, -0.5]])
    np.testing.assert_allclose(metrics["reward/kl"], -0.5 * 0.1 * 7 / 2, rtol=1e-6)


def test_running_normalisation_blends_batches_and_ignores_empty_ones():
    stats = init_norm_state().reward_model
    stats = update_running_stats(stats, jnp.array([1.0, 2.0, 3.0]), jnp.ones(3), momentum=0.5)
    np.testing.assert_allclose([stats.mean, stats.var], [2.0, 2 / 3], rtol=1e-6)
    stats = update_running_stats(stats, jnp.array([5.0, 5.0, 99.0]), jnp.array([1, 1, 0]),
                                 momentum=0.5)  # fmt: skip
    # An equal mixture of (mean 2, var 2/3) and (mean 5, var 0): var = 1/3 + 9/4.
    np.testing.assert_allclose([stats.mean, stats.var], [3.5, 1 / 3 + 9 / 4], rtol=1e-6)
    same = update_running_stats(stats, jnp.ones(3), jnp.zeros(3), momentum=0.5)
    np.testing.assert_allclose([same.mean, same.var], [stats.mean, stats.var])


def test_normalised_reward_model_scores_are_standardised():
    cfg = RewardConfig(outcome=0.0, reward_model=1.0, norm_momentum=0.9)
    rewards, norm, _ = assemble_rewards(
        cfg, init_norm_state(), jnp.asarray(MASK), reward_model=jnp.array([10.0, 12.0])
    )
    np.testing.assert_allclose(norm.reward_model.mean, 11.0)
    np.testing.assert_allclose(np.asarray(rewards).sum(axis=1), [-1.0, 1.0], rtol=1e-5)
    assert float(norm.reward_model.count) == 1.0


def test_guard_replaces_non_finite_values_and_counts_them():
    clean, n = guard_non_finite(
        jnp.array([1.0, jnp.nan, jnp.inf, -jnp.inf]), jnp.array([1, 1, 1, 0])
    )
    np.testing.assert_array_equal(np.asarray(clean), [1.0, 0, 0, 0])
    assert float(n) == 2  # the masked -inf is not counted


def test_non_finite_learned_rewards_never_reach_the_ppo_update():
    cfg = RewardConfig(outcome=1.0, reward_model=1.0, process=1.0)
    rewards, norm, metrics = assemble_rewards(
        cfg, init_norm_state(), jnp.asarray(MASK), outcome=jnp.array([1.0, 0.0]),
        reward_model=jnp.array([jnp.nan, 2.0]),
        process=jnp.asarray(SCORES).at[1, 3].set(jnp.inf), step_mask=jnp.asarray(STEPS),
    )  # fmt: skip
    assert np.isfinite(np.asarray(rewards)).all()
    assert float(metrics["reward/non_finite"]) == 2
    assert np.isfinite(float(norm.reward_model.mean)) and np.isfinite(float(norm.process.var))
    batch = new_rollout_batch(
        np.ones((2, 2), np.int32), np.ones((2, 2), bool), np.ones((2, 4), np.int32), MASK
    ).replace(rewards=rewards)
    ppo = PPOConfig(estimator="grpo", num_groups=1)
    out = compute_advantages(
        ppo, init_kl_controller(0.0), batch.replace(group_id=jnp.zeros(2, jnp.int32))
    )
    assert np.isfinite(np.asarray(out.advantages)).all()


def test_config_validation():
    with pytest.raises(ValueError, match="process_aggregation"):
        RewardConfig(process_aggregation="max")
    with pytest.raises(ValueError, match="clip"):
        dataclasses.replace(RewardConfig(), clip=0.0)
    with pytest.raises(ValueError, match="step_mask"):
        assemble_rewards(
            RewardConfig(), init_norm_state(), jnp.asarray(MASK), process=jnp.asarray(SCORES)
        )
