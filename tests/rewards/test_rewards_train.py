"""Reward-model, PRM and SFT steps: learning, sharding equivalence, skip guard, refresh, scoring."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlpt.models import CausalLM, ProcessRewardModel, RewardModel, create_model, get_preset
from rlpt.parallel import make_mesh
from rlpt.rewards import (
    PreferencePair,
    RewardConfig,
    RewardModelRefresher,
    Trace,
    TrainConfig,
    assemble_rewards,
    encode_pairs,
    encode_step_examples,
    init_norm_state,
    prm_trainer,
    rm_trainer,
    rollout_process_scores,
    rollout_rm_scores,
)
from rlpt.rl import new_rollout_batch
from rlpt.sampling import left_pad
from rlpt.sft import sft_trainer
from rlpt.tokenizers import ByteTokenizer

CFG = get_preset("tiny")
TOK = ByteTokenizer()
L = 32


def _pairs(n=16):
    # Learnable from the last token alone: the chosen answer is always odd.
    return [
        PreferencePair(f"q{i}", f"{i}<answer>{2 * i + 1}", f"{i}<answer>{2 * i}") for i in range(n)
    ]


def _batch(pairs=None):
    arrays, _ = encode_pairs(pairs or _pairs(), TOK, CFG.max_seq_len, pad_to=L)
    return {
        "chosen": arrays.chosen, "chosen_mask": arrays.chosen_mask, "rejected": arrays.rejected,
        "rejected_mask": arrays.rejected_mask, "margin": arrays.margin,
        "weight": np.ones(len(arrays), np.float32),
    }  # fmt: skip


def _rm(mesh=None):
    return create_model(lambda r: RewardModel(CFG, rngs=r), jax.random.key(0), mesh)


@pytest.fixture(scope="module")
def rm_run():
    graph, params = _rm()
    trainer = rm_trainer(TrainConfig(learning_rate=3e-3), graph, margin=0.5)
    state = trainer.init(params)
    metrics = []
    for _ in range(25):
        state, m = trainer.step(state, _batch())
        metrics.append(jax.device_get(m))
    return graph, state, metrics


def test_reward_model_learns_a_simple_preference(rm_run):
    _, state, metrics = rm_run
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.2
    assert metrics[-1]["accuracy"] == 1.0 and int(state.step) == 25 and int(state.skipped) == 0


def test_sharded_step_matches_single_device(devices):
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    out = []
    for m in (None, mesh):
        graph, params = _rm(m)
        trainer = rm_trainer(TrainConfig(learning_rate=1e-3), graph, mesh=m)
        state, metrics = trainer.step(trainer.init(params), _batch())
        out.append((state, metrics))
    (single, m1), (sharded, m2) = out
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-5)
    # The head bias cancels in r_c - r_r, so its true gradient is 0 and its float32 noise
    # (which Adam rescales to a full step) differs between layouts; every other leaf matches.
    flat_single = dict(jax.tree_util.tree_leaves_with_path(single.params))
    for path, a in jax.tree_util.tree_leaves_with_path(sharded.params):
        if "head_b" in jax.tree_util.keystr(path):
            continue
        np.testing.assert_allclose(np.asarray(a), np.asarray(flat_single[path]), atol=2e-5,
                                   rtol=1e-4)  # fmt: skip
    wq = sharded.params["trunk"]["blocks"][0]["attn"]["wq"][...]
    assert len({str(s.index) for s in wq.addressable_shards}) == 4


def test_non_finite_step_is_skipped_and_counted():
    graph, params = _rm()
    trainer = rm_trainer(TrainConfig(), graph)
    batch = _batch()
    batch["margin"] = batch["margin"].copy()
    batch["margin"][0] = np.nan
    state, m = trainer.step(trainer.init(params), batch)
    assert int(state.skipped) == 1 and float(m["skipped"]) == 1.0
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(_rm()[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_prm_and_sft_steps_reduce_their_losses():
    prm_graph, prm_params = create_model(
        lambda r: ProcessRewardModel(CFG, TOK.step_id, rngs=r), jax.random.key(1)
    )
    texts = ["1+1=2<step>2*3=6<answer>6", "1+1=3<step>3*3=9<answer>9"]
    ex = encode_step_examples(TOK, ["a", "a"], texts, [[1, 1], [0, 0]], max_len=L, pad_to=L)
    trainer = prm_trainer(TrainConfig(learning_rate=3e-3), prm_graph)
    state = trainer.init(prm_params)
    first = trainer.evaluate(state.params, ex)["loss"]
    for _ in range(10):
        state, m = trainer.step(state, ex)
    assert m["loss"] < first and np.isfinite(float(m["accuracy"]))

    lm_graph, lm_params = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(2))
    batch = {"tokens": ex["tokens"], "mask": ex["mask"], "loss_mask": ex["mask"]}
    sft = sft_trainer(TrainConfig(learning_rate=3e-3), lm_graph)
    state = sft.init(lm_params)
    first = sft.evaluate(state.params, batch)["loss"]
    for _ in range(10):
        state, m = sft.step(state, batch)
    assert m["loss"] < first - 0.5


def test_refresh_from_newest_traces_every_n_steps(rm_run):
    graph, state, _ = rm_run
    state = jax.tree.map(jnp.copy, state)  # refreshing donates it; the fixture's stays usable
    step = int(state.step)
    trainer = rm_trainer(TrainConfig(learning_rate=3e-3), graph)
    refresher = RewardModelRefresher(trainer, TOK, max_len=L, every=3, steps=4, batch_size=16,
                                     buffer_size=20)  # fmt: skip
    # The rollouts' verifier now says the opposite of what the fixture learned: even is right.
    traces = [
        Trace(f"t{i}", "d", f"q{i}", f"{i}<answer>{2 * i + k}", "wrong" if k else "correct")
        for i in range(12) for k in (0, 1)
    ]  # fmt: skip
    refresher.add(traces)
    assert refresher.traces == traces[-20:]  # only the newest are kept: prompts 2 to 11
    newest = _batch([
        PreferencePair(f"q{i}", f"{i}<answer>{2 * i}", f"{i}<answer>{2 * i + 1}")
        for i in range(2, 12)
    ])  # fmt: skip
    before = jax.device_get(trainer.evaluate(state.params, newest))
    assert before["accuracy"] == 0.0  # the fixture ranks every new pair the wrong way round
    same, metrics = refresher.maybe_refresh(2, state, jax.random.key(0))
    assert same is state and metrics == {}
    new, metrics = refresher.maybe_refresh(3, state, jax.random.key(0))
    assert metrics["rm/refresh_pairs"] == 10 and int(new.step) == step + 4
    assert np.isfinite(metrics["rm/refresh_loss"])
    # Four steps on the new verdicts cut the Bradley-Terry loss on them by a quarter at least
    # (8.2 to 4.1 at this seed); steps that ignored or reversed the traces would not.
    after = jax.device_get(trainer.evaluate(new.params, newest))
    assert after["loss"] < 0.75 * before["loss"]


def _expected_composite(outcome, rm_scores, step_probs, lengths, steps, *, eps=1e-6, clip=5.0):
    """``assemble_rewards`` for outcome 1, reward model 0.5, process 0.5 ("min"), by hand.

    The first batch sets the running moments, so each learned term is normalised by its
    own batch's mean and population variance (over rows, and over step tokens).
    """
    expected = np.zeros((len(lengths), 32))
    rm_z = np.clip((rm_scores - rm_scores.mean()) / np.sqrt(rm_scores.var() + eps), -clip, clip)
    flat = np.concatenate([step_probs[b] for b in range(len(lengths))])
    mean, var = flat.mean(), flat.var()
    for b, n in enumerate(lengths):
        expected[b, n - 1] += outcome[b] + 0.5 * rm_z[b]
        z = np.clip((step_probs[b] - mean) / np.sqrt(var + eps), -clip, clip)
        for j, col in enumerate(steps[b]):
            # PURE: the return from step j is the minimum of the rewards of steps j onwards.
            after = min(z[j + 1 :]) if j + 1 < len(z) else 0.0
            expected[b, col] += 0.5 * (min(z[j:]) - after)
    return expected


def test_rollout_scores_feed_the_composite_reward(rm_run):
    rm_graph, rm_state, _ = rm_run
    prm_graph, prm_params = create_model(
        lambda r: ProcessRewardModel(CFG, TOK.step_id, rngs=r), jax.random.key(1)
    )
    prompts = [TOK.encode("q1", add_bos=True), TOK.encode("q22", add_bos=True)]
    responses = [TOK.encode("1+1=2<step>2*3=6<answer>6", add_eos=True), TOK.encode("<answer>3")]
    p_tok, p_mask = left_pad(prompts, 8, TOK.pad_id)
    r_tok = np.full((2, 32), TOK.pad_id, np.int32)
    r_mask = np.zeros((2, 32), np.float32)
    for i, r in enumerate(responses):
        r_tok[i, : len(r)] = r
        r_mask[i, : len(r)] = 1
    batch = new_rollout_batch(p_tok, p_mask, r_tok, r_mask, step_token_id=TOK.step_id)
    scores = jax.jit(lambda p, b: rollout_rm_scores(rm_graph, p, b))(rm_state.params, batch)
    probs, steps = jax.jit(
        lambda p, b: rollout_process_scores(
            prm_graph, p, b, step_id=TOK.step_id, answer_id=TOK.answer_id
        )
    )(prm_params, batch)
    assert scores.shape == (2,) and probs.shape == steps.shape == (2, 32)
    # Row 0 has two steps: the <step> and the final <answer>; row 1 only the answer.
    step_cols = [[5, 11], [0]]
    for b in range(2):
        np.testing.assert_array_equal(np.flatnonzero(np.asarray(steps[b])), step_cols[b])

    # Reference scores: each prompt + response scored alone, with no padding at all.
    rm_model = nnx.merge(rm_graph, rm_state.params)
    prm_model = nnx.merge(prm_graph, prm_params)
    ref_rm, ref_probs = np.zeros(2), []
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        row = jnp.asarray([list(prompt) + list(response)], jnp.int32)
        ref_rm[b] = float(rm_model(row)[0])
        logits, _ = prm_model(row)
        cols = len(prompt) + np.asarray(step_cols[b])
        ref_probs.append(np.asarray(jax.nn.sigmoid(logits[0, cols])))
    # float32 attention over padded and unpadded rows agrees to rounding.
    np.testing.assert_allclose(np.asarray(scores), ref_rm, rtol=1e-4, atol=1e-5)
    for b in range(2):
        got = np.asarray(probs[b])[step_cols[b]]
        np.testing.assert_allclose(got, ref_probs[b], rtol=1e-4, atol=1e-5)

    cfg = RewardConfig(outcome=1.0, reward_model=0.5, process=0.5)
    outcome = np.array([1.0, 0.0])
    rewards, _, metrics = jax.jit(
        lambda n, m, s, p, k: assemble_rewards(
            cfg, n, m, outcome=jnp.asarray(outcome), reward_model=s, process=p, step_mask=k
        )
    )(init_norm_state(), batch.response_mask, scores, probs, steps)
    expected = _expected_composite(
        outcome, ref_rm, ref_probs, [len(r) for r in responses], step_cols
    )
    # float32 rounding of the scores, divided by the learned terms' small batch spread.
    np.testing.assert_allclose(np.asarray(rewards), expected, atol=1e-5)
    assert float(metrics["reward/total"]) == pytest.approx(expected.sum() / 2, abs=1e-5)


def test_decay_schedule_must_outlast_its_warmup():
    with pytest.raises(ValueError, match="decay_steps"):
        TrainConfig(warmup_steps=50, decay_steps=50)
