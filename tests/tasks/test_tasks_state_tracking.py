"""State tracking: hand-worked iterations, step labels, level lengths, the split."""

import random

import numpy as np
import pytest

from rlpt.tasks import StateTrackingDomain, Task, get_domain, partition_of
from rlpt.tasks.state_tracking import LEVEL_STEPS, iterate, parse_step
from rlpt.tokenizers import ByteTokenizer

DOMAIN = StateTrackingDomain()
# x=417; x=(x+583)%1000 three times: 417+583 = 1000 -> 0; 0+583 = 583; 583+583 = 1166 -> 166.
TASK = Task(
    "s", "state_tracking", "x=417; x=(x+583)%1000; 3 times", 1, "166",
    {"start": 417, "add": 583, "steps": 3, "answer_format": "number"},
)  # fmt: skip


def test_iterate_hand_worked():
    assert iterate(417, 583, 3) == [417, 0, 583, 166]
    assert iterate(999, 1, 2) == [999, 0, 1]


def test_demonstration_hand_worked():
    assert DOMAIN.demonstration(TASK) == "1:0<step>2:583<step>3:166<answer>166"
    assert DOMAIN.verify(TASK, DOMAIN.demonstration(TASK)).correct


@pytest.mark.parametrize(
    "completion, labels",
    [
        ("1:0<step>2:583<step>3:166<answer>166", [True, True, True]),
        ("1: 0<step> 2:583 <step>3:166<answer>166", [True, True, True]),
        ("1:0<step>2:584<step>3:166<answer>166", [True, False, True]),
        ("1:0<step>3:583<step>3:166<answer>166", [True, False, True]),  # wrong counter
        ("1:0<step>2:583<step>3:166<step>4:749<answer>749", [True, True, True, False]),
        ("0<step>583<answer>583", [False, False]),
        ("<answer>166", []),
    ],
)
def test_check_steps(completion, labels):
    assert DOMAIN.check_steps(TASK, completion) == labels


@pytest.mark.parametrize("seed", range(12))
def test_corrupt_step_plants_one_error_and_carries_it(seed):
    rng = random.Random(seed)
    task = DOMAIN.tasks("train", 1, 2, seed=seed)[0]
    good = DOMAIN.demonstration(task)
    bad = DOMAIN.corrupt_step(task, good, rng)
    labels = DOMAIN.check_steps(task, bad)
    n = task.data["steps"]
    assert len(labels) == n
    first_wrong = labels.index(False)
    # Right up to the planted step, wrong from it on (a constant shift mod 1000 never
    # lands on the true state again), and the answer is the last written state.
    assert labels == [True] * first_wrong + [False] * (n - first_wrong)
    states = [parse_step(s)[1] for s in bad.split("<answer>")[0].split("<step>")]
    truth = iterate(task.data["start"], task.data["add"], n)[1:]
    shifts = {(b - t) % 1000 for b, t in zip(states[first_wrong:], truth[first_wrong:])}
    assert len(shifts) == 1 and 0 not in shifts
    assert bad.split("<answer>")[1] == str(states[-1])
    assert not DOMAIN.verify(task, bad).correct


def test_corrupt_step_numpy_rng_and_no_parsable_step():
    bad = DOMAIN.corrupt_step(TASK, DOMAIN.demonstration(TASK), np.random.default_rng(0))
    assert DOMAIN.check_steps(TASK, bad).count(False) >= 1
    with pytest.raises(ValueError, match="can be corrupted"):
        DOMAIN.corrupt_step(TASK, "no steps<answer>1", random.Random(0))


def test_parse_step():
    assert parse_step("12:922") == (12, 922)
    assert parse_step(" 3 : 7 ") == (3, 7)
    assert parse_step("12-922") is None


def test_verification():
    assert DOMAIN.verify(TASK, "anything<answer>166").reward == 1.0
    assert DOMAIN.verify(TASK, "1:0<answer>165").outcome == "wrong"
    assert DOMAIN.verify(TASK, "1:0<step>2:583").outcome == "no_answer"


