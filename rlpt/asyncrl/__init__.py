"""Asynchronous RL: the experience pool between actors and the learner."""

from rlpt.asyncrl.pool import (
    PRIORITIES,
    Draw,
    ExperiencePool,
    PoolItem,
    PoolUnderfull,
    staleness_histogram,
)

__all__ = [
    "PRIORITIES",
    "Draw",
    "ExperiencePool",
    "PoolItem",
    "PoolUnderfull",
    "staleness_histogram",
]
