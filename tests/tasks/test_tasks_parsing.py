"""Answer and step parsing: hand-worked edge cases."""

from fractions import Fraction

import pytest

from rlpt.tasks import answers_match, extract_answer, parse_number, split_steps


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("12+7=19<step>19*2=38<answer>38", "38"),
        ("<answer>  38 \n", "38"),
        ("no marker at all 38", None),
        ("<answer>", ""),
        ("<answer>1<answer>2", "2"),  # the last marker wins
        ("3*4=12<answer>12<eos><pad><pad>", "12"),  # decoder leftovers are not the answer
        ("<answer>lambda x: 3*x+1", "lambda x: 3*x+1"),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("5+3=8<step>8*2=16<step>16-4=12<answer>12", ["5+3=8", "8*2=16", "16-4=12"]),
        ("5+3=8<answer>8", ["5+3=8"]),
        ("<answer>8", []),
        ("5+3=8<step><step>16-4=12<answer>12", ["5+3=8", "", "16-4=12"]),  # empty step kept
        ("5+3=8<step> 8*2=16 ", ["5+3=8", "8*2=16"]),  # no answer yet
    ],
)
def test_split_steps(completion, expected):
    assert split_steps(completion) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("38", Fraction(38)),
        (" 38 ", Fraction(38)),
        ("+38", Fraction(38)),
        ("38.0", Fraction(38)),
        ("38.", Fraction(38)),
        ("-5", Fraction(-5)),
        ("- 5", Fraction(-5)),
        ("1e3", Fraction(1000)),
        ("3/4", Fraction(3, 4)),
        ("0.1", Fraction(1, 10)),
        ("", None),
        ("38 apples", None),
        ("1/0", None),
        ("nan", None),
        ("inf", None),
        ("--5", None),
        (None, None),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    "predicted, expected, kwargs, match",
    [
        ("38.0", "38", {}, True),
        ("+38", "38", {}, True),
        ("38.0000001", "38", {}, False),  # exact by default
        ("38.0000001", "38", {"rel_tol": 1e-6}, True),  # 1e-7 <= 38e-6
        ("38.1", "38", {"abs_tol": 0.05}, False),
        ("0.30000000000000004", "0.3", {}, False),
        ("0.3", "0.3", {}, True),
        ("6/8", "0.75", {}, True),
        ("thirty", "38", {}, False),
        (None, "38", {}, False),
        ("hello  world", "hello world", {}, True),  # text: whitespace collapsed
        ("Hello world", "hello world", {}, False),
    ],
)
def test_answers_match(predicted, expected, kwargs, match):
    assert answers_match(predicted, expected, **kwargs) is match
