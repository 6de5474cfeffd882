"""A decoder-only transformer in the Llama / Qwen2 parameterisation, in Flax NNX.

RMSNorm, rotary position embeddings (configurable theta and scaling),
grouped-query attention with optional qkv bias, a SwiGLU MLP, optional tied
input/output embeddings. Parameters are float32 and carry logical axis names
(mapped to mesh axes only in ``rlpt.parallel``); matrix multiplications take
their inputs in the compute dtype and accumulate in float32, and the residual
stream stays float32.

Modules are used functionally: ``nnx.split`` once into (graphdef, state) and
pure functions of the state inside jit (see ``rlpt.models.init``).

Attention works on "slots": with no cache the slot of a token is its index in
the row; with a KV cache it is its index in the cache. A query attends to a
key when the key is valid (not padding), its slot is not later than the
query's, (optionally) both have the same segment id, and (with a sliding
window) the key is among the window's most recent positions or is a sink.
Positions (for the rotary embedding) are passed separately, so left-padded,
right-padded and unpadded rows give the same results for their real tokens.
The kernels and the mask description live in ``rlpt.models.attention``.

A sliding-window model decodes with a ring cache (``KVCache.create_ring``): S + W slots
per row whatever the length, the first S holding the sinks and position p >= S stored at
slot S + (p - S) mod W. Slots then say nothing about order, so the ring's mask is causal by
position (the key's position is not later than the query's), which is the same rule for
real tokens: positions grow with slots along a row, and padding is invalid either way.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name

from rlpt.models import attention as attn_lib
from rlpt.models import blockwise as blockwise_lib
from rlpt.models.attention import MaskInfo
from rlpt.models.config import ModelConfig
from rlpt.models.matmul import projection
from rlpt.parallel.context import ContextMask
from rlpt.parallel.sharding import constrain, context_parallelism


def _param(rngs: nnx.Rngs, shape, names, *, std: float | None = None, value=None) -> nnx.Param:
    if value is None:
        value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    # eager_sharding=False: the logical names are metadata read by rlpt.parallel,
    # not shardings to apply at creation (there may be no mesh yet).
    return nnx.Param(value, sharding_names=tuple(names), eager_sharding=False)


def _matmul(equation: str, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    # Inputs in the compute dtype, accumulation in float32: bfloat16 inputs with float32
    # accumulation reach the CPU's bf16 matrix units and keep sums exact; `projection`
    # keeps the backward products on that path too.
    return projection(equation, x, w, dtype)


def _project(module: nnx.Module, name: str, equation: str, x: jax.Array, dtype) -> jax.Array:
    """``x`` times the weight ``module.<name>``, plus its LoRA adapter when one is attached.

    Adapters (``rlpt.models.lora``) live beside the weight as ``lora_<name>``; the
    low-rank path runs next to the frozen matmul instead of materialising ``W + A B``.
    """
    out = _matmul(equation, x, getattr(module, name)[...], dtype)
    adapter = getattr(module, f"lora_{name}", None)
    if adapter is not None:
        out = out + adapter(x, dtype)
    return out


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs):
        del rngs
        self.eps = eps
        self.scale = _param(None, (dim,), ("norm",), value=jnp.ones((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(variance + self.eps) * self.scale[...]


def rotary_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim / 2], with linear or Llama-3 scaling applied."""
    dim = config.resolved_head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if config.rope_scaling is None:
        return inv_freq.astype(np.float32)
    scaling = dict(config.rope_scaling)
    factor = float(scaling["factor"])
    if scaling["type"] == "linear":
        return (inv_freq / factor).astype(np.float32)
    # Llama 3: long wavelengths are divided by `factor`, short ones kept, and the
    # band between them interpolated smoothly.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rotary(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate [B, T, heads, head_dim] by positions [B, T] (the half-split layout of HF Llama)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, head_dim/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    x = x.astype(jnp.float32)
    first, second = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return x * jnp.cos(angles) + rotated * jnp.sin(angles)


