"""Attention kernels against a numpy loop over queries, and the model paths that use them."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlpt.models import CausalLM, KVCache, abstract_model, create_model, get_preset
from rlpt.models import attention as A
from rlpt.models import blockwise as BW

TINY = get_preset("tiny")
B, K, G, H = 2, 2, 2, 8


def _numpy_attention(q, k, v, pos, valid, seg, window, sinks):
    """Masked softmax attention, one query at a time (float64). Rows seeing nothing: NaN."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t = q.shape[:2]
    out = np.full(q.shape, np.nan)
    for r in range(b):
        for i in range(t):
            keys = [
                j
                for j in range(i + 1)
                if valid[r, j]
                and (seg is None or seg[r, i] == seg[r, j])
                and (window == 0 or pos[r, i] - pos[r, j] < window or pos[r, j] < sinks)
            ]
            if not keys:
                continue
            for kh in range(q.shape[2]):
                for g in range(q.shape[3]):
                    s = np.array([q[r, i, kh, g] @ k[r, j, kh] for j in keys])
                    w = np.exp(s - s.max())
                    out[r, i, kh, g] = (w[:, None] * v[r, keys, kh]).sum(0) / w.sum()
    return out


def _case(name, t=37, seed=0):
    """q, k, v and the row layout of a named case: padding, packing, window with sinks."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, t, K, G, H)).astype(np.float32) * H**-0.5
    k = rng.normal(size=(B, t, K, H)).astype(np.float32)
    v = rng.normal(size=(B, t, K, H)).astype(np.float32)
    valid = np.ones((B, t), bool)
    seg = None
    window = sinks = 0
    if name in ("padded", "window_sinks"):
        valid[0, :5] = False  # left padding
        valid[1, t - 9 :] = False  # right padding
    if name == "packed":
        seg = np.zeros((B, t), np.int32)
        seg[0, :11], seg[0, 11:30] = 1, 2  # two sequences, then padding
        seg[1, :t] = 1
        seg[1, 20:] = 2
        valid = seg > 0
    if name == "window_sinks":
        window, sinks = 6, 2
    if name == "packed_window":
        seg = np.zeros((B, t), np.int32)
        seg[:, :17], seg[:, 17:] = 1, 2
        window, sinks = 5, 3
    if seg is None:
        pos = np.maximum(np.cumsum(valid, 1) - 1, 0) * valid
    else:  # positions restart in every segment
        pos = np.zeros((B, t), np.int32)
        for r in range(B):
            for i in range(t):
                pos[r, i] = 0 if i == 0 or seg[r, i] != seg[r, i - 1] else pos[r, i - 1] + 1
    info = A.self_attention_info(
        jnp.asarray(pos, jnp.int32), jnp.asarray(valid), None if seg is None else jnp.asarray(seg),
        window=window, sinks=sinks,
    )  # fmt: skip
    ref = _numpy_attention(q, k, v, pos, valid, seg, window, sinks)
    return (q, k, v, info), ref


CASES = ["padded", "packed", "window_sinks", "packed_window"]


def _run(kernel, q, k, v, info):
    if kernel == "dense":
        return A.dense_attention(q, k, v, A.visible(info))
    if kernel == "dot_product":
        return A.dot_product(q, k, v, A.visible(info))
    return BW.blockwise_attention(q, k, v, info, block_q=8, block_k=8)


@pytest.mark.parametrize("kernel", ["dense", "blockwise", "dot_product"])
@pytest.mark.parametrize("case", CASES)
def test_kernels_match_numpy_loop(kernel, case):
    # T = 37 is not a multiple of the block of 8: the last blocks are ragged.
    (q, k, v, info), ref = _case(case)
    out = np.asarray(jax.jit(_run, static_argnums=0)(kernel, q, k, v, info))
    seen = ~np.isnan(ref)
    assert seen.any()
    np.testing.assert_allclose(out[seen], ref[seen], atol=2e-5, rtol=2e-5)
    if kernel == "blockwise":  # a query that sees no key gets zeros, never NaN
        np.testing.assert_array_equal(out[~seen], 0.0)


@pytest.mark.parametrize("case", CASES)
def test_blockwise_gradients_match_dense(case):
    (q, k, v, info), ref = _case(case, t=29, seed=1)
    seen = jnp.asarray(~np.isnan(ref[..., 0]))[..., None]  # rows that see a key
    weights = jax.random.normal(jax.random.key(0), ref.shape)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.where(seen, fn(q, k, v) * weights, 0.0))

    def dense(q, k, v):
        return A.dense_attention(q, k, v, A.visible(info))

    def blockwise(q, k, v):
        return BW.blockwise_attention(q, k, v, info, block_q=8, block_k=4)

    g_dense = jax.grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2))(q, k, v)
    g_block = jax.jit(jax.grad(lambda *a: loss(blockwise, *a), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g_dense, g_block):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)


def test_key_shards_combine_to_the_whole():
    """Ring attention's contract: partials over disjoint key shards combine to the full
    output, and per-shard gradients (with the combined output) sum to the full gradient."""
    (q, k, v, info), ref = _case("packed_window", t=32, seed=2)
    seen = ~np.isnan(ref)
    shards = [(0, 12), (12, 32)]

    @jax.jit
    def forward(q, k, v, info):
        parts = [
            BW.blockwise_partial(q, k[:, lo:hi], v[:, lo:hi], info.slice_k(lo, hi - lo),
                                block_q=8, block_k=8)
            for lo, hi in shards
        ]  # fmt: skip
        return BW.combine_partials(parts)

    out, lse = forward(q, k, v, info)
    np.testing.assert_allclose(np.asarray(out)[seen], ref[seen], atol=2e-5, rtol=2e-5)

    d_out = jax.random.normal(jax.random.key(1), q.shape)
    dense = lambda q, k, v: A.dense_attention(q, k, v, A.visible(info))  # noqa: E731
    _, vjp = jax.vjp(dense, q, k, v)
    dq, dk, dv = vjp(jnp.where(jnp.asarray(seen), d_out, 0.0))

    @jax.jit
    def shard_grads(q, k, v, info, out, lse, d_out):
        return [
            BW.blockwise_partial_grads(q, k[:, lo:hi], v[:, lo:hi], info.slice_k(lo, hi - lo),
                                      out, lse, d_out, block_q=8, block_k=8)
            for lo, hi in shards
        ]  # fmt: skip

    grads = shard_grads(q, k, v, info, out, lse, d_out)
    for (lo, hi), g in zip(shards, grads):
        np.testing.assert_allclose(g[1], dk[:, lo:hi], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(g[2], dv[:, lo:hi], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(grads[0][0] + grads[1][0], dq, atol=1e-5, rtol=1e-5)


# bfloat16 on CPU: every product a canonical dot (rlpt.models.attention's docstring).

_U = 2.0**-8  # bfloat16's unit roundoff (8 significant bits, round to nearest)


def _bf16(x):
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)


def _numpy_vjp_with_bounds(q, k, v, allowed, d_out, empty_rows):
    """Attention and its gradients (float64, one head at a time), with first-order bounds
    on how far a bfloat16 kernel may be from them.

    allowed [B, K, G, T, S]. A query with no visible key averages all values with no score
    gradient (``empty_rows="mean"``, the dense kernel) or gets zeros (``"zero"``, blockwise).
    Returns ``{name: (value, bound)}`` for out, dq, dk, dv. The kernels' products are exact
    on bfloat16 operands (float32 accumulation), so the error comes from rounding the
    probabilities P to bfloat16 for P V and dO^T P, and dS = P (dP - D) for dS K and
    Q^T dS (the dense kernel's dS also starts from the rounded P, and D = rowsum(dO O)
    carries the output's error): 2u for dS, u for each of the others.
    """
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    b, t, kh, g, _ = q.shape
    s = k.shape[1]
    res = {n: (np.zeros(x.shape), np.zeros(x.shape)) for n, x in
           (("out", q), ("dq", q), ("dk", k), ("dv", v))}  # fmt: skip
    for r in range(b):
        for c in range(kh):
            kc, vc = k[r, :, c], v[r, :, c]  # [S, H]
            for j in range(g):
                qc, do, mask = q[r, :, c, j], d_out[r, :, c, j], allowed[r, c, j]
                scores = qc @ kc.T  # [T, S]
                p = np.zeros((t, s))
                for i in range(t):
                    if mask[i].any():
                        e = np.exp(scores[i, mask[i]] - scores[i, mask[i]].max())
                        p[i, mask[i]] = e / e.sum()
                    elif empty_rows == "mean":
                        p[i] = 1.0 / s
                seen = mask.any(axis=1)[:, None]
                dp = do @ vc.T
                delta = (p * dp).sum(axis=1, keepdims=True)
                ds = np.where(seen, p * (dp - delta), 0.0)
                e_out = _U * p @ np.abs(vc)
                e_delta = (np.abs(do) * e_out).sum(axis=1, keepdims=True)
                e_ds = np.where(seen, 2 * _U * p * np.abs(dp - delta) + p * e_delta, 0.0)
                for name, value, bound, index in (
                    ("out", p @ vc, e_out, (r, slice(None), c, j)),
                    ("dq", ds @ kc, e_ds @ np.abs(kc), (r, slice(None), c, j)),
                    ("dk", ds.T @ qc, e_ds.T @ np.abs(qc), (r, slice(None), c)),
                    ("dv", p.T @ do, _U * p.T @ np.abs(do), (r, slice(None), c)),
                ):
                    res[name][0][index] += value
                    res[name][1][index] += bound
    return res


@pytest.mark.parametrize("kernel, per_head", [("dense", False), ("dense", True),
                                              ("blockwise", False)])  # fmt: skip
def test_bfloat16_kernels_match_float64_within_rounding_bounds(kernel, per_head):
    """Grouped-query heads (G = 2), left and right padding (queries 0-4 of row 0 see no
    key), per-head masks as MoBA gives them; blocks of 8 x 4 queries x keys over T = 13."""
    (q, k, v, info), _ = _case("padded", t=13, seed=4)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    allowed = A.visible(info)
    if per_head:
        keep = np.random.default_rng(5).random((B, K, G, 13, 13)) < 0.7
        allowed = allowed[:, None, None] & jnp.asarray(keep)
    d_out = np.random.default_rng(6).normal(size=q.shape).astype(np.float32)

    def attend(q, k, v):
        if kernel == "dense":
            return A.dense_attention(q, k, v, allowed)
        return BW.blockwise_attention(q, k, v, info, block_q=8, block_k=4)

    out, vjp = jax.vjp(jax.jit(attend), q, k, v)
    dq, dk, dv = vjp(jnp.asarray(d_out))
    per_head_mask = np.broadcast_to(
        np.asarray(allowed)[:, None, None] if allowed.ndim == 3 else np.asarray(allowed),
        (B, K, G, 13, 13),
    )
    empty_rows = "mean" if kernel == "dense" else "zero"
    assert not per_head_mask.any(axis=-1).all()  # fully masked rows are in the case
    ref = _numpy_vjp_with_bounds(q, k, v, per_head_mask, _bf16(d_out), empty_rows)
    assert out.dtype == jnp.float32 and dq.dtype == dk.dtype == dv.dtype == jnp.bfloat16
    for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        want, bound = ref[name]
        if name != "out":  # the gradients come back rounded to bfloat16
            bound = bound + _U * np.abs(want)
        err = np.abs(np.asarray(got, np.float64) - want)
        # 1e-5: float32 accumulation and second-order terms of the rounding.
        assert (err <= bound + 1e-5).all(), (name, (err - bound).max())


def test_float32_canonical_products_equal_the_einsums():
    """Float32 keeps the einsums; the canonical kernels (called directly) agree with them to
    float32 summation order."""
    (q, k, v, info), _ = _case("padded", t=13, seed=7)
    allowed = A.visible(info)
    weights = np.random.default_rng(8).normal(size=q.shape).astype(np.float32)
    assert not A._canonical_dots(q, k, v)
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    assert A._canonical_dots(*bf16) == (jax.default_backend() == "cpu")

    def value_and_grads(fn):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v) * weights)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    pairs = [
        (lambda q, k, v: A._dense_canonical(q, k, v, allowed),
         lambda q, k, v: A.dense_attention(q, k, v, allowed)),
        (lambda q, k, v: BW._blockwise(q, k, v, info, 8, 4, True),
         lambda q, k, v: BW._blockwise(q, k, v, info, 8, 4, False)),
    ]  # fmt: skip
    for canonical, einsum in pairs:
        got, want = value_and_grads(canonical), value_and_grads(einsum)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        for a, b in zip(got[1], want[1]):
            # float32 sums in another order; D = rowsum(dO O) against autodiff's
            # rowsum(dP P) cancels in dP - D, so the error is absolute (~H eps |dO| |V|).
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _dot_operand_dtypes(hlo: str) -> list[list[str]]:
    """The operand dtypes of every dot in compiled HLO text."""
    dots = []
    for body in re.findall(r"^(?:ENTRY )?%.*?^}", hlo, re.M | re.S):
        for operands in re.findall(r" dot\(([^)]*)\)", body):
            names = [o.strip().lstrip("%") for o in operands.split(",")]
            # Declared in this computation's header ("name: bf16[...]") or body
            # ("%name = bf16[...] ...").
            found = [re.search(rf"(?:\(|, |%){re.escape(n)}(?::| =) (\w+)\[", body) for n in names]
            dots.append([m.group(1) if m else "?" for m in found])
    return dots


@pytest.mark.parametrize("kernel, n_dots", [("dense", 6), ("blockwise", 7)])
def test_bfloat16_gradient_dots_take_bfloat16_operands_on_cpu(kernel, n_dots):
    """No attention product is upcast to float32 by XLA, which it does to a bf16 dot that is
    not canonical. Dense: 2 forward products and 4 gradient products; blockwise: 2 per tile
    forward, and the backward recomputes the scores besides its 4."""
    (q, k, v, info), _ = _case("padded", t=32, seed=9)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))

    def attend(q, k, v):
        if kernel == "dense":
            return A.dense_attention(q, k, v, A.visible(info))
        return BW.blockwise_attention(q, k, v, info, block_q=16, block_k=16)

    grad = jax.jit(jax.grad(lambda *a: jnp.sum(attend(*a) ** 2), argnums=(0, 1, 2)))
    dots = _dot_operand_dtypes(grad.lower(q, k, v).compile().as_text())
    assert len(dots) == n_dots
    assert all(d == ["bf16", "bf16"] for d in dots), dots


def _numpy_moba(q, k, v, pos, valid, seg, block, top_k):
    """MoBA for one query at a time: its own block plus the top-k earlier blocks by
    q . mean(k), then softmax over the visible keys of the chosen blocks."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t = q.shape[:2]
    out = np.full(q.shape, np.nan)
    for r in range(b):
        for i in range(t):
            mine = [
                j for j in range(i + 1) if valid[r, j] and (seg is None or seg[r, i] == seg[r, j])
            ]
            if not mine:
                continue
            own = pos[r, i] // block
            for kh in range(q.shape[2]):
                for g in range(q.shape[3]):
                    gates = {}
                    for c in range(own):
                        members = [j for j in mine if pos[r, j] // block == c]
                        if members:
                            gates[c] = q[r, i, kh, g] @ k[r, members, kh].mean(0)
                    chosen = sorted(gates, key=lambda c: -gates[c])[:top_k]
                    keys = [j for j in mine if pos[r, j] // block in chosen + [own]]
                    s = np.array([q[r, i, kh, g] @ k[r, j, kh] for j in keys])
                    w = np.exp(s - s.max())
                    out[r, i, kh, g] = (w[:, None] * v[r, keys, kh]).sum(0) / w.sum()
    return out


@pytest.mark.parametrize("case", ["padded", "packed"])
def test_moba_matches_numpy_selection(case):
    (q, k, v, info), _ = _case(case, t=40, seed=3)
    pos, valid = np.asarray(info.q_positions), np.asarray(info.k_valid)
    seg = None if info.q_segments is None else np.asarray(info.q_segments)
    ref = _numpy_moba(q, k, v, pos, valid, seg, block=4, top_k=2)
    allowed = A.moba_select(q, k, info, block=4, top_k=2, max_len=64)
    out = np.asarray(A.dense_attention(q, k, v, allowed))
    seen = ~np.isnan(ref)
    np.testing.assert_allclose(out[seen], ref[seen], atol=2e-5, rtol=2e-5)
    # Sparse indeed: late queries see fewer keys than causal attention gives them.
    assert np.asarray(allowed).sum() < np.asarray(A.visible(info)).sum() * K * G


@pytest.mark.parametrize("case", ["padded", "packed"])
def test_memory_linear_moba_selects_as_the_numpy_loop(case):
    """``moba_blocks`` (block sums, no [T, S] scores) under the blockwise kernel against
    the numpy loop, and its mask against the dense reference selection."""
    (q, k, v, info), _ = _case(case, t=40, seed=3)
    pos, valid = np.asarray(info.q_positions), np.asarray(info.k_valid)
    seg = None if info.q_segments is None else np.asarray(info.q_segments)
    ref = _numpy_moba(q, k, v, pos, valid, seg, block=4, top_k=2)
    sparse = A.moba_blocks(jnp.asarray(q), jnp.asarray(k), info, block=4, top_k=2, max_len=64)
    assert sparse.q_blocks.shape == (B, K, G, 40, 16)
    np.testing.assert_array_equal(
        np.asarray(A.visible_per_head(sparse)),
        np.asarray(A.moba_select(q, k, info, block=4, top_k=2, max_len=64)),
    )
    out = np.asarray(BW.blockwise_attention(q, k, v, sparse, block_q=8, block_k=8))
    seen = ~np.isnan(ref)
    np.testing.assert_allclose(out[seen], ref[seen], atol=2e-5, rtol=2e-5)


def test_memory_linear_moba_ignores_where_padding_says_it_is():
    """Padding inside a row whose positions run on (as a caller may lay it out) joins the
    run of keys before it; it must not move that run's block."""
    rng = np.random.default_rng(11)
    t = 40
    q = jnp.asarray(rng.normal(size=(B, t, K, G, H)).astype(np.float32) * H**-0.5)
    k = jnp.asarray(rng.normal(size=(B, t, K, H)).astype(np.float32))
    valid = np.ones((B, t), bool)
    valid[0, 10:14] = False  # a hole after block 2's keys 8, 9, positions 10-13 (block 3)
    valid[1, 30:] = False
    info = A.self_attention_info(jnp.broadcast_to(jnp.arange(t), (B, t)), jnp.asarray(valid))
    sparse = A.moba_blocks(q, k, info, block=4, top_k=2, max_len=64)
    want = np.asarray(A.moba_select(q, k, info, block=4, top_k=2, max_len=64))
    got = np.asarray(A.visible_per_head(sparse))
    rows = np.broadcast_to(valid[:, None, None, :, None], got.shape)
    np.testing.assert_array_equal(got[rows], want[rows])


def test_memory_linear_moba_gradients_equal_the_dense_masks():
    (q, k, v, info), _ = _case("packed", t=40, seed=5)
    weights = np.random.default_rng(6).normal(size=q.shape).astype(np.float32)
    allowed = A.moba_select(q, k, info, block=4, top_k=1, max_len=64)
    sparse = A.moba_blocks(jnp.asarray(q), jnp.asarray(k), info, block=4, top_k=1, max_len=64)
    rows = np.asarray(info.k_valid)[:, :, None, None, None]  # queries on padding: unread

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * weights * rows), (0, 1, 2)))

    want = loss(lambda q, k, v: A.dense_attention(q, k, v, allowed))(q, k, v)
    got = loss(lambda q, k, v: BW.blockwise_attention(q, k, v, sparse, block_q=8, block_k=8))(
        q, k, v
    )
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _model(cfg, key=0):
    return create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(key))


