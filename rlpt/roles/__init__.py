"""The roles a post-training run is assembled from, each behind a narrow interface.

- rollout (``RolloutWorker``): prompts -> ``Trajectories`` (sampled ids, behaviour
  log-probs, masks, policy version); ``MultiTurnRolloutWorker`` (``rlpt.roles.multiturn``)
  retries failed answers with the verifier's feedback in the context;
- reward (``RewardRole``): trajectories -> verdicts and one per-token reward tensor;
- learner (``PPOLearner``): batches -> a new train state.

Evaluation is ``rlpt.eval.Evaluator``; checkpointing is ``rlpt.checkpoint``. The
trainer (``rlpt.trainers.post_train``) wires them together; none of them imports it.
"""

from rlpt.roles.learner import PPOLearner
from rlpt.roles.multiturn import MultiTurnRolloutWorker
from rlpt.roles.reward import COUNTERS, RewardRole, make_rule_reward
from rlpt.roles.rollout import (
    ChunkedRolloutWorker,
    RolloutWorker,
    Trajectories,
    TurnRecord,
    Verdicts,
)

__all__ = [
    "COUNTERS",
    "ChunkedRolloutWorker",
    "MultiTurnRolloutWorker",
    "PPOLearner",
    "RewardRole",
    "RolloutWorker",
    "Trajectories",
    "TurnRecord",
    "Verdicts",
    "make_rule_reward",
]