@struct.dataclass
class KVCache:
    """Preallocated keys and values of every layer.

    ``k[i]``, ``v[i]``: [B, S, kv_heads, head_dim] in the compute dtype;
    ``valid``: [B, S], which slots hold real tokens; ``index``: the next slot to
    write (every row writes in lockstep; padding is marked invalid); ``positions``:
    [B, S], the rotary position of each slot's token (for sliding windows and MoBA
    blocks in decoding). A ring cache (``window`` > 0) has S = sinks + window slots and
    writes each row's tokens by position instead (``ring_slots``); ``index`` then only
    counts the columns fed.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid: jax.Array
    index: jax.Array
    positions: jax.Array | None = None
    # A ring cache (``create_ring``) of a model with this sliding window and these sinks;
    # 0: slots in write order, one per token.
    window: int = struct.field(pytree_node=False, default=0)
    sinks: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def create(cls, config: ModelConfig, batch: int, length: int) -> KVCache:
        """A cache of ``length`` slots written in order, one per token (padding included)."""
        if length > config.max_seq_len:
            raise ValueError(
                f"cache length {length} exceeds model.max_seq_len ({config.max_seq_len})"
            )
        return cls._zeros(config, batch, length)

    @classmethod
    def create_ring(cls, config: ModelConfig, batch: int) -> KVCache:
        """A ring of ``attention_sinks + sliding_window`` slots per row, whatever the length.

        Position p of a row lives at slot p while p < S (the sinks), else at
        S + (p - S) mod W, overwriting position p - W, which no later query sees. Padding
        is never written, so left-padded rows keep their first S real tokens as sinks.
        """
        if config.sliding_window <= 0:
            raise ValueError("a ring KV cache needs model.sliding_window > 0")
        if config.sparse_attention != "none":
            # MoBA scores whole key blocks, older ones included: a window's ring lacks them.
            raise ValueError(
                f"a ring KV cache does not support model.sparse_attention="
                f"{config.sparse_attention!r} (it reads blocks outside the window)"
            )
        length = config.attention_sinks + config.sliding_window
        return cls._zeros(config, batch, length).replace(
            window=config.sliding_window, sinks=config.attention_sinks
        )

    @classmethod
    def for_generation(cls, config: ModelConfig, batch: int, length: int) -> KVCache:
        """The cache generating ``length`` positions needs: a ring for a sliding-window model
        when it is shorter than ``length``, else ``length`` slots in order."""
        if length > config.max_seq_len:
            raise ValueError(
                f"cache length {length} exceeds model.max_seq_len ({config.max_seq_len})"
            )
        ring = config.attention_sinks + config.sliding_window
        if config.sliding_window and config.sparse_attention == "none" and ring < length:
            return cls.create_ring(config, batch)
        return cls.create(config, batch, length)

    @classmethod
    def _zeros(cls, config: ModelConfig, batch: int, length: int) -> KVCache:
        shape = (batch, length, config.n_kv_heads, config.resolved_head_dim)
        zeros = tuple(jnp.zeros(shape, config.compute_dtype) for _ in range(config.n_layers))
        return cls(
            k=zeros,
            v=zeros,
            valid=jnp.zeros((batch, length), bool),
            index=jnp.zeros((), jnp.int32),
            positions=jnp.zeros((batch, length), jnp.int32),
        )

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def ring_slots(self, positions: jax.Array, mask: jax.Array) -> jax.Array:
        """The ring slot [B, T] each new token is written to; ``length`` (out of range, so
        the scatter drops it) for padding and for a token a later one of the same call
        overwrites (a scatter's order among duplicate indices is unspecified)."""
        s, w = self.sinks, self.window
        positions = positions.astype(jnp.int32)
        last = jnp.max(jnp.where(mask, positions, -1), axis=1, keepdims=True)
        keep = mask & ((positions < s) | (positions > last - w))
        slot = jnp.where(positions < s, positions, s + (positions - s) % w)
        return jnp.where(keep, slot, self.length)


@struct.dataclass
class _RingLayer:
    """One layer's ring (``k``, ``v`` [B, S + W, K, H]) and where the new tokens go [B, T]."""

    k: jax.Array
    v: jax.Array
    write: jax.Array


@struct.dataclass
class PagedCache:
    """Keys and values in fixed-size blocks shared by many sequences (the rollout engine's).

    ``k[i]``, ``v[i]``: [D, N, block, kv_heads, head_dim], one pool of N blocks per
    data-parallel shard D (a row of the batch only ever touches its own shard's pool, so
    the pools split over the data axes with no communication). ``write``: [B, T] the flat
    slot (``block * block_size + offset``, in its shard's pool) each input token's key and
    value go to; padding tokens write to a block no sequence reads. ``read``: [B, S] the flat
    slot of each of the row's context positions 0..S-1, in order; a query at position p sees
    positions 0..p. B is D times the rows per shard, shard-major.

    ``rows_k[i]``, ``rows_v[i]`` (optional, [B, S, kv_heads, head_dim]): the rows' context
    already gathered from the pools. A decode loop gathers once per call and then writes each
    new token both into the pool and into its row at its position, so a step reads its
    context in place instead of gathering it again (then ``read`` is unused).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    write: jax.Array
    read: jax.Array | None
    rows_k: tuple[jax.Array, ...] | None = None
    rows_v: tuple[jax.Array, ...] | None = None

    @property
    def context(self) -> int:
        return self.read.shape[1] if self.rows_k is None else self.rows_k[0].shape[1]

    def layer(self, i: int) -> PagedCache:
        if self.rows_k is None:
            return PagedCache(self.k[i], self.v[i], self.write, self.read)
        return PagedCache(self.k[i], self.v[i], self.write, None, self.rows_k[i], self.rows_v[i])


def gather_context(pool: jax.Array, read: jax.Array) -> jax.Array:
    """The context [B, S, K, H] of every row, gathered from ``pool`` [D, N, bs, K, H]."""
    shards, blocks, block, kv, hd = pool.shape
    flat = pool.reshape(shards, blocks * block, kv, hd)
    seen = jax.vmap(lambda p, i: p[i])(flat, read.reshape(shards, -1))
    return seen.reshape(read.shape[0], read.shape[1], kv, hd)


def _paged_write(pool, new, write):
    """``pool`` [D, N, bs, K, H] with ``new`` [B, T, K, H] written at the flat slots ``write``."""
    shards, blocks, block, kv, hd = pool.shape
    b, t = write.shape
    rows = b // shards
    flat = pool.reshape(shards, blocks * block, kv, hd)
    flat = jax.vmap(lambda p, i, x: p.at[i].set(x))(
        flat, write.reshape(shards, rows * t), new.reshape(shards, rows * t, kv, hd)
    )
    return flat.reshape(pool.shape)


def _paged_attend_to(cache: PagedCache, which: str, new, positions):
    """The updated pool and the keys (or values) [B, S, K, H] a paged step attends to."""
    pool = _paged_write(getattr(cache, which), new, cache.write)
    rows = getattr(cache, f"rows_{which}")
    if rows is None:
        return pool, gather_context(pool, cache.read), None
    index = jnp.arange(new.shape[0])[:, None]
    rows = rows.at[index, positions].set(new)
    return pool, rows, rows


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        d, n, k, h = config.d_model, config.n_heads, config.n_kv_heads, config.resolved_head_dim
        std_in, std_out = d**-0.5, (n * h) ** -0.5 / math.sqrt(2 * config.n_layers)
        self.wq = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), std=std_in)
        self.wk = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), std=std_in)
        self.wv = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), std=std_in)
        self.wo = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"), std=std_out)
        if config.qkv_bias:
            self.bq = _param(rngs, (n, h), ("heads", "head_dim"), value=jnp.zeros((n, h)))
            self.bk = _param(rngs, (k, h), ("kv_heads", "head_dim"), value=jnp.zeros((k, h)))
            self.bv = _param(rngs, (k, h), ("kv_heads", "head_dim"), value=jnp.zeros((k, h)))

    def __call__(self, x, positions, mask, layer_cache, kernel: str = "dense"):
        """x [B, T, D]; ``mask`` a ``MaskInfo`` or the materialised allowed [B, T, S];
        layer_cache None, (k, v, index) with [B, S, K, H], a ring's ``_RingLayer`` or a
        ``PagedCache``; ``kernel`` one of "dense",
        "blockwise", "dot_product", "splash", "moba" (see ``rlpt.models.attention``)."""
        cfg = self.config
        dtype = cfg.compute_dtype
        q = _project(self, "wq", "btd,dnh->btnh", x, dtype)
        k = _project(self, "wk", "btd,dkh->btkh", x, dtype)
        v = _project(self, "wv", "btd,dkh->btkh", x, dtype)
        if cfg.qkv_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        # Static numpy constants, computed at trace time (a module attribute would become state).
        inv_freq = rotary_inverse_frequencies(cfg)
        q = apply_rotary(q, positions, inv_freq)
        k = apply_rotary(k, positions, inv_freq).astype(dtype)
        v = v.astype(dtype)
        q = constrain(q, ("batch", "length", "act_heads", None))
        if isinstance(layer_cache, PagedCache):
            pool_k, k, rows_k = _paged_attend_to(layer_cache, "k", k, positions)
            pool_v, v, rows_v = _paged_attend_to(layer_cache, "v", v, positions)
            new_layer_cache = (pool_k, pool_v, rows_k, rows_v)
        elif isinstance(layer_cache, _RingLayer):
            # The new queries attend to the ring as it was plus the new keys, and only then
            # are the keys written: a chunk longer than the window overwrites keys its own
            # earlier queries still see.
            rows = jnp.arange(k.shape[0])[:, None]
            new_layer_cache = (
                layer_cache.k.at[rows, layer_cache.write].set(k, mode="drop"),
                layer_cache.v.at[rows, layer_cache.write].set(v, mode="drop"),
            )
            k = jnp.concatenate([layer_cache.k, k], axis=1)
            v = jnp.concatenate([layer_cache.v, v], axis=1)
        elif layer_cache is not None:
            cache_k, cache_v, index = layer_cache
            k = jax.lax.dynamic_update_slice(cache_k, k, (0, index, 0, 0))
            v = jax.lax.dynamic_update_slice(cache_v, v, (0, index, 0, 0))
            new_layer_cache = (k, v)
        else:
            new_layer_cache = None
        if isinstance(mask, ContextMask):
            out = mask.attend(q, k, v)
            return _project(self, "wo", "btnh,nhd->btd", out, dtype), new_layer_cache
        b, t, n, h = q.shape
        groups = n // cfg.n_kv_heads
        q = (q.reshape(b, t, cfg.n_kv_heads, groups, h) * (h**-0.5)).astype(dtype)
        if (
            kernel == "moba"
            and layer_cache is None
            and (attn_lib.resolve_kind(cfg.attention) == "blockwise")
        ):
            # Training rows: the selection and the attention over it, both memory linear.
            info = attn_lib.moba_blocks(
                q, k, mask, block=cfg.sparse_block, top_k=cfg.sparse_top_k,
                max_len=cfg.max_seq_len,
            )  # fmt: skip
            block = cfg.attention_block
            out = blockwise_lib.blockwise_attention(q, k, v, info, block_q=block, block_k=block)
        elif kernel == "moba":
            allowed = attn_lib.moba_select(
                q, k, mask, block=cfg.sparse_block, top_k=cfg.sparse_top_k,
                max_len=cfg.max_seq_len,
            )  # fmt: skip
            out = attn_lib.dense_attention(q, k, v, allowed)
        elif kernel == "blockwise":
            block = cfg.attention_block
            out = blockwise_lib.blockwise_attention(q, k, v, mask, block_q=block, block_k=block)
        elif kernel == "splash":
            out = attn_lib.splash(q, k, v, mask, block=cfg.attention_block)
        else:
            allowed = attn_lib.visible(mask) if isinstance(mask, MaskInfo) else mask
            if kernel == "dot_product":
                out = attn_lib.dot_product(q, k, v, allowed)
            else:
                out = attn_lib.dense_attention(q, k, v, allowed)
        # Named so the "attention_out" remat policy can keep it and recompute the rest.
        out = checkpoint_name(out.reshape(b, t, n, h), "attention_out")
        return _project(self, "wo", "btnh,nhd->btd", out, dtype), new_layer_cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        d, f = config.d_model, config.ffn_dim
        self.w_gate = _param(rngs, (d, f), ("embed", "mlp"), std=d**-0.5)
        self.w_up = _param(rngs, (d, f), ("embed", "mlp"), std=d**-0.5)
        self.w_down = _param(
            rngs, (f, d), ("mlp", "embed"), std=f**-0.5 / math.sqrt(2 * config.n_layers)
        )

    def __call__(self, x):
        dtype = self.config.compute_dtype
        gate = _project(self, "w_gate", "btd,df->btf", x, dtype)
        up = _project(self, "w_up", "btd,df->btf", x, dtype)
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
        return _project(self, "w_down", "btf,fd->btd", hidden, dtype)


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config.d_model, config.rms_eps, rngs=rngs)
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = RMSNorm(config.d_model, config.rms_eps, rngs=rngs)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x, positions, mask, layer_cache, kernel: str = "dense"):
        attn_out, new_layer_cache = self.attn(
            self.attn_norm(x), positions, mask, layer_cache, kernel
        )
        x = x + attn_out
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, ("batch", "length", "act_embed")), new_layer_cache


def attention_mask(
    mask: jax.Array,
    segment_ids: jax.Array | None = None,
    cache: KVCache | PagedCache | None = None,
    positions: jax.Array | None = None,
    *,
    window: int = 0,
    sinks: int = 0,
) -> tuple[MaskInfo, jax.Array | None, jax.Array | None]:
    """Which keys each query may see, as a ``MaskInfo`` (``attn_lib.visible`` materialises
    it as [B, T, S]); and the KV cache's updated validity and positions [B, S]."""
    t = mask.shape[1]
    if positions is None:
        positions = positions_from_mask(mask)
    if segment_ids is not None and cache is not None:
        raise ValueError("segment_ids are for packed training batches, not cached decoding")
    if isinstance(cache, PagedCache):
        # Context positions are in order, every one up to the query's own written: causal
        # by position is the whole rule. Padding queries see position 0 and are ignored.
        key_positions = jnp.arange(cache.context, dtype=jnp.int32)
        b = mask.shape[0]
        info = MaskInfo(
            q_slots=jnp.where(mask, positions, 0),
            k_slots=key_positions,
            q_positions=positions,
            k_positions=jnp.broadcast_to(key_positions, (b, cache.context)),
            k_valid=jnp.ones((b, cache.context), bool),
            window=window,
            sinks=sinks,
        )
        return info, None, None
    if cache is None:
        info = attn_lib.self_attention_info(
            positions, mask, segment_ids, window=window, sinks=sinks
        )
        return info, None, None
    if cache.window:
        return _ring_mask(cache, mask, positions.astype(jnp.int32), window, sinks)
    key_valid = jax.lax.dynamic_update_slice(cache.valid, mask, (0, cache.index))
    old = cache.positions if cache.positions is not None else jnp.zeros(cache.valid.shape, int)
    key_positions = jax.lax.dynamic_update_slice(
        old.astype(jnp.int32), positions.astype(jnp.int32), (0, cache.index)
    )
    info = MaskInfo(
        q_slots=cache.index + jnp.arange(t),
        k_slots=jnp.arange(cache.length),
        q_positions=positions,
        k_positions=key_positions,
        k_valid=key_valid,
        window=window,
        sinks=sinks,
    )
    return info, key_valid, key_positions


def _ring_mask(cache: KVCache, mask, positions, window: int, sinks: int):
    """The mask of new tokens over a ring's keys followed by their own (the keys
    ``Attention`` reads), causal by position; and the ring's validity and positions after
    the new tokens are written."""
    if (window, sinks) != (cache.window, cache.sinks):
        raise ValueError(
            f"the ring KV cache was made for sliding_window={cache.window}, attention_sinks="
            f"{cache.sinks}; the model has {window}, {sinks}"
        )
    write = cache.ring_slots(positions, mask)
    rows = jnp.arange(mask.shape[0])[:, None]
    k_positions = jnp.concatenate([cache.positions, positions], axis=1)
    info = MaskInfo(
        q_slots=positions,
        k_slots=k_positions,
        q_positions=positions,
        k_positions=k_positions,
        k_valid=jnp.concatenate([cache.valid, mask], axis=1),
        window=window,
        sinks=sinks,
    )
    new_valid = cache.valid.at[rows, write].set(True, mode="drop")
    new_positions = cache.positions.at[rows, write].set(positions, mode="drop")
    return info, new_valid, new_positions


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "attention_out": jax.checkpoint_policies.save_only_these_names("attention_out"),
}


