"""Sequence packing: the planner's layout, and packed scoring and updates against padded rows."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlpt.models import CausalLM, ValueModel, create_model, get_preset
from rlpt.parallel import make_mesh
from rlpt.rl import PPOConfig, PPOTrainer, init_train_state, new_rollout_batch
from rlpt.rl.packing import first_fit_decreasing, pack_batch, pack_unit, plan_update
from rlpt.rl.ppo import _policy_logp, epoch_permutations

CFG = get_preset("tiny")
B, P, T = 16, 9, 7


def _batch(seed=0):
    """Rows of very different lengths: packing has something to do."""
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(1, P + 1, size=B)
    prompt_mask = np.arange(P)[None, :] >= (P - prompt_len)[:, None]
    prompt = np.where(prompt_mask, rng.integers(5, 200, size=(B, P)), 0)
    resp_len = rng.integers(1, T + 1, size=B)
    resp_mask = (np.arange(T)[None, :] < resp_len[:, None]).astype(np.float32)
    response = np.where(resp_mask > 0, rng.integers(5, 200, size=(B, T)), 0)
    return new_rollout_batch(
        prompt, prompt_mask, response, resp_mask,
        sequence_rewards=rng.normal(size=B).astype(np.float32),
        group_id=np.repeat(np.arange(B // 4), 4).astype(np.int32),
    )  # fmt: skip


def test_first_fit_decreasing_by_hand():
    # Decreasing order 6, 5, 4, 3, 2: 6 opens a bin, 5 does not fit beside it, 4 joins
    # the 6, 3 and 2 join the 5.
    assert first_fit_decreasing(np.array([3, 6, 2, 5, 4]), 10) == [[1, 4], [3, 0, 2]]
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing(np.array([11]), 10)


def test_packed_layout_holds_every_sequence_once_with_its_positions():
    batch = _batch()
    tokens, input_mask = np.asarray(batch.tokens), np.asarray(batch.input_mask)
    positions = np.asarray(batch.positions)
    rows = np.random.default_rng(1).permutation(B)
    packed = pack_unit(tokens, input_mask, P, rows, n_rows=B)
    assert packed["tokens"].shape == (B, P + T)
    flat_tokens = packed["tokens"].reshape(-1)
    flat_positions = packed["positions"].reshape(-1)
    flat_segments = packed["segment_ids"].reshape(-1)
    response_mask = np.asarray(batch.response_mask)
    for j, src in enumerate(rows):
        real = response_mask[src] > 0
        index = packed["logit_index"][j][real]
        # The logits of response token t sit one position before it, in the same segment.
        np.testing.assert_array_equal(flat_tokens[index + 1], tokens[src, P:][real])
        np.testing.assert_array_equal(flat_positions[index + 1], positions[src, P:][real])
        assert len(set(flat_segments[np.r_[index, index + 1]])) == 1
    # Every real token is placed exactly once; padding is segment 0 and masked.
    assert packed["input_mask"].sum() == input_mask.sum()
    assert not packed["input_mask"][packed["segment_ids"] == 0].any()
    # Fewer rows than the padded batch: that is the point.
    assert len(first_fit_decreasing(input_mask.sum(1), P + T)) < B


def test_packing_refuses_rows_with_holes():
    batch = _batch()
    mask = np.asarray(batch.input_mask).copy()
    mask[2, P - 1] = False  # a hole between prompt and response
    with pytest.raises(ValueError, match=r"rows \[2\]"):
        pack_unit(np.asarray(batch.tokens), mask, P, np.arange(B), n_rows=B)


def test_packed_logits_equal_each_sequence_run_alone():
    """The independent reference: each sequence's real tokens through the model unpadded."""
    graph, params = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0))
    lm = nnx.merge(graph, params)
    batch = _batch(3)
    packed = pack_batch(batch)
    logits, _ = lm(packed.tokens, packed.positions, packed.input_mask, packed.segment_ids)
    flat = np.asarray(logits).reshape(-1, logits.shape[-1])
    tokens, input_mask = np.asarray(batch.tokens), np.asarray(batch.input_mask)
    response_mask = np.asarray(batch.response_mask)
    # Each sequence's real tokens moved to the start of its own row, positions 0..n-1 and
    # no segment ids: under causal attention, the junk after a sequence cannot reach it.
    lengths = input_mask.sum(axis=1)
    alone_tokens = np.zeros_like(tokens)
    for row in range(B):
        alone_tokens[row, : lengths[row]] = tokens[row][input_mask[row]]
    alone, _ = lm(jnp.asarray(alone_tokens))  # [B, P + T, V]
    alone = np.asarray(alone)
    for row in range(B):
        n_resp = int(response_mask[row].sum())
        end = int(lengths[row])
        expected = alone[row, end - n_resp - 1 : end - 1]  # logits predicting the response
        got = flat[np.asarray(packed.logit_index)[row, :n_resp]]
        np.testing.assert_allclose(got, expected, atol=2e-5, rtol=2e-5)


