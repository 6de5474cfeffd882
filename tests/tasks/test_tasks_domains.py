"""Built-in procedural domains: determinism, split disjointness, demonstrations, scoring."""

import dataclasses
from fractions import Fraction

import pytest

from rlpt.tasks import (
    ArithmeticDomain,
    ProgramSynthesisDomain,
    StepwiseMathDomain,
    Task,
    get_domain,
    heldout_half,
    partition_of,
    shared_items,
)

BUILTIN = [
    "arithmetic", "stepwise_math", "program_synthesis", "state_tracking", "fractions",
    "random_labels", "echo", "list_programs",
]  # fmt: skip


def _verify(domain, tasks, completions, pool):
    return domain.verify_batch(tasks, completions, pool=pool if domain.needs_sandbox else None)


@pytest.mark.parametrize("name", BUILTIN)
def test_same_seed_same_task(name):
    a, b = get_domain(name), get_domain(name)
    for difficulty in (1, a.max_difficulty):
        for split in ("train", "heldout", "validation", "test", "ood"):
            assert a.generate(split, 7, difficulty) == b.generate(split, 7, difficulty)
            assert a.tasks(split, 5, difficulty, seed=3) == b.tasks(split, 5, difficulty, seed=3)


@pytest.mark.parametrize("name", BUILTIN)
def test_seeds_give_varied_tasks(name):
    domain = get_domain(name)
    prompts = {t.prompt for t in domain.tasks("train", 50, domain.max_difficulty)}
    assert len(prompts) > 40


@pytest.mark.parametrize("name", BUILTIN)
def test_train_and_heldout_never_share_a_prompt(name):
    domain = get_domain(name)
    distinct = 0
    for difficulty in range(1, domain.max_difficulty + 1):
        train = {t.prompt for t in domain.tasks("train", 400, difficulty)}
        heldout = {t.prompt for t in domain.tasks("heldout", 200, difficulty)}
        ood = {t.prompt for t in domain.tasks("ood", 100, difficulty)}
        assert train.isdisjoint(heldout)
        assert train.isdisjoint(ood)
        assert len(heldout) > 1
        distinct += len(train | heldout | ood)
    # Disjointness means something only over many different prompts: a generator that
    # repeats a handful would pass the checks above. (The smallest domain, program
    # synthesis, draws about 1800 distinct prompts here; the others over 4000.)
    assert distinct >= 1000


@pytest.mark.parametrize("name", BUILTIN)
def test_validation_and_test_halve_the_heldout_partition(name):
    """Settings are chosen on validation and reported on test: the two never meet the
    training items or each other, and together they are the held-out split."""
    domain = get_domain(name)
    level = min(2, domain.max_difficulty)
    for a, b in [("train", "validation"), ("train", "test"), ("validation", "test")]:
        shared = shared_items(domain, a, b, 150, [level])
        assert shared == {"prompts": set(), "keys": set()}, (a, b)
    val = domain.tasks("validation", 150, level)
    test = domain.tasks("test", 150, level)
    assert len({t.prompt for t in val}) > 10 and len({t.prompt for t in test}) > 10
    for t in val + test:
        assert partition_of(t.partition_key, domain.heldout_fraction) == "heldout"
        assert heldout_half(t.partition_key) == t.split
    # Every held-out item belongs to exactly one half, roughly evenly.
    halves = [heldout_half(t.partition_key) for t in domain.tasks("heldout", 300, level)]
    assert 0.35 < halves.count("validation") / len(halves) < 0.65


def test_shared_items_finds_a_leak():
    """The checker itself can fail: a domain whose partition key ignores the prompt
    puts the same prompts in both splits, and ``shared_items`` reports them."""

    class Leaky(ProgramSynthesisDomain):
        name = "leaky"

        def _sample(self, rng, difficulty):
            problem = super()._sample(rng, difficulty)
            # A key drawn apart from the problem partitions nothing: level 1 has about
            # 50 functions, so each one turns up in both splits.
            return dataclasses.replace(problem, key=str(rng.random()))

    shared = shared_items(Leaky(), "train", "heldout", 200, [1])
    assert shared["prompts"] and not shared["keys"]


