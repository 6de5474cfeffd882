"""Asynchronous RL: actors and a learner around an experience pool."""

from rlpt.asyncrl.learner import PPOAsyncLearner
from rlpt.asyncrl.pool import (
    PRIORITIES,
    Draw,
    ExperiencePool,
    PoolItem,
    PoolUnderfull,
    staleness_histogram,
)
from rlpt.asyncrl.runtime import (
    AsyncConfig,
    AsyncRunner,
    Group,
    GroupReward,
    Prompt,
    PromptSource,
    request_seed,
)

__all__ = [
    "AsyncConfig",
    "AsyncRunner",
    "Group",
    "GroupReward",
    "PPOAsyncLearner",
    "Prompt",
    "PromptSource",
    "request_seed",
    "PRIORITIES",
    "Draw",
    "ExperiencePool",
    "PoolItem",
    "PoolUnderfull",
    "staleness_histogram",
]
