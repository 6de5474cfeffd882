"""Multi-turn rollouts: feedback between turns, token in, token out, one row per episode.

A scripted sampler and verifier give rows whose layout, masks, positions, behaviour
log-probs and rewards are written out below by hand. A tiny model then checks that
single-turn batches are exactly what they were: with ``turns=1``, and with several
turns when every row is solved at the first.
"""

import types

import jax
import numpy as np
import pytest

from rlpt.data.loader import PromptBatch
from rlpt.models import CausalLM, create_model, get_preset
from rlpt.rewards.composite import RewardConfig
from rlpt.rewards.learned import LearnedRewards
from rlpt.rewards.monitor import RewardMonitor
from rlpt.rl import PPOConfig
from rlpt.roles import MultiTurnRolloutWorker, PPOLearner, RewardRole, RolloutWorker
from rlpt.roles.multiturn import encode_feedback, feedback_message
from rlpt.sampling import SampleOutput, Sampler, SamplingParams
from rlpt.tasks import CompositeReward, Task, VerifyResult
from rlpt.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
EOS = TOK.eos_id


def _prompt_batch(texts, width):
    ids = [TOK.encode(t, add_bos=True) for t in texts]
    tokens = np.full((len(ids), width), TOK.pad_id, np.int32)
    mask = np.zeros((len(ids), width), bool)
    for row, p in enumerate(ids):
        tokens[row, width - len(p) :], mask[row, width - len(p) :] = p, True
    n = len(ids)
    return PromptBatch(
        tokens=tokens, mask=mask, loss_weight=np.ones(n, np.float32),
        domain_index=np.zeros(n, np.int32), difficulty=np.ones(n, np.int32),
        group_id=np.zeros(n, np.int32),
        tasks=[Task(id=t, domain="d", prompt=t, difficulty=1) for t in texts], step=0,
    )  # fmt: skip


class _ScriptedSampler:
    """Answers prompt ``p`` at its ``k``-th call with ``scripts[p][k]`` (an eos follows
    unless the text fills ``max_new_tokens``); token ``j`` of call ``k`` gets the
    behaviour log-prob ``-(k + 1) - 0.1 j``. Records the contexts it was given."""

    def __init__(self, scripts):
        self.scripts = scripts
        self.pad_id = TOK.pad_id
        self.config = types.SimpleNamespace(max_seq_len=256)
        self.calls = []

    def generate_padded(self, params, tokens, mask, key, *, max_new_tokens, sampling):
        del params, key, sampling
        contexts = [r[m].tolist() for r, m in zip(np.asarray(tokens), np.asarray(mask, bool))]
        k = len(self.calls)
        self.calls.append(contexts)
        n = len(contexts)
        out = SampleOutput(
            tokens=np.full((n, max_new_tokens), TOK.pad_id, np.int32),
            logprobs=np.zeros((n, max_new_tokens), np.float32),
            mask=np.zeros((n, max_new_tokens), np.float32),
            lengths=np.zeros(n, np.int32), truncated=np.zeros(n, bool),
        )  # fmt: skip
        for j, ctx in enumerate(contexts):
            prompt = next(p for p in self.scripts if ctx[: len(TOK.encode(p, add_bos=True))]
                          == TOK.encode(p, add_bos=True))  # fmt: skip
            ids = TOK.encode(self.scripts[prompt][k])
            if len(ids) < max_new_tokens:
                ids.append(EOS)
            ids = ids[:max_new_tokens]
            m = len(ids)
            out.tokens[j, :m], out.mask[j, :m], out.lengths[j] = ids, 1.0, m
            out.logprobs[j, :m] = -(k + 1) - 0.1 * np.arange(m)
            out.truncated[j] = EOS not in ids
        return out


class _ScriptedVerifier:
    """Correct iff the text is "ok"; task "A?" explains a wrong answer, the others don't."""

    def __init__(self):
        self.calls = []

    def verify(self, names, tasks, texts):
        self.calls.append(list(texts))
        out = []
        for task, text in zip(tasks, texts):
            if text == "ok":
                out.append(VerifyResult(1.0, "correct"))
            elif task.prompt == "A?":
                out.append(VerifyResult(0.0, "wrong", details={"feedback": f"got {text}"}))
            else:
                out.append(VerifyResult(0.0, "wrong"))
        return out


def _reward_role(verifier, turn_discount=1.0):
    learned = LearnedRewards(RewardConfig(), RewardMonitor(), step_id=TOK.step_id,
                             answer_id=TOK.answer_id)  # fmt: skip
    return RewardRole(verifier, CompositeReward({"correct": 1.0}), learned,
                      turn_discount=turn_discount)  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("tiny").replace(max_seq_len=64)
    graph, params = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(0))
    return cfg, graph, params


