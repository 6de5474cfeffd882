"""The curriculum's weight, difficulty and loss-weight updates, checked by hand on small cases."""

import json
import math

import ml_collections
import numpy as np
import pytest

from rlpt.data import (
    Curriculum,
    CurriculumConfig,
    DifficultyConfig,
    Feedback,
    make_curriculum,
)


def _softmax(x):
    z = np.exp(np.asarray(x) - np.max(x))
    return z / z.sum()


def test_uniform_and_fixed_with_floor():
    cur = Curriculum(["a", "b", "c", "d"], CurriculumConfig(strategy="uniform", floor=0.05))
    np.testing.assert_allclose(cur.weights(), [0.25] * 4)
    cfg = CurriculumConfig(
        strategy="fixed", floor=0.05, fixed_weights={"a": 0.7, "b": 0.3, "c": 0.0, "d": 0.0}
    )
    # floor + (1 - K floor) w = 0.05 + 0.8 w
    np.testing.assert_allclose(
        Curriculum(["a", "b", "c", "d"], cfg).weights(), [0.61, 0.29, 0.05, 0.05]
    )


def test_schedule_changes_at_given_steps():
    cfg = make_curriculum(
        {"strategy": "schedule", "floor": 0.0, "schedule": [(0, {"a": 1.0}), (2, {"b": 1.0})]},
        ["a", "b"],
    )
    seen = []
    for _ in range(4):
        seen.append(cfg.weights().tolist())
        cfg.update(Feedback([0], [1.0]))
    assert seen == [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]


def test_bandit_abs_advantage_hand_computed():
    cfg = CurriculumConfig(
        strategy="bandit", signal="abs_advantage", temperature=0.5, exploration=0.1, floor=0.0
    )
    cur = Curriculum(["a", "b"], cfg)
    cur.update(Feedback([0, 0, 1], [1, 0, 1], abs_advantage=[0.2, 0.4, 0.1]))
    # First observations replace the zero start: |A| = [0.3, 0.1], normalised [1, 1/3].
    g = np.array([1.0, 1.0 / 3.0])
    bonus = np.sqrt(2 * math.log(3 + 1) / (np.array([2.0, 1.0]) + 1))
    np.testing.assert_allclose(cur.weights(), _softmax((g + 0.1 * bonus) / 0.5), rtol=1e-12)


def test_bandit_progress_resists_the_noise_trap():
    # A noise domain at success 0.5 has the largest |advantage| but no learning progress.
    rng = np.random.default_rng(0)
    cfgs = {
        s: CurriculumConfig(strategy="bandit", signal=s, floor=0.0)
        for s in ("abs_advantage", "progress")
    }
    share = {}
    for signal, cfg in cfgs.items():
        cur = Curriculum(["noise", "learn"], cfg)
        p_learn = 0.05
        for _ in range(100):
            d = np.repeat([0, 1], 32)
            succ = np.concatenate([rng.random(32) < 0.5, rng.random(32) < p_learn]).astype(float)
            adv = np.abs(succ - np.repeat([succ[:32].mean(), succ[32:].mean()], 32))
            cur.update(Feedback(d, succ, abs_advantage=adv, difficulty=cur.level[d]))
            p_learn += 0.008
        share[signal] = cur.weights()[0]
    assert share["abs_advantage"] > 0.5
    assert share["progress"] < 0.25


def test_exp3_update_hand_computed():
    cfg = CurriculumConfig(strategy="exp3", signal="abs_advantage", floor=0.0, exp3_smoothing=0.9)
    cur = Curriculum(["a", "b"], cfg)
    # eps_1 = min(1/2, sqrt(ln 2 / 2)) = 1/2: the first distribution is uniform.
    p0 = cur.weights()
    np.testing.assert_allclose(p0, [0.5, 0.5])
    cur.last_probs = p0
    cur.update(Feedback([0, 0], [1, 0], abs_advantage=[0.5, 0.5]))
    # Only domain a was drawn; its normalised reward is 1: W_a = 0.9 * 0 + 0.1 * 1 / 0.5.
    np.testing.assert_allclose(cur.exp3_w, [0.2, 0.0])
    eps_prev, eps = 0.5, math.sqrt(math.log(2) / (2 * 2))
    expected = (1 - 2 * eps) * _softmax(eps_prev * np.array([0.2, 0.0])) + eps
    np.testing.assert_allclose(cur.weights(), expected, rtol=1e-12)


