"""The reward role: trajectories in, one per-token reward tensor out.

Every reward term is assembled here and nowhere else. ``judge`` runs the domain
verifiers (sandboxed domains in the pool) and the rule terms (``rewards.outcome``,
``rewards.format``, ``rewards.length``) into one reward per sequence; ``assemble`` puts
it on each row's last response token of the learner's batch and adds the learned
terms (reward-model score, process rewards on step tokens) when a reward model or
process reward model was trained.

A sample the sandbox failed to run, or whose reward is not finite, is kept (shapes
stay fixed) with weight 0, and counted in ``counters``.

A multi-turn row (``Trajectories.turns``) was verified turn by turn as it was rolled
out; its verdict is its last completion's, already in ``turns.results``, and its reward
that verdict's rule reward times ``turn_discount ** (turns - 1)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import MutableMapping

import numpy as np

from rlpt.rewards.learned import LearnedRewards
from rlpt.rl.batch import RolloutBatch
from rlpt.roles.rollout import Trajectories, Verdicts
from rlpt.tasks import CompositeReward, LengthPenalty, Verifier

COUNTERS = ("sandbox_failures", "nonfinite_rewards")


def make_rule_reward(rewards_config) -> CompositeReward:
    """Verifier reward plus format and length terms, weighted by ``config.rewards``."""
    r = rewards_config
    weights = {"correct": r.outcome, "format": r.format, "length": r.length}
    terms = {"length": LengthPenalty(r.length_target_bytes, r.length_scale_bytes)}
    return CompositeReward(
        {k: v for k, v in weights.items() if v},
        terms={k: v for k, v in terms.items() if weights[k]},
    )


class RewardRole:
    """Verdicts and rewards for trajectories; ``counters`` is part of the run's state."""

    def __init__(
        self,
        verifier: Verifier,
        rule_reward: CompositeReward,
        learned: LearnedRewards,
        counters: MutableMapping[str, int] | None = None,
        *,
        turn_discount: float = 1.0,
    ):
        self.verifier = verifier
        self.rule_reward = rule_reward
        self.learned = learned
        self.counters = counters if counters is not None else dict.fromkeys(COUNTERS, 0)
        self.turn_discount = turn_discount

    def judge(self, traj: Trajectories) -> Trajectories:
        """``traj`` with its ``Verdicts``: per-sequence reward, weight, success, validity."""
        if traj.turns is None:
            results = self.verifier.verify(traj.names, traj.tasks, traj.texts)
            discount = np.ones(len(traj))
        else:
            results = list(traj.turns.results)
            discount = self.turn_discount ** (traj.turns.turns - 1.0)
        n = len(traj)
        rewards = np.zeros(n, np.float32)
        weight = np.ones(n, np.float32)
        success = np.zeros(n, np.float32)
        valid = np.ones(n, np.float32)
        for i, (task, text, res) in enumerate(zip(traj.tasks, traj.texts, results)):
            if not res.valid:
                self.counters["sandbox_failures"] += 1
                weight[i] = valid[i] = 0.0
                continue
            total = self.rule_reward(task, text, res).total
            if not math.isfinite(total):
                self.counters["nonfinite_rewards"] += 1
                weight[i] = valid[i] = 0.0
                continue
            rewards[i] = total * discount[i]
            success[i] = float(res.correct)
        verdicts = Verdicts(results=results, rewards=rewards, weight=weight, success=success,
                            valid=valid)  # fmt: skip
        return dataclasses.replace(traj, verdicts=verdicts)

    def assemble(self, batch: RolloutBatch, traj: Trajectories):
        """The learner's ``batch`` (sequence rewards on the last token) with the learned
        terms added: ``(batch, metrics, confidence)``; ``confidence`` is the per-domain
        agreement of learned and verified verdicts (None without learned terms)."""
        if not self.learned.active:
            return batch, {}, None
        v = traj.verdicts
        return self.learned.apply(batch, traj.names, v.success, v.valid)
