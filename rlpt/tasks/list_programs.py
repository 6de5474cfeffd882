"""Program synthesis in a small list DSL: infer a pipeline of primitives from examples.

``"[3142]>[975] [75]>[51] [908]>[97] [6620]>[335] ?"`` ->
``"<answer>filter(x>1)|rsort|map(x*2+1)"``, in the spirit of DeepCoder (Balog et al.
2017, arXiv:1611.01989) but over lists of digits: every value is an integer 0..9, a
list is written without commas (``[3142]`` is 3, 1, 4, 2; ``[]`` is empty) and
arithmetic is mod 10, so values stay single bytes however long the pipeline (prompts
and answers are read one byte per token).

A program is list stages joined by ``|``, optionally ending in one reduction. Stages,
with the family each belongs to:

- ``map(x*a+b)`` (``map``): ``(a*x+b) % 10`` each; ``map(x+b)``, ``map(x*a)`` are its
  short forms. ``map(x%m)`` (``mod``), ``map(x//m)`` (``div``).
- ``filter(x>t)`` (``gt``), ``filter(x<t)`` (``lt``), ``filter(x%m==r)`` (``modeq``),
  ``filter(x!=c)`` (``ne``).
- ``take(k)``, ``drop(k)``: the first ``k`` / all but the first ``k``.
- ``sort``, ``rsort`` (``sort``); ``rev``; ``cumsum`` (running sums mod 10); ``dedup``
  (first occurrences, in order).
- Reductions: ``sum`` (mod 10), ``len``, ``max``, ``min``, ``head``, ``last`` (the
  last four give 0 on ``[]``).

``parse`` reads any program of this grammar (spaces allowed, constants of up to three
digits) without ``eval``; anything else is a ``ProgramError``, which the verifier
scores as a wrong answer with the reason in ``details["feedback"]``. The reward is the
fraction of hidden inputs (the shown ones, ``EDGE_INPUTS`` such as ``[]``, and random
ones) on which the answer's output is right.

Levels: level ``d`` has ``d + 2`` stages (``LEVEL_STAGES``), two adjacent ones never of
the same family (which rules out pairs that merge into one stage, such as
``map(x+1)|map(x+2)``), then a reduction with probability 1/3. ``program_space_size``
counts a level's programs from ``FAMILIES``: 1.5e7 at level 1, then 1.7e9, 2.1e11 and
2.5e13. The sampler draws families with weights, redraws a stage that leaves the probe
outputs unchanged or keeps under a quarter of their values, and rejects programs that
are trivial on the probes (``_trivial``): the identity, a function of the length alone,
lists of a single digit, or a stage whose removal changes nothing. What it can reach
still computes over 10^6 functions at level 1: a search over every level-1 program
under these rules (a minute and a half, so not a test) found 1,105,092 distinct probe
fingerprints that no program of one or two stages has, and 1,148,921 in all.

Partitions are by behaviour: ``Problem.key`` is a hash of the program's outputs on
``PROBES``, so programs computing the same function (``map(x+1)|map(x+2)`` and
``map(x+3)``; ``filter(x>3)|sort`` and ``sort|filter(x>3)``), and one program shown on
different inputs, never straddle train and test.

Out-of-distribution splits: ``HELDOUT_PAIRS`` are ordered family pairs (adjacent stages,
or last stage then reduction) that no ``train``/``heldout``/``validation``/``test``/``ood``
program contains. ``ood_composition`` draws programs of the level's length holding at
least one of them; ``ood_length`` draws programs of seen pairs only, two stages longer
than the level's. Both come from the held-out partition (``rlpt.tasks.base``); the base
``ood`` split is the in-distribution sampler on that partition, as in other domains.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlpt.tasks.base import ANSWER, AnswerDomain, Problem, Task, VerifyResult, extract_answer


def _affine(a: int, b: int) -> str:
    if a == 1:
        return f"map(x+{b})"
    return f"map(x*{a})" if b == 0 else f"map(x*{a}+{b})"


# Every stage of the sampler, by family: the instances are the canonical texts.
FAMILIES: dict[str, tuple[str, ...]] = {
    "map": tuple(_affine(a, b) for a in range(1, 10) for b in range(10) if (a, b) != (1, 0)),
    "mod": tuple(f"map(x%{m})" for m in range(2, 10)),
    "div": tuple(f"map(x//{m})" for m in range(2, 10)),
    "gt": tuple(f"filter(x>{t})" for t in range(9)),
    "lt": tuple(f"filter(x<{t})" for t in range(1, 10)),
    "modeq": tuple(f"filter(x%{m}=={r})" for m in range(2, 6) for r in range(m)),
    "ne": tuple(f"filter(x!={c})" for c in range(10)),
    "take": tuple(f"take({k})" for k in range(1, 6)),
    "drop": tuple(f"drop({k})" for k in range(1, 6)),
    "sort": ("sort", "rsort"),
    "rev": ("rev",),
    "cumsum": ("cumsum",),
    "dedup": ("dedup",),
}
# A reduction is its own family in ``HELDOUT_PAIRS``.
REDUCTIONS: tuple[str, ...] = ("sum", "max", "min", "len", "head", "last")
# Compositions kept out of every in-distribution program. Each changes meaning when its
# two stages swap, so the ``ood_composition`` program is not merely a reordering of a
# seen one (``filter|sort`` would be: filters commute with sorting).
HELDOUT_PAIRS: tuple[tuple[str, str], ...] = (
    ("sort", "take"),  # the k smallest / largest
    ("map", "cumsum"),
    ("cumsum", "mod"),
    ("div", "dedup"),
    ("rev", "drop"),
    ("dedup", "len"),  # the number of distinct values
)
# Stages per level; ``ood_length`` adds two.
LEVEL_STAGES = {1: 3, 2: 4, 3: 5, 4: 6}
OOD_EXTRA_STAGES = 2
# Examples shown per level; the verifier also runs ``EDGE_INPUTS`` and random inputs.
SHOWN = {1: 4, 2: 5, 3: 5, 4: 6}
# Families are drawn with weight 1 + ln(instances): parameterised ones a little more
# often, since they have more to learn and repeat less (uniform weights drew the few
# parameterless triples, such as ``dedup|rsort|cumsum``, many times over).
_FAMILY_WEIGHT = {f: 1 + math.log(len(inst)) for f, inst in FAMILIES.items()}
_REDUCTION_P = 1 / 3
# Shown inputs have 3..7 digits; the verifier adds the edge cases and 8 random inputs
# of 2..9 digits, so an answer fitted to the shown examples alone can still fail.
_SHOWN_LENGTHS = (3, 7)
EDGE_INPUTS = ("", "0", "9", "5555", "31415926")
_HIDDEN_RANDOM = 8
_HIDDEN_LENGTHS = (2, 9)
# Fixed inputs whose outputs identify a program's behaviour (``behaviour_key``): every
# digit, the empty list, singletons, runs, duplicates, sorted, reversed, lengths 0..9.
# Long varied ones come first: comparisons stop at the first probe that differs.
PROBES = (
    "314159265", "902741", "27182818", "0123456", "9876543", "8080808", "13579", "24680",
    "55200", "99019", "31415926", "3366", "2212", "7070", "4444", "123", "987", "605",
    "468", "642", "91", "58", "00", "11", "0", "7", "1", "",
)  # fmt: skip
_PROBE_LISTS = tuple([int(c) for c in p] for p in PROBES)
_MAX_PROGRAM_CHARS = 400
_MAX_STAGES = 32
_MAX_TRIES = 1000
# The sampler's checks on each new stage look at the first few probes only (for speed),
# and want a quarter of their values kept: long pipelines of filters otherwise end in
# empty lists (at level 4, most drawn programs had a dead stage).
_DRAW_PROBES = 10
_MIN_DRAW_VALUES = sum(len(p) for p in PROBES[:_DRAW_PROBES]) // 4
_STAGE_TRIES = 8
_MAX_EXAMPLE_TRIES = 50


class ProgramError(ValueError):
    """An answer that is not a program of the DSL."""


# Stage name -> (family, pattern of its text without spaces); constants are 1-3 digits.
_N = r"([0-9]{1,3})"
_STAGES: tuple[tuple[str, str, re.Pattern[str]], ...] = tuple(
    (name, family, re.compile(pattern))
    for name, family, pattern in (
        ("affine", "map", rf"map\(x(?:\*{_N})?(?:\+{_N})?\)"),
        ("mod", "mod", rf"map\(x%{_N}\)"),
        ("div", "div", rf"map\(x//{_N}\)"),
        ("gt", "gt", rf"filter\(x>{_N}\)"),
        ("lt", "lt", rf"filter\(x<{_N}\)"),
        ("modeq", "modeq", rf"filter\(x%{_N}=={_N}\)"),
        ("ne", "ne", rf"filter\(x!={_N}\)"),
        ("take", "take", rf"take\({_N}\)"),
        ("drop", "drop", rf"drop\({_N}\)"),
        ("sort", "sort", r"sort"),
        ("rsort", "sort", r"rsort"),
        ("rev", "rev", r"rev"),
        ("cumsum", "cumsum", r"cumsum"),
        ("dedup", "dedup", r"dedup"),
        *((r, r, r) for r in REDUCTIONS),
    )
)

Op = tuple[str, tuple[int, ...]]  # (stage name, its constants)


def _parse_stage(text: str) -> tuple[Op, str]:
    for name, family, pattern in _STAGES:
        m = pattern.fullmatch(text)
        if m is None:
            continue
        if name == "affine":
            a, b = m[1], m[2]
            return (name, (1 if a is None else int(a), 0 if b is None else int(b))), family
        args = tuple(int(g) for g in m.groups())
        if name in ("mod", "div", "modeq") and args[0] == 0:
            raise ProgramError(f"{text!r} divides by zero")
        return (name, args), family
    raise ProgramError(f"unknown stage {text!r}")


def parse(text: str) -> tuple[Op, ...]:
    """``"sort | take(2)"`` -> ``(("sort", ()), ("take", (2,)))``; ``ProgramError`` if malformed."""
    return tuple(op for op, _ in _parse_with_families(text))


def families_of(text: str) -> tuple[str, ...]:
    """The family of each stage of a program (a reduction is its own family)."""
    return tuple(family for _, family in _parse_with_families(text))


def _parse_with_families(text: str) -> list[tuple[Op, str]]:
    if len(text) > _MAX_PROGRAM_CHARS:
        raise ProgramError(f"program longer than {_MAX_PROGRAM_CHARS} characters")
    compact = "".join(text.split())
    if not compact:
        raise ProgramError("empty program")
    parts = compact.split("|")
    if len(parts) > _MAX_STAGES:
        raise ProgramError(f"more than {_MAX_STAGES} stages")
    stages = [_parse_stage(part) for part in parts]
    for (name, _), _ in stages[:-1]:
        if name in REDUCTIONS:
            raise ProgramError(f"{name} gives a number; no stage may follow it")
    return stages


def _cumsum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total = (total + x) % 10
        out.append(total)
    return out


# Stage name -> its meaning, called as ``f(xs, *constants)``.
_MEANING: dict[str, Callable[..., list[int] | int]] = {
    "affine": lambda xs, a, b: [(a * x + b) % 10 for x in xs],
    "mod": lambda xs, m: [x % m for x in xs],
    "div": lambda xs, m: [x // m for x in xs],
    "gt": lambda xs, t: [x for x in xs if x > t],
    "lt": lambda xs, t: [x for x in xs if x < t],
    "modeq": lambda xs, m, r: [x for x in xs if x % m == r],
    "ne": lambda xs, c: [x for x in xs if x != c],
    "take": lambda xs, k: xs[:k],
    "drop": lambda xs, k: xs[k:],
    "sort": sorted,
    "rsort": lambda xs: sorted(xs, reverse=True),
    "rev": lambda xs: xs[::-1],
    "cumsum": _cumsum,
    "dedup": lambda xs: list(dict.fromkeys(xs)),
    "sum": lambda xs: sum(xs) % 10,
    "len": len,
    "max": lambda xs: max(xs, default=0),
    "min": lambda xs: min(xs, default=0),
    "head": lambda xs: xs[0] if xs else 0,
    "last": lambda xs: xs[-1] if xs else 0,
}


def _apply(op: Op, xs: list[int]) -> list[int] | int:
    name, args = op
    return _MEANING[name](xs, *args)


def run(program: Sequence[Op], xs: list[int]) -> list[int] | int:
    """The program's output on the digit list ``xs`` (which no stage modifies)."""
    value: list[int] | int = xs
    for op in program:
        value = _apply(op, value)  # type: ignore[arg-type]  # only a last reduction gives an int
    return value