def test_plan_units_follow_the_update_permutations():
    batch = _batch()
    cfg = PPOConfig(epochs=2, num_minibatches=2, grad_accum=2)
    perms = np.asarray(epoch_permutations(cfg, jax.random.key(4), B))
    plan = plan_update(batch, perms, cfg.num_minibatches, cfg.grad_accum)
    assert plan.rows.logit_index.shape == (2, 2, 2, B // 4, T)
    tokens = np.asarray(batch.tokens)
    response_mask = np.asarray(batch.response_mask)
    units = perms.reshape(2, 2, 2, B // 4)
    for e, m, g in np.ndindex(2, 2, 2):
        flat = np.asarray(plan.rows.tokens[e, m, g]).reshape(-1)
        for j, src in enumerate(units[e, m, g]):
            real = response_mask[src] > 0
            index = np.asarray(plan.rows.logit_index[e, m, g, j])[real]
            np.testing.assert_array_equal(flat[index + 1], tokens[src, P:][real])
    assert plan.rows.tokens.shape[3] % 4 == 0


@functools.cache  # the mesh test reuses the packed GRPO run of the equivalence test
def _run(cfg, mesh=None):
    policy_graph, policy = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0), mesh)
    value_graph, value = create_model(lambda r: ValueModel(CFG, rngs=r), jax.random.key(1), mesh)
    _, ref = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(7), mesh)
    critic = value if cfg.uses_critic else None
    trainer = PPOTrainer(cfg, policy_graph, value_graph if critic else None, mesh=mesh)
    state = trainer.shard_state(init_train_state(cfg, policy, critic, jax.random.key(5)))
    scored = []
    metrics = []
    for seed in range(2):
        b = trainer.shard_batch(_batch(seed))
        b = trainer.advantages(state, trainer.score(state, ref, b))
        scored.append(jax.device_get(b))
        state, m = trainer.update(state, b)
        metrics.append(jax.device_get(m))
    return jax.device_get(state), metrics, scored


@pytest.mark.parametrize(
    "fields",
    [
        dict(estimator="grpo", num_groups=B // 4, kl_placement="loss", sampling_temperature=1.3),
        dict(estimator="gae", grad_accum=2, aggregation="seq_mean_token_mean"),
    ],
    ids=["grpo", "gae_accum"],
)
def test_packed_update_equals_padded_update(fields):
    base = PPOConfig(
        epochs=2, num_minibatches=2, learning_rate=1e-3, value_learning_rate=1e-3, **fields
    )
    padded = _run(base)
    packed = _run(PPOConfig(**{**base.__dict__, "pack_sequences": True}))
    for a, b in zip(padded[2], packed[2]):
        for name in ("old_logp", "ref_logp", "values", "advantages"):
            np.testing.assert_allclose(getattr(b, name), getattr(a, name), atol=1e-5)
    for a, b in zip(padded[1], packed[1]):
        for name in ("loss", "policy_loss", "kl", "entropy", "grad_norm", "clip_frac"):
            np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-6)
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), padded[0].policy, packed[0].policy)
    assert max(jax.tree.leaves(moved)) < 1e-5
    if base.uses_critic:
        moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), padded[0].value, packed[0].value)
        assert max(jax.tree.leaves(moved)) < 1e-5


def test_packed_update_on_a_mesh_matches_one_device(devices):
    cfg = PPOConfig(
        epochs=2, num_minibatches=2, learning_rate=1e-3, value_learning_rate=1e-3,
        estimator="grpo", num_groups=B // 4, kl_placement="loss", sampling_temperature=1.3,
        pack_sequences=True,
    )  # fmt: skip
    single = _run(cfg)
    sharded = _run(cfg, make_mesh(data=2, fsdp=2, tensor=2))
    for a, b in zip(single[1], sharded[1]):
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-4, atol=1e-6)
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), single[0].policy, sharded[0].policy)
    assert max(jax.tree.leaves(moved)) < 1e-5


def test_packed_rows_with_a_chunked_vocabulary_match_padded_rows():
    """Packed hidden states are gathered to the response layout before the chunked head:
    log-probs, entropy and their gradients equal the padded dense computation."""
    batch = _batch(3)
    packed = pack_batch(batch)

    def stats(vocab_chunk, rows):
        model_cfg = CFG.replace(vocab_chunk=vocab_chunk)
        graph, params = create_model(lambda r: CausalLM(model_cfg, rngs=r), jax.random.key(0))

        def loss(p):
            logp, entropy = _policy_logp(graph, p, batch, temperature=1.3, packed=rows,
                                         with_entropy=True)  # fmt: skip
            mask = batch.response_mask
            return jnp.sum(logp * mask) + jnp.sum(entropy * mask), (logp * mask, entropy * mask)

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (_, (dense_logp, dense_entropy)), dense_grads = stats(0, None)
    (_, (logp, entropy)), grads = stats(4, packed)
    np.testing.assert_allclose(logp, dense_logp, atol=2e-5)
    np.testing.assert_allclose(entropy, dense_entropy, atol=2e-5)
    scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(dense_grads))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(dense_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5 * scale)