def _jit_logits(cfg, state, tokens, mask):
    graphdef, _ = abstract_model(lambda r: CausalLM(cfg, rngs=r))
    fn = jax.jit(lambda s, t, m: nnx.merge(graphdef, s)(t, mask=m)[0])
    return np.asarray(fn(state, tokens, mask))


def _tokens(t, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 200, size=(2, t)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    mask[0, :3] = False
    return tokens, mask


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(sliding_window=7, attention_sinks=2),
     dict(sparse_attention="moba", sparse_block=3, sparse_top_k=1)],
    ids=["causal", "window_sinks", "moba"],
)  # fmt: skip
def test_blockwise_model_equals_dense_forward_and_grad(overrides):
    """The dense and blockwise kernels in a model; for MoBA, the dense-mask selection
    against the memory-linear one (``moba_blocks``)."""
    cfg = TINY.replace(**overrides)
    graphdef, state = _model(cfg)
    graphdef_b, _ = abstract_model(
        lambda r: CausalLM(cfg.replace(attention="blockwise", attention_block=8), rngs=r)
    )
    tokens, mask = _tokens(27)

    def loss(g, s):
        logits = nnx.merge(g, s)(tokens, mask=mask)[0]
        return jnp.sum(jnp.where(mask[..., None], logits**2, 0.0)), logits

    (v1, l1), g1 = jax.jit(jax.value_and_grad(lambda s: loss(graphdef, s), has_aux=True))(state)
    (v2, l2), g2 = jax.jit(jax.value_and_grad(lambda s: loss(graphdef_b, s), has_aux=True))(state)
    np.testing.assert_allclose(np.asarray(l2)[mask], np.asarray(l1)[mask], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(v2, v1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        # float32 sums in another order: the error scales with the largest entry (~40 here).
        np.testing.assert_allclose(b, a, atol=1e-5 * np.abs(a).max(), rtol=1e-4)
    if overrides:  # the restriction bites at this length: plain attention differs
        plain = _jit_logits(TINY, state, tokens, mask)[mask]
        assert not np.allclose(plain, np.asarray(l1)[mask], atol=1e-3)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(sliding_window=4, attention_sinks=2),
        dict(sparse_attention="moba", sparse_block=3, sparse_top_k=1),
    ],
    ids=["window_sinks", "moba"],
)
def test_cached_decoding_matches_full_forward(overrides):
    cfg = TINY.replace(**overrides)
    graphdef, state = _model(cfg, key=4)

    model = nnx.merge(graphdef, state)
    tokens, mask = _tokens(14, seed=5)
    full = np.asarray(model(tokens, mask=mask)[0])
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0) * mask
    cache = KVCache.create(cfg, 2, 16)
    prompt = 6
    logits, cache = model(tokens[:, :prompt], pos[:, :prompt], mask[:, :prompt], cache=cache)
    steps = [np.asarray(logits)]
    for t in range(prompt, tokens.shape[1]):
        logits, cache = model(tokens[:, t : t + 1], pos[:, t : t + 1], mask[:, t : t + 1],
                              cache=cache)  # fmt: skip
        steps.append(np.asarray(logits))
    cached = np.concatenate(steps, axis=1)
    np.testing.assert_allclose(cached[mask], full[mask], atol=1e-5, rtol=1e-5)
    # The restriction bites: without it the same weights give other logits.
    plain_logits = _jit_logits(TINY, state, tokens, mask)
    assert not np.allclose(plain_logits[mask], full[mask], atol=1e-3)