def read_list(text: str) -> list[int]:
    """``"314"`` -> ``[3, 1, 4]``."""
    return [int(c) for c in text]


def show(value: list[int] | int) -> str:
    """``[3, 1, 4]`` -> ``"[314]"``; a number as itself."""
    if isinstance(value, int):
        return str(value)
    return "[" + "".join(str(v) for v in value) + "]"


# The parsed stage of every instance in the table, for the sampler.
_OPS: dict[str, Op] = {t: parse(t)[0] for inst in FAMILIES.values() for t in (*inst, *REDUCTIONS)}


def _probe_outputs(program: Sequence[Op]) -> list[list[int] | int]:
    return [run(program, xs) for xs in _PROBE_LISTS]


def behaviour_key(program: Sequence[Op]) -> str:
    """A fingerprint of what the program computes: a hash of its outputs on ``PROBES``."""
    return _key(_probe_outputs(program))


def _key(outputs: list[list[int] | int]) -> str:
    text = " ".join(show(o) for o in outputs)
    return "list_programs:" + hashlib.sha256(text.encode()).hexdigest()[:20]


def _allowed(prev: str | None, nxt: str, pairs: frozenset[tuple[str, str]]) -> bool:
    return prev != nxt and (prev, nxt) not in pairs


def program_space_size(
    n_stages: int,
    *,
    heldout: bool = True,
    families: Mapping[str, Sequence[str]] = FAMILIES,
    reductions: Sequence[str] = REDUCTIONS,
    pairs: Sequence[tuple[str, str]] = HELDOUT_PAIRS,
) -> int:
    """How many distinct programs have ``n_stages`` stages, with or without a reduction.

    Adjacent stages differ in family; with ``heldout`` no adjacent pair (reduction
    included) is in ``pairs``, which is the in-distribution space. Without it, the
    space of every split at that length; ``ood_composition``'s is the difference. A
    transfer-matrix count: ``W[i][g] = w_g * sum_{f allowed before g} W[i-1][f]``
    with ``w_g`` the instances of family ``g``, then each end family times the
    number of allowed endings (none, or an allowed reduction).
    """
    banned = frozenset(pairs) if heldout else frozenset()
    ways = {g: len(inst) for g, inst in families.items()}
    for _ in range(n_stages - 1):
        ways = {
            g: len(families[g]) * sum(w for f, w in ways.items() if _allowed(f, g, banned))
            for g in families
        }
    return sum(w * (1 + sum(_allowed(f, r, banned) for r in reductions)) for f, w in ways.items())


