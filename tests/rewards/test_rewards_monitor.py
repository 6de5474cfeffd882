"""The reward-hacking monitor and the per-domain confidence it gives the curriculum."""

import numpy as np
import pytest

from rlpt.data.curriculum import Feedback
from rlpt.rewards import MonitorConfig, RewardMonitor


def test_agreeing_reward_is_trusted_and_diverging_one_is_flagged():
    mon = RewardMonitor(MonitorConfig(momentum=0.5, min_samples=8))
    rng = np.random.default_rng(0)
    for _ in range(4):
        verified = rng.integers(0, 2, size=16).astype(float)
        learned_math = np.where(verified > 0, 2.0, -2.0)  # agrees with the verifier
        # The policy found a hack in "code": learned reward high, verifier says wrong.
        learned_code = np.full(16, 3.0)
        verified_code = np.zeros(16)
        mon.update(["math"] * 16 + ["code"] * 16,
                   np.concatenate([learned_math, learned_code]),
                   np.concatenate([verified, verified_code]))  # fmt: skip
    metrics = mon.metrics()
    assert metrics["monitor/math/agreement"] == 1.0 and metrics["monitor/math/diverged"] == 0.0
    assert metrics["monitor/code/agreement"] == 0.0 and metrics["monitor/code/diverged"] == 1.0
    assert metrics["monitor/code/gap"] > 0.9
    conf = mon.confidence()
    assert conf == {"math": 1.0, "code": 0.0}
    Feedback(domain_index=[0], success=[1], confidence=conf)  # the curriculum's contract


def test_monitor_waits_for_enough_samples_and_drops_invalid_ones():
    mon = RewardMonitor(MonitorConfig(min_samples=10))
    mon.update(["a"] * 4, np.array([5.0, 5.0, np.nan, 5.0]), np.zeros(4))
    assert not mon.diverged("a") and mon.stats["a"].samples == 3
    mon.update(["a"] * 8, np.full(8, 5.0), np.zeros(8), valid=np.array([True] * 7 + [False]))
    assert mon.diverged("a") and mon.stats["a"].samples == 10
    with pytest.raises(ValueError, match="same length"):
        mon.update(["a"], np.zeros(2), np.zeros(2))