@pytest.mark.parametrize("name", BUILTIN)
def test_task_fields(name):
    domain = get_domain(name)
    task = domain.generate("heldout", 11, 2)
    assert isinstance(task, Task)
    assert task.domain == name == domain.name
    assert task.difficulty == 2
    assert task.split == "heldout"
    assert task.id == f"{name}/heldout/d2/11"
    hash(task)  # usable as a dict key despite its data mapping


@pytest.mark.parametrize("name", BUILTIN)
def test_bad_arguments_raise(name):
    domain = get_domain(name)
    with pytest.raises(ValueError, match="split"):
        domain.generate("testing", 0, 1)
    with pytest.raises(ValueError, match="difficulty"):
        domain.generate("train", 0, domain.max_difficulty + 1)
    with pytest.raises(ValueError, match="difficulty"):
        domain.generate("train", 0, 0)


@pytest.mark.parametrize("name", BUILTIN)
def test_demonstrations_are_correct_at_every_difficulty(name, any_pool):
    domain = get_domain(name)
    tasks = [
        t
        for d in range(1, domain.max_difficulty + 1)
        for split in ("train", "heldout")
        for t in domain.tasks(split, 2, d)
    ]
    results = _verify(domain, tasks, [domain.demonstration(t) for t in tasks], any_pool)
    assert [r.outcome for r in results] == ["correct"] * len(tasks)
    assert all(r.reward == 1.0 and r.valid for r in results)


@pytest.mark.parametrize("name", BUILTIN)
def test_wrong_answers_score_zero(name, any_pool):
    domain = get_domain(name)
    tasks = [domain.generate("train", s, d) for d in (1, 3) for s in range(3)]
    wrong = {
        "arithmetic": lambda t: f"<answer>{int(t.answer) + 1}",
        "stepwise_math": lambda t: f"<answer>{int(t.answer) - 3}",
        "program_synthesis": lambda t: "<answer>lambda x: 'nope'",
        "state_tracking": lambda t: f"<answer>{(int(t.answer) + 1) % 1000}",
        "fractions": lambda t: f"<answer>{Fraction(t.answer) + Fraction(1, 7)}",
        "random_labels": lambda t: f"<answer>{(int(t.answer) + 1) % 10}",
        "echo": lambda t: f"<answer>{t.answer[::-1]}0",
        "list_programs": lambda t: "<answer>nope",
    }[name]
    results = _verify(domain, tasks, [wrong(t) for t in tasks], any_pool)
    assert [r.reward for r in results] == [0.0] * len(tasks)
    assert {r.outcome for r in results} == {"wrong"}


@pytest.mark.parametrize("domain", [ArithmeticDomain(), StepwiseMathDomain()])
def test_missing_or_unparsable_answer_is_no_answer(domain):
    task = domain.generate("train", 0, 1)
    for completion in ["", task.answer, "<answer>", "<answer>forty"]:
        result = domain.verify(task, completion)
        assert (result.reward, result.outcome, result.valid) == (0.0, "no_answer", True)


def test_arithmetic_hand_worked():
    domain = ArithmeticDomain()
    task = Task("t", "arithmetic", "12+7*2=", 2, "26", {"expression": "12+7*2"})
    assert domain.demonstration(task) == "7*2=14<step>12+14=26<answer>26"
    paren = Task("p", "arithmetic", "(12+7)*2=", 4, "38", {"expression": "(12+7)*2"})
    assert domain.demonstration(paren) == "12+7=19<step>19*2=38<answer>38"
    for answer in ["26", " 26", "+26", "26.0", "26.00 "]:
        assert domain.verify(task, "whatever<answer>" + answer).reward == 1.0
    assert domain.verify(task, "<answer>26.5").reward == 0.0


def test_difficulty_grows_problem_size():
    arith = ArithmeticDomain()
    lengths = [sum(len(t.prompt) for t in arith.tasks("train", 30, d)) for d in (1, 3, 5, 7)]
    assert lengths == sorted(lengths)
    assert len(arith.generate("train", 0, 1).prompt) <= 5  # "a+b=" tiny at level 1


def test_program_synthesis_prompt_shape():
    task = ProgramSynthesisDomain().generate("train", 0, 1)
    assert task.prompt.startswith("f(0)=") and task.prompt.endswith(" f=")
    assert task.answer.startswith("lambda x: ")
    inputs = [x for (x,) in task.data["inputs"]]
    assert {0, -1, 10**9} <= set(inputs)  # zero, negatives and large values are tested