def _choose_family(
    rng: random.Random, prev: str | None, nxt: str | None, banned: frozenset[tuple[str, str]]
) -> str:
    options, weights = _family_options(prev, nxt, banned)
    return rng.choices(options, weights)[0]


@functools.cache
def _family_options(
    prev: str | None, nxt: str | None, banned: frozenset[tuple[str, str]]
) -> tuple[list[str], list[float]]:
    options = [f for f in FAMILIES if _allowed(prev, f, banned) and f != nxt]
    return options, [_FAMILY_WEIGHT[f] for f in options]


def _draw(rng: random.Random, n: int, pair: tuple[str, str] | None) -> str | None:
    """A program of ``n`` stages, or None where a draw failed (the caller draws again).

    Without ``pair``, no adjacent families form a held-out pair; with one, that pair is
    placed at a random position and the other stages are free. Each stage is drawn
    until it changes the probe states it receives: a cheap filter against dead stages
    (``take(5)`` after a filter that leaves at most two values), which ``_trivial``
    then checks for the whole program.
    """
    banned = frozenset() if pair else frozenset(HELDOUT_PAIRS)
    fixed: dict[int, str] = {}
    reduction = None
    if pair is not None:
        first, second = pair
        if second in REDUCTIONS:
            fixed[n - 1], reduction = first, second
        else:
            i = rng.randrange(n - 1)
            fixed[i], fixed[i + 1] = first, second
    states = list(_PROBE_LISTS[:_DRAW_PROBES])
    stages: list[str] = []
    prev = None
    for i in range(n):
        for _ in range(_STAGE_TRIES):
            family = fixed.get(i) or _choose_family(rng, prev, fixed.get(i + 1), banned)
            text = rng.choice(FAMILIES[family])
            changed = [_apply(_OPS[text], xs) for xs in states]
            if changed != states and sum(map(len, changed)) >= _MIN_DRAW_VALUES:
                break
        else:
            return None
        stages.append(text)
        states, prev = changed, family
    if reduction is None and rng.random() < _REDUCTION_P:
        reduction = rng.choice([r for r in REDUCTIONS if _allowed(prev, r, banned)])
    return "|".join([*stages, *([reduction] if reduction else [])])