def _learner(tiny, num_groups):
    cfg, graph, _ = tiny
    ppo = PPOConfig(estimator="grpo", num_groups=num_groups, kl_placement="loss")
    return PPOLearner(ppo, graph, cfg, value_key=jax.random.key(1))


def test_feedback_is_the_verdicts_message_in_a_fixed_format_cut_to_its_budget():
    assert feedback_message(VerifyResult(0.0, "wrong", details={"feedback": " f(3) gave 7 "})) == (
        "f(3) gave 7"
    )
    assert feedback_message(VerifyResult(0.0, "no_answer")) == "no answer given"
    assert feedback_message(VerifyResult(0.0, "timeout")) == "timeout"
    assert encode_feedback(TOK, "f(3) gave 7", 64) == TOK.encode("\nfeedback: f(3) gave 7\n")
    # 11 prefix + 5 kept + 3 for "..." + 1 newline = 20 byte tokens.
    cut = encode_feedback(TOK, "abcdefghijklmnopqrstuvwxyz", 20)
    assert cut == TOK.encode("\nfeedback: abcde...\n") and len(cut) == 20


def test_a_three_turn_row_by_hand(tiny):
    scripts = {"A?": ["x", "y", "ok"], "B?": ["ok"], "C?": ["x", "x", "xxxxx"]}
    sampler, verifier = _ScriptedSampler(scripts), _ScriptedVerifier()
    worker = MultiTurnRolloutWorker(
        sampler, TOK, verifier, domain_names=("d",), max_new_tokens=4,
        sampling=SamplingParams(), turns=3, feedback_tokens=24,
    )  # fmt: skip
    prompts = _prompt_batch(["A?", "B?", "C?"], width=8)
    traj = worker.generate(None, prompts, jax.random.key(0), version=5)

    def fb(message):
        return TOK.encode(f"\nfeedback: {message}\n")

    x, y, ok = TOK.encode("x"), TOK.encode("y"), TOK.encode("ok")
    row_a = x + [EOS] + fb("got x") + y + [EOS] + fb("got y") + ok + [EOS]
    row_b = ok + [EOS]
    row_c = x + [EOS] + fb("wrong answer") + x + [EOS] + fb("wrong answer") + x * 4
    assert (len(fb("got x")), len(fb("wrong answer"))) == (17, 24)
    assert traj.tokens.shape == (3, 3 * 4 + 2 * 24)
    pad = TOK.pad_id
    for i, row in enumerate((row_a, row_b, row_c)):
        assert traj.tokens[i].tolist() == row + [pad] * (60 - len(row))
    assert traj.lengths.tolist() == [41, 3, 56]
    np.testing.assert_array_equal(traj.mask[0], [1] * 41 + [0] * 19)
    np.testing.assert_array_equal(
        traj.loss_mask[0], [1] * 2 + [0] * 17 + [1] * 2 + [0] * 17 + [1] * 3 + [0] * 19
    )
    np.testing.assert_array_equal(traj.loss_mask[1], [1] * 3 + [0] * 57)
    np.testing.assert_array_equal(
        traj.loss_mask[2], [1] * 2 + [0] * 24 + [1] * 2 + [0] * 24 + [1] * 4 + [0] * 4
    )
    # Behaviour log-probs exactly as sampled on the model's tokens, 0 on the feedback.
    np.testing.assert_allclose(
        traj.logprobs[0],
        [-1.0, -1.1] + [0] * 17 + [-2.0, -2.1] + [0] * 17 + [-3.0, -3.1, -3.2] + [0] * 19,
        rtol=0, atol=1e-6,
    )  # fmt: skip
    np.testing.assert_allclose(
        traj.logprobs[2],
        [-1.0, -1.1] + [0] * 24 + [-2.0, -2.1] + [0] * 24 + [-3.0, -3.1, -3.2, -3.3] + [0] * 4,
        rtol=0, atol=1e-6,
    )  # fmt: skip
    # Each turn's context is the prompt and every id so far, never re-encoded text.
    p = [TOK.encode(t, add_bos=True) for t in ("A?", "B?", "C?")]
    assert sampler.calls[1] == [p[0] + row_a[:19], p[2] + row_c[:26]]
    assert sampler.calls[2] == [p[0] + row_a[:38], p[2] + row_c[:52]]
    assert verifier.calls == [["x", "ok", "x"], ["y", "x"], ["ok", "xxxx"]]
    t = traj.turns
    assert t.turns.tolist() == [3, 1, 3]
    assert t.first_success.tolist() == [0.0, 1.0, 0.0]
    assert t.success.tolist() == [1.0, 1.0, 0.0]
    assert traj.truncated.tolist() == [False, False, True]
    assert traj.texts == ["ok", "ok", "xxxx"]
    assert traj.policy_version.tolist() == [5, 5, 5]

    # The reward: the last verdict, discounted per extra turn; nothing is verified again.
    traj = _reward_role(verifier, turn_discount=0.5).judge(traj)
    assert len(verifier.calls) == 3
    assert traj.verdicts.rewards.tolist() == [0.25, 1.0, 0.0]
    assert traj.verdicts.success.tolist() == [1.0, 1.0, 0.0]

    # Rows keep their turn records through selection.
    picked = traj.take(np.array([2, 0]))
    assert picked.turns.turns.tolist() == [3, 3] and picked.loss_mask.shape == (2, 60)

    batch, layout = _learner(tiny, 1).make_batch(
        traj, np.zeros(3, np.int32), prompt_buckets=(8,), pad_id=pad, step_id=TOK.step_id,
        max_new_tokens=60,
    )  # fmt: skip
    assert layout["width"] == 56  # the longest row, 56, rounded up to a multiple of 8
    b = jax.tree.map(np.asarray, batch)
    assert b.tokens[0].tolist() == [pad] * 5 + p[0] + row_a + [pad] * 15
    # Present: prompt, completions and feedback; positions run on through the feedback.
    assert b.input_mask[0].tolist() == [False] * 5 + [True] * 44 + [False] * 15
    assert b.positions[0].tolist() == [0] * 5 + list(range(44)) + [0] * 15
    assert b.positions[2].tolist() == [0] * 5 + list(range(59))
    # Trained: the model's tokens only.
    np.testing.assert_array_equal(b.response_mask, traj.loss_mask[:, :56])
    np.testing.assert_array_equal(b.behaviour_logp, traj.logprobs[:, :56])
    # The reward sits on the last model token: column 40 of row A, 2 of row B.
    expected = np.zeros((3, 56), np.float32)
    expected[0, 40], expected[1, 2] = 0.25, 1.0
    np.testing.assert_array_equal(b.rewards, expected)
    # Self-imitation only of rows solved at the first try.
    assert b.imitation_weight.tolist() == [0.0, 1.0, 0.0]
    assert b.truncated.tolist() == [False, False, True]


