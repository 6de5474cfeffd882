"""The blockwise attention kernel: FlashAttention's online softmax in plain XLA.

The FlashAttention algorithm (Dao et al. 2022; Rabe & Staats 2021 for the memory-linear
formulation) written with ``lax`` loops, so it runs on every backend: a hand-written
``custom_vjp`` recomputes each block in the backward pass, so neither pass holds more than
one ``[block_q, block_k]`` tile of scores. No library offers this for CPU:
``jax.nn.dot_product_attention``'s XLA path materialises the scores, cuDNN and Pallas
kernels are GPU/TPU only. The visibility rule, shapes and the bf16 canonical-dot scheme are
those of ``rlpt.models.attention``; ``blockwise_partial`` and friends serve context
parallelism (a query block against one shard's keys, combined across shards).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlpt.models.attention import MaskInfo, _bmm, _canonical_dots, _row_term, visible_per_head
from rlpt.models.matmul import _physical_transpose


def _pad_to(x: jax.Array, axis: int, size: int, mode: str = "constant", value=0) -> jax.Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    if mode == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _pad_info(info: MaskInfo, tp: int, sp: int) -> MaskInfo:
    """``info`` padded to ``tp`` queries and ``sp`` keys; padded keys are invalid."""
    seg_q, seg_k, sel = info.q_segments, info.k_segments, info.q_blocks
    big = jnp.iinfo(jnp.int32).max
    return info.replace(
        q_blocks=None if sel is None else _pad_to(sel, 3, tp, "edge"),
        # Padded queries repeat the last slot so they widen no causal range.
        q_slots=_pad_to(info.q_slots, 0, tp, "edge"),
        q_positions=_pad_to(info.q_positions, 1, tp, "edge"),
        q_segments=None if seg_q is None else _pad_to(seg_q, 1, tp, "edge"),
        k_slots=_pad_to(info.k_slots, 0, sp, value=big),
        k_positions=_pad_to(info.k_positions, 1, sp),
        k_valid=_pad_to(info.k_valid, 1, sp, value=False),
        k_segments=None if seg_k is None else _pad_to(seg_k, 1, sp),
    )


def _key_block_counts(info: MaskInfo, bq: int, bk: int, nq: int, nk: int) -> jax.Array:
    """[nq]: how many leading key blocks can be causally visible to each query block."""
    first_k = info.k_slots.reshape(nk, bk)[:, 0]
    last_q = info.q_slots.reshape(nq, bq).max(axis=1)
    return jnp.sum(first_k[None, :] <= last_q[:, None], axis=1)


def _scores(q, k, qi, kj, bq: int, bk: int) -> jax.Array:
    """Scores [B, K, G, bq, bk] (float32) of one tile."""
    qb = jax.lax.dynamic_slice_in_dim(q, qi * bq, bq, 1)
    kb = jax.lax.dynamic_slice_in_dim(k, kj * bk, bk, 1)
    return jnp.einsum("bqkgh,bskh->bkgqs", qb, kb, preferred_element_type=jnp.float32)


def _block(x: jax.Array, i, size: int, axis: int) -> jax.Array:
    """Block ``i`` (may be traced) of ``size`` entries along ``axis``."""
    return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis)


def _add_block(x: jax.Array, y: jax.Array, i, size: int, axis: int) -> jax.Array:
    """``x`` with ``y`` added to its block ``i`` along ``axis``."""
    return jax.lax.dynamic_update_slice_in_dim(x, _block(x, i, size, axis) + y, i * size, axis)


def _forward_blocks(q, k, v, info: MaskInfo, bq: int, bk: int, canonical: bool = False):
    """Padded inputs -> (acc [B, K, G, Tp, H], max [B, K, G, Tp], sum [B, K, G, Tp]).

    ``canonical``: every tile product a canonical dot (module docstring)."""
    b, tp, kh, g, h = q.shape
    sp = k.shape[1]
    nq, nk = tp // bq, sp // bk
    counts = _key_block_counts(info, bq, bk, nq, nk)
    if canonical:
        # Written out once, copies the size of q, k and v: Q K^T reads q rows and k columns,
        # P V reads v rows.
        q_rows = _physical_transpose(q, (0, 2, 3, 1, 4))  # [B, K, G, Tp, H]
        k_cols = _physical_transpose(k, (0, 2, 3, 1))  # [B, K, H, Sp]
        v_rows = _physical_transpose(v, (0, 2, 1, 3))  # [B, K, Sp, H]

    def query_block(qi):
        # The query block's rows, sliced once outside the key loop.
        qb = _block(q_rows, qi, bq, 3).reshape(b, kh, g * bq, h) if canonical else None

        def tile_scores(kj):  # [B, K, G, bq, bk] float32
            if canonical:
                return _bmm(qb, _block(k_cols, kj, bk, 3)).reshape(b, kh, g, bq, bk)
            return _scores(q, k, qi, kj, bq, bk)

        def tile_values(p, kj):  # p [B, K, G, bq, bk] -> P V [B, K, G, bq, H] float32
            if canonical:
                p = p.astype(v.dtype).reshape(b, kh, g * bq, bk)
                return _bmm(p, _block(v_rows, kj, bk, 2)).reshape(b, kh, g, bq, h)
            vb = jax.lax.dynamic_slice_in_dim(v, kj * bk, bk, 1)
            return jnp.einsum(
                "bkgqs,bskh->bkgqh", p.astype(v.dtype), vb, preferred_element_type=jnp.float32
            )

        def key_block(kj, carry):
            def update(carry):
                acc, m, denom = carry
                scores = tile_scores(kj)
                scores = jnp.where(mask, scores, -jnp.inf)
                m_new = jnp.maximum(m, scores.max(axis=-1))
                # Rows with nothing visible yet keep max -inf; shift them by 0 instead.
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(scores - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                pv = tile_values(p, kj)
                return acc * alpha[..., None] + pv, m_new, denom * alpha + p.sum(axis=-1)

            # Key blocks outside the window, or of other segments, cost one mask tile only.
            mask = visible_per_head(info.slice_q(qi * bq, bq).slice_k(kj * bk, bk))
            return jax.lax.cond(mask.any(), update, lambda c: c, carry)

        init = (
            jnp.zeros((b, kh, g, bq, h), jnp.float32),
            jnp.full((b, kh, g, bq), -jnp.inf, jnp.float32),
            jnp.zeros((b, kh, g, bq), jnp.float32),
        )
        return jax.lax.fori_loop(0, counts[qi], key_block, init)

    acc, m, denom = jax.lax.map(query_block, jnp.arange(nq))  # each [nq, B, K, G, bq, ...]
    acc = jnp.moveaxis(acc, 0, 3).reshape(b, kh, g, tp, h)
    m = jnp.moveaxis(m, 0, 3).reshape(b, kh, g, tp)
    denom = jnp.moveaxis(denom, 0, 3).reshape(b, kh, g, tp)
    return acc, m, denom


def _backward_blocks(q, k, v, info: MaskInfo, out, lse, d_out, bq: int, bk: int):
    """Padded inputs and the normalised ``out`` [B, Tp, K, G, H], ``lse`` [B, K, G, Tp] and
    ``d_out`` -> (dq, dk, dv) in float32 (FlashAttention-2's backward, per tile)."""
    b, tp, kh, g, h = q.shape
    sp = k.shape[1]
    nq, nk = tp // bq, sp // bk
    counts = _key_block_counts(info, bq, bk, nq, nk)
    # D_i = sum_h dO_i O_i: the softmax Jacobian's row term.
    delta = jnp.einsum("bqkgh,bqkgh->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)

    def query_block(qi, carry):
        dq, dk, dv = carry
        qb = jax.lax.dynamic_slice_in_dim(q, qi * bq, bq, 1)
        dob = jax.lax.dynamic_slice_in_dim(d_out, qi * bq, bq, 1).astype(v.dtype)
        lse_b = jax.lax.dynamic_slice_in_dim(lse, qi * bq, bq, 3)
        delta_b = jax.lax.dynamic_slice_in_dim(delta, qi * bq, bq, 3)

        def key_block(kj, carry):
            def update(carry):
                dq_b, dk, dv = carry
                scores = _scores(q, k, qi, kj, bq, bk)
                p = jnp.where(mask, jnp.exp(scores - lse_b[..., None]), 0.0)
                kb = jax.lax.dynamic_slice_in_dim(k, kj * bk, bk, 1)
                vb = jax.lax.dynamic_slice_in_dim(v, kj * bk, bk, 1)
                dv_b = jnp.einsum(
                    "bkgqs,bqkgh->bskh", p.astype(v.dtype), dob,
                    preferred_element_type=jnp.float32,
                )  # fmt: skip
                dp = jnp.einsum("bqkgh,bskh->bkgqs", dob, vb, preferred_element_type=jnp.float32)
                ds = (p * (dp - delta_b[..., None])).astype(q.dtype)
                dq_b = dq_b + jnp.einsum(
                    "bkgqs,bskh->bqkgh", ds, kb, preferred_element_type=jnp.float32
                )
                dk_b = jnp.einsum("bkgqs,bqkgh->bskh", ds, qb, preferred_element_type=jnp.float32)
                start = kj * bk
                dk = jax.lax.dynamic_update_slice_in_dim(
                    dk, jax.lax.dynamic_slice_in_dim(dk, start, bk, 1) + dk_b, start, 1
                )
                dv = jax.lax.dynamic_update_slice_in_dim(
                    dv, jax.lax.dynamic_slice_in_dim(dv, start, bk, 1) + dv_b, start, 1
                )
                return dq_b, dk, dv

            mask = visible_per_head(info.slice_q(qi * bq, bq).slice_k(kj * bk, bk))
            return jax.lax.cond(mask.any(), update, lambda c: c, carry)

        dq_b = jnp.zeros((b, bq, kh, g, h), jnp.float32)
        dq_b, dk, dv = jax.lax.fori_loop(0, counts[qi], key_block, (dq_b, dk, dv))
        dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_b, qi * bq, 1)
        return dq, dk, dv

    zeros_k = jnp.zeros(k.shape, jnp.float32)
    init = (jnp.zeros(q.shape, jnp.float32), zeros_k, zeros_k)
    return jax.lax.fori_loop(0, nq, query_block, init)


def _backward_blocks_canonical(q, k, v, info: MaskInfo, out, lse, d_out, bq: int, bk: int):
    """``_backward_blocks`` with every tile product a canonical dot (module docstring):
    dV^T += dO^T P, dP = dO V^T, dQ += dS K, dK^T += Q^T dS."""
    b, tp, kh, g, h = q.shape
    sp = k.shape[1]
    nq, nk = tp // bq, sp // bk
    counts = _key_block_counts(info, bq, bk, nq, nk)
    dtype = v.dtype
    # The cotangent in the compute dtype, as the products take it; D uses the same rounded
    # values so that each row of dS still sums to zero.
    d_out = d_out.astype(dtype)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    # Each operand in the layouts its products read, written out once (copies the size of
    # q, k and v; the [bq, bk] tiles are only ever read in the layout they were made in).
    q_rows = _physical_transpose(q, (0, 2, 3, 1, 4))  # [B, K, G, Tp, H]
    q_cols = _physical_transpose(q, (0, 2, 4, 3, 1))  # [B, K, H, G, Tp]
    do_rows = _physical_transpose(d_out, (0, 2, 3, 1, 4))  # [B, K, G, Tp, H]
    out_rows = _physical_transpose(out.astype(jnp.float32), (0, 2, 3, 1, 4))
    delta = _row_term(do_rows, out_rows)  # [B, K, G, Tp]
    do_cols = _physical_transpose(d_out, (0, 2, 4, 3, 1))  # [B, K, H, G, Tp]
    k_rows = _physical_transpose(k, (0, 2, 1, 3))  # [B, K, Sp, H]
    k_cols = _physical_transpose(k, (0, 2, 3, 1))  # [B, K, H, Sp]
    v_cols = _physical_transpose(v, (0, 2, 3, 1))  # [B, K, H, Sp]

    def query_block(qi, carry):
        dq, dk_cols, dv_cols = carry
        qb_rows = _block(q_rows, qi, bq, 3).reshape(b, kh, g * bq, h)
        qb_cols = _block(q_cols, qi, bq, 4).reshape(b, kh, h, g * bq)
        dob_rows = _block(do_rows, qi, bq, 3).reshape(b, kh, g * bq, h)
        dob_cols = _block(do_cols, qi, bq, 4).reshape(b, kh, h, g * bq)
        lse_b = _block(lse, qi, bq, 3)  # [B, K, G, bq]
        delta_b = _block(delta, qi, bq, 3)

        def key_block(kj, carry):
            def update(carry):
                dq_b, dk_cols, dv_cols = carry
                scores = _bmm(qb_rows, _block(k_cols, kj, bk, 3)).reshape(b, kh, g, bq, bk)
                p = jnp.where(mask, jnp.exp(scores - lse_b[..., None]), 0.0)
                dp = _bmm(dob_rows, _block(v_cols, kj, bk, 3)).reshape(b, kh, g, bq, bk)
                ds = (p * (dp - delta_b[..., None])).astype(dtype).reshape(b, kh, g * bq, bk)
                p = p.astype(dtype).reshape(b, kh, g * bq, bk)
                dq_b = dq_b + _bmm(ds, _block(k_rows, kj, bk, 2))  # [B, K, G bq, H]
                dk_cols = _add_block(dk_cols, _bmm(qb_cols, ds), kj, bk, 3)
                dv_cols = _add_block(dv_cols, _bmm(dob_cols, p), kj, bk, 3)
                return dq_b, dk_cols, dv_cols

            mask = visible_per_head(info.slice_q(qi * bq, bq).slice_k(kj * bk, bk))
            return jax.lax.cond(mask.any(), update, lambda c: c, carry)

        dq_b = jnp.zeros((b, kh, g * bq, h), jnp.float32)
        dq_b, dk_cols, dv_cols = jax.lax.fori_loop(
            0, counts[qi], key_block, (dq_b, dk_cols, dv_cols)
        )
        dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_b.reshape(b, kh, g, bq, h), qi * bq, 3)
        return dq, dk_cols, dv_cols

    zeros_k = jnp.zeros((b, kh, h, sp), jnp.float32)
    init = (jnp.zeros((b, kh, g, tp, h), jnp.float32), zeros_k, zeros_k)
    dq, dk_cols, dv_cols = jax.lax.fori_loop(0, nq, query_block, init)
    dq = jnp.transpose(dq, (0, 3, 1, 2, 4))  # [B, Tp, K, G, H]
    return dq, jnp.transpose(dk_cols, (0, 3, 1, 2)), jnp.transpose(dv_cols, (0, 3, 1, 2))


