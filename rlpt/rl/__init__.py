"""Pure RL maths over response tokens: GAE, critic-free advantages, losses, KL."""

from rlpt.rl.advantages import (
    grpo_advantages,
    process_group_advantages,
    rloo_advantages,
    sequence_to_tokens,
)
from rlpt.rl.batch import RolloutBatch, new_rollout_batch
from rlpt.rl.gae import gae, whiten
from rlpt.rl.kl import (
    KL_KINDS,
    KLControllerState,
    init_kl_controller,
    kl_estimate,
    kl_loss,
    kl_penalty_rewards,
    update_kl_controller,
)
from rlpt.rl.losses import (
    AGGREGATION_MODES,
    aggregate,
    entropy_from_logits,
    imitation_loss,
    masked_mean,
    policy_loss,
    token_entropy,
    value_loss,
)
from rlpt.rl.ppo import (
    PPOConfig,
    PPOTrainer,
    TrainState,
    check_batch_layout,
    compute_advantages,
    init_train_state,
    learning_rate_schedule,
    ppo_update,
    response_log_probs,
    score_rollout,
)

__all__ = [
    "PPOConfig",
    "PPOTrainer",
    "RolloutBatch",
    "TrainState",
    "check_batch_layout",
    "compute_advantages",
    "init_train_state",
    "learning_rate_schedule",
    "new_rollout_batch",
    "ppo_update",
    "response_log_probs",
    "score_rollout",
    "AGGREGATION_MODES",
    "KL_KINDS",
    "KLControllerState",
    "aggregate",
    "entropy_from_logits",
    "gae",
    "grpo_advantages",
    "imitation_loss",
    "process_group_advantages",
    "init_kl_controller",
    "kl_estimate",
    "kl_loss",
    "kl_penalty_rewards",
    "masked_mean",
    "policy_loss",
    "rloo_advantages",
    "sequence_to_tokens",
    "token_entropy",
    "update_kl_controller",
    "value_loss",
    "whiten",
]
