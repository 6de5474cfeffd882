"""Integer arithmetic: evaluate an expression like ``12+7*2=``.

Difficulty grows the operator count, the operand digits and, from level 4,
adds parentheses. The demonstration reduces one operation per step in
evaluation order: ``"12+7*2="`` -> ``"7*2=14<step>12+14=26<answer>26"``.
"""

from __future__ import annotations

import dataclasses
import random

from rlpt.tasks.base import ANSWER, STEP, AnswerDomain, Problem, Task, VerifyResult, extract_answer
from rlpt.tasks.rewards import answers_match, parse_number


@dataclasses.dataclass(frozen=True)
class _Level:
    n_ops: int
    max_digits: int
    ops: str
    parens: bool


_LEVELS = {
    1: _Level(1, 1, "+-", False),
    2: _Level(1, 2, "+-*", False),
    3: _Level(2, 2, "+-*", False),
    4: _Level(3, 2, "+-*", True),
    5: _Level(4, 2, "+-*", True),
    6: _Level(5, 3, "+-*", True),
    7: _Level(6, 3, "+-*", True),
}


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


class _Parser:
    """Recursive descent over ``+ - *`` and parentheses, left-associative.

    Yields a tree of ``int`` leaves and ``(op, left, right)`` nodes.
    """

    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    def parse(self):
        node = self._expr()
        if self.pos != len(self.text):
            raise ValueError(f"trailing input in {self.text!r}")
        return node

    def _expr(self):
        node = self._term()
        while self.pos < len(self.text) and self.text[self.pos] in "+-":
            op = self.text[self.pos]
            self.pos += 1
            node = (op, node, self._term())
        return node

    def _term(self):
        node = self._atom()
        while self.pos < len(self.text) and self.text[self.pos] == "*":
            self.pos += 1
            node = ("*", node, self._atom())
        return node

    def _atom(self):
        if self.text[self.pos] == "(":
            self.pos += 1
            node = self._expr()
            assert self.text[self.pos] == ")"
            self.pos += 1
            return node
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos].isdigit():
            self.pos += 1
        return int(self.text[start : self.pos])


def solve(expression: str) -> tuple[int, list[str]]:
    """The value of ``expression`` and one ``a op b=c`` step per operation."""
    steps: list[str] = []

    def walk(node) -> int:
        if isinstance(node, int):
            return node
        op, left, right = node
        a, b = walk(left), walk(right)
        c = _apply(op, a, b)
        steps.append(f"{a}{op}{b}={c}")
        return c

    return walk(_Parser(expression).parse()), steps


class ArithmeticDomain(AnswerDomain):
    """Integer expressions; the final answer must equal the value exactly."""

    name = "arithmetic"
    max_difficulty = max(_LEVELS)
    needs_sandbox = False

    def _sample(self, rng: random.Random, difficulty: int) -> Problem:
        level = _LEVELS[difficulty]
        n = level.n_ops + 1
        numbers = [str(rng.randrange(10 ** rng.randint(1, level.max_digits))) for _ in range(n)]
        ops = [rng.choice(level.ops) for _ in range(level.n_ops)]
        tokens = [numbers[0]]
        for op, num in zip(ops, numbers[1:]):
            tokens += [op, num]
        if level.parens and rng.random() < 0.7:
            # Wrap a proper sub-span of operands, at least two of them.
            i = rng.randrange(n - 1)
            j = rng.randrange(i + 1, n if i > 0 else n - 1)
            tokens[2 * i] = "(" + tokens[2 * i]
            tokens[2 * j] = tokens[2 * j] + ")"
        expression = "".join(tokens)
        value, _ = solve(expression)
        return Problem(
            prompt=expression + "=",
            answer=str(value),
            data={"expression": expression, "answer_format": "number"},
        )

    def demonstration(self, task: Task) -> str:
        value, steps = solve(task.data["expression"])
        return STEP.join(steps) + ANSWER + str(value)

    def verify_one(self, task: Task, completion: str) -> VerifyResult:
        got = extract_answer(completion)
        details = {"parsed": got, "expected": task.answer}
        if got is None or parse_number(got) is None:
            return VerifyResult(0.0, "no_answer", True, details)
        ok = answers_match(got, task.answer)
        return VerifyResult(float(ok), "correct" if ok else "wrong", True, details)
