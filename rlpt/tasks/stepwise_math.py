"""Multi-step word arithmetic whose every step can be checked on its own.

``"start at 5, add 3, times 2, minus 4"`` ->
``"5+3=8<step>8*2=16<step>16-4=12<answer>12"``. Difficulty grows the number of
instructions and operand sizes; from level 4 exact division appears.

``check_steps`` labels each step against the reference path and
``corrupt_step`` plants one wrong step (and carries the error forward), for
process-reward-model training and evaluation.
"""

from __future__ import annotations

import dataclasses
import math
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


@dataclasses.dataclass(frozen=True)
class _Level:
    n_ops: int
    max_operand: int
    ops: str


_LEVELS = {
    1: _Level(1, 9, "+-"),
    2: _Level(2, 9, "+-*"),
    3: _Level(3, 9, "+-*"),
    4: _Level(4, 12, "+-*/"),
    5: _Level(5, 20, "+-*/"),
    6: _Level(6, 30, "+-*/"),
    7: _Level(8, 50, "+-*/"),
}

_WORDS = {"+": "add", "-": "minus", "*": "times", "/": "divide by"}
_STEP_RE = re.compile(r"\s*(-?\d+)\s*([-+*/])\s*(-?\d+)\s*=\s*(-?\d+)\s*")


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if a % b:
        raise ValueError(f"{a}/{b} is not exact")
    return a // b


def _values(start: int, instructions: list[tuple[str, int]]) -> list[int]:
    values = [start]
    for op, b in instructions:
        values.append(_apply(op, values[-1], b))
    return values


def parse_step(step: str) -> tuple[int, str, int, int] | None:
    """``"8*2=16"`` -> ``(8, "*", 2, 16)``; None if the step is not of that form."""
    m = _STEP_RE.fullmatch(step)
    if m is None:
        return None
    return int(m[1]), m[2], int(m[3]), int(m[4])


class StepwiseMathDomain(AnswerDomain):
    """Apply a chain of instructions to a start value; one checkable step each."""

    name = "stepwise_math"
    max_difficulty = max(_LEVELS)
    needs_sandbox = False

    def _sample(self, rng: random.Random, difficulty: int) -> Problem:
        level = _LEVELS[difficulty]
        value = rng.randint(1, level.max_operand)
        start = value
        instructions: list[tuple[str, int]] = []
        while len(instructions) < level.n_ops:
            op = rng.choice(level.ops)
            if op == "/":
                divisors = [d for d in range(2, 10) if value and value % d == 0]
                if not divisors:
                    continue
                b = rng.choice(divisors)
            elif op == "*":
                b = rng.randint(2, 9)
            else:
                b = rng.randint(1, level.max_operand)
            instructions.append((op, b))
            value = _apply(op, value, b)
        prompt = ", ".join([f"start at {start}"] + [f"{_WORDS[op]} {b}" for op, b in instructions])
        return Problem(
            prompt=prompt,
            answer=str(value),
            data={
                "start": start,
                "instructions": [list(i) for i in instructions],
                "answer_format": "number",
            },
        )

    @staticmethod
    def _instructions(task: Task) -> list[tuple[str, int]]:
        return [(op, int(b)) for op, b in task.data["instructions"]]

    def demonstration(self, task: Task) -> str:
        instructions = self._instructions(task)
        values = _values(int(task.data["start"]), instructions)
        steps = [f"{values[i]}{op}{b}={values[i + 1]}" for i, (op, b) in enumerate(instructions)]
        return STEP.join(steps) + ANSWER + str(values[-1])

    def check_steps(self, task: Task, completion: str) -> list[bool]:
        """Per step of ``completion`` (see ``split_steps``): is it the right step?

        Step ``i`` is right when it applies instruction ``i`` to the true value
        after ``i`` instructions and states the true result. Labels follow the
        reference path, so steps after a mistake are wrong unless they return
        to it; steps beyond the instruction count are wrong.
        """
        instructions = self._instructions(task)
        values = _values(int(task.data["start"]), instructions)
        labels = []
        for i, step in enumerate(split_steps(completion)):
            parsed = parse_step(step)
            labels.append(
                parsed is not None
                and i < len(instructions)
                and parsed == (values[i], instructions[i][0], instructions[i][1], values[i + 1])
            )
        return labels

    def corrupt_step(self, task: Task, completion: str, rng: Any) -> str:
        """``completion`` with one step's result made wrong and the error carried on.

        A step that parses is picked at random; its result is shifted by a
        nonzero multiple of the later divisors (so later divisions stay exact),
        and the later steps and the answer are recomputed from the wrong value,
        as a model that slipped once would write them. ``rng`` is a
        ``random.Random`` or ``numpy.random.Generator``.
        """
        instructions = self._instructions(task)
        steps = split_steps(completion)
        parsed = [parse_step(s) for s in steps]
        candidates = [i for i, p in enumerate(parsed[: len(instructions)]) if p is not None]
        if not candidates:
            raise ValueError(f"no step of {completion!r} can be corrupted")
        i = candidates[randint_inclusive(rng, 0, len(candidates) - 1)]
        a, op, b, c = parsed[i]
        later_divisors = [d for o, d in instructions[i + 1 :] if o == "/"]
        stride = math.prod(later_divisors)
        shift = randint_inclusive(rng, 1, 3) * (1 if randint_inclusive(rng, 0, 1) else -1) * stride
        value = c + shift
        new_steps = steps[:i] + [f"{a}{op}{b}={value}"]
        for op, b in instructions[i + 1 :]:
            nxt = _apply(op, value, b)
            new_steps.append(f"{value}{op}{b}={nxt}")
            value = nxt
        return STEP.join(new_steps) + ANSWER + str(value)

    def verify_one(self, task: Task, completion: str) -> VerifyResult:
        got = extract_answer(completion)
        details: dict[str, Any] = {"parsed": got, "expected": task.answer}
        if got is None or parse_number(got) is None:
            return VerifyResult(0.0, "no_answer", True, details)
        ok = answers_match(got, task.answer)
        return VerifyResult(float(ok), "correct" if ok else "wrong", True, details)
