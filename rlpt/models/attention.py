"""Attention kernels: dense, dot_product, splash; MoBA selection; the shared mask rule.

All kernels share one visibility rule, described by a ``MaskInfo`` (per-token arrays, never a
``[T, S]`` mask) so each kernel builds only the block of mask it needs. Key ``j`` is visible
to query ``i`` when

* the key is valid (not padding),
* both carry the same segment id (packed rows; when segment ids are given),
* the key's slot is not later than the query's (causal by slot: with no cache the slot is the
  index in the row, with a KV cache the index in the cache),
* with a sliding window ``W > 0``: ``pos_i - pos_j < W`` or ``pos_j < sinks``. Positions
  restart at 0 in every packed segment, so the sinks are the first tokens of each sequence
  (StreamingLLM, Xiao et al. 2023).

Shapes: ``B`` batch, ``T`` queries, ``S`` keys, ``K`` key/value heads, ``G`` query heads per
key/value head (grouped-query attention), ``H`` head dim. Queries enter pre-scaled by
``H ** -0.5``; scores, running maxima and sums are float32.

The blockwise kernel (FlashAttention's online softmax in plain XLA) is
``rlpt.models.blockwise``.

On CPU with bfloat16 inputs the dense and blockwise kernels write every product as a canonical
batched dot (``[..., M, N] @ [..., N, P]``, float32 accumulation), the only form XLA:CPU
hands to its bf16 matmul library; any other form it upcasts to float32 and runs ~6x slower
(``rlpt.models.matmul``). Each product is arranged so that the large [T, S] operand (scores,
probabilities, their gradients) is used in the layout it was made in: ``dV^T = dO^T P`` and
``dK^T = Q^T dS`` instead of ``P^T dO`` and ``dS^T Q``, so only the [T, H] and [S, H] operands,
small beside it, are written out transposed. Float32 inputs and other backends keep the einsums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rlpt.models.matmul import _physical_transpose

_MASKED = -1e30  # the dense path's fill: finite, so a fully masked row gives no NaN


@struct.dataclass
class MaskInfo:
    """Which keys each query sees, as per-token arrays (see the module docstring).

    ``q_slots`` [T] and ``k_slots`` [S] are shared by the batch and ascending (the blockwise
    kernel skips key blocks whose first slot is after a query block's last; the materialised
    mask also takes per-row slots [B, T] / [B, S], as the paged cache needs);
    ``q_positions`` [B, T], ``k_positions`` [B, S] are rotary positions; ``k_valid`` [B, S];
    ``q_segments`` [B, T] / ``k_segments`` [B, S] are None or both given.
    ``q_blocks`` [B, K, G, T, n_blocks] (MoBA, ``moba_blocks``): None, or per query head the
    earlier key blocks (``position // block``) it reads besides its own; the rest is masked.
    """

    q_slots: jax.Array
    k_slots: jax.Array
    q_positions: jax.Array
    k_positions: jax.Array
    k_valid: jax.Array
    q_segments: jax.Array | None = None
    k_segments: jax.Array | None = None
    q_blocks: jax.Array | None = None
    window: int = struct.field(pytree_node=False, default=0)
    sinks: int = struct.field(pytree_node=False, default=0)
    block: int = struct.field(pytree_node=False, default=0)

    def slice_q(self, start, size: int) -> MaskInfo:
        """The rows of queries ``start .. start + size`` (``start`` may be traced)."""
        seg, sel = self.q_segments, self.q_blocks
        return self.replace(
            q_slots=jax.lax.dynamic_slice_in_dim(self.q_slots, start, size, 0),
            q_positions=jax.lax.dynamic_slice_in_dim(self.q_positions, start, size, 1),
            q_segments=None if seg is None else jax.lax.dynamic_slice_in_dim(seg, start, size, 1),
            q_blocks=None if sel is None else jax.lax.dynamic_slice_in_dim(sel, start, size, 3),
        )

    def slice_k(self, start, size: int) -> MaskInfo:
        """The columns of keys ``start .. start + size`` (``start`` may be traced)."""
        seg = self.k_segments
        return self.replace(
            k_slots=jax.lax.dynamic_slice_in_dim(self.k_slots, start, size, 0),
            k_positions=jax.lax.dynamic_slice_in_dim(self.k_positions, start, size, 1),
            k_valid=jax.lax.dynamic_slice_in_dim(self.k_valid, start, size, 1),
            k_segments=None if seg is None else jax.lax.dynamic_slice_in_dim(seg, start, size, 1),
        )


def self_attention_info(
    positions: jax.Array,
    valid: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    window: int = 0,
    sinks: int = 0,
) -> MaskInfo:
    """The ``MaskInfo`` of a training row attending to itself (no cache): slots are indices."""
    slots = jnp.arange(positions.shape[1], dtype=jnp.int32)
    return MaskInfo(
        q_slots=slots,
        k_slots=slots,
        q_positions=positions,
        k_positions=positions,
        k_valid=valid.astype(bool),
        q_segments=segment_ids,
        k_segments=segment_ids,
        window=window,
        sinks=sinks,
    )


def visible(info: MaskInfo) -> jax.Array:
    """The materialised mask [B, T, S] of ``info`` (for small blocks, or the dense path)."""
    q_slots = info.q_slots if info.q_slots.ndim == 2 else info.q_slots[None]
    k_slots = info.k_slots if info.k_slots.ndim == 2 else info.k_slots[None]
    allowed = info.k_valid[:, None, :] & (k_slots[:, None, :] <= q_slots[:, :, None])
    if info.q_segments is not None:
        allowed &= info.q_segments[:, :, None] == info.k_segments[:, None, :]
    if info.window > 0:
        distance = info.q_positions[:, :, None] - info.k_positions[:, None, :]
        in_window = distance < info.window
        if info.sinks > 0:
            in_window |= info.k_positions[:, None, :] < info.sinks
        allowed &= in_window
    return allowed


def visible_per_head(info: MaskInfo) -> jax.Array:
    """``visible(info)`` as [B, 1, 1, T, S], or with MoBA's block selection (``q_blocks``)
    [B, K, G, T, S]: the query's own key block and the blocks it selected."""
    allowed = visible(info)[:, None, None]
    if info.q_blocks is None:
        return allowed
    n_blocks = info.q_blocks.shape[-1]
    k_block = jnp.clip(info.k_positions // info.block, 0, n_blocks - 1)  # [B, S]
    own = info.k_positions[:, None, :] // info.block == info.q_positions[:, :, None] // info.block
    index = jnp.broadcast_to(
        k_block[:, None, None, None, :], info.q_blocks.shape[:-1] + k_block.shape[-1:]
    )
    chosen = jnp.take_along_axis(info.q_blocks, index, axis=-1)  # [B, K, G, T, S]
    return allowed & (own[:, None, None] | chosen)


def _canonical_dots(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Whether the products take canonical dots (module docstring): q, k and v in one
    dtype other than float32, on CPU. Float32 dots are never upcast, and other backends'
    matmul units take transposed operands directly, so both keep the einsums."""
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    return (
        len(dtypes) == 1 and dtypes != {jnp.dtype(jnp.float32)} and jax.default_backend() == "cpu"
    )


def _bmm(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [..., M, N] @ b [..., N, P] -> [..., M, P] float32: a canonical batched dot."""
    return jnp.matmul(a, b, preferred_element_type=jnp.float32)


def _row_term(d_out: jax.Array, out: jax.Array) -> jax.Array:
    """D = sum_h dO O (float32) over the last axis of d_out and out, both head-major.

    Head-major copies, not views of the [B T, N H] activations: a multiply-and-sum that
    reads a bitcast of those to [B, T, K, 1, H] runs ~25x slower in XLA:CPU's YNNPACK
    fusion (46 ms instead of ~1 ms at the PPO benchmark's shapes)."""
    return jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)


@jax.custom_vjp
def _dense_canonical(q, k, v, allowed):
    return _dense_canonical_fwd(q, k, v, allowed)[0]


def _dense_canonical_fwd(q, k, v, allowed):
    """``dense_attention`` as canonical dots (module docstring); the same masking and fill."""
    b, t, kh, g, h = q.shape
    s = k.shape[1]
    q_rows = _physical_transpose(q, (0, 2, 3, 1, 4)).reshape(b, kh, g * t, h)
    k_cols = _physical_transpose(k, (0, 2, 3, 1))  # [B, K, H, S]
    v_rows = _physical_transpose(v, (0, 2, 1, 3))  # [B, K, S, H]
    scores = _bmm(q_rows, k_cols).reshape(b, kh, g, t, s)
    mask = allowed[:, None, None] if allowed.ndim == 3 else allowed
    probs = jax.nn.softmax(jnp.where(mask, scores, _MASKED), axis=-1).astype(k.dtype)
    out_rows = _bmm(probs.reshape(b, kh, g * t, s), v_rows)  # [B, K, G T, H]
    out = jnp.transpose(out_rows.reshape(b, kh, g, t, h), (0, 3, 1, 2, 4))  # [B, T, K, G, H]
    # Kept for the backward pass: the probabilities in the compute dtype, as the product
    # used them ([B, K, G, T, S], half the bytes of the float32 ones autodiff keeps, and no
    # mask or exp to redo), and the output head-major ([B, K, G T, H] float32) for D.
    # A query with no visible key has no score gradient (the fill is a constant).
    seen = mask.any(axis=-1)  # [B, 1, 1, T] or [B, K, G, T]
    return out, (q, k, v, probs, out_rows, seen)


def _dense_canonical_bwd(residuals, d_out):
    """dV^T = dO^T P, dP = dO V^T, dS = P (dP - rowsum(dO O)), dQ = dS K, dK^T = Q^T dS."""
    q, k, v, probs, out_rows, seen = residuals
    b, t, kh, g, h = q.shape
    s = k.shape[1]
    dtype = k.dtype
    # The cotangent in the compute dtype, as the products take it; the row term D uses the
    # same rounded values so that each row of dS still sums to zero.
    d_out = d_out.astype(dtype)
    do_rows = _physical_transpose(d_out, (0, 2, 3, 1, 4)).reshape(b, kh, g * t, h)
    delta = _row_term(do_rows, out_rows).reshape(b, kh, g, t)
    do_cols = _physical_transpose(d_out, (0, 2, 4, 3, 1)).reshape(b, kh, h, g * t)
    q_cols = _physical_transpose(q, (0, 2, 4, 3, 1)).reshape(b, kh, h, g * t)
    k_rows = _physical_transpose(k, (0, 2, 1, 3))  # [B, K, S, H]
    v_cols = _physical_transpose(v, (0, 2, 3, 1))  # [B, K, H, S]
    p = probs.reshape(b, kh, g * t, s)
    dv_cols = _bmm(do_cols, p)  # [B, K, H, S]
    dp = _bmm(do_rows, v_cols).reshape(b, kh, g, t, s)
    # Zeroing dP and D (not dS) of the rows that see nothing keeps the select right after
    # the dot, where XLA leaves the dot alone: fused with the arithmetic below into one
    # YNNPACK call, the product ran at half speed.
    dp = jnp.where(seen[..., None], dp, 0.0)
    delta = jnp.where(seen, delta, 0.0)
    ds = probs.astype(jnp.float32) * (dp - delta[..., None])
    ds = ds.astype(dtype).reshape(b, kh, g * t, s)
    dq = _bmm(ds, k_rows).reshape(b, kh, g, t, h)
    dk_cols = _bmm(q_cols, ds)  # [B, K, H, S]
    dq = jnp.transpose(dq, (0, 3, 1, 2, 4)).astype(q.dtype)
    dk = jnp.transpose(dk_cols, (0, 3, 1, 2)).astype(k.dtype)
    dv = jnp.transpose(dv_cols, (0, 3, 1, 2)).astype(v.dtype)
    return dq, dk, dv, None  # the mask has no cotangent


_dense_canonical.defvjp(_dense_canonical_fwd, _dense_canonical_bwd)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """Softmax attention over materialised scores (the reference path).

    q [B, T, K, G, H] (pre-scaled, compute dtype); k, v [B, S, K, H]; allowed [B, T, S] or,
    per head, [B, K, G, T, S]. Returns [B, T, K, G, H] float32. A query with no visible key
    averages all values (its scores are all equal), as it always has.
    """
    if _canonical_dots(q, k, v):
        return _dense_canonical(q, k, v, allowed)
    dtype = k.dtype
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    if allowed.ndim == 3:
        allowed = allowed[:, None, None, :, :]
    scores = jnp.where(allowed, scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum(
        "bkgts,bskh->btkgh", probs.astype(dtype), v, preferred_element_type=jnp.float32
    )


# ----------------------------------------------------------------------------- library kernels


def dot_product(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """``jax.nn.dot_product_attention`` (implementation chosen by JAX) -> [B, T, K, G, H].

    The mask goes in as an explicit [B, 1, T, S] boolean: padding, segments, slot causality
    and the window with sinks are more than ``is_causal`` and ``local_window_size`` express.
    """
    b, t, kh, g, h = q.shape
    out = jax.nn.dot_product_attention(
        q.reshape(b, t, kh * g, h), k, v, mask=allowed[:, None], scale=1.0
    )
    return out.reshape(b, t, kh, g, h).astype(jnp.float32)


def splash(q: jax.Array, k: jax.Array, v: jax.Array, info: MaskInfo, *, block: int) -> jax.Array:
    """The Pallas TPU splash-attention kernel -> [B, T, K, G, H] float32 (TPU only).

    The kernel's masks are static: causal by slot, a local window by slot (so positions must
    run with slots inside a sequence, as in left-padded and packed rows), and segment ids
    for padding and packing (padding is segment 0 when none are given). Attention sinks
    depend on per-row positions and are not supported.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    if info.sinks:
        raise ValueError("model.attention='splash' does not support model.attention_sinks")
    b, t, kh, g, h = q.shape
    s = k.shape[1]
    n = kh * g
    if info.window:
        head_mask = masks.LocalMask((t, s), window_size=(info.window - 1, 0), offset=0)
    else:
        head_mask = masks.CausalMask((t, s))
    multi = masks.MultiHeadMask([head_mask] * n)
    blk = min(block, t, s)
    sizes = kernel.BlockSizes(
        block_q=blk, block_kv=blk, block_kv_compute=blk,
        block_q_dkv=blk, block_kv_dkv=blk, block_kv_dkv_compute=blk,
        block_q_dq=blk, block_kv_dq=blk,
    )  # fmt: skip
    attend = kernel.make_splash_mha(multi, head_shards=1, q_seq_shards=1, block_sizes=sizes)
    if info.q_segments is not None:
        q_seg, k_seg = info.q_segments, info.k_segments
    else:
        q_seg = jnp.ones((b, t), jnp.int32)
        k_seg = info.k_valid.astype(jnp.int32)
    qh = jnp.moveaxis(q.reshape(b, t, n, h), 1, 2)  # [B, N, T, H]
    kv_index = np.arange(n) // g
    kh_ = jnp.moveaxis(k, 1, 2)[:, kv_index]
    vh_ = jnp.moveaxis(v, 1, 2)[:, kv_index]

    def one(qr, kr, vr, qs, ks):
        return attend(qr, kr, vr, segment_ids=kernel.SegmentIds(q=qs, kv=ks))

    out = jax.vmap(one)(qh, kh_, vh_, q_seg.astype(jnp.int32), k_seg.astype(jnp.int32))
    return jnp.moveaxis(out, 2, 1).reshape(b, t, kh, g, h).astype(jnp.float32)


def resolve_kind(kind: str, backend: str | None = None) -> str:
    """The kernel ``kind`` names on ``backend`` (default: JAX's): "auto" is splash on TPU,
    dot_product on GPU, blockwise elsewhere; "splash" off TPU is an error naming the field."""
    backend = backend or jax.default_backend()
    if kind == "auto":
        return {"tpu": "splash", "gpu": "dot_product"}.get(backend, "blockwise")
    if kind == "splash" and backend != "tpu":
        raise ValueError(
            f"model.attention='splash' needs a TPU (the Pallas splash kernel); this backend is "
            f"{backend!r}: use 'blockwise', 'dot_product' or 'auto'"
        )
    return kind


# ----------------------------------------------------------------------------- MoBA


def moba_select(
    q: jax.Array,
    k: jax.Array,
    info: MaskInfo,
    *,
    block: int,
    top_k: int,
    max_len: int,
) -> jax.Array:
    """MoBA's per-head block mask [B, K, G, T, S] (Lu et al. 2025, arXiv 2502.13189).

    Key blocks are ``block`` consecutive positions of one sequence (position // block, so
    blocks restart with every packed segment and match between training and decoding). Each
    query head keeps its own block and the ``top_k`` earlier blocks with the largest
    ``q . mean(k over the block's valid keys of the query's segment)``; the rest is masked.
    The selection is not differentiable (it is a mask); gradients flow through the attention
    over the selected blocks. Materialises [T, S] scores (a reference implementation).
    """
    n_blocks = -(-max_len // block)
    q_block = info.q_positions // block  # [B, T]
    k_block = info.k_positions // block  # [B, S]
    same = info.k_valid[:, None, :] & (k_block[:, None, :] < q_block[:, :, None])
    if info.q_segments is not None:
        same &= info.q_segments[:, :, None] == info.k_segments[:, None, :]
    onehot = jax.nn.one_hot(k_block, n_blocks, dtype=jnp.float32)  # [B, S, nb]
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = jax.lax.stop_gradient(scores)
    # q . mean(K) = mean(q . k): block sums of the scores, divided by the block's key count.
    sums = jnp.einsum("bkgts,bsc->bkgtc", jnp.where(same[:, None, None], scores, 0.0), onehot)
    counts = jnp.einsum("bts,bsc->btc", same.astype(jnp.float32), onehot)[:, None, None]
    gate = jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), -jnp.inf)
    top = min(top_k, n_blocks)
    values, index = jax.lax.top_k(gate, top)
    chosen = jnp.einsum(
        "bkgtic,bsc->bkgts",
        jax.nn.one_hot(index, n_blocks) * jnp.isfinite(values)[..., None],
        onehot,
    )
    own = k_block[:, None, :] == q_block[:, :, None]
    return visible(info)[:, None, None] & ((chosen > 0) | own[:, None, None])


def moba_blocks(
    q: jax.Array, k: jax.Array, info: MaskInfo, *, block: int, top_k: int, max_len: int
) -> MaskInfo:
    """``info`` with MoBA's selection as ``q_blocks``, memory linear in the row's length.

    The same choice as ``moba_select`` (its own block and the ``top_k`` earlier blocks of
    the query's segment with the largest ``q . mean(k)``) for a row attending to itself
    (no cache: query ``t`` is key ``t``), without [T, S] scores: each block's key sum is
    taken once ([B, S, K, H] by ``segment_sum``) and each query scores only the blocks
    before its own, [B, K, G, T, n_blocks] in all (T^2 / block entries, against T^2).

    A block here is a maximal run of valid keys with one segment and one ``position //
    block``; the ``n_blocks - 1`` runs before a query's own are its candidates, kept when
    they are of its segment and an earlier block. That is every earlier block of its
    segment when each block's keys lie together in the row, as in every row rlpt builds
    (positions ascend within a segment and segments do not interleave).
    """
    b, t, kh, g, h = q.shape
    if k.shape[1] != t:
        raise ValueError(f"moba_blocks is for self-attention rows: {t} queries, {k.shape[1]} keys")
    n_blocks = -(-max_len // block)
    q = jax.lax.stop_gradient(q).astype(jnp.float32)
    k = jax.lax.stop_gradient(k).astype(jnp.float32)
    valid = info.k_valid
    seg = jnp.zeros((b, t), jnp.int32) if info.k_segments is None else info.k_segments
    key_block = info.k_positions // block  # [B, S]
    # Run ids along the row: a valid key starts a run unless the last valid key before it
    # has its segment and block (padding between them does not break a run).
    last = jax.lax.cummax(jnp.where(valid, jnp.arange(t), -1), axis=1)
    prev = jnp.concatenate([jnp.full((b, 1), -1), last[:, :-1]], axis=1)
    prev_c = jnp.maximum(prev, 0)
    same_as_prev = (
        (prev >= 0)
        & (jnp.take_along_axis(seg, prev_c, 1) == seg)
        & (jnp.take_along_axis(key_block, prev_c, 1) == key_block)
    )
    starts = valid & ~same_as_prev
    run = jnp.maximum(jnp.cumsum(starts, axis=1) - 1, 0)  # [B, S]; a query's own run
    flat = (run + t * jnp.arange(b)[:, None]).reshape(-1)
    w = valid.reshape(-1).astype(jnp.float32)
    sums = jax.ops.segment_sum(k.reshape(b * t, kh, h) * w[:, None, None], flat, b * t)
    counts = jax.ops.segment_sum(w, flat, b * t).reshape(b, t)
    # Every valid key of a run has the run's segment and block (padding, which joins the
    # run before it, is kept out: its positions may be anything).
    lowest = jnp.iinfo(jnp.int32).min
    run_seg = jax.ops.segment_max(jnp.where(valid, seg, lowest).reshape(-1), flat, b * t)
    run_block = jax.ops.segment_max(jnp.where(valid, key_block, lowest).reshape(-1), flat, b * t)
    run_seg, run_block = run_seg.reshape(b, t), run_block.reshape(b, t)
    sums = sums.reshape(b, t, kh, h)
    q_seg = seg if info.q_segments is None else info.q_segments
    q_block = info.q_positions // block  # [B, T]

    def candidate(d):  # the run d before each query's own: gate [B, K, G, T], its block
        r = run - d
        rc = jnp.maximum(r, 0)
        ok = (r >= 0) & (jnp.take_along_axis(run_seg, rc, 1) == q_seg)
        blk = jnp.take_along_axis(run_block, rc, 1)
        ok &= (blk < q_block) & (jnp.take_along_axis(counts, rc, 1) > 0)
        mean = (
            jnp.take_along_axis(sums, rc[:, :, None, None], 1)
            / jnp.maximum(jnp.take_along_axis(counts, rc, 1), 1.0)[:, :, None, None]
        )  # [B, T, K, H]
        gate = jnp.einsum("btkgh,btkh->bkgt", q, mean)
        return jnp.where(ok[:, None, None], gate, -jnp.inf), blk

    gates, blocks = jax.lax.map(candidate, jnp.arange(1, max(n_blocks, 2)))
    gates = jnp.moveaxis(gates, 0, -1)  # [B, K, G, T, n_blocks - 1]
    blocks = jnp.moveaxis(blocks, 0, -1)  # [B, T, n_blocks - 1]
    top = min(top_k, gates.shape[-1])
    values, index = jax.lax.top_k(gates, top)
    chosen_block = jnp.take_along_axis(
        jnp.broadcast_to(blocks[:, None, None], gates.shape), index, axis=-1
    )
    picked = jax.nn.one_hot(chosen_block, n_blocks, dtype=bool) & jnp.isfinite(values)[..., None]
    return info.replace(q_blocks=picked.any(axis=-2), block=block)


__all__ = [
    "MaskInfo",
    "dense_attention",
    "dot_product",
    "moba_blocks",
    "moba_select",
    "resolve_kind",
    "self_attention_info",
    "splash",
    "visible",
    "visible_per_head",
]
