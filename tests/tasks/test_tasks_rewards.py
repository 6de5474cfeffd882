"""Rule rewards and their weighted composition, with hand-worked values."""

import pytest

from rlpt.tasks import (
    ArithmeticDomain,
    CompositeReward,
    LengthPenalty,
    NumericMatch,
    Task,
    VerifyResult,
    answer_format_ok,
    code_pass_rate,
    correct,
    exact_match,
)

ARITH = ArithmeticDomain()
TASK = Task(
    "t", "arithmetic", "12+7*2=", 2, "26", {"expression": "12+7*2", "answer_format": "number"}
)
GOOD = "7*2=14<step>12+14=26<answer>26"  # 6 + 6 + 8 + 8 + 2 = 30 bytes


def test_composite_hand_worked():
    reward = CompositeReward({"correct": 1.0, "format": 0.1, "length": 0.01})
    total, terms = reward(TASK, GOOD, ARITH.verify(TASK, GOOD))
    assert terms == {"correct": 1.0, "format": 1.0, "length": -0.30}
    assert total == pytest.approx(1.0 + 0.1 - 0.003)

    wrong = "12+7=19<answer> 38"  # 7 + 8 + 3 = 18 bytes: well formed, wrong
    total, terms = reward(TASK, wrong, ARITH.verify(TASK, wrong))
    assert terms == {"correct": 0.0, "format": 1.0, "length": -0.18}
    assert total == pytest.approx(0.1 - 0.0018)

    unformatted = "26"
    total, terms = reward(TASK, unformatted, ARITH.verify(TASK, unformatted))
    assert terms == {"correct": 0.0, "format": 0.0, "length": -0.02}
    assert total == pytest.approx(-0.0002)


def test_composite_custom_terms_and_batch():
    reward = CompositeReward(
        {"exact": 2.0, "short": 0.5},
        terms={"exact": exact_match, "short": LengthPenalty(target_bytes=10, scale_bytes=20)},
    )
    results = reward.batch([TASK, TASK], [GOOD, "<answer>25"])
    # GOOD: exact 1, 30 bytes -> -(30-10)/20 = -1; "<answer>25": exact 0, 10 bytes -> 0.
    assert results[0].terms == {"exact": 1.0, "short": -1.0}
    assert results[0].total == pytest.approx(2.0 - 0.5)
    assert results[1].terms == {"exact": 0.0, "short": 0.0}
    assert results[1].total == 0.0
    with pytest.raises(ValueError, match="without a weight"):
        CompositeReward({"a": 1.0}, terms={"b": exact_match})


def test_correct_excludes_invalid_and_needs_a_result():
    assert correct(TASK, GOOD, VerifyResult(0.5, "partial")) == 0.5
    assert correct(TASK, GOOD, VerifyResult(1.0, "sandbox_error", valid=False)) == 0.0
    with pytest.raises(ValueError):
        correct(TASK, GOOD, None)


def test_numeric_match_tolerance():
    task = Task("t", "d", "p", 1, "3.14159")
    assert NumericMatch(rel_tol=1e-3)(task, "<answer>3.1416") == 1.0
    assert NumericMatch(rel_tol=1e-6)(task, "<answer>3.1416") == 0.0
    assert NumericMatch()(task, "<answer>pi") == 0.0
    assert exact_match(task, "<answer>3.14159000") == 1.0


def test_code_pass_rate():
    assert (
        code_pass_rate(TASK, "", VerifyResult(0.0, "partial", details={"pass_rate": 0.25})) == 0.25
    )
    assert code_pass_rate(TASK, "", VerifyResult(1.0, "correct")) == 1.0
    assert code_pass_rate(TASK, "", VerifyResult(0.0, "sandbox_error", valid=False)) == 0.0


@pytest.mark.parametrize(
    "completion, data, ok",
    [
        ("<answer>26", {"answer_format": "number"}, True),
        ("<answer> -2.5 ", {"answer_format": "number"}, True),
        ("<answer>twenty", {"answer_format": "number"}, False),
        ("<answer>", {}, False),
        ("26", {}, False),
        ("<answer>1<answer>2", {}, False),  # one answer, not several
        ("<answer>lambda x: x+1", {"answer_format": "code"}, True),
        ("<answer>lambda x: (", {"answer_format": "code"}, False),
        ("<answer>anything", {}, True),
        ("<answer>sort|take(2)|sum", {"answer_format": "list_program"}, True),
        ("<answer>sort|explode", {"answer_format": "list_program"}, False),
    ],
)
def test_format(completion, data, ok):
    assert answer_format_ok(Task("t", "d", "p", 1, "26", data), completion) is ok