def test_remat_policies_give_the_same_gradients():
    cfg = TINY.replace(n_layers=1)
    graphdef, state = _model(cfg, key=6)
    tokens, mask = _tokens(9)

    def grads(cfg):
        g, _ = abstract_model(lambda r: CausalLM(cfg, rngs=r))
        loss = lambda s: jnp.mean(nnx.merge(g, s)(tokens, mask=mask)[0] ** 2)  # noqa: E731
        return jax.grad(loss)(state)

    ref = grads(cfg)
    for policy in ("full", "dots", "dots_no_batch", "attention_out"):
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(grads(cfg.replace(
                remat=True, remat_policy=policy)))):  # fmt: skip
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7, err_msg=policy)


def test_blockwise_gradient_memory_is_linear_in_length():
    t, heads = 2048, 1
    q = jnp.zeros((1, t, heads, 1, 16))
    k = v = jnp.zeros((1, t, heads, 16))
    info = A.self_attention_info(jnp.arange(t)[None], jnp.ones((1, t), bool))

    def temp_bytes(fn):
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2)))
        return grad.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    dense = temp_bytes(lambda q, k, v: A.dense_attention(q, k, v, A.visible(info)))
    block = temp_bytes(lambda q, k, v: BW.blockwise_attention(q, k, v, info, block_q=128,
                                                             block_k=128))  # fmt: skip
    # Even a boolean [T, S] mask is t * t bytes; the float32 scores four times that.
    assert dense >= 4 * t * t
    assert block < t * t // 4, (block, dense)


def test_kernel_choice_per_backend():
    assert A.resolve_kind("auto", "cpu") == "blockwise"
    assert A.resolve_kind("auto", "gpu") == "dot_product"
    assert A.resolve_kind("auto", "tpu") == "splash"
    with pytest.raises(ValueError, match="model.attention"):
        A.resolve_kind("splash", "cpu")
    graphdef, state = _model(TINY.replace(attention="splash"))
    with pytest.raises(ValueError, match="model.attention"):
        nnx.merge(graphdef, state)(jnp.zeros((1, 4), jnp.int32))
