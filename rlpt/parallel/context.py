"""Context parallelism: attention over rows whose tokens are split along a mesh axis.

With a ``sequence`` mesh axis of size P, every activation of shape [B, T, ...]
holds T / P tokens per device. Everything but attention is token-wise; attention
needs every query to meet every key of its row. Two strategies:

- ``"allgather"``: queries stay sharded, keys and values are all-gathered along the
  axis, and each device attends its T / P queries to all T keys (MaxText's default
  context parallelism). Simple and fast when K and V are small next to the
  activations (grouped-query attention), but each device holds the whole K and V.
- ``"ring"``: ring attention (Liu et al. 2023, "Ring Attention with Blockwise
  Transformers for Near-Infinite Context"). Each device keeps its query shard and
  passes its K/V shard round the ring with ``jax.lax.ppermute``; after P steps
  every query has met every key shard. The partial results are combined with an
  online softmax (Milakov & Gimelshein 2018; the FlashAttention recurrence):
  running max m, running sum l (`total`) and running output o, all float32,

      m' = max(m, max_s x_s),  l' = l e^(m - m') + sum_s e^(x_s - m'),
      o' = o e^(m - m') + sum_s e^(x_s - m') v_s,  out = o / l.

  A K/V shard that no query of the local shard may see (wholly in the future
  under the causal mask, outside the window, another segment, padding) is
  skipped with ``lax.cond``: under the plain causal mask about half the blocks.

  Load balance: with contiguous shards the causal mask gives device i work on
  i + 1 of the P blocks, and the ring moves in lockstep, so every step waits
  for the busiest device and the skipped blocks save no time. ``"ring"`` lays
  the row out in zigzag order when its length divides by 2P (Brandon et al.
  2023, "Striped Attention"; the zigzag of Megatron's and Llama 3's context
  parallelism): the row is cut into 2P chunks and device i holds chunks i and
  2P - 1 - i, so every device holds an early and a late chunk. Each ring step
  then meets four chunk pairs, of which the causal mask needs about two on
  every device (the other two are skipped): each device's work is about half
  the contiguous layout's busiest device. The reordering is a permutation of
  the token axis before and after the attention; positions, validity and
  segments travel with the tokens, so the maths is unchanged.
  ``"ring_contiguous"`` keeps contiguous shards (the layout to compare with).

A query attends to a key when the key is valid, ``k_pos <= q_pos`` (causal by the
given positions), both carry the same segment id (when given), and, with a
sliding window W > 0, ``q_pos - k_pos < W`` or ``k_pos < attention_sinks``.
Scores are ``(q * H**-0.5) . k`` as in ``rlpt.models.transformer.Attention``; a
masked score is a large finite negative number, so a query that may see no key
at all gets a finite (meaningless) output instead of NaN, as in the dense path.

The per-block maths is a plain einsum per shard pair (the scores of one query
shard against one key shard are materialised, [B, N, T/P, T/P]); each block is
rematerialised in the backward pass, so the memory kept for gradients is the
carried K/V shards and running statistics, not the scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, PartitionSpec

from rlpt.parallel.sharding import DEFAULT_RULES, Rules, logical_to_spec

STRATEGIES = ("allgather", "ring", "ring_contiguous")
_MASKED = -1e30  # finite, so fully masked rows give no NaN (values and gradients)


def _allowed(q_pos, k_pos, k_valid, q_seg, k_seg, sliding_window, attention_sinks):
    """[B, Tq, Tk] bool: which keys each query may see."""
    allowed = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    if sliding_window:
        visible = k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
        if attention_sinks:
            visible |= k_pos[:, None, :] < attention_sinks
        allowed &= visible
    if q_seg is not None:
        allowed &= q_seg[:, :, None] == k_seg[:, None, :]
    return allowed


def _empty_stats(q):
    """Running (max, sum, output) for q [B, Tq, K, G, H]: float32 [B,K,G,Tq], [..], [..,H]."""
    b, t, kh, g, h = q.shape
    m = jnp.full((b, kh, g, t), _MASKED, jnp.float32)
    return m, jnp.zeros_like(m), jnp.zeros((b, kh, g, t, h), jnp.float32)


def _accumulate(stats, q, k, v, allowed):
    """Fold one key block into the running statistics (the online softmax above).

    q [B, Tq, K, G, H] (already scaled, in the compute dtype); k, v [B, Tk, K, H];
    allowed [B, Tq, Tk]. The running max starts at the finite mask value, so the
    first block never subtracts infinities (whose gradients would be NaN).
    """
    m, total, o = stats
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(allowed[:, None, None, :, :], scores, _MASKED)
    # The result does not depend on the max (it cancels between o and l), so no gradient
    # needs to flow through it; stopping it also avoids the max's subgradient.
    m_new = jax.lax.stop_gradient(jnp.maximum(m, scores.max(axis=-1)))
    correction = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[..., None])
    total = total * correction + p.sum(axis=-1)
    pv = jnp.einsum("bkgts,bskh->bkgth", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = o * correction[..., None] + pv
    return m_new, total, o


def _finish(stats, out_dtype):
    """[B, Tq, K*G, H] from the running statistics."""
    _, total, o = stats
    out = o / total[..., None]  # total >= 1: the running max is one of the summed scores
    b, kh, g, t, h = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, kh * g, h).astype(out_dtype)


def _axis_size(mesh: Mesh, axis: str | tuple[str, ...]) -> int:
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    size = 1
    for name in axes:
        if name not in mesh.shape:
            raise ValueError(f"context parallelism: mesh axes {tuple(mesh.shape)} lack {name!r}")
        size *= mesh.shape[name]
    return size


def _local_attention(
    q, k, v, q_pos, k_pos, k_valid, q_seg, k_seg, *, axis, size, strategy, window, sinks
):
    """The per-device body: local query shard [B, T/P, N, H] against the whole row."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    # Scale in the input precision, then cast to the keys' dtype: the dense path's order.
    q = (q * (h**-0.5)).astype(k.dtype).reshape(b, t, kh, n // kh, h)
    mask = functools.partial(_allowed, sliding_window=window, attention_sinks=sinks)
    stats = _empty_stats(q)
    if strategy == "allgather":
        gather = functools.partial(jax.lax.all_gather, axis_name=axis, axis=1, tiled=True)
        k_all, v_all, kp_all, kv_all = gather(k), gather(v), gather(k_pos), gather(k_valid)
        ks_all = None if k_seg is None else gather(k_seg)
        allowed = mask(q_pos, kp_all, kv_all, q_seg, ks_all)
        return _finish(_accumulate(stats, q, k_all, v_all, allowed), v.dtype)

    @jax.checkpoint
    def block(stats, q_part, kv):
        q_blk, qp_blk, qseg_blk = q_part
        k_blk, v_blk, kp_blk, kvalid_blk, kseg_blk = kv
        allowed = mask(qp_blk, kp_blk, kvalid_blk, qseg_blk, kseg_blk)
        return jax.lax.cond(
            jnp.any(allowed),
            lambda s: _accumulate(s, q_blk, k_blk, v_blk, allowed),
            lambda s: s,
            stats,
        )

    # Zigzag: the local shard is two chunks (an early and a late one), and so is each key
    # shard; each of the four chunk pairs is computed or skipped on its own.
    parts = 2 if strategy == "ring" and _zigzag(size, t * size) else 1

    def split(x):
        return (None,) * parts if x is None else tuple(jnp.split(x, parts, axis=1))

    q_parts = list(zip(split(q), split(q_pos), split(q_seg)))
    part_stats = [_empty_stats(qp[0]) for qp in q_parts]
    # Device i holds key shard (i - step) mod P at ring step `step`. A Python loop (P is
    # a mesh size, small) lets XLA overlap each ppermute with the block computed meanwhile.
    perm = [(i, (i + 1) % size) for i in range(size)]
    kv = (k, v, k_pos, k_valid, k_seg)
    for step in range(size):
        incoming = None
        if step + 1 < size:
            incoming = jax.tree.map(lambda x: jax.lax.ppermute(x, axis, perm), kv)
        kv_parts = list(zip(*(split(x) for x in kv)))
        pairs = [(i, j) for i in range(parts) for j in range(parts)]
        for i, j in sorted(pairs, key=lambda ij: ij[0] != ij[1]):  # diagonals first
            if step == 0 and i == j:
                # A diagonal block holds each query's own key: never skipped (and its
                # result is what makes the running statistics vary across devices).
                q_blk, qp_blk, qseg_blk = q_parts[i]
                k_blk, v_blk, kp_blk, kvalid_blk, kseg_blk = kv_parts[j]
                allowed = mask(qp_blk, kp_blk, kvalid_blk, qseg_blk, kseg_blk)
                part_stats[i] = _accumulate(part_stats[i], q_blk, k_blk, v_blk, allowed)
            else:
                part_stats[i] = block(part_stats[i], q_parts[i], kv_parts[j])
        kv = incoming
    return jnp.concatenate([_finish(st, v.dtype) for st in part_stats], axis=1)


def _zigzag(size: int, length: int) -> bool:
    """Whether a row of ``length`` tokens over ``size`` devices takes the zigzag layout."""
    return size > 1 and length % (2 * size) == 0


def zigzag_order(size: int, length: int) -> np.ndarray:
    """Token indices in zigzag order [length]: device i's shard is chunk i then chunk
    2 * size - 1 - i of the row cut into 2 * size chunks."""
    chunks = np.arange(length).reshape(2 * size, length // (2 * size))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * size - 1 - i]])
                           for i in range(size)])  # fmt: skip