def test_confidence_scales_the_learning_signal():
    cfg = CurriculumConfig(
        strategy="bandit", signal="abs_advantage", temperature=0.5, exploration=0.0, floor=0.0
    )
    cur = Curriculum(["a", "b"], cfg)
    cur.update(Feedback([0, 1], [1, 1], abs_advantage=[0.3, 0.3], confidence={"a": 0.5}))
    np.testing.assert_allclose(cur.weights(), _softmax(np.array([0.5, 1.0]) / 0.5))
    with pytest.raises(ValueError, match="confidence of domain 'b'"):
        cur.update(Feedback([0], [1], abs_advantage=[0.1], confidence={"b": 1.5}))
    with pytest.raises(ValueError, match="unknown domain 'zzz'"):
        cur.update(Feedback([0], [1], abs_advantage=[0.1], confidence={"zzz": 0.5}))


def test_size_prior_slows_a_small_domain():
    cfg = CurriculumConfig(strategy="bandit", floor=0.0, size_power=1.0)
    cur = Curriculum(["small", "big"], cfg, sizes=[10, math.inf])
    np.testing.assert_allclose(cur.weights(), [0.5, 0.5])
    cur.record_draws(np.zeros(20, np.int64))  # two epochs of the small domain: factor 1/3
    np.testing.assert_allclose(cur.weights(), [0.25, 0.75])


def test_floor_respected_under_extreme_signals():
    k = 50
    cfg = CurriculumConfig(strategy="bandit", signal="abs_advantage", temperature=0.01, floor=0.004)
    cur = Curriculum([f"d{i}" for i in range(k)], cfg)
    cur.update(Feedback(np.arange(k), np.ones(k), abs_advantage=np.linspace(0, 1, k) ** 8))
    p = cur.weights()
    assert p.min() >= 0.004 - 1e-12
    np.testing.assert_allclose(p.sum(), 1.0)
    with pytest.raises(ValueError, match="floor"):
        Curriculum([f"d{i}" for i in range(k)], CurriculumConfig(floor=0.05))


def test_difficulty_moves_at_thresholds():
    cfg = CurriculumConfig(
        strategy="uniform", difficulty=DifficultyConfig(start=1, upper=0.75, lower=0.25, window=4)
    )
    cur = Curriculum(["a", "b"], cfg, max_levels=[3, 1])
    cur.update(Feedback([0, 0, 0], [1, 1, 1], difficulty=[1, 1, 1]))
    assert cur.level.tolist() == [1, 1]  # block not full yet
    cur.update(Feedback([0, 1, 1, 1, 1], [1, 1, 1, 1, 1], difficulty=[1, 1, 1, 1, 1]))
    assert cur.level.tolist() == [2, 1]  # 4/4 > 0.75; b is capped at its max level
    cur.update(Feedback([0] * 4, [1, 1, 1, 0], difficulty=[2] * 4))
    assert cur.level.tolist() == [2, 1]  # 0.75 is not above 0.75
    # Samples drawn at a stale level do not count.
    cur.update(Feedback([0] * 4, [0] * 4, difficulty=[1] * 4))
    assert cur.level.tolist() == [2, 1]
    cur.update(Feedback([0] * 4, [0, 0, 0, 1], difficulty=[2] * 4))
    assert cur.level.tolist() == [2, 1]  # 0.25 is not below 0.25
    cur.update(Feedback([0] * 4, [0, 0, 0, 0], difficulty=[2] * 4))
    assert cur.level.tolist() == [1, 1]
    assert cur.metrics()["curriculum/a/difficulty"] == 1


