"""rlpt.eval: the pass@k estimator, standard errors, the verifier cache, eval sets, the table."""

import collections
import itertools
import math
import types

import numpy as np
import pytest

from rlpt import eval as ev
from rlpt.tasks import Task, VerifyResult, get_domain
from rlpt.tasks.base import AnswerDomain, Problem, heldout_half, partition_of
from rlpt.tokenizers import ByteTokenizer


def _brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c correct) that hold a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(
    "n,c,k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (6, 1, 2), (8, 3, 4), (4, 4, 4)]
)
def test_pass_at_k_matches_brute_force_over_subsets(n, c, k):
    assert ev.pass_at_k(n, c, k) == pytest.approx(_brute_force_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_hand_worked_values():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6.
    assert ev.pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # k=1 is the fraction correct.
    assert ev.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # Fewer wrong samples than k: every k-subset holds a correct one.
    assert ev.pass_at_k(5, 3, 3) == 1.0


def test_pass_at_k_is_stable_for_large_n():
    # The binomials here overflow floats; the product form does not.
    value = ev.pass_at_k(2000, 1, 1000)
    assert value == pytest.approx(0.5)
    assert math.isfinite(ev.pass_at_k(5000, 17, 200))


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError):
        ev.pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        ev.pass_at_k(3, 1, 4)


def test_sampled_pass_at_k_needs_k_of_at_least_two_before_anything_is_generated():
    # No sampler: the arguments are refused before one would be used.
    evaluator = ev.Evaluator(None, ByteTokenizer(), ev.Verifier({}), max_new_tokens=4, chunk_size=4)
    cases = [
        (2, 1, "eval.k must be >= 2 when eval.n_samples > 0, got 1"),
        (1, 2, r"eval.n_samples \(1\) must be >= eval.k \(2\)"),
        (-1, 2, "eval.n_samples must be >= 0, got -1"),
    ]
    for n_samples, k, message in cases:
        with pytest.raises(ValueError, match=message):
            evaluator.evaluate(None, {}, None, n_samples=n_samples, k=k)
    ev.check_sampling(0, 1)  # greedy only: k is unused
    ev.check_sampling(4, 4)


def test_mean_and_stderr():
    mean, se = ev.mean_and_stderr([1.0, 0.0, 1.0, 0.0])
    assert mean == 0.5
    assert se == pytest.approx(np.std([1, 0, 1, 0], ddof=1) / 2)
    assert ev.mean_and_stderr([1.0]) == (1.0, 0.0)
    assert math.isnan(ev.mean_and_stderr([])[0])


class _CountingDomain:
    """A sandbox-like domain that counts what it is asked to verify."""

    name = "fake"
    needs_sandbox = True

    def __init__(self):
        self.calls = []

    def verify_batch(self, tasks, completions, pool=None):
        self.calls.append(list(completions))
        return [
            VerifyResult(1.0 if c == "good" else 0.0, "correct" if c == "good" else "wrong",
                         valid=c != "crash")
            for c in completions
        ]  # fmt: skip


def test_verifier_caches_sandbox_verdicts_but_not_sandbox_failures():
    dom = _CountingDomain()
    verifier = ev.Verifier({"fake": dom})
    task = Task(id="t", domain="fake", prompt="p", difficulty=1)
    out = verifier.verify(["fake"] * 4, [task] * 4, ["good", "good", "bad", "crash"])
    assert [r.outcome for r in out] == ["correct", "correct", "wrong", "wrong"]
    assert not out[3].valid
    assert dom.calls == [["good", "bad", "crash"]]  # duplicates submitted once
    verifier.verify(["fake"] * 3, [task] * 3, ["good", "bad", "crash"])
    assert dom.calls[-1] == ["crash"]  # only the failed run is retried