def context_parallel_attention(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, T, K, H]
    v: jax.Array,  # [B, T, K, H]
    q_positions: jax.Array,  # [B, T] int
    k_positions: jax.Array,  # [B, T] int
    k_valid: jax.Array,  # [B, T] bool
    segment_ids: jax.Array | None = None,  # [B, T] int, packed rows
    *,
    mesh: Mesh,
    strategy: str = "ring",
    axis: str | tuple[str, ...] = "sequence",
    sliding_window: int = 0,
    attention_sinks: int = 0,
    rules: Rules = DEFAULT_RULES,
) -> jax.Array:
    """Causal grouped-query self-attention of rows split along mesh ``axis``: [B, T, N, H].

    Queries and keys are the same tokens (self-attention over one row), so
    ``q_positions`` and ``k_positions`` are normally the same array. N must be a
    multiple of K (query head n reads key head n // (N / K)). T must divide by the
    axis size. The batch and head axes are split as ``rules`` say for the
    activations (``batch``, ``act_heads``/``act_kv_heads``); the output is sharded
    like the queries: batch over the batch axes, length over ``axis``.
    The output has v's dtype; scores, softmax and sums are float32.
    """
    if strategy not in STRATEGIES:
        raise ValueError(
            f"context parallelism strategy must be one of {STRATEGIES}, got {strategy!r}"
        )
    b, t, n, h = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != h or n % k.shape[2]:
        raise ValueError(
            f"context parallelism: q {q.shape}, k {k.shape}, v {v.shape} are not [B, T, N, H], "
            "[B, T, K, H], [B, T, K, H] with N a multiple of K"
        )
    for name, x in (("q_positions", q_positions), ("k_positions", k_positions),
                    ("k_valid", k_valid), ("segment_ids", segment_ids)):  # fmt: skip
        if x is not None and x.shape != (b, t):
            raise ValueError(f"context parallelism: {name} is {x.shape}, expected {(b, t)}")
    size = _axis_size(mesh, axis)
    if t % size:
        raise ValueError(
            f"context parallelism: the length {t} does not divide by the {size} devices of "
            f"mesh axis {axis!r}"
        )
    seq_axes = (axis,) if isinstance(axis, str) else tuple(axis)
    q_spec = logical_to_spec(("batch", None, "act_heads", None), q.shape, mesh, rules)
    k_spec = logical_to_spec(("batch", None, "act_kv_heads", None), k.shape, mesh, rules)
    batch = q_spec[0]
    batch_axes = () if batch is None else (batch,) if isinstance(batch, str) else tuple(batch)
    if set(batch_axes) & set(seq_axes):
        raise ValueError(f"context parallelism: axis {axis!r} also splits the batch ({batch!r})")
    # Heads stay split only where query and key heads split alike (each device then holds
    # whole groups); otherwise they are replicated inside the attention.
    q_heads, k_heads = q_spec[2], k_spec[2]
    if q_heads != k_heads or set(_as_tuple(q_heads)) & set(seq_axes):
        q_heads = k_heads = None
    row = PartitionSpec(batch, axis)
    qs = PartitionSpec(batch, axis, q_heads, None)
    ks = PartitionSpec(batch, axis, k_heads, None)
    seg = segment_ids is not None

    def body(q, k, v, q_pos, k_pos, k_valid, *segs):
        q_seg, k_seg = (segs[0], segs[0]) if seg else (None, None)
        return _local_attention(
            q, k, v, q_pos, k_pos, k_valid.astype(bool), q_seg, k_seg, axis=axis, size=size,
            strategy=strategy, window=sliding_window, sinks=attention_sinks,
        )  # fmt: skip

    args = (q, k, v, q_positions, k_positions, k_valid) + ((segment_ids,) if seg else ())
    specs = (qs, ks, ks, row, row, row) + ((row,) if seg else ())
    zigzag = strategy == "ring" and _zigzag(size, t)
    if zigzag:  # every [B, T, ...] argument in zigzag order along T (see the module doc)
        order = zigzag_order(size, t)
        args = tuple(jnp.take(x, order, axis=1) for x in args)
    out = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=qs)(*args)
    if zigzag:
        out = jnp.take(out, np.argsort(order), axis=1)
        out = jax.lax.with_sharding_constraint(out, jax.sharding.NamedSharding(mesh, qs))
    return out


