"""reasoning-gym datasets (optional dependency) as rlpt domains.

``get_domain("reasoning_gym/chain_sum")`` or ``ReasoningGymDomain("chain_sum")``.
Answers are scored by the dataset's own ``score_answer`` on the text after
``<answer>``. Where the dataset has a curriculum, difficulty ``d`` is its global
level ``d - 1``; otherwise there is one level with the dataset's defaults.
The package is imported only when such a domain is made.
"""

from __future__ import annotations

import functools
import random
from typing import Any

from rlpt.tasks.base import (
    ANSWER,
    AnswerDomain,
    Problem,
    Task,
    VerifyResult,
    extract_answer,
    stable_hash,
)

# Items are drawn from seeded blocks of this many; a block is built once and cached.
_BLOCK = 256


def _import_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(
            "reasoning-gym domains need the optional reasoning-gym package: "
            "pip install reasoning-gym"
        ) from e
    return reasoning_gym


class ReasoningGymDomain(AnswerDomain):
    """One reasoning-gym dataset; ``config`` overrides its configuration fields."""

    def __init__(self, dataset: str, **config: Any):
        rg = _import_reasoning_gym()
        from reasoning_gym import factory

        if dataset not in factory.DATASETS:
            raise ValueError(
                f"unknown reasoning-gym dataset {dataset!r}; known: {sorted(factory.DATASETS)}"
            )
        self._rg = rg
        self._factory = factory
        self.dataset = dataset
        self.config = config
        self.name = f"reasoning_gym/{dataset}"
        self._curriculum = dataset in factory.CURRICULA
        if self._curriculum:
            attributes = factory.create_curriculum(dataset).attributes.values()
            self.max_difficulty = min(len(a.levels) for a in attributes)
        else:
            self.max_difficulty = 1
        self._block = functools.lru_cache(maxsize=32)(self._make_block)

    def _make_block(self, difficulty: int, index: int) -> Any:
        seed = stable_hash(self.name, difficulty, index) % 2**31
        if not self._curriculum:
            return self._rg.create_dataset(self.dataset, seed=seed, size=_BLOCK, **self.config)
        curriculum = self._factory.create_curriculum(self.dataset)
        curriculum.set_global_level(difficulty - 1)
        cfg = curriculum.generate_configuration({"seed": seed, "size": _BLOCK, **self.config})
        dataset_cls, _ = self._factory.DATASETS[self.dataset]
        return dataset_cls(config=cfg)

    def _sample(self, rng: random.Random, difficulty: int) -> Problem:
        # Drawing from a few cached blocks keeps generation cheap; which block
        # and item comes from the per-attempt rng, so it stays deterministic.
        block = self._block(difficulty, rng.randrange(64))
        entry = block[rng.randrange(_BLOCK)]
        return Problem(prompt=entry["question"], answer=str(entry["answer"]), data={"entry": entry})

    def demonstration(self, task: Task) -> str:
        return ANSWER + str(task.answer)

    def verify_one(self, task: Task, completion: str) -> VerifyResult:
        got = extract_answer(completion)
        if got is None:
            return VerifyResult(0.0, "no_answer", True, {"parsed": None})
        entry = task.data["entry"]
        score = float(self._block(task.difficulty, 0).score_answer(got, entry))
        outcome = "correct" if score >= 1.0 else "partial" if score > 0 else "wrong"
        return VerifyResult(score, outcome, True, {"parsed": got, "expected": task.answer})
