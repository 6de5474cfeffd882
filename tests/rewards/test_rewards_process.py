"""Math-Shepherd labels (stub and real batched sampler), separators, PRM examples, best-of-N."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlpt.models import CausalLM, create_model, get_preset
from rlpt.rewards import (
    best_of_n,
    encode_step_examples,
    math_shepherd_labels,
    separator_mask,
    separator_positions,
    solution_score,
    step_prefixes,
)
from rlpt.sampling import SampleOutput, Sampler
from rlpt.tasks import get_domain
from rlpt.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
DOM = get_domain("stepwise_math")


class StubSampler:
    """Returns known continuations: for each prefix, ``good`` for all but the last of each
    group of ``n`` copies, which gets ``bad``. Records every call."""

    def __init__(self, table, n):
        self.table = table  # full prompt text (prompt + prefix) -> (good, bad)
        self.n = n
        self.calls = []

    def generate(self, state, prompts, key, *, max_new_tokens, sampling):
        del state, key, sampling
        self.calls.append(len(prompts))
        tokens = np.full((len(prompts), max_new_tokens), TOK.pad_id, np.int32)
        lengths = np.zeros(len(prompts), np.int32)
        for r, prompt in enumerate(prompts):
            good, bad = self.table[TOK.decode(prompt)]
            ids = TOK.encode(bad if r % self.n == self.n - 1 else good, add_eos=True)
            tokens[r, : len(ids)] = ids
            lengths[r] = len(ids)
        mask = (np.arange(max_new_tokens)[None] < lengths[:, None]).astype(np.float32)
        return SampleOutput(tokens, np.zeros_like(mask), mask, lengths, lengths < 0)


def _task_and_solutions():
    task = next(t for t in DOM.tasks("train", 50, 3) if len(t.data["instructions"]) == 3)
    good = DOM.demonstration(task)
    steps = good.split("<answer>")[0].split("<step>")
    a, op, b, c = DOM_parse(steps[1])
    wrong_step = f"{a}{op}{b}={c + 1}"
    # A solution whose second step is wrong, error carried on by the policy.
    bad = DOM.corrupt_step(task, good, _FixedRng(index=1))
    assert bad.split("<step>")[1] == wrong_step
    return task, good, bad


def DOM_parse(step):  # noqa: N802
    from rlpt.tasks.stepwise_math import parse_step

    return parse_step(step)


class _FixedRng:
    """Picks candidate ``index`` and a +1 shift, so the planted error is known."""

    def __init__(self, index):
        self.calls = 0
        self.index = index

    def randint(self, lo, hi):
        self.calls += 1
        return {1: self.index, 2: 1, 3: 1}[self.calls] if self.calls <= 3 else lo


def test_step_prefixes_and_separators():
    text = "1+2=3<step>3*2=6<step>6-1=5<answer>5"
    assert step_prefixes(text) == ["1+2=3<step>", "1+2=3<step>3*2=6<step>"]
    assert step_prefixes("no steps<answer>1") == []
    ids = TOK.encode(text)
    seps = separator_positions(ids, TOK.step_id, TOK.answer_id)
    assert [ids[k] for k in seps] == [TOK.step_id, TOK.step_id, TOK.answer_id]
    assert len(seps) == 3  # one per entry of split_steps
    row = np.array([ids + [TOK.pad_id] * 3])
    mask = separator_mask(jnp.asarray(row), jnp.asarray(row != TOK.pad_id), step_id=TOK.step_id,
                          answer_id=TOK.answer_id)  # fmt: skip
    assert list(np.flatnonzero(np.asarray(mask[0]))) == seps


def test_labels_from_a_stub_policy_are_exact_and_come_from_one_batched_call():
    task, good, bad = _task_and_solutions()
    g = good.split("<step>")
    b = bad.split("<step>")
    n = 4
    table = {
        # After a right prefix the stub policy finishes right 3 times in 4.
        task.prompt + g[0] + "<step>": ("<step>".join(g[1:]), "1+1=2<answer>2"),
        task.prompt + "<step>".join(g[:2]) + "<step>": (g[2], "1+1=2<answer>2"),
        # b[0] == g[0]: the bad solution's first step is right, so it shares that prefix.
        # After the planted error the policy carries it on (never right).
        task.prompt + "<step>".join(b[:2]) + "<step>": (b[2], b[2]),
    }
    sampler = StubSampler(table, n)
    labels = math_shepherd_labels(
        sampler, None, DOM, [task, task], [good, bad], TOK, jax.random.key(0),
        n_continuations=n, max_new_tokens=40, chunk_rows=64,
    )  # fmt: skip
    assert labels.soft == [[0.75, 0.75, 1.0], [0.75, 0.0, 0.0]]
    assert labels.hard == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert sampler.calls == [64]  # 2 solutions x 2 prefixes x 4 copies, padded to one chunk
    assert labels.samples == 16
    assert labels.soft == [[float(x) * s for x, s in zip(DOM.check_steps(task, c), lab)]
                           for c, lab in zip([good, bad], [[0.75, 0.75, 1.0]] * 2)]  # fmt: skip


def test_labels_with_the_real_batched_sampler():
    cfg = get_preset("tiny")
    graph, params = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(0))
    sampler = Sampler(graph, cfg, eos_id=TOK.eos_id, pad_id=TOK.pad_id)
    tasks = DOM.tasks("train", 3, 2)
    completions = [DOM.demonstration(t) for t in tasks]
    labels = math_shepherd_labels(
        sampler, params, DOM, tasks, completions, TOK, jax.random.key(1),
        n_continuations=2, max_new_tokens=6, chunk_rows=16,
    )  # fmt: skip
    assert sampler.trace_count == 1  # one compiled program for the whole job
    assert labels.samples == 3 * 1 * 2 and 0 < labels.tokens <= 6 * 6
    for soft, hard, c in zip(labels.soft, labels.hard, completions):
        assert len(soft) == len(DOM.check_steps(tasks[0], c)) == 2
        assert all(0.0 <= s <= h <= 1.0 for s, h in zip(soft, hard))
        assert soft[-1] == 1.0  # the last step: the verdict on the demonstration itself


def test_encode_step_examples_puts_labels_on_separators():
    task, good, bad = _task_and_solutions()
    ex = encode_step_examples(TOK, [task.prompt] * 2, [good, bad],
                              [[1, 1, 1], [1, 0, 0]], max_len=96, pad_to=96)  # fmt: skip
    assert ex["tokens"].shape == (2, 96)
    for r in range(2):
        pos = np.flatnonzero(ex["label_mask"][r])
        assert [int(ex["tokens"][r, k]) for k in pos] == [TOK.step_id, TOK.step_id, TOK.answer_id]
    assert list(ex["labels"][1][ex["label_mask"][1] > 0]) == [1, 0, 0]
    with pytest.raises(ValueError, match="context of 10"):
        encode_step_examples(TOK, [task.prompt], [good], [[1, 1, 1]], max_len=10)


def test_best_of_n_against_random_and_majority():
    scores = np.array([[0.9, 0.1, 0.2], [0.2, 0.8, 0.1], [0.6, 0.5, 0.5]])
    correct = np.array([[1, 0, 0], [0, 1, 0], [1, 0, 0]], bool)
    answers = [["5", "7", "7"], ["3", "4", "3"], ["9", "8", "8"]]
    out = best_of_n(scores, correct, answers)
    # Weighted votes by hand: 5 (0.9) beats 7 (0.3); 4 (0.8) beats 3 (0.3); 8 (1.0)
    # beats 9 (0.6), although 9 alone scores highest.
    assert out == pytest.approx(
        {"reranked": 1.0, "weighted_vote": 2 / 3, "random": 1 / 3, "majority": 0.0}
    )
    with pytest.raises(ValueError, match="non-negative"):
        best_of_n(-scores, correct, answers)
    probs = np.array([[0.9, 0.2, 0.7, 0.0], [0.5, 0.6, 0.8, 0.3]])
    steps = np.array([[1, 0, 1, 0], [0, 1, 1, 1]])
    np.testing.assert_allclose(solution_score(probs, steps), [0.7, 0.3])
    np.testing.assert_allclose(solution_score(probs, steps, "product"), [0.63, 0.144])
    np.testing.assert_allclose(solution_score(probs, steps, "last"), [0.7, 0.3])
    np.testing.assert_allclose(solution_score(probs[:, :3], steps[:, :3], "last"), [0.7, 0.8])
    for how in ("min", "product", "last"):
        assert solution_score(probs, np.zeros((2, 4)), how).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="how"):
        solution_score(probs, steps, "mean")
