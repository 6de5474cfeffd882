"""The demo, asynchronous: actors and the learner overlap, at most 2 versions stale.

Launch (the demo's domains, model and budget; the rollout engine on half of the
devices, the learner on the other half):

    nice python -m rlpt.train --config=experiments/demo_async.py --workdir=/tmp/rlpt_demo_async

Smoke run:

    python -m rlpt.train --config=experiments/demo_async.py:runlocal \\
        --workdir=/tmp/rlpt_demo_async_smoke

Everything is ``experiments/demo.py`` except: ``async_rl.enabled`` with ``max_staleness = 2``;
decoupled PPO (the learner's parameters when a batch is formed are the proximal policy,
the engine's per-token log-probs the behaviour policy, importance weights truncated at
``ppo.is_cap``); no dynamic sampling (a group is trained on as it comes; the pool's
``learnability`` priority favours groups whose rewards vary, with unbiasing weights).
On a CPU the host "devices" share the cores: the gain is from overlapping sandbox waits
and host work with device work (``benchmarks/async_rl.py``).
"""

from __future__ import annotations

import ml_collections

from experiments import demo


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = demo.get_config(arg)
    config.async_rl.enabled = True
    config.async_rl.max_staleness = 2
    config.async_rl.priority = "learnability"
    config.ppo.behaviour_correction = "truncate"
    config.rollout.filter_groups = False
    return config
