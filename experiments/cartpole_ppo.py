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

from rlpt.config import default_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Returns the config; ``arg="runlocal"`` shrinks it to a smoke run."""
    # Every other field is at its default (``rlpt.config.GymConfig``): CleanRL's values.
    config = default_config("ppo_gym")
    config.env_id = "CartPole-v1"
    config.num_envs = 8
    config.num_steps = 128  # per env per rollout: 1024 transitions per update
    config.total_env_steps = 500_000
    config.target_return = 475.0

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
