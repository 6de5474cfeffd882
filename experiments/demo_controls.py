"""Controls for ``experiments/demo.py``: is it RL, and is it the curriculum?

``sft_more``: the same warm start, then SFT continues on demonstrations for the wall
clock the demo spent in RL (``sft.continued_wall_s``; set it to the demo run's RL time,
the difference of ``wall_s`` and the SFT stage's end in its metrics) instead of PPO.
``uniform``: the demo with uniform domain mixing instead of the learned curriculum
(difficulty control unchanged).

Launch:

    nice python -m rlpt.train --config=experiments/demo_controls.py:sft_more \\
        --config.sft.continued_wall_s=900 --workdir=/tmp/rlpt_demo_sft_more
    nice python -m rlpt.train --config=experiments/demo_controls.py:uniform \\
        --workdir=/tmp/rlpt_demo_uniform

Append ``,runlocal`` to the argument (``:uniform,runlocal``) for a smoke run.
"""

from __future__ import annotations

import os
import sys

import ml_collections

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo  # noqa: E402  (a sibling config file, not a package)

VARIANTS = ("sft_more", "uniform")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """``arg`` is ``sft_more`` or ``uniform``, optionally followed by ``,runlocal``."""
    parts = [p for p in (arg or "").split(",") if p]
    variant = parts[0] if parts else ""
    if variant not in VARIANTS or any(p != "runlocal" for p in parts[1:]):
        raise ValueError(f"config argument must be one of {VARIANTS} [+ ',runlocal'], got {arg!r}")
    config = demo.get_config("runlocal" if "runlocal" in parts[1:] else None)
    if variant == "sft_more":
        config.stages = ("sft", "sft_continued")
        # The demo's RL wall clock on this machine; override with the measured figure.
        config.sft.continued_wall_s = 900.0 if "runlocal" not in parts else 2.0
        # A learning curve as dense as the RL stage's (an SFT step is ~5x faster).
        config.sft.eval_every = 200 if "runlocal" not in parts else 2
    else:
        config.curriculum.strategy = "uniform"
    return config
