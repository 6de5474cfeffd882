"""Multi-turn feedback: the model sees why its program failed and tries again (3 turns).

``list_programs`` answers are checked in-process on hidden inputs; a wrong one gets
``"\\nfeedback: on [31] gave [4], expected [62]\\n"`` (or why it did not parse) as
environment tokens, and the model answers again from the whole transcript. The warm
start is SFT on the fixed demonstration set (single-turn demonstrations); RL then
trains on whole multi-turn rows, the feedback masked out of the loss. Evaluation
reports greedy ``pass@1`` (first turn) and ``pass@1_turns`` (solved within the turns).

    nice python -m rlpt.train --config=experiments/multiturn.py --workdir=runs/multiturn

The target: after RL, solved within 3 turns beats first-turn success by >= 15 points,
and beats the multi-turn success of the warm start (the ``sft`` evaluation).
"""

from __future__ import annotations

import os
import sys

import ml_collections

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo  # noqa: E402  (sibling config files, not a package)
import efficacy  # noqa: E402


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """``arg="runlocal"`` shrinks it to a smoke run."""
    if arg not in (None, "", "runlocal"):
        raise ValueError(f"unknown config argument {arg!r}; expected 'runlocal' or nothing")
    runlocal = arg == "runlocal"
    config = demo.get_config("runlocal" if runlocal else None)
    config.domains = ("list_programs",)
    config.train_max_level.default = 1
    config.sft.demonstrations = 2000
    config.sft.token_budget = 150_000
    config.sft.eval_every = 100
    config.sft.keep_best = True
    config.sft.max_len = 128
    config.rollout.max_new_tokens = 48
    config.rollout.turns = 3
    config.rollout.feedback_tokens = 48
    # Prompt bucket + 3 completions + 2 feedback messages (336) fit the mini model's 512.
    config.rollout.buckets = (96,)
    config.eval.heldout_split = "validation"
    if runlocal:
        efficacy.shrink_fixed_demonstrations_for_runlocal(config)
        config.rollout.feedback_tokens = 24
        config.rollout.turns = 2
    return config