def _as_tuple(spec_entry) -> tuple[str, ...]:
    if spec_entry is None:
        return ()
    return (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


@struct.dataclass
class ContextMask:
    """What attention needs to mask a row split over devices, in place of the dense
    [B, T, S] mask: key validity and segment ids. Queries and keys are the row's own
    tokens, causal by slot (index in the row), as in the dense path without a cache."""

    valid: jax.Array  # [B, T] bool
    segment_ids: jax.Array | None = None  # [B, T] int
    # Rotary positions [B, T] (restarting per packed segment): the sliding window and its
    # sinks count in positions; None counts in slots.
    positions: jax.Array | None = None
    sliding_window: int = struct.field(pytree_node=False, default=0)
    attention_sinks: int = struct.field(pytree_node=False, default=0)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        """q [B, T, N, H], k and v [B, T, K, H] -> [B, T, N, H] on the active mesh."""
        from rlpt.parallel.sharding import context_parallelism

        b, t = self.valid.shape
        active = context_parallelism(t)
        if active is None:
            raise ValueError(
                "ContextMask used outside an activation_sharding context that splits rows"
            )
        mesh, rules, axes, strategy = active
        if self.positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        else:
            positions = self.positions
        return context_parallel_attention(
            q, k, v, positions, positions, self.valid, self.segment_ids,
            mesh=mesh, strategy=strategy, axis=axes, rules=rules,
            sliding_window=self.sliding_window, attention_sinks=self.attention_sinks,
        )  # fmt: skip
