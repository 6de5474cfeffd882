"""The list-program DSL domain: interpreter, parser, space size, partitions, OOD splits."""

import itertools
import random
import re

import pytest

from rlpt.tasks import Task, shared_items
from rlpt.tasks.list_programs import (
    FAMILIES,
    HELDOUT_PAIRS,
    LEVEL_STAGES,
    OOD_EXTRA_STAGES,
    REDUCTIONS,
    ListProgramsDomain,
    ProgramError,
    behaviour_key,
    families_of,
    parse,
    program_space_size,
    read_list,
    run,
    show,
)

LEVELS = range(1, ListProgramsDomain.max_difficulty + 1)
IN_DISTRIBUTION = ("train", "heldout", "validation", "test", "ood")


@pytest.fixture(scope="module")
def domain():
    return ListProgramsDomain()


def _out(program: str, xs: str) -> str:
    return show(run(parse(program), read_list(xs)))


# Expected outputs worked by hand (values mod 10 where arithmetic is involved).
@pytest.mark.parametrize(
    "program, xs, expected",
    [
        ("map(x*3+4)", "0129", "[4701]"),  # 4, 7, 10, 31
        ("map(x+7)", "53", "[20]"),  # 12, 10
        ("map(x*4)", "35", "[20]"),  # 12, 20
        ("map(x%3)", "759", "[120]"),
        ("map(x//4)", "934", "[201]"),
        ("filter(x>4)", "3594", "[59]"),
        ("filter(x<2)", "021", "[01]"),
        ("filter(x%3==1)", "14579", "[147]"),
        ("filter(x!=3)", "3133", "[1]"),
        ("take(2)", "789", "[78]"),
        ("take(5)", "7", "[7]"),
        ("take(2)", "", "[]"),
        ("drop(2)", "789", "[9]"),
        ("drop(5)", "7", "[]"),
        ("sort", "312", "[123]"),
        ("rsort", "312", "[321]"),
        ("rev", "312", "[213]"),
        ("cumsum", "567", "[518]"),  # 5, 11, 18
        ("dedup", "31321", "[312]"),
        ("sum", "98", "7"),  # 17
        ("len", "111", "3"),
        ("max", "392", "9"),
        ("min", "392", "2"),
        ("head", "392", "3"),
        ("last", "392", "2"),
        ("sum", "", "0"),
        ("len", "", "0"),
        ("max", "", "0"),
        ("min", "", "0"),
        ("head", "", "0"),
        ("last", "", "0"),
        # 3142 -> 342 -> 432 -> 9,7,5 (2x+1 of 4, 3, 2 is 9, 7, 5)
        ("filter(x>1)|rsort|map(x*2+1)", "3142", "[975]"),
        ("filter(x>1)|rsort|map(x*2+1)", "6620", "[335]"),  # 662 -> 13, 13, 5
        ("dedup|cumsum|last", "5565", "1"),  # 5,6 -> 5,11 -> 1
        ("drop(1)|take(2)|rev", "12345", "[32]"),
    ],
)
def test_interpreter_hand_worked(program, xs, expected):
    assert _out(program, xs) == expected


def test_parser_reads_spaces_and_short_forms():
    assert parse(" sort | take( 2 ) ") == parse("sort|take(2)") == (("sort", ()), ("take", (2,)))
    assert parse("map(x+3)") == (("affine", (1, 3)),)
    assert parse("map(x*3)") == (("affine", (3, 0)),)
    assert parse("map(x*3+0)") == parse("map(x*3)")
    assert parse("map(x)") == (("affine", (1, 0)),)
    # Constants beyond one digit are read, arithmetic still mod 10.
    assert _out("map(x+13)|filter(x%12==2)", "0199") == "[22]"  # 3, 4, 2, 2 kept if 2
    assert families_of("rsort|map(x//2)|filter(x%3==0)|len") == ("sort", "div", "modeq", "len")


