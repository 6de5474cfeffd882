"""reasoning-gym datasets as domains (skipped when the optional package is absent)."""

import pytest

pytest.importorskip(
    "reasoning_gym", reason="reasoning-gym is optional; pip install reasoning-gym to test it"
)

from rlpt.tasks import get_domain  # noqa: E402


@pytest.fixture(scope="module")
def chain_sum():
    return get_domain("reasoning_gym/chain_sum")


def test_generation_is_deterministic_and_split(chain_sum):
    assert chain_sum.name == "reasoning_gym/chain_sum"
    assert chain_sum.max_difficulty > 1  # chain_sum has a curriculum
    again = get_domain("reasoning_gym", dataset="chain_sum")
    assert chain_sum.generate("train", 5, 2) == again.generate("train", 5, 2)
    train = {t.prompt for t in chain_sum.tasks("train", 200, 1)}
    heldout = {t.prompt for t in chain_sum.tasks("heldout", 50, 1)}
    assert train.isdisjoint(heldout) and len(heldout) > 1


def test_scored_by_the_dataset(chain_sum):
    tasks = chain_sum.tasks("heldout", 5, 2)
    good = chain_sum.verify_batch(tasks, [chain_sum.demonstration(t) for t in tasks])
    assert [r.outcome for r in good] == ["correct"] * 5
    bad = chain_sum.verify_batch(tasks, ["<answer>not a number"] * 5)
    assert [r.reward for r in bad] == [0.0] * 5
    assert chain_sum.verify(tasks[0], tasks[0].answer).outcome == "no_answer"


def test_dataset_without_curriculum_has_one_level():
    from reasoning_gym import factory

    name = next(n for n in sorted(factory.DATASETS) if n not in factory.CURRICULA)
    domain = get_domain(f"reasoning_gym/{name}")
    assert domain.max_difficulty == 1


def test_unknown_dataset():
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset"):
        get_domain("reasoning_gym/no_such_dataset")