def _padded(q, k, v, info: MaskInfo, block_q: int, block_k: int):
    t, s = q.shape[1], k.shape[1]
    bq, bk = min(block_q, t), min(block_k, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    q = _pad_to(q, 1, tp)
    k, v = _pad_to(k, 1, sp), _pad_to(v, 1, sp)
    return q, k, v, _pad_info(info, tp, sp), bq, bk


def blockwise_partial(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    info: MaskInfo,
    *,
    block_q: int = 512,
    block_k: int = 512,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Un-normalised attention of queries over one set of keys (one K/V shard of a ring).

    q [B, T, K, G, H] (pre-scaled); k, v [B, S, K, H]; ``info`` the mask between them with
    the keys' global slots (ascending). Returns float32 ``(acc [B, T, K, G, H],
    max [B, K, G, T], sum [B, K, G, T])`` with ``acc = sum_j exp(s_j - max) v_j`` and
    ``sum = sum_j exp(s_j - max)`` over visible keys (max = -inf, acc = sum = 0 for a query
    that sees none). Shards combine with ``combine_partials``; the output is ``acc / sum``
    and the log-sum-exp ``max + log(sum)`` is what ``blockwise_partial_grads`` needs.
    Not differentiable by itself: the backward of a sharded attention calls
    ``blockwise_partial_grads`` per shard with the combined output and log-sum-exp.
    """
    return _partial(q, k, v, info, block_q, block_k, _canonical_dots(q, k, v))


def _partial(q, k, v, info: MaskInfo, block_q: int, block_k: int, canonical: bool):
    t = q.shape[1]
    q, k, v, info, bq, bk = _padded(q, k, v, info, block_q, block_k)
    acc, m, denom = _forward_blocks(q, k, v, info, bq, bk, canonical)
    acc = jnp.moveaxis(acc, 3, 1)[:, :t]
    return acc, m[..., :t], denom[..., :t]


def combine_partials(
    parts: list[tuple[jax.Array, jax.Array, jax.Array]],
) -> tuple[jax.Array, jax.Array]:
    """Merge ``blockwise_partial`` results over disjoint key sets into the normalised output
    [B, T, K, G, H] (float32; 0 where no key is visible) and the log-sum-exp [B, K, G, T]."""
    m = functools.reduce(jnp.maximum, [p[1] for p in parts])
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    acc = 0.0
    total = 0.0
    for a, mi, li in parts:
        scale = jnp.exp(mi - m_safe)
        acc = acc + a * jnp.moveaxis(scale, 3, 1)[..., None]
        total = total + li * scale
    out = acc / jnp.moveaxis(jnp.where(total > 0, total, 1.0), 3, 1)[..., None]
    lse = jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return out, lse


def blockwise_partial_grads(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    info: MaskInfo,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    *,
    block_q: int = 512,
    block_k: int = 512,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients (dq [B, T, K, G, H], dk, dv [B, S, K, H], float32) of the attention output
    with respect to one K/V shard's contribution, given the output ``out`` [B, T, K, G, H]
    and log-sum-exp ``lse`` [B, K, G, T] combined over all shards and the cotangent
    ``d_out``; summing ``dq`` over shards gives the full query gradient."""
    canonical = _canonical_dots(q, k, v)
    return _partial_grads(q, k, v, info, out, lse, d_out, block_q, block_k, canonical)


def _partial_grads(q, k, v, info, out, lse, d_out, block_q: int, block_k: int, canonical: bool):
    t, s = q.shape[1], k.shape[1]
    q, k, v, info, bq, bk = _padded(q, k, v, info, block_q, block_k)
    tp = q.shape[1]
    out, d_out = _pad_to(out, 1, tp), _pad_to(d_out, 1, tp)
    lse = _pad_to(lse, 3, tp)
    backward = _backward_blocks_canonical if canonical else _backward_blocks
    dq, dk, dv = backward(q, k, v, info, out, lse, d_out, bq, bk)
    return dq[:, :t], dk[:, :s], dv[:, :s]


def _zero_cotangent(x):
    if x is None:
        return None
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _blockwise(q, k, v, info, block_q, block_k, canonical):
    return _blockwise_fwd(q, k, v, info, block_q, block_k, canonical)[0]


def _blockwise_fwd(q, k, v, info, block_q, block_k, canonical):
    acc, m, denom = _partial(q, k, v, info, block_q, block_k, canonical)
    out, lse = combine_partials([(acc, m, denom)])
    return out, (q, k, v, info, out, lse)


def _blockwise_bwd(block_q, block_k, canonical, residuals, d_out):
    q, k, v, info, out, lse = residuals
    dq, dk, dv = _partial_grads(q, k, v, info, out, lse, d_out, block_q, block_k, canonical)
    info_ct = jax.tree.map(_zero_cotangent, info)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), info_ct


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    info: MaskInfo,
    *,
    block_q: int = 512,
    block_k: int = 512,
) -> jax.Array:
    """Memory-linear softmax attention: q [B, T, K, G, H] (pre-scaled), k, v [B, S, K, H]
    -> [B, T, K, G, H] float32 (0 for a query that sees no key).

    Loops over query blocks and, within each, over the key blocks that can be causally
    visible (a key block whose first slot is after the query block's last is never visited;
    one whose mask tile is empty, e.g. before a sliding window, is skipped after building
    the tile). Differentiable: the backward recomputes every tile (custom VJP).
    """
    return _blockwise(q, k, v, info, block_q, block_k, _canonical_dots(q, k, v))


__all__ = [
    "blockwise_attention",
    "blockwise_partial",
    "blockwise_partial_grads",
    "combine_partials",
]
