"""The transformer against an independent numpy implementation, and its invariances."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlpt.models import (
    PRESETS,
    CausalLM,
    KVCache,
    ModelConfig,
    ProcessRewardModel,
    RewardModel,
    ValueModel,
    abstract_model,
    count_params,
    create_model,
    get_preset,
)

TINY = get_preset("tiny")
TINY_BIAS = TINY.replace(qkv_bias=True, tie_embeddings=False, rope_theta=500.0)


def _perturbed(constructor, key):
    """A model whose norm scales and biases are not left at their defaults of one and zero."""
    graphdef, state = create_model(constructor, key)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(99), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return graphdef, jax.tree.unflatten(treedef, leaves)


def _numpy_forward(params, cfg: ModelConfig, tokens):
    """Llama/Qwen2 forward for one unpadded row, written with per-head loops in numpy."""
    p = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
    hd = cfg.resolved_head_dim
    group = cfg.n_heads // cfg.n_kv_heads

    def rms(x, w):
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + cfg.rms_eps) * w

    def rope(x, pos):  # x [hd]
        half = hd // 2
        out = np.empty_like(x)
        for i in range(half):
            theta = pos * cfg.rope_theta ** (-2.0 * i / hd)
            a, b = x[i], x[i + half]
            out[i] = a * np.cos(theta) - b * np.sin(theta)
            out[i + half] = b * np.cos(theta) + a * np.sin(theta)
        return out

    x = p["trunk"]["embedding"][tokens].astype(np.float64)
    t = len(tokens)
    for blk in p["trunk"]["blocks"].values():
        a = blk["attn"]
        h = rms(x, blk["attn_norm"]["scale"])
        out = np.zeros((t, cfg.n_heads, hd))
        for head in range(cfg.n_heads):
            kv = head // group
            q = h @ a["wq"][:, head] + (a["bq"][head] if cfg.qkv_bias else 0)
            k = h @ a["wk"][:, kv] + (a["bk"][kv] if cfg.qkv_bias else 0)
            v = h @ a["wv"][:, kv] + (a["bv"][kv] if cfg.qkv_bias else 0)
            q = np.stack([rope(q[i], i) for i in range(t)])
            k = np.stack([rope(k[i], i) for i in range(t)])
            for i in range(t):
                s = np.array([q[i] @ k[j] / np.sqrt(hd) for j in range(i + 1)])
                w = np.exp(s - s.max())
                w /= w.sum()
                out[i, head] = (w[:, None] * v[: i + 1]).sum(0)
        x = x + np.einsum("tnh,nhd->td", out, a["wo"])
        m = blk["mlp"]
        h = rms(x, blk["mlp_norm"]["scale"])
        g = h @ m["w_gate"]
        x = x + ((g / (1 + np.exp(-g))) * (h @ m["w_up"])) @ m["w_down"]
    x = rms(x, p["trunk"]["final_norm"]["scale"])
    head = p["trunk"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]
    return x @ head


@pytest.mark.parametrize("cfg", [TINY, TINY_BIAS], ids=["tied", "qkv_bias_untied"])
def test_logits_match_numpy_reference(cfg):
    graphdef, state = _perturbed(lambda r: CausalLM(cfg, rngs=r), jax.random.key(0))
    tokens = np.array([7, 100, 3, 250, 41, 9], np.int32)
    logits, _ = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens[None])
    expected = _numpy_forward(state, cfg, tokens)
    np.testing.assert_allclose(np.asarray(logits[0]), expected, atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def tiny_lm():
    graphdef, state = _perturbed(lambda r: CausalLM(TINY_BIAS, rngs=r), jax.random.key(1))
    return graphdef, state


def _logits(graphdef, state, tokens, mask=None, segment_ids=None):
    return nnx.merge(graphdef, state)(tokens, mask=mask, segment_ids=segment_ids)[0]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_gives_same_logits_as_unpadded(tiny_lm, side):
    graphdef, state = tiny_lm
    rows = [[5, 9, 33, 7, 120], [64, 3], [11, 12, 13]]
    width = 8
    tokens = np.zeros((3, width), np.int32)
    mask = np.zeros((3, width), bool)
    for i, row in enumerate(rows):
        sl = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        tokens[i, sl], mask[i, sl] = row, True
    batched = np.asarray(_logits(graphdef, state, tokens, mask))
    for i, row in enumerate(rows):
        single = np.asarray(_logits(graphdef, state, np.array([row], np.int32)))[0]
        np.testing.assert_allclose(batched[i][mask[i]], single, atol=1e-5, rtol=1e-5)


def test_packed_segments_match_separate_rows(tiny_lm):
    graphdef, state = tiny_lm
    a, b = [5, 9, 33], [64, 3, 17, 2]
    packed = np.array([a + b], np.int32)
    segments = np.array([[0] * len(a) + [1] * len(b)])
    positions = np.array([list(range(len(a))) + list(range(len(b)))])
    model = nnx.merge(graphdef, state)
    out = np.asarray(model(packed, positions, None, segments)[0][0])
    np.testing.assert_allclose(out[: len(a)], _logits(graphdef, state, np.array([a]))[0], atol=1e-5)
    np.testing.assert_allclose(out[len(a) :], _logits(graphdef, state, np.array([b]))[0], atol=1e-5)


def test_cached_decoding_matches_full_forward(tiny_lm):
    graphdef, state = tiny_lm
    model = nnx.merge(graphdef, state)
    tokens = np.array([[0, 0, 5, 9, 33, 7, 120, 64], [4, 8, 15, 16, 23, 42, 99, 1]], np.int32)
    mask = np.ones_like(tokens, bool)
    mask[0, :2] = False
    full = np.asarray(model(tokens, mask=mask)[0])
    prompt = 4
    cache = KVCache.create(TINY_BIAS, 2, 16)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0) * mask
    logits, cache = model(tokens[:, :prompt], pos[:, :prompt], mask[:, :prompt], cache=cache)
    steps = [np.asarray(logits)]
    for t in range(prompt, tokens.shape[1]):
        logits, cache = model(
            tokens[:, t : t + 1], pos[:, t : t + 1], mask[:, t : t + 1], cache=cache
        )
        steps.append(np.asarray(logits))
    cached = np.concatenate(steps, axis=1)
    np.testing.assert_allclose(cached[mask], full[mask], atol=1e-5, rtol=1e-5)
    assert int(cache.index) == tokens.shape[1]


def test_remat_changes_neither_outputs_nor_gradients():
    cfg = TINY.replace(remat=True)
    graphdef, state = create_model(lambda r: CausalLM(TINY, rngs=r), jax.random.key(2))
    graphdef_remat, _ = abstract_model(lambda r: CausalLM(cfg, rngs=r))
    tokens = jnp.array([[5, 6, 7, 8, 9]])

    def loss(g, s):
        return jnp.mean(nnx.merge(g, s)(tokens)[0] ** 2)

    v1, g1 = jax.value_and_grad(lambda s: loss(graphdef, s))(state)
    v2, g2 = jax.value_and_grad(lambda s: loss(graphdef_remat, s))(state)
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_remat_keeps_only_each_blocks_input_for_the_backward_pass():
    # Eight blocks at 256 tokens: without remat the backward pass keeps every block's
    # activations (the MLP's [T, ffn] arrays, the attention's [T, S] scores); with remat it
    # keeps each block's input [T, D] and recomputes one block at a time.
    length, layers = 256, 8
    base = TINY.replace(n_layers=layers, max_seq_len=length, ffn_dim=256)
    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)

    def temp_bytes(cfg):
        graphdef, state = abstract_model(lambda r: CausalLM(cfg, rngs=r))

        def loss(s, t):
            hidden, _ = nnx.merge(graphdef, s).trunk(t)
            return jnp.sum(hidden**2)

        compiled = jax.jit(jax.grad(loss)).lower(state, tokens).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    plain, remat = temp_bytes(base), temp_bytes(base.replace(remat=True))
    one_block = 4 * length * (base.ffn_dim * 3 + base.n_heads * length)  # one block's big arrays
    assert plain > layers * one_block / 2
    assert remat < plain / 3


def test_bfloat16_compute_stays_close_to_float32(tiny_lm):
    graphdef, state = tiny_lm
    graphdef_bf16, _ = abstract_model(
        lambda r: CausalLM(TINY_BIAS.replace(dtype="bfloat16"), rngs=r)
    )
    tokens = jnp.array([[5, 6, 7, 8, 9, 10]])
    f32 = np.asarray(_logits(graphdef, state, tokens))
    bf16 = np.asarray(_logits(graphdef_bf16, state, tokens))
    assert bf16.dtype == np.float32
    # bfloat16 keeps 8 mantissa bits: relative error of a few 1e-3 per product.
    np.testing.assert_allclose(bf16, f32, atol=0.1 * np.abs(f32).max())
    assert np.corrcoef(bf16.ravel(), f32.ravel())[0, 1] > 0.999


def test_value_reward_and_process_reward_heads(tiny_lm):
    del tiny_lm
    key = jax.random.key(3)
    tokens = np.array([[9, 3, 10, 3, 11, 0], [12, 13, 3, 14, 0, 0]], np.int32)
    mask = tokens != 0
    g, s = create_model(lambda r: ValueModel(TINY, rngs=r), key)
    values = nnx.merge(g, s)(tokens, mask=mask)
    assert values.shape == (2, 6) and values.dtype == jnp.float32

    g, s = create_model(lambda r: RewardModel(TINY, rngs=r), key)
    model = nnx.merge(g, s)
    rewards = model(tokens, mask=mask)
    per_token = model.token_scores(tokens, mask=mask)
    assert rewards.shape == (2,)
    np.testing.assert_allclose(rewards, [per_token[0, 4], per_token[1, 3]], rtol=1e-6)
    # The reward of a row does not depend on what padding follows it.
    np.testing.assert_allclose(model(tokens[:1, :5], mask=mask[:1, :5])[0], rewards[0], rtol=1e-5)

    g, s = create_model(lambda r: ProcessRewardModel(TINY, step_token_id=3, rngs=r), key)
    scores, step_mask = nnx.merge(g, s)(tokens, mask=mask)
    assert scores.shape == (2, 6)
    np.testing.assert_array_equal(step_mask, tokens == 3)


@pytest.mark.parametrize("cfg", [TINY, TINY_BIAS], ids=["tied", "untied"])
def test_likelihood_reward_adds_the_policy_log_likelihood(cfg):
    from rlpt.rewards.train import with_trunk

    tokens = np.array([[9, 3, 10, 3, 11, 0], [0, 12, 13, 3, 14, 15]], np.int32)
    mask = tokens != 0
    _, policy = _perturbed(lambda r: CausalLM(cfg, rngs=r), jax.random.key(4))
    g, s = create_model(lambda r: RewardModel(cfg, likelihood=True, rngs=r), jax.random.key(5))
    model = nnx.merge(g, with_trunk(s, policy))
    got = np.asarray(model(tokens, mask=mask))
    head = np.asarray(model.token_scores(tokens, mask=mask))[[0, 1], [4, 5]]
    # Reference: each row unpadded through the numpy forward, log-softmax by hand.
    for row, want_head in zip(range(2), head):
        ids = tokens[row][mask[row]]
        logits = _numpy_forward(policy, cfg, ids).astype(np.float64)  # [n, V]
        total = 0.0
        for t in range(1, len(ids)):
            z = logits[t - 1]
            total += z[ids[t]] - (np.log(np.sum(np.exp(z - z.max()))) + z.max())
        np.testing.assert_allclose(got[row], want_head + total, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("cfg", [TINY, TINY_BIAS], ids=["tied", "untied"])
def test_likelihood_prm_adds_each_steps_log_likelihood(cfg):
    from rlpt.rewards.train import with_trunk

    # Prompt 9 10, then steps ending at separators 3 (step) and 4 (answer).
    tokens = np.array([[9, 10, 11, 3, 12, 13, 4, 14, 0], [0, 0, 9, 15, 3, 11, 4, 12, 13]],
                      np.int32)  # fmt: skip
    mask = tokens != 0
    response = np.zeros_like(mask)
    response[0, 2:8] = True
    response[1, 3:] = True
    _, policy = _perturbed(lambda r: CausalLM(cfg, rngs=r), jax.random.key(4))
    g, s = create_model(
        lambda r: ProcessRewardModel(cfg, 3, likelihood=True, answer_token_id=4, rngs=r),
        jax.random.key(5),
    )  # fmt: skip
    model = nnx.merge(g, with_trunk(s, policy))
    got, step_mask = model(tokens, mask=mask, response_mask=response)
    got = np.asarray(got)
    head = np.asarray(model.token_scores(tokens, mask=mask))
    np.testing.assert_array_equal(step_mask, tokens == 3)
    for row in range(2):
        cols = np.flatnonzero(mask[row])
        ids = tokens[row, cols]
        logits = _numpy_forward(policy, cfg, ids).astype(np.float64)  # [n, V]
        # Hand-walked: a running sum of response-token log-probabilities, reset after
        # each separator.
        running = 0.0
        for k, col in enumerate(cols):
            if k > 0 and response[row, col]:
                z = logits[k - 1]
                running += z[ids[k]] - (np.log(np.sum(np.exp(z - z.max()))) + z.max())
            np.testing.assert_allclose(got[row, col], head[row, col] + running,
                                       rtol=2e-4, atol=2e-4)  # fmt: skip
            if ids[k] in (3, 4):
                running = 0.0


def test_presets_have_the_documented_sizes():
    def size(name):
        return count_params(abstract_model(lambda r: CausalLM(PRESETS[name], rngs=r))[1])

    assert size("tiny") < 100_000 and PRESETS["tiny"].d_model <= 64
    assert 1e6 <= size("mini") <= 3e6
    assert 10e6 <= size("small") <= 30e6
    # Published sizes: Llama 3.2 1B has 1.24B parameters, Qwen2 1.5B has 1.54B.
    assert abs(size("llama-1b") - 1.236e9) < 0.01e9
    assert abs(size("qwen2-1.5b") - 1.544e9) < 0.01e9


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(n_heads=3), "n_heads"),
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(dtype="float16"), "dtype"),
        (dict(vocab_size=0), "vocab_size"),
    ],
)
def test_bad_configs_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        get_preset("tiny", **overrides)


def test_unknown_preset_lists_allowed():
    with pytest.raises(ValueError, match="allowed.*mini"):
        get_preset("huge")


def test_config_round_trips_through_dict():
    cfg = PRESETS["llama-1b"]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown model config fields"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_layer": 3})
