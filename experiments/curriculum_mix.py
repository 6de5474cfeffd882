"""The curriculum in the real trainer: two learnable domains, one unlearnable, one mastered.

``arithmetic`` and ``stepwise_math`` can be learnt from the warm start (the demo's RL
lifts both); ``random_labels`` cannot (its labels are noise: chance is 0.1 whatever the
policy does); ``echo`` is solved by the warm start. A learned curriculum should move
samples off the last two and reach the target on the learnable ones sooner than uniform
mixing. The config argument picks the arm (append ``,runlocal`` for a smoke run):
``warm`` (the SFT warm start alone, which both RL arms of a seed start from),
``learned`` (the bandit on learning progress) and ``uniform``.

    nice python -m rlpt.train --config=experiments/curriculum_mix.py:warm \\
        --workdir=runs/mix_warm_s0 --config.seed=0
    nice python -m rlpt.train --config=experiments/curriculum_mix.py:learned \\
        --workdir=runs/mix_learned_s0 --config.seed=0 \\
        --config.model.init_from=runs/mix_warm_s0 --config.stages="('ppo',)"
    nice python -m rlpt.train --config=experiments/curriculum_mix.py:uniform \\
        --workdir=runs/mix_uniform_s0 --config.seed=0 \\
        --config.model.init_from=runs/mix_warm_s0 --config.stages="('ppo',)"
    python benchmarks/learning_curves.py uniform=runs/mix_uniform_s0,... \\
        learned=runs/mix_learned_s0,... --target=arithmetic:T1,stepwise_math:T2

``--target`` gives the samples each run generated (every filtering round counted) until
both learnable domains reached their targets, the learned arm's ratio to uniform's
(paired by seed; the issue's bar is 0.7) and each arm's mean sampling weight per domain;
a run started from ``model.init_from`` takes its warm start's last evaluation as its
point at 0 samples. ``model.init_from`` alone keeps the arm's SFT stage, which would
then continue training the warm start: the RL arms name ``stages`` too. Without either
flag an RL arm runs its own SFT stage first (the warm arm's fixed rule) and then PPO.

Evaluation during training is greedy, on the validation half of the held-out partition.
"""

from __future__ import annotations

import os
import sys

import ml_collections

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo  # noqa: E402  (a sibling config file, not a package)

ARMS = ("warm", "learned", "uniform")
DOMAINS = ("arithmetic", "stepwise_math", "random_labels", "echo")
LEARNABLE = ("arithmetic", "stepwise_math")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """``arg`` is ``warm``, ``learned`` or ``uniform``, optionally followed by ``,runlocal``."""
    parts = [p for p in (arg or "").split(",") if p]
    arm = parts[0] if parts else ""
    if arm not in ARMS or any(p != "runlocal" for p in parts[1:]):
        raise ValueError(f"config argument must be one of {ARMS} [+ ',runlocal'], got {arg!r}")
    config = demo.get_config("runlocal" if "runlocal" in parts[1:] else None)
    config.domains = DOMAINS
    config.train_max_level.default = 2
    config.sft.max_len = 128
    config.rollout.max_new_tokens = 48
    config.eval.heldout_split = "validation"
    # Only greedy pass@1 on the learnable domains decides the comparison: no sampled
    # pass@k and no OOD split, so the frequent evaluations stay cheap.
    config.eval.n_samples = 0
    config.eval.ood_items = 0
    config.eval.periodic_items = config.eval.heldout_items
    # Every 20 steps: the samples at which a domain reaches its target are read off these.
    config.eval.every = 20 if "runlocal" not in parts[1:] else 2
    config.curriculum.strategy = "bandit" if arm == "learned" else "uniform"
    if arm == "warm":
        config.stages = ("sft",)
    else:
        config.ppo_steps = 240 if "runlocal" not in parts[1:] else config.ppo_steps
    return config