def test_eval_sets_spread_over_trained_levels_and_ood_is_one_above():
    domains = {"arithmetic": get_domain("arithmetic")}
    sets = ev.make_eval_sets(domains, {"arithmetic": 2}, heldout_items=5, ood_items=3, seed=0)
    levels = [t.difficulty for t in sets["heldout"]["arithmetic"]]
    assert sorted(levels) == [1, 1, 1, 2, 2]
    assert {t.split for t in sets["heldout"]["arithmetic"]} == {"heldout"}
    assert [t.difficulty for t in sets["ood"]["arithmetic"]] == [3, 3, 3]


def test_train_items_come_from_the_training_partition_over_the_same_levels():
    domains = {"arithmetic": get_domain("arithmetic")}
    sets = ev.make_eval_sets(
        domains, {"arithmetic": 2}, heldout_items=6, ood_items=0, seed=0, train_items=5
    )
    train = sets["train"]["arithmetic"]
    assert sorted(t.difficulty for t in train) == [1, 1, 1, 2, 2]
    assert {t.split for t in train} == {"train"}
    fraction = domains["arithmetic"].heldout_fraction
    assert {partition_of(t.prompt, fraction) for t in train} == {"train"}
    assert not {t.prompt for t in train} & {t.prompt for t in sets["heldout"]["arithmetic"]}
    with pytest.raises(ValueError, match="eval.train_items must be >= 0, got -1"):
        ev.make_eval_sets(domains, {"arithmetic": 2}, heldout_items=2, ood_items=0, seed=0,
                          train_items=-1)  # fmt: skip
    assert "train" not in ev.make_eval_sets(domains, {"arithmetic": 2}, heldout_items=2,
                                            ood_items=0, seed=0)  # fmt: skip


def test_heldout_split_draws_from_one_half_of_the_heldout_partition():
    domains = {"arithmetic": get_domain("arithmetic")}
    halves = {}
    for split in ("validation", "test"):
        sets = ev.make_eval_sets(domains, {"arithmetic": 3}, heldout_items=30, ood_items=0,
                                 seed=0, heldout_split=split)  # fmt: skip
        tasks = sets["heldout"]["arithmetic"]
        assert {t.split for t in tasks} == {split}
        assert {heldout_half(t.prompt) for t in tasks} == {split}
        halves[split] = {t.prompt for t in tasks}
    assert halves["validation"].isdisjoint(halves["test"])
    with pytest.raises(ValueError, match="eval.heldout_split must be one of"):
        ev.make_eval_sets(domains, {"arithmetic": 2}, heldout_items=2, ood_items=0, seed=0,
                          heldout_split="train")  # fmt: skip


class _TwoOodDomain(AnswerDomain):
    """A domain with two OOD splits of its own: their prompts say which split drew them."""

    name = "two_ood"
    max_difficulty = 3
    extra_splits = ("ood_a", "ood_b")

    def _sample_split(self, rng, difficulty, split):
        return Problem(prompt=f"{split}-{difficulty}-{rng.randrange(10**6)}", answer="0")

    def demonstration(self, task):
        return ""

    def verify_one(self, task, completion):
        return VerifyResult(float(completion == task.prompt), "wrong")


def test_a_domains_own_ood_splits_are_evaluated_over_the_training_levels():
    sets = ev.make_eval_sets({"d": _TwoOodDomain()}, {"d": 2}, heldout_items=4, ood_items=4,
                             seed=0)  # fmt: skip
    for split in ("ood_a", "ood_b"):
        tasks = sets[split]["d"]
        assert [t.difficulty for t in tasks] == [1, 1, 2, 2]
        assert all(t.prompt.startswith(f"{split}-") and t.split == split for t in tasks)
    assert "ood_a" not in ev.make_eval_sets({"d": _TwoOodDomain()}, {"d": 2}, heldout_items=4,
                                            ood_items=0, seed=0)  # fmt: skip


