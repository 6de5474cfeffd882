"""Free-form math answers (math-verify) and the fractions domain."""

import itertools
import re
import threading
import time
from fractions import Fraction

import pytest

from rlpt.tasks import FractionsDomain, Task, get_reward, math_answers, math_equivalent


@pytest.mark.parametrize(
    "answer",
    ["19/12", "38/24", "\\frac{19}{12}", "$\\frac{19}{12}$", "\\boxed{19/12}", "x = 19/12",
     "1.583333", " 19 / 12 "],
)  # fmt: skip
def test_equivalent_forms_are_accepted(answer):
    assert math_equivalent("19/12", answer)


@pytest.mark.parametrize(
    "answer", ["12/19", "1.58", "-19/12", "19/13", "", "   ", "abc", None, "1" * 300]
)
def test_other_values_are_rejected(answer):
    assert not math_equivalent("19/12", answer)


def test_integers_and_negatives():
    assert math_equivalent("-3", "-3") and math_equivalent("-3", "-6/2")
    assert math_equivalent("-5/6", "-\\frac{5}{6}") and not math_equivalent("-5/6", "5/6")


def test_off_the_main_thread_power_towers_are_not_evaluated():
    """Without math-verify's alarm-based time bound, ``9^9^9`` would run for ever."""
    out = {}

    def work():
        start = time.perf_counter()
        out["tower"] = math_equivalent("1", "9^9^9^9")
        out["plain"] = math_equivalent("19/12", "\\frac{19}{12}")
        out["s"] = time.perf_counter() - start

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert out["tower"] is False and out["plain"] is True and out["s"] < 30


def test_math_verify_reward():
    reward = get_reward("math_verify")
    task = Task("t", "fractions", "1/2+1/3=", 1, "5/6")
    assert reward(task, "1/2+1/3=5/6<answer>\\frac{5}{6}", None) == 1.0
    assert reward(task, "<answer>0.8", None) == 0.0
    assert reward(task, "no marker 5/6", None) == 0.0
    with pytest.raises(ValueError, match="no reference answer"):
        reward(Task("u", "code", "p", 1, None), "<answer>1", None)


def _evaluate(prompt: str) -> Fraction:
    """The prompt's value with Python's own operator precedence over exact fractions."""
    assert prompt.endswith("=")
    expression = re.sub(r"(\d+)", r"Fraction(\1)", prompt[:-1])
    return eval(expression, {"Fraction": Fraction})


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_answers_follow_the_written_expression(level):
    """The reference answer is the prompt's value under ordinary precedence: the
    brackets the prompt writes make left-to-right evaluation what a reader reads."""
    domain = FractionsDomain()
    for task in domain.tasks("train", 60, level) + domain.tasks("test", 20, level):
        assert Fraction(task.answer) == _evaluate(task.prompt), task.prompt
        steps = task.data["steps"]
        assert len(steps) == math_answers._TERMS[level] - 1
        # Each demonstration step is itself a true equation.
        for line in steps:
            lhs, rhs = line.split("=")
            assert _evaluate(lhs + "=") == Fraction(rhs), line


def test_hand_worked_task():
    domain = FractionsDomain()
    task = Task(
        "t", "fractions", "(1/2+1/3)*(3/4)=", 3, "5/8",
        {"steps": ["1/2+1/3=5/6", "5/6*(3/4)=5/8"]},
    )  # fmt: skip
    assert domain.demonstration(task) == "1/2+1/3=5/6<step>5/6*(3/4)=5/8<answer>5/8"
    assert domain.verify(task, "<answer>0.625").correct
    assert domain.verify(task, "<answer>\\frac{10}{16}").correct
    assert domain.verify(task, "<answer>5/6").outcome == "wrong"
    assert domain.verify(task, "5/8").outcome == "no_answer"


def test_level_sizes_exceed_a_million():
    for level in range(1, FractionsDomain.max_difficulty + 1):
        assert math_answers.level_size(level) >= 10**6


def test_level_size_counts_the_prompts(monkeypatch):
    """The formula against an independent count: with tiny ranges every prompt of
    level 1 and 2 turns up in enough draws, and there are exactly as many as it says."""
    monkeypatch.setattr(math_answers, "_MAX_NUMERATOR", 2)
    monkeypatch.setattr(math_answers, "_MAX_DENOMINATOR", 3)
    domain = FractionsDomain()
    for level, ops in [(1, "+-"), (2, "*/")]:
        signs = [1] if level == 1 else [1, -1]
        terms = [(s * n, d) for s in signs for n in (1, 2) for d in (2, 3)]
        expected = len(list(itertools.product(terms, ops, terms)))
        draws = [domain.tasks(split, 1500, level) for split in ("train", "heldout")]
        seen = {t.prompt for tasks in draws for t in tasks}
        assert len(seen) == expected == math_answers.level_size(level)