def _trivial(program: tuple[Op, ...], outputs: list[list[int] | int]) -> bool:
    """Nothing worth inferring, judged on the probes (``outputs`` are the program's own).

    The identity; a function of the length alone (constants included); lists of a
    single digit (a count written in unary); or a stage whose removal changes nothing
    (``rev|dedup|sort``), so the program only repeats a shorter one.
    """
    if outputs == list(_PROBE_LISTS):
        return True
    by_length: dict[int, list[int] | int] = {}
    if all(by_length.setdefault(len(xs), o) == o for xs, o in zip(_PROBE_LISTS, outputs)):
        return True
    values = {v for o in outputs if isinstance(o, list) for v in o}
    if not isinstance(outputs[0], int) and len(values) < 2:
        return True  # as filter(x>7)|map(x//8) gives
    return any(
        _same_on_probes(program[:i] + program[i + 1 :], outputs)
        for i, (name, _) in enumerate(program)
        if name not in REDUCTIONS
    )


def _same_on_probes(program: Sequence[Op], outputs: list[list[int] | int]) -> bool:
    # Stops at the first probe that differs, which is usually among the first few.
    return all(run(program, xs) == o for xs, o in zip(_PROBE_LISTS, outputs))


def _random_input(rng: random.Random, lengths: tuple[int, int]) -> str:
    return "".join(rng.choices("0123456789", k=rng.randint(*lengths)))


