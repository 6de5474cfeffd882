"""Long reasoning in a short window: Delethink's chunked reasoning on ``state_tracking``.

Launch (a 2-core CPU finishes it in about 15-20 minutes):

    nice python -m rlpt.train --config=experiments/long_reasoning.py --workdir=/tmp/rlpt_long

Smoke run (tiny model, one SFT step and two PPO steps, a minute or two on CPU):

    python -m rlpt.train --config=experiments/long_reasoning.py:runlocal --workdir=/tmp/rlpt_ls

The model's window is ``model.max_seq_len`` = 128 positions. The policy reasons in
chunks of C = 64 tokens; at each boundary the context is reset to the prompt plus the
last m = 16 reasoning tokens (Delethink, Aghajohari et al. 2025, arXiv:2510.06557), two
steps of ``state_tracking``'s ``i:x`` trace, which hold the iteration count and the
value. No forward pass, in sampling, SFT or the update, sees more than prompt (<= 34) +
16 + 64 <= 128 positions, while a level-5 trace (128 to 160 additions) is 660 to 1200
tokens, 5 to 9 windows, and a level-6 one (256 to 320) about 2000 to 2500.

``sft`` trains on demonstrations of levels 1-5 cut into exactly those windows
(``rlpt.sft.encode_chunked_example``); a short ``ppo`` stage with chunk rows sharing
their trace's advantage follows. Per-level and per-chunk-size accuracy of the result:
``python -m rlpt.chunked_eval --workdir=/tmp/rlpt_long``.

``experiments/long_reasoning.py:mod100`` runs the same on ``state_tracking/100``: each step a
two-digit addition, which a small model learns far sooner than the three-digit one (the
mini model had not learnt that in this config's budget). A level-4 trace (64 to 80
additions) is 370 to 470 tokens, a level-5 one 725 to 1000: 3 to 8 windows of 128.
"""

from __future__ import annotations

import ml_collections

from rlpt.config import default_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Returns the long-reasoning config; ``arg="runlocal"`` shrinks it to a smoke run,
    ``arg="mod100"`` trains on ``state_tracking/100``."""
    config = default_config("post_train")
    config.stages = ("sft", "ppo")
    config.model.preset = "mini"
    config.model.overrides = {"max_seq_len": 128}
    config.domains = ("state_tracking",)
    config.train_max_level.default = 5

    # Rows of at most one window (context <= 64, chunk 64); about 530 steps, 13 minutes of
    # a 2-core CPU (the whole run took 19 minutes under nice on a shared machine).
    config.sft.max_len = 128
    config.sft.batch_size = 32
    config.sft.learning_rate = 1e-3
    config.sft.warmup_steps = 20
    config.sft.token_budget = 1_000_000
    config.sft.heldout_items = 8
    config.sft.log_every = 10

    config.rollout.sampler = "static"
    config.rollout.batch_size = 16
    config.rollout.group_size = 4
    config.rollout.temperature = 1.0
    config.rollout.filter_groups = False
    # Prompt (at most 34 byte tokens) plus the carry fit the 64 bucket; with a chunk the
    # window is 64 + 64 = 128 = model.max_seq_len.
    config.rollout.buckets = (64,)
    c = config.rollout.chunked_reasoning
    c.enabled = True
    c.chunk_tokens = 64
    c.carry_tokens = 16
    c.max_chunks = 20  # 1280 tokens: every level-5 trace
    config.ppo_steps = 4

    config.ppo.estimator = "grpo"
    config.ppo.epochs = 1
    config.ppo.num_minibatches = 4
    config.ppo.learning_rate = 1e-4
    config.ppo.warmup_steps = 1
    config.ppo.kl_coef = 0.0
    config.ppo.imitation_coef = 0.25
    # Chunk rows are all about one window long, so packing saves little, and its row
    # count follows the data, which would recompile the update as traces grow.
    config.ppo.pack_sequences = False

    config.rewards.outcome = 1.0
    config.rewards.format = 0.1
    config.curriculum.strategy = "bandit"

    # Held-out greedy accuracy over levels 1-5 after SFT and at the end; the per-level
    # and out-of-distribution (level 6, 40 chunks) figures come from rlpt.chunked_eval.
    config.eval.heldout_items = 25
    config.eval.ood_items = 0
    config.eval.n_samples = 0
    config.eval.k = 1
    config.eval.every = 0
    config.eval.batch_size = 32
    config.checkpoint.every = 50

    if arg == "runlocal":
        shrink_for_runlocal(config)
    elif arg == "mod100":
        config.domains = ("state_tracking/100",)
    elif arg:
        raise ValueError(
            f"unknown config argument {arg!r}; expected 'runlocal', 'mod100' or nothing"
        )
    return config


def shrink_for_runlocal(config: ml_collections.ConfigDict) -> None:
    """A tiny model, a window of 64, one SFT step and traces of up to 4 chunks of 16."""
    config.model.preset = "tiny"
    config.model.overrides = {"max_seq_len": 64}
    config.train_max_level.default = 1
    config.sft.max_len = 64
    config.sft.batch_size = 8
    config.sft.token_budget = 1
    config.sft.heldout_items = 2
    config.rollout.batch_size = 8
    config.rollout.group_size = 4
    config.rollout.buckets = (48,)
    c = config.rollout.chunked_reasoning
    c.chunk_tokens = 16
    c.carry_tokens = 8
    c.max_chunks = 4
    c.budgets = (2, 4)
    c.budget_steps = (1,)
    config.ppo_steps = 2
    config.ppo.num_minibatches = 1
    config.curriculum.difficulty.window = 8
    config.eval.heldout_items = 4
    config.eval.train_items = 4
    config.eval.periodic_items = 4
    config.eval.batch_size = 8
    config.eval.log_samples = 2
    config.checkpoint.every = 2