class Transformer(nnx.Module):
    """The shared trunk: embedding, blocks, final norm. Returns float32 hidden states."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        # A tied table is also the output projection: scale its rows so initial logits are O(1).
        std = config.d_model**-0.5 if config.tie_embeddings else 1.0
        self.embedding = _param(
            rngs, (config.vocab_size, config.d_model), ("table_vocab", "table_embed"), std=std
        )
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layers)])
        self.final_norm = RMSNorm(config.d_model, config.rms_eps, rngs=rngs)

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int
        positions: jax.Array | None = None,  # [B, T] int; default: from the mask
        mask: jax.Array | None = None,  # [B, T] bool, True for real tokens
        segment_ids: jax.Array | None = None,  # [B, T] int, for packed rows
        cache: KVCache | PagedCache | None = None,
    ) -> tuple[jax.Array, KVCache | PagedCache | None]:
        if mask is None:
            mask = jnp.ones(tokens.shape, bool)
        mask = mask.astype(bool)
        if positions is None:
            positions = positions_from_mask(mask)
        if isinstance(cache, PagedCache) and segment_ids is not None:
            raise ValueError("segment_ids are for packed training batches, not paged decoding")
        cfg = self.config
        info, new_valid, new_positions = attention_mask(
            mask, segment_ids, cache, positions,
            window=cfg.sliding_window, sinks=cfg.attention_sinks,
        )  # fmt: skip
        if cfg.sparse_attention == "moba":
            kernel, attn_mask = "moba", info
        elif cache is None and context_parallelism(tokens.shape[1]):
            # Rows split over devices: attention builds its mask shard by shard.
            kernel = attn_lib.resolve_kind(cfg.attention)
            attn_mask = ContextMask(
                mask, segment_ids, positions, cfg.sliding_window, cfg.attention_sinks
            )
        elif cache is None:
            kernel = attn_lib.resolve_kind(cfg.attention)
            # The dense and dot_product kernels share one materialised mask across layers.
            attn_mask = attn_lib.visible(info) if kernel in ("dense", "dot_product") else info
        else:
            # Decoding reads T (usually 1) queries against the cache: a materialised mask.
            kernel, attn_mask = "dense", attn_lib.visible(info)
        if isinstance(cache, KVCache) and cache.window:
            ring_write = cache.ring_slots(positions, mask)
        x = jnp.take(self.embedding[...], tokens, axis=0)
        x = constrain(x, ("batch", "length", "act_embed"))
        new_k, new_v, new_rows_k, new_rows_v = [], [], [], []
        if cfg.remat and cache is None:
            x = self._scan_rematerialised(x, positions, attn_mask, kernel)
        for i, block in enumerate(() if cfg.remat and cache is None else self.blocks):
            if isinstance(cache, PagedCache):
                layer_cache = cache.layer(i)
            elif isinstance(cache, KVCache) and cache.window:
                layer_cache = _RingLayer(cache.k[i], cache.v[i], ring_write)
            else:
                layer_cache = None if cache is None else (cache.k[i], cache.v[i], cache.index)
            # Cached decoding has no backward pass: nothing to rematerialise.
            x, updated = block(x, positions, attn_mask, layer_cache, kernel)
            if updated is not None:
                new_k.append(updated[0])
                new_v.append(updated[1])
                if len(updated) == 4:
                    new_rows_k.append(updated[2])
                    new_rows_v.append(updated[3])
        x = self.final_norm(x)
        if isinstance(cache, PagedCache):
            cache = cache.replace(k=tuple(new_k), v=tuple(new_v))
            if cache.rows_k is not None:
                cache = cache.replace(rows_k=tuple(new_rows_k), rows_v=tuple(new_rows_v))
        elif cache is not None:
            cache = cache.replace(
                k=tuple(new_k), v=tuple(new_v), valid=new_valid,
                index=cache.index + tokens.shape[1], positions=new_positions,
            )  # fmt: skip
        return x, cache

    def _scan_rematerialised(self, x, positions, attn_mask, kernel: str) -> jax.Array:
        """The blocks as a scan over layers, each rematerialised under the config's policy.

        The backward pass is then a reverse scan that recomputes one block at a time and
        keeps only the blocks' inputs [L, B, T, D]. An unrolled loop of rematerialised
        blocks leaves the scheduler free to run every recomputation early, and XLA's CPU
        scheduler did: the update's memory stayed that of no remat (2.8 against 3.1 GiB at
        8k tokens, small preset). The per-layer parameters are stacked for the scan (one
        transient copy of the blocks' weights); storage stays one module per block.
        """
        graphdef, _ = nnx.split(self.blocks[0])
        stacked = jax.tree.map(
            lambda *leaves: jnp.stack(leaves), *[nnx.state(block) for block in self.blocks]
        )
        policy = _REMAT_POLICIES[self.config.remat_policy]

        # prevent_cse=False is safe inside a scan body (the scan already keeps the
        # recomputation apart from the forward pass).
        @functools.partial(jax.checkpoint, policy=policy, prevent_cse=False)
        def one_block(h, layer_state):
            out, _ = nnx.merge(graphdef, layer_state)(h, positions, attn_mask, None, kernel)
            return out, None

        x, _ = jax.lax.scan(one_block, x, stacked)
        return x


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Rotary positions [B, T]: the count of real tokens before each token (0 at pads)."""
    mask = mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0) * mask
