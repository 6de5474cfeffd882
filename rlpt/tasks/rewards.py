"""Rule-based rewards: answer matching, code pass rate, format, length, and their sum.

A reward function has the signature ``fn(task, completion, result) -> float``
where ``result`` is the domain's ``VerifyResult`` for that completion (terms
that only read the text ignore it). ``CompositeReward`` weighs named terms:

    reward = CompositeReward({"correct": 1.0, "format": 0.1, "length": 0.01})
    total, terms = reward(task, completion, result)   # terms: unweighted values
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import NamedTuple

from rlpt.tasks.base import ANSWER, Task, VerifyResult, extract_answer

RewardFn = Callable[[Task, str, VerifyResult | None], float]

_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?(/\d+)?")


def parse_number(text: str | None) -> Fraction | None:
    """A number written as the whole of ``text``, exactly, or None.

    Tolerant of what a model writes around a number: surrounding and inner
    whitespace (``"- 5"``), a leading ``+``, trailing zeros (``"38.0"``), a
    trailing dot, exponents (``"1e3"``) and fractions (``"3/4"``). Exact
    ``Fraction`` arithmetic keeps ``0.1 + 0.2`` style rounding out of the match.
    """
    if text is None:
        return None
    compact = "".join(text.split())
    if not _NUMBER.fullmatch(compact):
        return None
    try:
        return Fraction(compact)
    except (ValueError, ZeroDivisionError):
        return None


def normalize_text(text: str) -> str:
    return " ".join(text.split())


def answers_match(
    predicted: str | None, expected: str, *, rel_tol: float = 0.0, abs_tol: float = 0.0
) -> bool:
    """Whether a predicted final answer equals the expected one.

    Numbers compare by value within ``max(abs_tol, rel_tol * |expected|)`` (exact
    at the default zero tolerance); other answers compare as text with runs of
    whitespace collapsed.
    """
    if predicted is None:
        return False
    want = parse_number(expected)
    if want is not None:
        got = parse_number(predicted)
        if got is None:
            return False
        return abs(got - want) <= max(Fraction(abs_tol), Fraction(rel_tol) * abs(want))
    return normalize_text(predicted) == normalize_text(expected)


def correct(task: Task, completion: str, result: VerifyResult | None) -> float:
    """The domain verifier's reward (0 for an invalid sample: the trainer drops those)."""
    del task, completion
    if result is None:
        raise ValueError("the 'correct' reward needs the domain's VerifyResult")
    return float(result.reward) if result.valid else 0.0


def exact_match(task: Task, completion: str, result: VerifyResult | None = None) -> float:
    """1 if the final answer equals ``task.answer`` exactly (numbers by value)."""
    del result
    if task.answer is None:
        return 0.0
    return float(answers_match(extract_answer(completion), task.answer))


class NumericMatch:
    """1 if the final answer is within tolerance of ``task.answer``."""

    def __init__(self, rel_tol: float = 1e-6, abs_tol: float = 1e-9):
        self.rel_tol = rel_tol
        self.abs_tol = abs_tol

    def __call__(self, task: Task, completion: str, result: VerifyResult | None = None) -> float:
        del result
        if task.answer is None:
            return 0.0
        got = extract_answer(completion)
        return float(answers_match(got, task.answer, rel_tol=self.rel_tol, abs_tol=self.abs_tol))


def code_pass_rate(task: Task, completion: str, result: VerifyResult | None) -> float:
    """Fraction of a code task's tests that passed, as the code domain reported it."""
    del task, completion
    if result is None:
        raise ValueError("the 'code_pass_rate' reward needs the domain's VerifyResult")
    if not result.valid:
        return 0.0
    rate = result.details.get("pass_rate")
    return float(result.reward if rate is None else rate)


def answer_format_ok(task: Task, completion: str) -> bool:
    """One ``<answer>`` marker, a non-empty answer after it, in the task's expected form.

    ``task.data["answer_format"]`` picks the form: ``number`` (parses as a
    number), ``code`` (compiles as Python; compiling runs nothing), ``list_program``
    (parses in the ``list_programs`` DSL) or anything else / absent (any non-empty text).
    """
    if completion.count(ANSWER) != 1:
        return False
    answer = extract_answer(completion)
    if not answer:
        return False
    form = task.data.get("answer_format")
    if form == "number":
        return parse_number(answer) is not None
    if form == "code":
        try:
            compile(answer, "<answer>", "exec")
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
            return False
    if form == "list_program":
        from rlpt.tasks.list_programs import ProgramError, parse

        try:
            parse(answer)
        except ProgramError:
            return False
    return True


def format_reward(task: Task, completion: str, result: VerifyResult | None = None) -> float:
    """1 if the answer is present in the expected form (see ``answer_format_ok``)."""
    del result
    return float(answer_format_ok(task, completion))


class LengthPenalty:
    """``-max(0, n - target_bytes) / scale_bytes`` for a completion of ``n`` UTF-8 bytes.

    Bytes, because rlpt's tokenizer is byte-level; marker strings count at their
    written length. With the defaults a 12-byte completion scores -0.12.
    """

    def __init__(self, target_bytes: int = 0, scale_bytes: float = 100.0):
        if scale_bytes <= 0:
            raise ValueError("scale_bytes must be positive")
        self.target_bytes = target_bytes
        self.scale_bytes = scale_bytes

    def __call__(self, task: Task, completion: str, result: VerifyResult | None = None) -> float:
        del task, result
        n = len(completion.encode("utf-8"))
        return -max(0, n - self.target_bytes) / self.scale_bytes


class RewardTerms(NamedTuple):
    """A composite reward: the weighted total and each term's unweighted value."""

    total: float
    terms: dict[str, float]


class CompositeReward:
    """A weighted sum of named reward terms.

    ``weights`` maps a term name to its weight; a term is looked up with
    ``get_reward`` (a registered name or ``pkg.module:attr``) unless ``terms``
    gives its function. ``total = sum(weights[k] * terms[k])``.
    """

    def __init__(
        self,
        weights: Mapping[str, float],
        terms: Mapping[str, RewardFn | str] | None = None,
    ):
        from rlpt.tasks.registry import get_reward

        terms = dict(terms or {})
        extra = set(terms) - set(weights)
        if extra:
            raise ValueError(f"terms without a weight: {sorted(extra)}")
        self.weights = {k: float(w) for k, w in weights.items()}
        self.fns: dict[str, RewardFn] = {}
        for name in self.weights:
            fn = terms.get(name, name)
            self.fns[name] = get_reward(fn) if isinstance(fn, str) else fn

    def __call__(
        self, task: Task, completion: str, result: VerifyResult | None = None
    ) -> RewardTerms:
        values = {name: float(fn(task, completion, result)) for name, fn in self.fns.items()}
        total = math.fsum(self.weights[k] * v for k, v in values.items())
        return RewardTerms(total, values)

    def batch(
        self,
        tasks: Sequence[Task],
        completions: Sequence[str],
        results: Sequence[VerifyResult | None] | None = None,
    ) -> list[RewardTerms]:
        if results is None:
            results = [None] * len(tasks)
        if not len(tasks) == len(completions) == len(results):
            raise ValueError("tasks, completions and results must have the same length")
        return [self(t, c, r) for t, c, r in zip(tasks, completions, results)]
