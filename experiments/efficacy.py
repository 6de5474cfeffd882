"""The efficacy protocol's arms: few demonstrations, unlimited verifiable prompts.

The regime RL is for: each domain has a fixed set of ``sft.demonstrations`` (2,000)
demonstrations, and prompts to practise on without limit. The domains cannot be
memorised (over 10^6 problems per level; ``list_programs`` partitions by the function a
program computes) and every setting is chosen on the validation half of the held-out
partition (``eval.heldout_split``); the test half is scored once, by ``rlpt.efficacy``.

Arms (the config argument; append ``,runlocal`` for a smoke run):

- ``sft``: SFT on the demonstrations to its best validation checkpoint (``sft.keep_best``);
- ``rl_uniform``: that warm start, then PPO with uniform domain mixing;
- ``rl_curriculum``: that warm start, then PPO with the learned curriculum;
- ``sft_more``: that warm start, then SFT on the same demonstrations for RL's wall clock
  (``sft.continued_wall_s``; the protocol sets it from ``rl_curriculum``'s ``rl_wall_s``).

The whole protocol (tuning on validation, every arm over three seeds, the test
evaluation and the results table; hours on a 2-core CPU, resumable):

    nice python -m rlpt.efficacy --config=experiments/efficacy.py --workdir=runs/efficacy \\
        --learning_rates=4e-4,8e-4

One arm alone:

    nice python -m rlpt.train --config=experiments/efficacy.py:rl_curriculum \\
        --workdir=runs/efficacy_rl --config.seed=0
"""

from __future__ import annotations

import os
import sys

import ml_collections

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo  # noqa: E402  (a sibling config file, not a package)

ARMS = ("sft", "rl_uniform", "rl_curriculum", "sft_more")
DOMAINS = ("arithmetic", "fractions", "list_programs")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """``arg`` is one of ``ARMS``, optionally followed by ``,runlocal``."""
    parts = [p for p in (arg or "").split(",") if p]
    arm = parts[0] if parts else ""
    if arm not in ARMS or any(p != "runlocal" for p in parts[1:]):
        raise ValueError(f"config argument must be one of {ARMS} [+ ',runlocal'], got {arg!r}")
    runlocal = "runlocal" in parts[1:]
    config = demo.get_config("runlocal" if runlocal else None)
    config.domains = DOMAINS
    # Training-level prompts only; OOD is the level above plus list_programs' own splits.
    config.train_max_level.default = 2

    # Few demonstrations, several passes over them: SFT keeps its best validation score.
    # (Probe, seed 0, mini model: arithmetic validation pass@1 0.107 at step 200 and 0.047
    # at step 400 of a 600k-token budget; it overfits the 2,000 demonstrations early.)
    config.sft.demonstrations = 2000
    config.sft.token_budget = 300_000  # a few epochs of the 6,000 demonstrations
    config.sft.eval_every = 100
    config.sft.keep_best = True
    # Fractions and list programs write longer answers than the demo's domains.
    config.sft.max_len = 128
    config.rollout.max_new_tokens = 48
    if not runlocal:
        # The whole protocol (tuning, 4 arms x 3 seeds, test evaluations) fits an afternoon
        # of a 2-core CPU at 150 PPO steps (9,600 samples a run); 420 would take ~8 hours.
        config.ppo_steps = 150
        config.eval.every = 50
        config.checkpoint.every = 50

    # Settings are chosen on validation; the test half is scored only by rlpt.efficacy.
    config.eval.heldout_split = "validation"
    config.eval.heldout_items = 200
    config.eval.periodic_items = 150

    if arm == "sft":
        config.stages = ("sft",)
    elif arm == "sft_more":
        config.stages = ("sft", "sft_continued")
        config.sft.continued_wall_s = 1200.0  # replaced by the RL arm's measured rl_wall_s
    elif arm == "rl_uniform":
        config.curriculum.strategy = "uniform"
    if runlocal:
        shrink_fixed_demonstrations_for_runlocal(config)
        config.sft.continued_wall_s = 2.0
        config.eval.heldout_items = 4
    return config


def shrink_fixed_demonstrations_for_runlocal(config: ml_collections.ConfigDict) -> None:
    """A smoke-sized fixed demonstration set, SFT checked often, short generations."""
    config.train_max_level.default = 1
    config.sft.demonstrations = 8
    config.sft.token_budget = 1500
    config.sft.eval_every = 4
    config.eval.periodic_items = 0
    config.rollout.max_new_tokens = 16
