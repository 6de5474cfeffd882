"""Long-horizon state tracking: add a constant modulo 1000, N times.

``"x=417; x=(x+583)%1000; 3 times"`` ->
``"1:0<step>2:583<step>3:166<answer>166"``: step ``i`` writes the iteration count
and the state after ``i`` applications, so the last few steps of a trace hold all a
reader needs to go on (the iteration reached and the current value). That is what
makes the domain suit chunked reasoning with a bounded carry (Delethink, Aghajohari
et al. 2025, arXiv:2510.06557): the prompt stays short while the reasoning grows
with N, and at the higher levels it is many times longer than a small model's window.

Each step is one three-digit addition modulo 1000 (the counter's +1 and ``x + a``), easy
enough for a small byte-level model to learn, so the length of the chain is the only
difficulty. A level fixes a range of iteration counts: the problem space per level is
the start value (1000), the increment (1..999) and the count (at least 2 values), over
2 million prompts, split into train and held-out by ``rlpt.tasks.base.partition_of``.
Drawing the count from a range also means the model must read where to stop from the
prompt rather than learn one length per level. ``check_steps`` labels each step against the
reference path, for process rewards.

``StateTrackingDomain(modulus=M)`` (registered name ``state_tracking/M``) works modulo M
instead: ``state_tracking/100`` makes each step a two-digit addition, which a small model
learns far sooner, so the chain's length alone makes the answer hard (at M = 100 a level
holds about 2 x 10^4 prompts).
"""

from __future__ import annotations

import random
import re
from typing import Any

from rlpt.tasks.base import (
    ANSWER,
    STEP,
    AnswerDomain,
    Problem,
    Task,
    VerifyResult,
    extract_answer,
    randint_inclusive,
    split_steps,
)
from rlpt.tasks.rewards import answers_match, parse_number

MODULUS = 1000
# Iteration counts per level, inclusive: from N to N + max(1, N // 4). A step "i:x" is at
# most 8 byte tokens with its separator (about 7.5 on average from the tenth step), so
# level 1 reasons in about 20 tokens, level 4 in at least 450, level 5 in at least 950
# and level 6 in at least 1900.
LEVEL_STEPS = {
    level: (n, n + max(1, n // 4))
    for level, n in {1: 3, 2: 8, 3: 24, 4: 64, 5: 128, 6: 256}.items()
}
_STEP_RE = re.compile(r"\s*(\d+)\s*:\s*(-?\d+)\s*")


def iterate(start: int, add: int, steps: int, modulus: int = MODULUS) -> list[int]:
    """The states ``x_0 = start``, ``x_{i+1} = (x_i + add) % modulus``, ``steps + 1`` of them."""
    values = [start]
    for _ in range(steps):
        values.append((values[-1] + add) % modulus)
    return values


def parse_step(step: str) -> tuple[int, int] | None:
    """``"12:922"`` -> ``(12, 922)``; None if the step is not of that form."""
    m = _STEP_RE.fullmatch(step)
    return None if m is None else (int(m[1]), int(m[2]))


class StateTrackingDomain(AnswerDomain):
    """Iterate ``x -> (x + add) % 1000`` from a start value; the answer is the last x."""

    name = "state_tracking"
    max_difficulty = max(LEVEL_STEPS)
    needs_sandbox = False

    def __init__(self, modulus: int | str = MODULUS):
        try:
            self.modulus = int(modulus)
        except ValueError:
            raise ValueError(
                f"state_tracking: modulus must be an integer, got {modulus!r}"
            ) from None
        if self.modulus < 10:
            raise ValueError(f"state_tracking: modulus must be at least 10, got {self.modulus}")
        if self.modulus != MODULUS:
            self.name = f"state_tracking/{self.modulus}"

    def _sample(self, rng: random.Random, difficulty: int) -> Problem:
        m = self.modulus
        steps = rng.randint(*LEVEL_STEPS[difficulty])
        start, add = rng.randrange(m), rng.randint(1, m - 1)
        values = iterate(start, add, steps, m)
        return Problem(
            prompt=f"x={start}; x=(x+{add})%{m}; {steps} times",
            answer=str(values[-1]),
            data={
                "start": start, "add": add, "steps": steps,
                "answer_format": "number",
            },
        )  # fmt: skip

    def _values(self, task: Task) -> list[int]:
        d = task.data
        return iterate(int(d["start"]), int(d["add"]), int(d["steps"]), self.modulus)

    def demonstration(self, task: Task) -> str:
        values = self._values(task)
        steps = [f"{i}:{x}" for i, x in enumerate(values[1:], start=1)]
        return STEP.join(steps) + ANSWER + str(values[-1])

    def check_steps(self, task: Task, completion: str) -> list[bool]:
        """Per step of ``completion`` (see ``split_steps``): is it ``i:x_i`` for its index i?

        Step ``i`` (from 1) is right when it names iteration ``i`` and the true state
        after it; steps beyond the iteration count are wrong.
        """
        values = self._values(task)
        return [
            parse_step(step) == (i, values[i]) if i < len(values) else False
            for i, step in enumerate(split_steps(completion), start=1)
        ]

    def corrupt_step(self, task: Task, completion: str, rng: Any) -> str:
        """``completion`` with one step's state made wrong and the error carried on.

        A step that parses, among the first ``steps``, is picked at random; its state is
        shifted by a nonzero amount modulo the modulus, and the later steps (up to the iteration
        count) and the answer are recomputed from the wrong state, as a model that slipped
        once would write them: every later state is off by the same shift. ``rng`` is a
        ``random.Random`` or ``numpy.random.Generator``.
        """
        n, add = int(task.data["steps"]), int(task.data["add"])
        steps = split_steps(completion)
        parsed = [parse_step(s) for s in steps[:n]]
        candidates = [i for i, p in enumerate(parsed) if p is not None]
        if not candidates:
            raise ValueError(f"no step of {completion!r} can be corrupted")
        i = candidates[randint_inclusive(rng, 0, len(candidates) - 1)]
        count, value = parsed[i]
        m = self.modulus
        value = (value + randint_inclusive(rng, 1, m - 1)) % m
        new_steps = steps[:i] + [f"{count}:{value}"]
        for later in range(count + 1, n + 1):
            value = (value + add) % m
            new_steps.append(f"{later}:{value}")
        return STEP.join(new_steps) + ANSWER + str(value)

    def verify_one(self, task: Task, completion: str) -> VerifyResult:
        got = extract_answer(completion)
        details: dict[str, Any] = {"parsed": got, "expected": task.answer}
        if got is None or parse_number(got) is None:
            return VerifyResult(0.0, "no_answer", True, details)
        ok = answers_match(got, task.answer)
        return VerifyResult(float(ok), "correct" if ok else "wrong", True, details)
