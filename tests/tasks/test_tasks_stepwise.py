"""Stepwise math: per-step checking and planted wrong steps for process rewards."""

import random

import numpy as np
import pytest

from rlpt.tasks import StepwiseMathDomain, Task
from rlpt.tasks.stepwise_math import parse_step

DOMAIN = StepwiseMathDomain()
# "start at 5, add 3, times 2, minus 4"
TASK = Task(
    "s",
    "stepwise_math",
    "start at 5, add 3, times 2, minus 4",
    2,
    "12",
    {"start": 5, "instructions": [["+", 3], ["*", 2], ["-", 4]], "answer_format": "number"},
)


def test_demonstration_hand_worked():
    assert DOMAIN.demonstration(TASK) == "5+3=8<step>8*2=16<step>16-4=12<answer>12"


@pytest.mark.parametrize(
    "completion, labels",
    [
        ("5+3=8<step>8*2=16<step>16-4=12<answer>12", [True, True, True]),
        ("5 + 3 = 8<step>8*2=16<step>16-4=12<answer>12", [True, True, True]),
        ("5+3=9<step>9*2=18<step>18-4=14<answer>14", [False, False, False]),
        ("5+3=8<step>8*2=15<step>16-4=12<answer>12", [True, False, True]),  # back on the path
        ("5+3=8<step>8+2=10<step>16-4=12<answer>12", [True, False, True]),  # wrong operation
        ("5+3=8<step>eight times two<step>16-4=12<answer>12", [True, False, True]),
        ("5+3=8<step>8*2=16<step>16-4=12<step>12+0=12<answer>12", [True, True, True, False]),
        ("<answer>12", []),
    ],
)
def test_check_steps(completion, labels):
    assert DOMAIN.check_steps(TASK, completion) == labels


def test_parse_step():
    assert parse_step("8*2=16") == (8, "*", 2, 16)
    assert parse_step("-3-4=-7") == (-3, "-", 4, -7)
    assert parse_step(" 16 / 4 = 4 ") == (16, "/", 4, 4)
    assert parse_step("8*2") is None


@pytest.mark.parametrize("rng", [random.Random(0), np.random.default_rng(0)])
def test_corrupt_step_plants_one_error_and_carries_it(rng):
    for difficulty in range(1, DOMAIN.max_difficulty + 1):
        for task in DOMAIN.tasks("train", 10, difficulty):
            good = DOMAIN.demonstration(task)
            bad = DOMAIN.corrupt_step(task, good, rng)
            labels = DOMAIN.check_steps(task, bad)
            first = labels.index(False)
            assert labels == [True] * first + [False] * (len(labels) - first)
            assert DOMAIN.verify(task, bad).reward == 0.0
            # Every step still does correct arithmetic from what it was given,
            # except the planted one: the error is carried, not compounded.
            for i, step in enumerate(bad.split("<answer>")[0].split("<step>")):
                a, op, b, c = parse_step(step)
                true_c = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
                assert (c == true_c) == (i != first)
                if op == "/":
                    assert a % b == 0


def test_corrupt_step_is_deterministic_given_rng():
    good = DOMAIN.demonstration(TASK)
    assert DOMAIN.corrupt_step(TASK, good, random.Random(5)) == DOMAIN.corrupt_step(
        TASK, good, random.Random(5)
    )


def test_corrupt_step_needs_a_parsable_step():
    with pytest.raises(ValueError):
        DOMAIN.corrupt_step(TASK, "no steps here<answer>12", random.Random(0))