def _tree_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_single_turn_batches_are_exactly_todays(tiny):
    cfg, graph, params = tiny
    sampler = Sampler(graph, cfg, eos_id=EOS, pad_id=TOK.pad_id, buckets=(16,))
    sampling = SamplingParams(temperature=1.0)
    prompts = _prompt_batch(["1+2=", "1+2=", "30+4=", "30+4="], width=16)
    key = jax.random.key(3)
    group_id = np.array([0, 0, 1, 1], np.int32)

    def batch_of(worker, verifier, width):
        traj = _reward_role(verifier).judge(worker.generate(params, prompts, key, version=0))
        batch, _ = _learner(tiny, 2).make_batch(
            traj, group_id, prompt_buckets=(16,), pad_id=TOK.pad_id, step_id=TOK.step_id,
            max_new_tokens=width,
        )  # fmt: skip
        return traj, batch

    # Verdicts that differ by row (a function of the text alone, so both paths agree).
    mixed = types.SimpleNamespace(verify=lambda names, tasks, texts: [
        VerifyResult(1.0, "correct") if len(t) % 2 else VerifyResult(0.0, "wrong") for t in texts
    ])  # fmt: skip
    single = RolloutWorker(sampler, TOK, domain_names=("d",), max_new_tokens=8, sampling=sampling)
    today, today_batch = batch_of(single, mixed, 8)
    assert 0 < today.verdicts.success.sum() < 4  # both kinds of row are covered
    one_turn = MultiTurnRolloutWorker(
        sampler, TOK, mixed, domain_names=("d",), max_new_tokens=8, sampling=sampling, turns=1,
        feedback_tokens=16,
    )  # fmt: skip
    _, batch = batch_of(one_turn, mixed, one_turn.width)
    _tree_equal(batch, today_batch)

    # Every row solved at the first turn: no feedback is ever appended.
    solved = types.SimpleNamespace(
        verify=lambda names, tasks, texts: [VerifyResult(1.0, "correct") for _ in texts]
    )
    today, today_batch = batch_of(single, solved, 8)
    three_turns = MultiTurnRolloutWorker(
        sampler, TOK, solved, domain_names=("d",), max_new_tokens=8, sampling=sampling, turns=3,
        feedback_tokens=16,
    )  # fmt: skip
    traj, batch = batch_of(three_turns, solved, three_turns.width)
    assert traj.tokens.shape == (4, 3 * 8 + 2 * 16)
    np.testing.assert_array_equal(traj.tokens[:, :8], today.tokens)
    np.testing.assert_array_equal(traj.logprobs[:, :8], today.logprobs)
    assert traj.turns.turns.tolist() == [1] * 4
    _tree_equal(batch, today_batch)
