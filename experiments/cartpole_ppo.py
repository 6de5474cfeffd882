"""PPO on gymnasium CartPole-v1: the control-task check of the rlpt RL maths.

Launch:

    python -m rlpt.train --config=experiments/cartpole_ppo.py --workdir=/tmp/cartpole

Smoke run (a few thousand env steps, seconds):

    python -m rlpt.train --config=experiments/cartpole_ppo.py:runlocal --workdir=/tmp/cp_smoke

Hyperparameters follow CleanRL's ``ppo.py`` for CartPole. The target is a mean
episodic return >= 475 (of 500) within 500,000 environment steps.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Returns the config; ``arg="runlocal"`` shrinks it to a smoke run."""
    config = ml_collections.ConfigDict()
    config.trainer = "ppo_gym"
    config.seed = 0

    config.env_id = "CartPole-v1"
    config.num_envs = 8
    config.num_steps = 128  # per env per rollout: 1024 transitions per update
    config.total_env_steps = 500_000

    config.hidden_size = 64
    config.learning_rate = 2.5e-4
    config.anneal_lr = True
    config.adam_eps = 1e-5
    config.max_grad_norm = 0.5
    config.gamma = 0.99
    config.gae_lambda = 0.95
    config.num_epochs = 4
    config.num_minibatches = 4
    config.clip_eps = 0.2
    # None: no value clipping (Huang et al. 2022 find it rarely helps); a float enables it.
    config.value_clip_eps = config_dict.placeholder(float)
    config.normalize_advantages = True
    # Keeps value targets O(1) so the tanh critic does not saturate (see ppo_gym).
    config.reward_scale = 0.1
    config.ent_coef = 0.01
    config.vf_coef = 0.5

    config.log_every = 10  # updates between metrics.jsonl lines
    config.return_window = 20  # finished episodes averaged into train/episode_return
    config.target_return = 475.0
    config.eval_episodes = 16
    config.eval_seed_offset = 10_000

    if arg == "runlocal":
        config.num_steps = 32
        config.total_env_steps = 2048  # 8 updates
        config.num_epochs = 2
        config.log_every = 2
        config.return_window = 10
        config.eval_episodes = 8
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; expected 'runlocal' or nothing")
    return config