def _examples(rng: random.Random, program: tuple[Op, ...], n: int) -> list[str]:
    """``n`` distinct inputs whose outputs differ and are not all the inputs themselves."""
    for _ in range(_MAX_EXAMPLE_TRIES):
        inputs = [_random_input(rng, _SHOWN_LENGTHS) for _ in range(n)]
        outputs = [run(program, read_list(x)) for x in inputs]
        informative = len(set(map(show, outputs))) > 1 and any(
            o != read_list(x) for o, x in zip(outputs, inputs)
        )
        if len(set(inputs)) == n and informative:
            return inputs
    return inputs


class ListProgramsDomain(AnswerDomain):
    """Infer a DSL program from input/output examples; reward is the fraction of hidden
    inputs right (``all_or_nothing=True``: 1 only when every one is right)."""

    name = "list_programs"
    max_difficulty = max(LEVEL_STAGES)
    needs_sandbox = False
    extra_splits = ("ood_composition", "ood_length")

    def __init__(self, all_or_nothing: bool = False):
        self.all_or_nothing = all_or_nothing

    def _sample(self, rng: random.Random, difficulty: int) -> Problem:
        return self._sample_split(rng, difficulty, "train")

    def _sample_split(self, rng: random.Random, difficulty: int, split: str) -> Problem:
        n = LEVEL_STAGES[difficulty] + OOD_EXTRA_STAGES * (split == "ood_length")
        pair = rng.choice(HELDOUT_PAIRS) if split == "ood_composition" else None
        for _ in range(_MAX_TRIES):
            text = _draw(rng, n, pair)
            if text is None:
                continue
            program = parse(text)
            outputs = _probe_outputs(program)
            if not _trivial(program, outputs):
                return self.problem_for(text, rng, SHOWN[difficulty], key=_key(outputs))
        raise RuntimeError(f"{self.name}: no {split} program at level {difficulty}")

    @staticmethod
    def problem_for(text: str, rng: random.Random, n_shown: int, key: str | None = None) -> Problem:
        """The problem for program ``text``, shown on ``n_shown`` random inputs.

        ``key`` is its ``behaviour_key`` where the caller already has it.
        """
        program = parse(text)
        shown = _examples(rng, program, n_shown)
        hidden = [_random_input(rng, _HIDDEN_LENGTHS) for _ in range(_HIDDEN_RANDOM)]
        inputs = list(dict.fromkeys([*shown, *EDGE_INPUTS, *hidden]))
        expected = {x: show(run(program, read_list(x))) for x in inputs}
        prompt = " ".join(f"[{x}]>{expected[x]}" for x in shown)
        return Problem(
            prompt=prompt + " ?",
            answer=text,
            data={
                "inputs": inputs,
                "expected": [expected[x] for x in inputs],
                "stages": sum(op[0] not in REDUCTIONS for op in program),
                "answer_format": "list_program",
            },
            key=behaviour_key(program) if key is None else key,
        )

    def demonstration(self, task: Task) -> str:
        return ANSWER + task.answer

    def verify_one(self, task: Task, completion: str) -> VerifyResult:
        got = extract_answer(completion)
        if not got:
            return VerifyResult(0.0, "no_answer", True, {"parsed": got, "pass_rate": 0.0})
        try:
            program = parse(got)
        except ProgramError as e:
            details = {"parsed": got, "pass_rate": 0.0, "feedback": f"not a program: {e}"}
            return VerifyResult(0.0, "wrong", True, details)
        inputs, expected = task.data["inputs"], task.data["expected"]
        outputs = [show(run(program, read_list(x))) for x in inputs]
        ok = [o == e for o, e in zip(outputs, expected)]
        rate = sum(ok) / len(ok)
        details: dict[str, Any] = {
            "parsed": got, "pass_rate": rate, "passed": sum(ok), "total": len(ok),
        }  # fmt: skip
        if all(ok):
            return VerifyResult(1.0, "correct", True, details)
        i = ok.index(False)
        details["feedback"] = f"on [{inputs[i]}] gave {outputs[i]}, expected {expected[i]}"
        reward = 0.0 if self.all_or_nothing else rate
        return VerifyResult(reward, "partial" if any(ok) else "wrong", True, details)
