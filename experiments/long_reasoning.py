"""Long reasoning in a short window: Delethink's chunked reasoning on ``state_tracking``.

Launch:

    nice python -m rlpt.train --config=experiments/long_reasoning.py --workdir=/tmp/rlpt_long

Smoke run (tiny model, a few PPO steps, a minute or two on CPU):

    python -m rlpt.train --config=experiments/long_reasoning.py:runlocal --workdir=/tmp/rlpt_ls

The model's window is ``model.max_seq_len`` = 128 positions. The policy reasons in
chunks of 64 tokens; at each boundary the context is reset to the prompt plus the last
24 reasoning tokens (Delethink, Aghajohari et al. 2025, arXiv:2510.06557), so no
forward pass, in sampling or in the update, sees more than prompt (<= 40) + 24 + 64
positions, while a trace runs up to 8 chunks = 512 tokens, four windows. The length
curriculum grows the chunk budget from 2 to 4 to 8 chunks over the PPO stage
(``rollout.chunked_reasoning.budgets``); the difficulty curriculum moves through
``state_tracking`` levels 1-4 (3 to 64 iterations, about 20 to 450 reasoning tokens).

RL starts from the initial weights: SFT on demonstrations longer than the window
would need the demonstrations cut into chunks as well, which the SFT stage does not
do yet.
"""

from __future__ import annotations

import ml_collections

from rlpt.config import default_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Returns the long-reasoning config; ``arg="runlocal"`` shrinks it to a smoke run."""
    config = default_config("post_train")
    config.stages = ("ppo",)
    config.model.preset = "mini"
    config.model.overrides = {"max_seq_len": 128}
    config.domains = ("state_tracking",)
    config.train_max_level.default = 4

    config.rollout.batch_size = 32
    config.rollout.group_size = 8
    config.rollout.temperature = 1.0
    config.rollout.filter_groups = True
    # Prompt (at most 40 byte tokens) plus the carry fit the 64 bucket; with a chunk the
    # window is 64 + 64 = 128 = model.max_seq_len.
    config.rollout.buckets = (32, 64)
    c = config.rollout.chunked_reasoning
    c.enabled = True
    c.chunk_tokens = 64
    c.carry_tokens = 24
    c.max_chunks = 8  # 512-token traces: four windows
    c.budgets = (2, 4, 8)
    c.budget_steps = (100, 200)
    config.ppo_steps = 300

    config.ppo.estimator = "grpo"
    config.ppo.epochs = 1
    config.ppo.num_minibatches = 4
    config.ppo.learning_rate = 3e-4
    config.ppo.warmup_steps = 10
    config.ppo.kl_coef = 0.0
    config.ppo.imitation_coef = 0.25
    # Chunk rows are all about one window long, so packing saves little, and its row
    # count follows the data, which would recompile the update as traces grow.
    config.ppo.pack_sequences = False

    config.rewards.outcome = 1.0
    config.rewards.format = 0.1
    config.curriculum.strategy = "bandit"

    config.eval.heldout_items = 100
    config.eval.ood_items = 50
    config.eval.n_samples = 4
    config.eval.k = 4
    config.eval.every = 50
    config.checkpoint.every = 50

    if arg == "runlocal":
        shrink_for_runlocal(config)
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; expected 'runlocal' or nothing")
    return config


def shrink_for_runlocal(config: ml_collections.ConfigDict) -> None:
    """A tiny model, a window of 64 and traces of up to 4 chunks of 16: four windows."""
    config.model.preset = "tiny"
    config.model.overrides = {"max_seq_len": 64}
    config.train_max_level.default = 1
    config.rollout.batch_size = 8
    config.rollout.group_size = 4
    config.rollout.filter_groups = False
    config.rollout.buckets = (48,)
    c = config.rollout.chunked_reasoning
    c.chunk_tokens = 16
    c.carry_tokens = 8
    c.max_chunks = 4
    c.budgets = (2, 4)
    c.budget_steps = (1,)
    config.ppo_steps = 2
    config.ppo.num_minibatches = 1
    config.ppo.warmup_steps = 1
    config.curriculum.difficulty.window = 8
    config.eval.heldout_items = 4
    config.eval.ood_items = 4
    config.eval.train_items = 4
    config.eval.n_samples = 2
    config.eval.k = 2
    config.eval.every = 0
    config.eval.periodic_items = 4
    config.eval.batch_size = 8
    config.eval.log_samples = 2
    config.checkpoint.every = 2