class _SmallSpaceDomain(AnswerDomain):
    """Level 1 has three prompts in all; level 2 has a million."""

    name = "small_space"
    max_difficulty = 2
    heldout_fraction = 1.0  # every prompt is held out, so level 1 has exactly three

    def _sample(self, rng, difficulty):
        size = 3 if difficulty == 1 else 10**6
        return Problem(prompt=f"q{difficulty}-{rng.randrange(size)}", answer="0")

    def demonstration(self, task):
        return ""

    def verify_one(self, task, completion):
        return VerifyResult(0.0, "wrong")


def test_eval_items_are_distinct_and_a_small_level_repeats_its_prompts_evenly():
    sets = ev.make_eval_sets({"s": _SmallSpaceDomain()}, {"s": 2}, heldout_items=14,
                             ood_items=0, seed=0)  # fmt: skip
    tasks = sets["heldout"]["s"]
    level1 = [t.prompt for t in tasks if t.difficulty == 1]
    level2 = [t.prompt for t in tasks if t.difficulty == 2]
    assert len(level1) == len(level2) == 7
    assert len(set(level2)) == 7
    # Three prompts over seven items: each two or three times, never one hogging the level.
    assert sorted(collections.Counter(level1).values()) == [2, 2, 3]


def test_the_periodic_subset_sees_every_prompt_of_a_small_level():
    # Nine level-1 items over three prompts; the periodic evaluation's evenly spaced
    # subset of 6 of the 18 items takes level-1 items 0, 3 and 7.
    sets = ev.make_eval_sets({"s": _SmallSpaceDomain()}, {"s": 2}, heldout_items=18,
                             ood_items=0, seed=0)  # fmt: skip
    every = {t.prompt for t in sets["heldout"]["s"] if t.difficulty == 1}
    subset = ev._spread(sets["heldout"]["s"], 6)
    assert len(every) == 3
    assert {t.prompt for t in subset if t.difficulty == 1} == every


def test_pass_at_1_by_level_counts_valid_items_per_level():
    tasks = [
        Task(id=str(i), domain="d", prompt=p, difficulty=lvl)
        for i, (p, lvl) in enumerate([("a", 1), ("a", 1), ("b", 1), ("c", 2), ("d", 2)])
    ]
    results = [
        VerifyResult(1.0, "correct"), VerifyResult(1.0, "correct"), VerifyResult(0.0, "wrong"),
        VerifyResult(0.0, "timeout", valid=False), VerifyResult(0.0, "wrong"),
    ]  # fmt: skip
    got = ev._by_level(tasks, results)
    # Level 1: two of three right; level 2: the sandbox failure is left out, 0 of 1 right.
    assert got == {
        "1": {"pass@1": pytest.approx(2 / 3), "items": 3, "distinct_items": 2},
        "2": {"pass@1": 0.0, "items": 2, "distinct_items": 2},
    }


def test_decode_response_marks_ids_past_the_vocabulary():
    tok = ByteTokenizer()
    ids = tok.encode("ab") + [tok.vocab_size + 1] + tok.encode("c")
    assert ev.decode_response(tok, ids) == "ab\ufffdc"


def test_flatten_and_table():
    results = {
        "heldout": {"arithmetic": {"pass@1": 0.5, "pass@1_se": 0.1, "pass@4": 0.75,
                                   "pass@4_se": 0.05, "items": 10, "sandbox_failures": 0}},
        "ood": {"arithmetic": {"pass@1": 0.25, "pass@1_se": 0.1, "items": 10,
                               "sandbox_failures": 1}},
    }  # fmt: skip
    flat = ev.flatten_results(results, 4)
    assert flat["eval/arithmetic/pass@1"] == 0.5
    assert flat["eval/arithmetic/pass@4"] == 0.75
    assert flat["eval/arithmetic/ood/pass@1"] == 0.25
    table = ev.format_table(results, 4)
    assert "arithmetic" in table and "0.500±0.100" in table
    results["train"] = {
        "arithmetic": {
            "pass@1": 0.9,
            "pass@1_se": 0.05,
            "items": 10,
            "sandbox_failures": 0,
            "by_level": {"1": {"pass@1": 1.0}, "2": {"pass@1": 0.8}},
        }
    }
    assert ev.flatten_results(results, 4)["eval/arithmetic/train/pass@1"] == 0.9
    assert "1:1.00 2:0.80" in ev.format_table(results, 4)