GARBAGE = [
    "sort|",
    "|sort",
    "sort||rev",
    "map(x**2)",
    "map(y+1)",
    "map(x-1)",
    "filter(x>)",
    "filter(x>=3)",
    "take(-1)",
    "take(1234)",
    "sum|sort",
    "len|len",
    "map(x%0)",
    "map(x//0)",
    "filter(x%0==0)",
    "lambda x: sorted(x)",
    "__import__('os').system('true')",
    "sort;rev",
    "SORT",
    "take(\u0663)",  # an Arabic-Indic digit three
    "|".join(["rev"] * 150),  # longer than any program should be
    "\x00",
]


@pytest.mark.parametrize("text", GARBAGE)
def test_parser_rejects_garbage(text, domain):
    with pytest.raises(ProgramError):
        parse(text)
    task = domain.generate("train", 0, 1)
    result = domain.verify(task, "<answer>" + text)
    assert (result.reward, result.outcome, result.valid) == (0.0, "wrong", True)
    assert result.details["feedback"].startswith("not a program")


def test_missing_answer_is_no_answer(domain):
    task = domain.generate("train", 0, 1)
    for completion in ["", task.answer, "<answer>", "<answer>  "]:
        result = domain.verify(task, completion)
        assert (result.reward, result.outcome) == (0.0, "no_answer")


def test_reward_is_the_fraction_of_hidden_inputs_right():
    inputs = ["", "1", "12", "123"]
    task = Task(
        "t", "list_programs", "?", 1, "take(2)",
        {"inputs": inputs, "expected": ["[]", "[1]", "[12]", "[12]"]},
    )  # fmt: skip
    partial = ListProgramsDomain().verify(task, "<answer>take(3)")  # wrong on "123" only
    assert (partial.reward, partial.outcome) == (0.75, "partial")
    assert partial.details["feedback"] == "on [123] gave [123], expected [12]"
    strict = ListProgramsDomain(all_or_nothing=True).verify(task, "<answer>take(3)")
    assert (strict.reward, strict.outcome) == (0.0, "partial")
    assert ListProgramsDomain().verify(task, "x<step>y<answer>take(2)").correct
    wrong = ListProgramsDomain().verify(task, "<answer>map(x+1)|len")
    assert (wrong.reward, wrong.outcome) == (0.0, "wrong")


def test_demonstrations_are_correct_at_every_level_and_split(domain):
    tasks = [t for d in LEVELS for split in domain.splits for t in domain.tasks(split, 2, d)]
    results = domain.verify_batch(tasks, [domain.demonstration(t) for t in tasks])
    assert [r.outcome for r in results] == ["correct"] * len(tasks)
    assert all(r.reward == 1.0 for r in results)
    for t in tasks:
        assert domain.demonstration(t) == "<answer>" + t.answer
        assert "" in t.data["inputs"]  # the empty list is always tested


def test_wrong_programs_score_below_one(domain):
    tasks = [domain.generate("train", s, d) for d in LEVELS for s in range(5)]
    for t in tasks:
        # A digit where a list is due, or the other way round, is wrong on every input.
        other = "sort" if t.answer.split("|")[-1] in REDUCTIONS else t.answer + "|sum"
        result = domain.verify(t, "<answer>" + other)
        assert (result.reward, result.outcome) == (0.0, "wrong"), (t.answer, other)
        # Another program of the same level: right at most by chance, on some inputs.
        near = domain.generate("train", 1000 + len(t.answer), t.difficulty).answer
        if behaviour_key(parse(near)) != t.key:
            assert domain.verify(t, "<answer>" + near).reward < 1.0, (t.answer, near)


