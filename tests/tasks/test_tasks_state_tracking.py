"""State tracking: hand-worked iterations, step labels, level lengths, the split."""

import pytest

from rlpt.tasks import StateTrackingDomain, Task, get_domain, partition_of
from rlpt.tasks.state_tracking import LEVEL_STEPS, iterate, parse_step
from rlpt.tokenizers import ByteTokenizer

DOMAIN = StateTrackingDomain()
# x=417; x=(x*37+5)%1000 three times: 417*37+5 = 15434 -> 434; 434*37+5 = 16063 -> 63;
# 63*37+5 = 2336 -> 336.
TASK = Task(
    "s", "state_tracking", "x=417; x=(x*37+5)%1000; 3 times", 1, "336",
    {"start": 417, "mul": 37, "add": 5, "steps": 3, "answer_format": "number"},
)  # fmt: skip


def test_iterate_hand_worked():
    assert iterate(417, 37, 5, 3) == [417, 434, 63, 336]


def test_demonstration_hand_worked():
    assert DOMAIN.demonstration(TASK) == "1:434<step>2:63<step>3:336<answer>336"
    assert DOMAIN.verify(TASK, DOMAIN.demonstration(TASK)).correct


@pytest.mark.parametrize(
    "completion, labels",
    [
        ("1:434<step>2:63<step>3:336<answer>336", [True, True, True]),
        ("1: 434<step> 2:63 <step>3:336<answer>336", [True, True, True]),
        ("1:434<step>2:64<step>3:336<answer>336", [True, False, True]),
        ("1:434<step>3:63<step>3:336<answer>336", [True, False, True]),  # wrong counter
        ("1:434<step>2:63<step>3:336<step>4:437<answer>437", [True, True, True, False]),
        ("434<step>63<answer>63", [False, False]),
        ("<answer>336", []),
    ],
)
def test_check_steps(completion, labels):
    assert DOMAIN.check_steps(TASK, completion) == labels


def test_parse_step():
    assert parse_step("12:922") == (12, 922)
    assert parse_step(" 3 : 7 ") == (3, 7)
    assert parse_step("12-922") is None


def test_verification():
    assert DOMAIN.verify(TASK, "anything<answer>336").reward == 1.0
    assert DOMAIN.verify(TASK, "1:434<answer>335").outcome == "wrong"
    assert DOMAIN.verify(TASK, "1:434<step>2:63").outcome == "no_answer"


def test_registered():
    assert isinstance(get_domain("state_tracking"), StateTrackingDomain)


def test_generated_task_matches_its_own_data():
    for d in range(1, DOMAIN.max_difficulty + 1):
        task = DOMAIN.generate("train", 5, d)
        data = task.data
        assert task.prompt == (
            f"x={data['start']}; x=(x*{data['mul']}+{data['add']})%1000; {data['steps']} times"
        )
        assert data["steps"] == LEVEL_STEPS[d]
        values = iterate(data["start"], data["mul"], data["add"], data["steps"])
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


def test_problem_space_is_large_and_split_by_prompt():
    # 1000 starts x 98 multipliers x 100 increments per level.
    assert 1000 * 98 * 100 >= 10**6
    heldout = DOMAIN.tasks("heldout", 300, 3)
    train = DOMAIN.tasks("train", 2000, 3)
    assert all(partition_of(t.prompt, DOMAIN.heldout_fraction) == "heldout" for t in heldout)
    assert all(partition_of(t.prompt, DOMAIN.heldout_fraction) == "train" for t in train)
    assert {t.prompt for t in heldout}.isdisjoint(t.prompt for t in train)
    # 2000 draws from ~7.8M train prompts repeat about 0.26 times on average.
    assert len({t.prompt for t in train}) >= len(train) - 3
