"""The reward role: verdicts per row, counted failures, and the group-variation check."""

import math
import types

import numpy as np

from rlpt.rewards.composite import RewardConfig
from rlpt.rewards.learned import LearnedRewards
from rlpt.rewards.monitor import RewardMonitor
from rlpt.roles import RewardRole, Trajectories
from rlpt.tasks import CompositeReward, Task, VerifyResult


def _trajectories(texts):
    n = len(texts)
    task = Task(id="t", domain="d", prompt="p", difficulty=1)
    return Trajectories(
        prompt_tokens=np.ones((n, 2), np.int32), prompt_mask=np.ones((n, 2), bool),
        tasks=[task] * n, names=["d"] * n, texts=list(texts),
        tokens=np.zeros((n, 4), np.int32), logprobs=np.zeros((n, 4), np.float32),
        mask=np.ones((n, 4), np.float32), lengths=np.full(n, 4), truncated=np.zeros(n, bool),
        loss_weight=np.ones(n, np.float32), domain_index=np.zeros(n, np.int32),
        difficulty=np.ones(n, np.int32), policy_version=np.zeros(n, np.int32),
    )  # fmt: skip


def test_sandbox_failures_and_non_finite_rewards_get_zero_weight_and_are_counted():
    results = [
        VerifyResult(1.0, "correct"),
        VerifyResult(0.0, "sandbox_error", valid=False),
        VerifyResult(1.0, "correct"),
    ]
    verifier = types.SimpleNamespace(verify=lambda names, tasks, texts: list(results))
    rule = CompositeReward({"correct": 1.0})

    def rule_reward(task, text, res):
        # A reward term that breaks on one completion: its NaN must not reach the update.
        total = math.nan if text == "nan" else rule(task, text, res).total
        return types.SimpleNamespace(total=total)

    learned = LearnedRewards(RewardConfig(), RewardMonitor(), step_id=1, answer_id=2)
    role = RewardRole(verifier, rule_reward, learned)
    traj = role.judge(_trajectories(["ok", "ok", "nan"]))
    v = traj.verdicts
    assert v.rewards.tolist() == [1.0, 0.0, 0.0]
    assert v.weight.tolist() == v.valid.tolist() == [1.0, 0.0, 0.0]
    assert v.success.tolist() == [1.0, 0.0, 0.0]
    assert role.counters == {"sandbox_failures": 1, "nonfinite_rewards": 1}
    # Rows keep their verdicts through selection and concatenation.
    both = Trajectories.concat([traj.take(np.array([2, 0])), traj.take(np.array([1]))])
    assert both.texts == ["nan", "ok", "ok"]
    assert both.verdicts.rewards.tolist() == [0.0, 1.0, 0.0]
