"""Control domains for curriculum experiments: one nothing can learn, one already mastered.

A curriculum earns its keep by not spending samples where they teach nothing: on a
domain whose labels are noise, or on one the policy already solves. These two make
both cases real inside the trainer (the simulator in ``benchmarks/curriculum.py`` has
them too, as assumptions):

- ``random_labels``: an arithmetic-looking prompt whose reference answer is a number
  drawn from a hash of the prompt, independent of the expression. Over 10^6 prompts
  per level, so it cannot be memorised either: a policy's expected success is the
  chance of guessing one of ``label_range`` values, whatever it learns.
- ``echo``: repeat the digits after ``echo`` (``"echo 4071="`` -> ``4071``); a warm
  start solves it after a few hundred demonstrations, so RL on it has nothing left
  to gain.
"""

from __future__ import annotations

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
from rlpt.tasks.rewards import answers_match


class RandomLabelsDomain(AnswerDomain):
    """``"a+b*c="`` with a label that ignores the expression: unlearnable by design."""

    name = "random_labels"
    max_difficulty = 3

    def __init__(self, label_range: int = 10):
        if label_range < 2:
            raise ValueError(f"label_range must be >= 2, got {label_range}")
        self.label_range = label_range

    def _sample(self, rng: random.Random, difficulty: int) -> Problem:
        terms = [str(rng.randint(0, 10**difficulty * 10 - 1)) for _ in range(difficulty + 2)]
        ops = [rng.choice("+-*") for _ in terms[1:]]
        prompt = terms[0] + "".join(op + t for op, t in zip(ops, terms[1:])) + "="
        label = stable_hash("rlpt-random-label", prompt) % self.label_range
        return Problem(prompt=prompt, answer=str(label))

    def demonstration(self, task: Task) -> str:
        return ANSWER + str(task.answer)

    def verify_one(self, task: Task, completion: str) -> VerifyResult:
        got = extract_answer(completion)
        if got is None:
            return VerifyResult(0.0, "no_answer", True, {"parsed": None})
        ok = answers_match(got, str(task.answer))
        return VerifyResult(float(ok), "correct" if ok else "wrong", True, {"parsed": got})


class EchoDomain(AnswerDomain):
    """``"echo 4071="`` -> ``4071``: a domain the warm start masters."""

    name = "echo"
    max_difficulty = 3

    def _sample(self, rng: random.Random, difficulty: int) -> Problem:
        digits = "".join(str(rng.randrange(10)) for _ in range(5 + 2 * difficulty))
        return Problem(prompt=f"echo {digits}=", answer=digits)

    def demonstration(self, task: Task) -> str:
        return ANSWER + str(task.answer)

    def verify_one(self, task: Task, completion: str) -> VerifyResult:
        got = extract_answer(completion)
        if got is None:
            return VerifyResult(0.0, "no_answer", True, {"parsed": None})
        ok = got == task.answer
        return VerifyResult(float(ok), "correct" if ok else "wrong", True, {"parsed": got})


def level_sizes(domain: Any, difficulty: int) -> int:
    """Distinct prompts a level can draw (for the >= 10^6 check)."""
    if isinstance(domain, EchoDomain):
        return 10 ** (5 + 2 * difficulty)
    terms = difficulty + 2
    return (10**difficulty * 10) ** terms * 3 ** (terms - 1)
