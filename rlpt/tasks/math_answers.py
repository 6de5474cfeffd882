"""Free-form math answers judged by ``math-verify``, and a domain that needs them.

A model may write ``5/6``, ``\\frac{5}{6}``, ``$\\frac{5}{6}$``, ``\\boxed{5/6}``,
``x = 5/6`` or ``0.833333`` for the same answer; string or plain numeric matching
accepts one of them. ``math_equivalent`` parses both sides with math-verify (LaTeX
and plain expressions, SymPy equivalence, decimals compared at six places) rather
than a home-made normaliser: answer extraction is where hand-written graders are
known to go wrong.

math-verify bounds its parsing time with ``signal.alarm``, which works only on a
process's main thread. Off the main thread (the asynchronous actors verify there)
it runs without that bound, so answers whose evaluation could explode (power
towers such as ``9^9^9``) are judged wrong there without being evaluated.
"""

from __future__ import annotations

import functools
import random
import re
import threading
from fractions import Fraction
from typing import Any

from rlpt.tasks.base import (
    ANSWER,
    STEP,
    AnswerDomain,
    Problem,
    Task,
    VerifyResult,
    extract_answer,
)

# Longer answers are not parsed at all: no answer in these domains needs more.
MAX_ANSWER_CHARS = 200
_POWER = re.compile(r"\^|\*\*")


def _import_math_verify() -> Any:
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            "free-form math answers need the math-verify package: pip install math-verify"
        ) from e
    return math_verify


def _timeout_s() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=65_536)
def _parse_gold(expected: str, timeout_s: int | None) -> Any:
    # The reference is our own text: parse it once per distinct answer, as LaTeX in
    # math mode (a bare "5/6" is also a valid plain expression).
    mv = _import_math_verify()
    return mv.parse(f"${expected}$", parsing_timeout=timeout_s)


def math_equivalent(expected: str, answer: str | None) -> bool:
    """Whether ``answer`` states the same mathematical value as ``expected``."""
    if answer is None or not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        return False
    timeout_s = _timeout_s()
    if timeout_s is None and len(_POWER.findall(answer)) > 1:
        return False  # no time bound off the main thread: see the module docstring
    mv = _import_math_verify()
    gold = _parse_gold(expected, timeout_s)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {expected!r}")
    predicted = mv.parse(answer, parsing_timeout=timeout_s)
    if not predicted:
        return False
    return bool(mv.verify(gold, predicted, timeout_seconds=timeout_s))


def math_verify_reward(task: Task, completion: str, result: VerifyResult | None = None) -> float:
    """1.0 when the completion's final answer is math-equivalent to the task's answer."""
    del result
    if task.answer is None:
        raise ValueError(f"task {task.id} has no reference answer for math_verify")
    return float(math_equivalent(task.answer, extract_answer(completion)))


# -- fractions: exact rational arithmetic with free-form answers --------------------------------

# Terms per expression at each level; level 1 adds or subtracts two fractions.
_TERMS = {1: 2, 2: 2, 3: 3, 4: 4}
_OPS = {1: "+-", 2: "*/", 3: "+-*", 4: "+-*/"}
_MAX_NUMERATOR = 40
_MAX_DENOMINATOR = 40


def _fraction_text(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator}"


def _term_text(numerator: int, denominator: int, op: str = "") -> str:
    """A term as the prompt writes it: bracketed when negative or after ``*`` and ``/``
    (``x/(a/b)`` is not ``x/a/b``)."""
    text = f"{'-' if numerator < 0 else ''}{abs(numerator)}/{denominator}"
    return f"({text})" if numerator < 0 or op in ("*", "/") else text


def level_size(difficulty: int) -> int:
    """How many distinct expressions (prompts) a level can draw."""
    signs = 2 if difficulty >= 2 else 1
    term_choices = _MAX_NUMERATOR * (_MAX_DENOMINATOR - 1) * signs
    ops = len(_OPS[difficulty])
    terms = _TERMS[difficulty]
    return term_choices**terms * ops ** (terms - 1)


def _apply(left: Fraction, op: str, right: Fraction) -> Fraction:
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    return left / right


class FractionsDomain(AnswerDomain):
    """Evaluate a chain of fractions left to right; any equivalent written form is right.

    ``"3/4+5/6="``: answer ``19/12`` (or ``\\frac{19}{12}``, ``1.583333``). The chain is
    evaluated strictly left to right (the prompt brackets it so), one step per
    operation in the demonstration: ``"3/4+5/6=19/12<answer>19/12"``. Levels: two
    positive terms with ``+``/``-``; two signed terms with ``*``/``/``; three with
    ``+ - *``; four with all four. Each level has over 10^6 distinct prompts
    (``level_size``), and the partition is by prompt.
    """

    name = "fractions"
    max_difficulty = max(_TERMS)

    def _sample(self, rng: random.Random, difficulty: int) -> Problem:
        signed = difficulty >= 2
        terms: list[tuple[int, int]] = []
        for _ in range(_TERMS[difficulty]):
            numerator = rng.randint(1, _MAX_NUMERATOR)
            if signed and rng.random() < 0.5:
                numerator = -numerator
            terms.append((numerator, rng.randint(2, _MAX_DENOMINATOR)))
        ops = [rng.choice(_OPS[difficulty]) for _ in terms[1:]]
        text = _term_text(*terms[0])
        value = Fraction(*terms[0])
        steps = []
        for i, (op, term) in enumerate(zip(ops, terms[1:])):
            new = _apply(value, op, Fraction(*term))
            # One line of the demonstration: "<value so far><op><term as written>=<new>".
            written = _term_text(*term, op)
            steps.append(f"{_fraction_text(value)}{op}{written}={_fraction_text(new)}")
            # Brackets keep the order of evaluation left to right whatever the operators.
            left = f"({text})" if i > 0 else text
            text = f"{left}{op}{written}"
            value = new
        return Problem(prompt=text + "=", answer=_fraction_text(value), data={"steps": steps})

    def demonstration(self, task: Task) -> str:
        return STEP.join(task.data["steps"]) + ANSWER + str(task.answer)

    def verify_one(self, task: Task, completion: str) -> VerifyResult:
        got = extract_answer(completion)
        if got is None:
            return VerifyResult(0.0, "no_answer", True, {"parsed": None})
        ok = math_equivalent(str(task.answer), got)
        details = {"parsed": got, "expected": task.answer}
        return VerifyResult(float(ok), "correct" if ok else "wrong", True, details)
