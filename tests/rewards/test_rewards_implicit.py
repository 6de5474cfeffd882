"""Implicit process rewards (PRIME): hand-worked values, numpy oracles, gradients, training."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlpt.models import CausalLM, create_model, get_preset
from rlpt.rewards import (
    ImplicitPRM,
    RewardConfig,
    TrainConfig,
    assemble_rewards,
    encode_implicit_examples,
    implicit_outcome_logits,
    implicit_prm_loss,
    implicit_prm_objective,
    implicit_token_rewards,
    init_norm_state,
    rollout_implicit_examples,
    rollout_implicit_rewards,
    row_log_probs,
    step_ends,
    step_rewards,
    train_implicit_prm,
)
from rlpt.rl import new_rollout_batch
from rlpt.sampling import left_pad
from rlpt.tokenizers import ByteTokenizer

TOK = ByteTokenizer()


def _random(seed, b=5, t=7):
    rng = np.random.default_rng(seed)
    logp = -rng.gamma(2.0, 1.0, (b, t)).astype(np.float32)
    ref = -rng.gamma(2.0, 1.0, (b, t)).astype(np.float32)
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    labels = (rng.random(b) < 0.5).astype(np.float32)
    weights = rng.random(b).astype(np.float32)
    return logp, ref, mask, labels, weights


def test_token_rewards_hand_worked():
    logp = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -0.5, -jnp.inf]])
    ref = jnp.array([[-1.5, -2.0, -2.0], [-1.0, -0.25, -1.0]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    r = implicit_token_rewards(logp, ref, mask, beta=0.5)
    # 0.5 * (logp - ref) on the mask; the -inf log-probability of a pad stays out (no NaN).
    np.testing.assert_allclose(r, [[0.25, 0.0, 0.0], [0.25, -0.125, 0.0]])
    np.testing.assert_allclose(implicit_outcome_logits(logp, ref, mask, 0.5), [0.25, 0.125])


def test_loss_hand_worked():
    # r_phi = 0 gives log 2 whatever the label; r_phi = log 3 gives P(correct) = 3/4.
    zero = jnp.zeros((2, 2))
    loss, m = implicit_prm_loss(zero, zero, jnp.ones((2, 2)), jnp.array([1.0, 0.0]), 0.05)
    np.testing.assert_allclose(loss, np.log(2.0), rtol=1e-6)
    logp = jnp.array([[np.log(3.0) / 0.05, 0.0]])
    loss, m = implicit_prm_loss(logp, jnp.zeros((1, 2)), jnp.ones((1, 2)), jnp.ones(1), 0.05)
    np.testing.assert_allclose(loss, -np.log(0.75), rtol=1e-5)
    assert m["accuracy"] == 1.0 and m["reward_wrong"] == 0.0
    np.testing.assert_allclose(m["reward_correct"], np.log(3.0), rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_matches_numpy_loop(seed):
    logp, ref, mask, labels, weights = _random(seed)
    beta = 0.3
    num = den = 0.0
    for b in range(len(labels)):
        x = sum(beta * (logp[b, t] - ref[b, t]) for t in range(logp.shape[1]) if mask[b, t])
        p = 1.0 / (1.0 + np.exp(-x))
        num += weights[b] * -(labels[b] * np.log(p) + (1 - labels[b]) * np.log(1 - p))
        den += weights[b]
    for fn in (implicit_prm_loss, jax.jit(implicit_prm_loss, static_argnums=4)):
        loss, _ = fn(logp, ref, mask, labels, beta, weights)
        np.testing.assert_allclose(loss, num / den, rtol=1e-5)


def test_loss_gradient_matches_closed_form_and_finite_differences():
    logp, ref, mask, labels, weights = _random(3)
    beta = 0.2
    grad = jax.grad(lambda lp: implicit_prm_loss(lp, ref, mask, labels, beta, weights)[0])(logp)
    # dL/dlogp_bt = w_b / sum(w) * (sigmoid(r_b) - l_b) * beta * mask_bt.
    r = (beta * (logp - ref) * mask).sum(axis=1).astype(np.float64)
    expected = (weights / weights.sum() * (1 / (1 + np.exp(-r)) - labels))[:, None] * beta * mask
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-7)
    # Central differences in float64 numpy on one masked entry, independent of JAX.
    b, t = map(int, np.argwhere(mask > 0)[0])

    def np_loss(lp):
        x = (beta * (lp - ref) * mask).sum(axis=1).astype(np.float64)
        per = np.logaddexp(0, x) - labels * x
        return (per * weights).sum() / weights.sum()

    h = 1e-4
    up, down = logp.astype(np.float64), logp.astype(np.float64)
    up[b, t] += h
    down[b, t] -= h
    np.testing.assert_allclose(grad[b, t], (np_loss(up) - np_loss(down)) / (2 * h), rtol=1e-3)


def test_step_rewards_hand_worked():
    tokens = jnp.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    marks = jnp.array([[0.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
    # Steps [1, 2] and [3, 4, 5]; the trailing 6 belongs to no step.
    np.testing.assert_allclose(step_rewards(tokens, marks), [[0, 3, 0, 0, 12, 0]])
    np.testing.assert_allclose(step_rewards(tokens, jnp.zeros_like(marks)), jnp.zeros_like(marks))


@pytest.mark.parametrize("seed", [0, 1])
def test_step_rewards_match_numpy_loop(seed):
    rng = np.random.default_rng(seed)
    r = rng.normal(size=(4, 9)).astype(np.float32)
    marks = (rng.random((4, 9)) < 0.3).astype(np.float32)
    expected = np.zeros_like(r)
    for b in range(4):
        acc = 0.0
        for t in range(9):
            acc += r[b, t]
            if marks[b, t]:
                expected[b, t], acc = acc, 0.0
    np.testing.assert_allclose(jax.jit(step_rewards)(r, marks), expected, rtol=1e-5, atol=1e-6)


def test_step_ends_add_the_last_token_to_the_separators():
    text = "1+1=2<step>2*3=6<step><answer>6"
    ids = TOK.encode(text, add_eos=True)
    tokens = jnp.array([ids + [TOK.pad_id] * 3])
    mask = jnp.array([[1] * len(ids) + [0] * 3])
    ends = step_ends(tokens, mask, step_id=TOK.step_id, answer_id=TOK.answer_id)
    step_at = [k for k, t in enumerate(ids) if t in (TOK.step_id, TOK.answer_id)]
    assert np.flatnonzero(ends[0]).tolist() == step_at + [len(ids) - 1]
    # With every token rewarded 1, the step sums are the segment lengths and add up to the row.
    per_step = step_rewards(mask.astype(jnp.float32), ends)
    assert float(per_step.sum()) == len(ids)


# -- training pi_phi on a tiny model ---------------------------------------------------------

CFG = get_preset("tiny")


def _examples():
    # Two prompts; the correct response is always "yes", the wrong one "no".
    out = []
    for prompt in ("a?", "b?"):
        p = TOK.encode(prompt, add_bos=True)
        out.append((p, TOK.encode("yes", add_eos=True), 1.0))
        out.append((p, TOK.encode("no", add_eos=True), 0.0))
    return out


@pytest.fixture(scope="module")
def trained():
    graph, params = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0))
    prm, history = train_implicit_prm(
        graph, params, _examples(), pad_id=TOK.pad_id, pad_to=16, steps=20, batch_size=4,
        cfg=TrainConfig(learning_rate=1e-2), beta=0.05,
    )  # fmt: skip
    return graph, params, prm, history


def _rows():
    return encode_implicit_examples(_examples(), pad_id=TOK.pad_id, pad_to=16)


def test_implicit_reward_is_zero_against_itself(trained):
    graph, params, _, _ = trained
    rows = _rows()
    same = ImplicitPRM(graph, params, params)
    r = same.token_rewards(rows["tokens"], rows["mask"], rows["response_mask"])
    assert r.shape == (4, 15) and float(jnp.max(jnp.abs(r))) == 0.0


def test_training_lowers_the_loss_and_separates_right_from_wrong(trained):
    graph, params, prm, history = trained
    assert history[-1]["loss"] < history[0]["loss"] - 0.3  # log 2 to about 0.2 in 20 steps
    assert history[-1]["skipped"] == 0.0
    rows = _rows()
    # The policy's arrays were not donated away: the reference still reads.
    assert np.isfinite(np.asarray(jax.tree.leaves(params)[0])).all()
    logits = np.asarray(prm.outcome_logits(rows["tokens"], rows["mask"], rows["response_mask"]))
    correct, wrong = logits[rows["labels"] > 0.5], logits[rows["labels"] < 0.5]
    assert correct.min() > wrong.max()
    assert correct.mean() > 0 > wrong.mean()
    # Token rewards sit on the response only (column t rewards token t + 1).
    r = np.asarray(prm.token_rewards(rows["tokens"], rows["mask"], rows["response_mask"]))
    assert np.all(r[~rows["response_mask"][:, 1:]] == 0.0)


def test_rollout_rewards_match_unpadded_rows_and_feed_the_composite(trained):
    graph, params, prm, _ = trained
    prompts = [TOK.encode("a?", add_bos=True), TOK.encode("bb?", add_bos=True)]
    responses = [TOK.encode("1<step>yes", add_eos=True), TOK.encode("no", add_eos=True)]
    p_tok, p_mask = left_pad(prompts, 6, TOK.pad_id)
    r_tok = np.full((2, 12), TOK.pad_id, np.int32)
    r_mask = np.zeros((2, 12), np.float32)
    for i, r in enumerate(responses):
        r_tok[i, : len(r)] = r
        r_mask[i, : len(r)] = 1
    batch = new_rollout_batch(p_tok, p_mask, r_tok, r_mask, step_token_id=TOK.step_id)
    score = jax.jit(
        lambda p, rp, b, dense: rollout_implicit_rewards(
            graph, p, rp, b, beta=prm.beta, step_id=TOK.step_id, answer_id=TOK.answer_id,
            dense=dense,
        ),
        static_argnums=3,
    )  # fmt: skip
    dense, on = score(prm.params, params, batch, True)
    steps, ends = score(prm.params, params, batch, False)
    np.testing.assert_array_equal(on, r_mask)
    # Row 0: the step ends at its <step> (column 1) and at the last token; row 1 at its last.
    assert [np.flatnonzero(np.asarray(e)).tolist() for e in ends] == [[1, 5], [2]]
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        # The same row alone, without padding, through ImplicitPRM.
        row = encode_implicit_examples([(prompt, response, 1.0)], pad_id=TOK.pad_id,
                                       pad_to=len(prompt) + len(response))  # fmt: skip
        alone = prm.token_rewards(row["tokens"], row["mask"], row["response_mask"])[0]
        n = len(response)
        # float32 forward passes over differently padded rows: agree to rounding.
        np.testing.assert_allclose(dense[b, :n], alone[-n:], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(steps[b].sum(), alone.sum(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(steps[0, 1], dense[0, :2].sum(), rtol=1e-5, atol=1e-6)
    total, _, metrics = assemble_rewards(
        RewardConfig(process=1.0, process_aggregation="sum", normalize=False), init_norm_state(),
        batch.response_mask, outcome=jnp.zeros(2), process=steps, step_mask=ends,
    )  # fmt: skip
    np.testing.assert_allclose(total, steps, rtol=1e-6, atol=1e-7)


def test_online_examples_of_a_rollout_give_the_loss_of_right_padded_rows(trained):
    """PRIME's online update reads the rollout's own layout (left-padded prompts, response
    columns, a multi-turn environment token present but untrained); its loss equals that
    of the same rows encoded alone, right-padded, with the environment token's loss off."""
    graph, params, prm, _ = trained
    prompts = [TOK.encode("a?", add_bos=True), TOK.encode("bb?", add_bos=True)]
    responses = [TOK.encode("yes", add_eos=True), TOK.encode("n!o", add_eos=True)]
    p_tok, p_mask = left_pad(prompts, 6, TOK.pad_id)
    r_tok = np.full((2, 8), TOK.pad_id, np.int32)
    r_mask = np.zeros((2, 8), np.float32)
    present = np.zeros((2, 8), bool)
    for i, r in enumerate(responses):
        r_tok[i, : len(r)] = r
        r_mask[i, : len(r)] = 1
        present[i, : len(r)] = True
    r_mask[1, 1] = 0.0  # "!" is an environment token: present, not trained
    batch = new_rollout_batch(p_tok, p_mask, r_tok, r_mask, present_mask=present)
    labels = np.asarray([1.0, 0.0], np.float32)
    weights = np.asarray([1.0, 0.5], np.float32)
    data = rollout_implicit_examples(batch, jnp.asarray(labels), jnp.asarray(weights))
    data["ref_logp"] = row_log_probs(graph, params, data["tokens"], data["mask"])
    objective = lambda d: implicit_prm_objective(graph, prm.params, d, beta=prm.beta)  # noqa: E731
    loss, metrics = objective(data)

    # Independent layout: right-padded rows from the raw ids, loss per row by hand.
    rows = encode_implicit_examples(
        [(p, r, lab) for p, r, lab in zip(prompts, responses, labels)], pad_id=TOK.pad_id,
        pad_to=12,
    )  # fmt: skip
    rows["response_mask"][1, len(prompts[1]) + 1] = False
    logits = np.asarray(prm.outcome_logits(rows["tokens"], rows["mask"], rows["response_mask"]))
    per_row = np.log1p(np.exp(logits)) - labels * logits
    expected = float((per_row * weights).sum() / weights.sum())
    np.testing.assert_allclose(float(loss), expected, rtol=1e-4, atol=1e-6)
    assert float(metrics["accuracy"]) == pytest.approx(
        float((((logits > 0) == (labels > 0.5)) * weights).sum() / weights.sum())
    )