def test_registered():
    assert isinstance(get_domain("state_tracking"), StateTrackingDomain)


def test_generated_task_matches_its_own_data():
    for d in range(1, DOMAIN.max_difficulty + 1):
        task = DOMAIN.generate("train", 5, d)
        data = task.data
        assert task.prompt == f"x={data['start']}; x=(x+{data['add']})%1000; {data['steps']} times"
        assert 1 <= data["add"] <= 999 and 0 <= data["start"] <= 999
        lo, hi = LEVEL_STEPS[d]
        assert lo <= data["steps"] <= hi
        values = iterate(data["start"], data["add"], data["steps"])
        assert task.answer == str(values[-1])


def test_reasoning_length_grows_with_level_and_prompt_stays_short():
    tok = ByteTokenizer()
    mean_len = {}
    for d in range(1, DOMAIN.max_difficulty + 1):
        tasks = DOMAIN.tasks("train", 10, d)
        mean_len[d] = sum(len(tok.encode(DOMAIN.demonstration(t))) for t in tasks) / len(tasks)
        assert max(len(tok.encode(t.prompt)) for t in tasks) <= 40
    assert list(mean_len.values()) == sorted(mean_len.values())
    assert mean_len[1] < 40  # the tiny demo's level
    assert mean_len[4] > 300 and mean_len[6] > 1500  # many windows of a small model
    # Level 5 has at least 128 steps: counter digits 9 + 180 + 87, 128 colons, 128
    # separators and >= 128 value digits make >= 660 tokens, over 4 windows of 128.
    assert LEVEL_STEPS[5][0] == 128
    assert (
        min(len(tok.encode(DOMAIN.demonstration(t))) for t in DOMAIN.tasks("train", 10, 5)) >= 660
    )


def test_problem_space_is_large_and_split_by_prompt():
    # 1000 starts x 999 increments x at least 2 iteration counts per level.
    assert min(hi - lo + 1 for lo, hi in LEVEL_STEPS.values()) >= 2
    assert 1000 * 999 * 2 >= 10**6
    heldout = DOMAIN.tasks("heldout", 300, 3)
    train = DOMAIN.tasks("train", 2000, 3)
    assert all(partition_of(t.prompt, DOMAIN.heldout_fraction) == "heldout" for t in heldout)
    assert all(partition_of(t.prompt, DOMAIN.heldout_fraction) == "train" for t in train)
    assert {t.prompt for t in heldout}.isdisjoint(t.prompt for t in train)
    # 2000 draws from ~5.6M train prompts (7 counts at level 3) repeat about 0.36 times.
    assert len({t.prompt for t in train}) >= len(train) - 3


def test_another_modulus_hand_worked_and_by_name():
    """state_tracking/100: two-digit states. x=47; +58 mod 100: 5, 63, 21."""
    domain = get_domain("state_tracking/100")
    assert isinstance(domain, StateTrackingDomain) and domain.name == "state_tracking/100"
    task = Task(
        "s", domain.name, "x=47; x=(x+58)%100; 3 times", 1, "21",
        {"start": 47, "add": 58, "steps": 3, "answer_format": "number"},
    )  # fmt: skip
    assert domain.demonstration(task) == "1:5<step>2:63<step>3:21<answer>21"
    assert domain.check_steps(task, "1:5<step>2:63<step>3:121<answer>121") == [True, True, False]
    wrong = domain.corrupt_step(task, domain.demonstration(task), random.Random(0))
    assert not domain.verify(task, wrong).correct
    assert all(0 <= parse_step(s)[1] < 100 for s in wrong.split("<answer>")[0].split("<step>"))
    for t in domain.tasks("train", 20, 2, seed=0):
        assert "%100;" in t.prompt and t.domain == "state_tracking/100"
        assert domain.verify(t, domain.demonstration(t)).correct
        assert get_domain(t.domain).demonstration(t) == domain.demonstration(t)
    with pytest.raises(ValueError, match="modulus"):
        StateTrackingDomain(modulus=5)
    with pytest.raises(ValueError, match="modulus"):
        get_domain("state_tracking/ten")
