"""Shared by the remote-engine tests (Ray, replicas, the two-process script): a prompt
source, a reward, requests small enough for the tiny model, and an asynchronous run's
check."""

import jax
import numpy as np

from rlpt.asyncrl import AsyncConfig, AsyncRunner, GroupReward, Prompt
from rlpt.sampling import Request, RequestParams


class CyclingPrompts:
    """Prompt ``k``: three tokens; every third one may run to 12 tokens, the rest to 2, so
    groups finish out of order."""

    position = 0

    def next(self):
        self.position += 1
        k = self.position - 1
        return Prompt(k, (5 + k % 50, 9, 11), max_tokens=12 if k % 3 == 0 else 2)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def parity_reward(prompt, completions):
    """1 for a completion of odd length: rewards that vary within a group."""
    r = np.array([float(len(c.tokens) % 2) for c in completions])
    return GroupReward(rewards=r, success=r)


def requests(n=4, max_tokens=6):
    return [
        Request(i, [5 + i, 17, 40 + i], RequestParams(max_tokens=max_tokens, n=2, seed=i))
        for i in range(n)
    ]


def run_async_and_check(engine, params, steps=4):
    """Runs ``steps`` learner steps (staleness 1, 2 groups of 2) through ``engine`` with a
    stand-in learner that publishes new weights every step; checks that every drawn prompt
    was trained on once or is still held and every batch kept the bound."""
    consumed = []

    def learn(draw, version):
        consumed.extend(draw.keys)
        return jax.tree.map(lambda x: x * 0.99, params), {}

    cfg = AsyncConfig(max_staleness=1, batch_groups=2, group_size=2, reward_threads=2)
    runner = AsyncRunner(
        cfg, engine, CyclingPrompts(), parity_reward, learn, RequestParams(max_tokens=12)
    )
    metrics = runner.run(steps)
    assert len(consumed) == len(set(consumed)) == 2 * steps
    for m in metrics:
        assert sum(m["async/staleness_hist"]) == 2 and len(m["async/staleness_hist"]) == 2
    state = runner.state_dict()
    held = [p["key"] for p in state["inflight"]] + [i["key"] for i in state["pool"]["items"]]
    assert sorted(consumed + held) == list(range(state["started"]))
