"""Shared by the remote-engine tests (the Ray one and the two-process script): a prompt
source, a reward and requests small enough for the tiny model."""

import numpy as np

from rlpt.asyncrl import GroupReward, Prompt
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