def test_prompt_shape(domain):
    pattern = re.compile(r"(\[\d*\]>(\[\d*\]|\d) )+\?")
    for d in LEVELS:
        for split in domain.splits:
            for t in domain.tasks(split, 6, d):
                assert pattern.fullmatch(t.prompt), t.prompt
                assert len(t.prompt) <= 150
                pairs = [p.split(">") for p in t.prompt[:-2].split(" ")]
                # The examples say something: not one output for all, not all unchanged.
                assert len({o for _, o in pairs}) > 1
                assert any(i != o for i, o in pairs)


@pytest.mark.parametrize(
    "a, b",
    [
        ("map(x+1)|map(x+2)", "map(x+3)"),
        ("map(x*3)|map(x*7)", "map(x)"),  # 21x = x mod 10
        ("filter(x>3)|sort", "sort|filter(x>3)"),
        ("sort|rev", "rsort"),
        ("sort|dedup", "dedup|sort"),
        ("rsort|head", "max"),
        ("rev|last", "head"),
        ("cumsum|take(1)", "take(1)"),
        ("filter(x%2==0)|filter(x<5)", "filter(x<5)|filter(x%2==0)"),
    ],
)
def test_equivalent_programs_share_a_key(a, b):
    assert behaviour_key(parse(a)) == behaviour_key(parse(b))


@pytest.mark.parametrize(
    "a, b",
    [("map(x+1)", "map(x+2)"), ("take(5)", "take(6)"), ("sort", "rsort"), ("max", "last")],
)
def test_different_programs_have_different_keys(a, b):
    assert behaviour_key(parse(a)) != behaviour_key(parse(b))


def test_one_program_on_other_inputs_keeps_its_key(domain):
    text = "filter(x>1)|rsort|map(x*2+1)"
    a = domain.problem_for(text, random.Random(1), 5)
    b = domain.problem_for(text, random.Random(2), 5)
    assert a.prompt != b.prompt and a.key == b.key == behaviour_key(parse(text))
    task = domain.generate("test", 3, 2)
    assert task.key == task.partition_key == behaviour_key(parse(task.answer))


def test_sampled_programs_are_not_trivial(domain):
    for d in LEVELS:
        for t in domain.tasks("train", 20, d):
            expected = t.data["expected"]
            assert len(set(expected)) > 1, t.answer  # not constant
            assert expected != [f"[{x}]" for x in t.data["inputs"]], t.answer  # not identity
            stages = t.answer.split("|")
            for i, stage in enumerate(stages):
                if stage not in REDUCTIONS:  # every stage matters
                    shorter = "|".join(stages[:i] + stages[i + 1 :])
                    assert behaviour_key(parse(shorter)) != t.key, (t.answer, i)


def test_train_and_test_share_no_prompt_and_no_function(domain):
    shared = shared_items(domain, "train", "test", 200, list(LEVELS))
    assert shared == {"prompts": set(), "keys": set()}
    for split in ("ood_composition", "ood_length"):
        shared = shared_items(domain, "train", split, 40, list(LEVELS))
        assert shared == {"prompts": set(), "keys": set()}, split


def _family(stage: str) -> str:
    """The family of a stage by its spelling, apart from the parser."""
    for prefix, family in [
        ("map(x%", "mod"), ("map(x//", "div"), ("map(", "map"),
        ("filter(x>", "gt"), ("filter(x<", "lt"), ("filter(x%", "modeq"), ("filter(x!", "ne"),
        ("take(", "take"), ("drop(", "drop"), ("rsort", "sort"),
    ]:  # fmt: skip
        if stage.startswith(prefix):
            return family
    return stage


def _pairs(program: str) -> list[tuple[str, str]]:
    families = [_family(s) for s in program.split("|")]
    assert tuple(families) == families_of(program)
    return list(zip(families, families[1:]))


def _stages(program: str) -> int:
    return sum(s not in REDUCTIONS for s in program.split("|"))