def test_periodic_subset_is_spread_over_the_levels():
    from rlpt.eval import _spread

    items = [f"level1-{i}" for i in range(5)] + [f"level2-{i}" for i in range(5)]
    picked = _spread(items, 4)
    assert picked == ["level1-0", "level1-3", "level2-1", "level2-4"]  # indices 0, 3, 6, 9
    assert _spread(items, 20) == items and _spread(items, 1) == ["level1-0"]


class _ScriptedPolicy:
    """A sampler answering prompt ``p`` with ``scripts[p][k]`` after ``k`` feedbacks in its
    context (each answer followed by eos)."""

    def __init__(self, scripts):
        self.tok = ByteTokenizer()
        self.scripts = scripts
        self.pad_id = self.tok.pad_id
        self.config = types.SimpleNamespace(max_seq_len=256)

    def generate(self, params, prompts, key, *, max_new_tokens, sampling):
        from rlpt.sampling import SampleOutput

        n = len(prompts)
        out = SampleOutput(
            tokens=np.full((n, max_new_tokens), self.pad_id, np.int32),
            logprobs=np.zeros((n, max_new_tokens), np.float32),
            mask=np.zeros((n, max_new_tokens), np.float32),
            lengths=np.zeros(n, np.int32), truncated=np.zeros(n, bool),
        )  # fmt: skip
        for i, ids in enumerate(prompts):
            context = self.tok.decode(ids)  # the prompts are one character long
            answer = self.tok.encode(self.scripts[context[0]][context.count("feedback:")])
            answer.append(self.tok.eos_id)
            out.tokens[i, : len(answer)], out.lengths[i] = answer, len(answer)
            out.mask[i, : len(answer)] = 1.0
        return out

    def generate_padded(self, params, tokens, mask, key, *, max_new_tokens, sampling):
        rows = [r[m].tolist() for r, m in zip(np.asarray(tokens), np.asarray(mask, bool))]
        return self.generate(params, rows, key, max_new_tokens=max_new_tokens, sampling=sampling)


class _OkDomain(AnswerDomain):
    name = "d"

    def demonstration(self, task):
        return "ok"

    def verify_one(self, task, completion):
        if completion == "ok":
            return VerifyResult(1.0, "correct")
        return VerifyResult(0.0, "wrong", details={"feedback": f"not {completion}"})


def test_multi_turn_evaluation_reports_pass_at_one_within_the_turns():
    import jax

    scripts = {"A": ["x", "ok"], "B": ["ok"], "C": ["x", "y"]}
    tasks = [Task(id=p, domain="d", prompt=p, difficulty=1) for p in scripts]
    sets = {"heldout": {"d": tasks}}

    def evaluate(turns):
        evaluator = ev.Evaluator(
            _ScriptedPolicy(scripts), ByteTokenizer(), ev.Verifier({"d": _OkDomain()}),
            max_new_tokens=4, chunk_size=2, turns=turns, feedback_tokens=32,
        )  # fmt: skip
        results, _ = evaluator.evaluate(None, sets, jax.random.key(0))
        return ev.flatten_results(results, 1)

    one, two = evaluate(1), evaluate(2)
    # Greedy first answers: x, ok, x; second answers after feedback: ok (A), y (C).
    assert one["eval/d/pass@1"] == two["eval/d/pass@1"] == pytest.approx(1 / 3)
    assert two["eval/d/pass@1_turns"] == pytest.approx(2 / 3)
    assert two["eval/d/mean_turns"] == pytest.approx(5 / 3)
    # Single-turn evaluations keep their keys exactly.
    assert set(two) - set(one) == {
        "eval/d/pass@1_turns",
        "eval/d/pass@1_turns_se",
        "eval/d/mean_turns",
    }