def test_review_samples_move_neither_the_signal_nor_the_level():
    cfg = CurriculumConfig(
        strategy="uniform", success_alpha=0.5,
        difficulty=DifficultyConfig(start=2, upper=0.75, lower=0.25, window=4, review=0.25),
    )  # fmt: skip
    cur = Curriculum(["a"], cfg, max_levels=[3])
    # Level 2: four samples at the level (3 of 4 right), four review samples at level 1
    # (all wrong). Only the first four count: success 0.75, so the level holds (0.75 is
    # not above 0.75) and the first EMA value is their mean.
    cur.update(Feedback([0] * 8, [1, 1, 1, 0, 0, 0, 0, 0], difficulty=[2] * 4 + [1] * 4))
    assert cur.level.tolist() == [2]
    assert cur.success.tolist() == [0.75]
    assert cur.seen.tolist() == [4.0]
    # Review samples all right, those at the level all wrong: the level falls.
    cur.update(Feedback([0] * 8, [0] * 4 + [1] * 4, difficulty=[2] * 4 + [1] * 4))
    assert cur.level.tolist() == [1]
    with pytest.raises(ValueError, match="review"):
        DifficultyConfig(review=1.0)


def test_lagging_loss_weights():
    cfg = CurriculumConfig(strategy="uniform", floor=0.0, loss_weighting="lagging")
    cur = Curriculum(["a", "b"], cfg)
    cur.update(Feedback([0, 1], [1.0, 0.0]))
    # lag = [0, 1], mean lag under p = [.5, .5] is 0.5
    np.testing.assert_allclose(cur.loss_weights(np.array([0.5, 0.5])), np.exp([-0.5, 0.5]))


def test_ema_counts_samples():
    cfg = CurriculumConfig(strategy="uniform", success_alpha=0.5)
    cur = Curriculum(["a"], cfg)
    cur.update(Feedback([0, 0], [1.0, 1.0]))
    cur.update(Feedback([0, 0], [0.0, 0.0]))
    # Two samples at rate 0.5 keep (1 - 0.5)^2 of the old value.
    assert cur.success[0] == pytest.approx(0.25)


def test_state_round_trips_through_json():
    cfg = CurriculumConfig(strategy="exp3", signal="progress")
    a = Curriculum(["a", "b", "c"], cfg, max_levels=[3, 3, 3], sizes=[5, 100, math.inf])
    rng = np.random.default_rng(1)
    for _ in range(5):
        d, _ = a.sample(6, rng)
        a.record_draws(d)
        a.update(Feedback(d, rng.random(6) < 0.5, difficulty=a.level[d]))
    b = Curriculum(["a", "b", "c"], cfg, max_levels=[3, 3, 3], sizes=[5, 100, math.inf])
    b.set_state(json.loads(json.dumps(a.get_state())))
    np.testing.assert_array_equal(a.weights(), b.weights())
    assert a.metrics() == b.metrics()


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="sum to 1"):
        make_curriculum({"strategy": "fixed", "fixed_weights": {"a": 0.5, "b": 0.4}}, ["a", "b"])
    with pytest.raises(ValueError, match="domain 'b'"):
        make_curriculum({"strategy": "fixed", "fixed_weights": {"a": 1.5, "b": -0.5}}, ["a", "b"])
    with pytest.raises(ValueError, match="unknown domain"):
        make_curriculum({"strategy": "fixed", "fixed_weights": {"a": 0.5, "x": 0.5}}, ["a", "b"])
    with pytest.raises(ValueError, match="schedule entry at step 5"):
        make_curriculum(
            {"strategy": "schedule", "schedule": [(0, {"a": 1.0}), (5, {"a": 0.2})]}, ["a", "b"]
        )
    with pytest.raises(ValueError, match="strategy"):
        make_curriculum({"strategy": "greedy"}, ["a"])
    with pytest.raises(ValueError, match="unknown curriculum config"):
        make_curriculum({"temprature": 1.0}, ["a"])


def test_make_curriculum_from_config_dict():
    config = ml_collections.ConfigDict(
        {
            "strategy": "bandit",
            "temperature": 0.3,
            "floor": 0.1,
            "difficulty": {"upper": 0.9, "lower": 0.1, "window": 8, "start": 2},
        }
    )
    cur = make_curriculum(config, ["a", "b"], max_levels=[3, 1])
    assert cur.config.temperature == 0.3
    assert cur.config.difficulty.window == 8
    assert cur.level.tolist() == [2, 1]  # start is capped at each domain's max