def test_held_out_compositions_only_in_ood_composition(domain):
    held_out = set(HELDOUT_PAIRS)
    for d in LEVELS:
        for split in IN_DISTRIBUTION:
            for t in domain.tasks(split, 15, d):
                pairs = _pairs(t.answer)
                assert not held_out & set(pairs), (split, t.answer)
                assert all(a != b for a, b in pairs), t.answer  # adjacent families differ
                assert _stages(t.answer) == LEVEL_STAGES[d] == d + 2
        found = set()
        for t in domain.tasks("ood_composition", 30, d):
            assert held_out & set(_pairs(t.answer)), t.answer
            assert _stages(t.answer) == LEVEL_STAGES[d]
            found |= held_out & set(_pairs(t.answer))
        assert len(found) >= 4  # the pairs are drawn evenly, not one over and over


def test_ood_length_is_longer_and_of_seen_compositions(domain):
    for d in LEVELS:
        for t in domain.tasks("ood_length", 25, d):
            assert not set(HELDOUT_PAIRS) & set(_pairs(t.answer)), t.answer
            assert _stages(t.answer) == LEVEL_STAGES[d] + OOD_EXTRA_STAGES
    assert OOD_EXTRA_STAGES == 2


def test_same_seed_same_task():
    a, b = ListProgramsDomain(), ListProgramsDomain()
    for split in a.splits:
        for d in (1, a.max_difficulty):
            assert a.generate(split, 7, d) == b.generate(split, 7, d)
            assert a.tasks(split, 3, d, seed=2) == b.tasks(split, 3, d, seed=2)
    assert a.generate("train", 7, 1) != a.generate("train", 8, 1)


def _brute_force_size(families, reductions, pairs, n, heldout=True):
    """Every sequence of ``n`` stage instances and every ending, checked one by one."""
    banned = set(pairs) if heldout else set()
    instances = [(f, i) for f, inst in families.items() for i in inst]
    count = 0
    for stages in itertools.product(instances, repeat=n):
        for end in (None, *reductions):
            fams = [f for f, _ in stages] + ([end] if end else [])
            if all(a != b and (a, b) not in banned for a, b in zip(fams, fams[1:])):
                count += 1
    return count


def test_program_space_size_matches_a_brute_force_count():
    families = {"a": ("a1", "a2"), "b": ("b1",), "c": ("c1", "c2", "c3")}
    reductions = ("r", "s")
    pairs = (("a", "c"), ("c", "b"), ("b", "r"))
    for n in range(1, 5):
        for heldout in (True, False):
            expected = _brute_force_size(families, reductions, pairs, n, heldout)
            got = program_space_size(
                n, heldout=heldout, families=families, reductions=reductions, pairs=pairs
            )
            assert got == expected, (n, heldout)
    # Hand-worked: two families of 2 and 3 instances, nothing else: 2*3 + 3*2 orders.
    assert program_space_size(2, families={"a": "xy", "b": "xyz"}, reductions=(), pairs=()) == 12


def test_every_level_has_over_a_million_programs():
    # One stage: 162 instances times 7 endings (none or a reduction), less dedup|len.
    assert sum(len(v) for v in FAMILIES.values()) == 162
    assert program_space_size(1) == 162 * 7 - 1
    for d in LEVELS:
        assert program_space_size(LEVEL_STAGES[d]) >= 10**6
        # ood_composition's space: programs of the level's length with a held-out pair.
        n = LEVEL_STAGES[d]
        assert program_space_size(n, heldout=False) - program_space_size(n) > 10**5


def test_level_one_behaviours_are_mostly_distinct(domain):
    # Were 2000 programs drawn uniformly from 10^6 distinct behaviours, about
    # 2000^2 / (2 * 10^6) = 2 pairs would collide: over 99.8% distinct. The sampler is
    # not uniform (parameterless families such as sort and rev are drawn more often than
    # their share of the space) and some distinct programs still compute one function,
    # so we ask for 90%; it draws about 98%.
    tasks = domain.tasks("train", 2000, 1)
    assert len({t.key for t in tasks}) >= 0.9 * len(tasks)
