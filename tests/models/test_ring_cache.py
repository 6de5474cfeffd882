"""The ring KV cache of sliding-window models against the full forward pass and the full cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlpt.models import CausalLM, KVCache, create_model, get_preset, positions_from_mask
from rlpt.sampling import Sampler

S, W = 2, 8
CFG = get_preset("tiny", sliding_window=W, attention_sinks=S)
PROMPT, NEW = 16, 40


@pytest.fixture(scope="module")
def model():
    return create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(3))


@functools.cache
def _forward(graphdef):
    @jax.jit
    def full(state, tokens, mask):
        return nnx.merge(graphdef, state)(tokens, mask=mask)[0]

    @jax.jit
    def cached(state, cache, tokens, positions, mask):
        return nnx.merge(graphdef, state)(tokens, positions, mask, cache=cache)

    return full, cached


def _rows(lengths, total, seed=0):
    """Left-padded prompts of ``lengths`` in ``total`` columns: tokens and mask [B, total]."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, size=(len(lengths), total)).astype(np.int32)
    mask = np.zeros(tokens.shape, bool)
    for row, n in enumerate(lengths):
        mask[row, total - n :] = True
    return tokens, mask


def _decode(model, cache, tokens, mask, chunks):
    """Feed ``tokens`` [B, T] in column ``chunks`` (lengths); logits [B, T, V] and the cache."""
    graphdef, state = model
    _, cached = _forward(graphdef)
    positions = np.asarray(positions_from_mask(jnp.asarray(mask)))
    out, start = [], 0
    for size in chunks:
        cols = slice(start, start + size)
        logits, cache = cached(state, cache, tokens[:, cols], positions[:, cols], mask[:, cols])
        out.append(np.asarray(logits))
        start += size
    assert start == tokens.shape[1]
    return np.concatenate(out, axis=1), cache


def _teacher_forced(prompt_lengths, seed=0):
    """Prompts left-padded to PROMPT then NEW decoded tokens in every row: tokens, mask."""
    tokens, mask = _rows(prompt_lengths, PROMPT + NEW, seed)
    mask[:, PROMPT:] = True
    return tokens, mask


def test_ring_decoding_matches_full_forward_and_full_cache(model):
    # Prompts shorter than the sinks, inside the ring, and longer than the ring (16 > 10).
    tokens, mask = _teacher_forced([1, 7, PROMPT])
    full, _ = _forward(model[0])
    reference = np.asarray(full(model[1], tokens, mask))
    chunks = [PROMPT] + [1] * NEW
    ring, cache = _decode(model, KVCache.create_ring(CFG, 3), tokens, mask, chunks)
    whole, _ = _decode(model, KVCache.create(CFG, 3, PROMPT + NEW), tokens, mask, chunks)
    # float32 sums over other key sets and orders: differences of a few ulps of O(1) logits.
    np.testing.assert_allclose(ring[mask], reference[mask], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(ring[mask], whole[mask], atol=2e-5, rtol=1e-5)
    # Every step of the decode is compared, the 40 after the prompt included.
    assert mask[:, PROMPT:].all()
    # The ring holds the sinks and the last W positions of every row.
    last = mask.sum(1) - 1
    for row in range(3):
        want = set(range(S)) | set(range(last[row] - W + 1, last[row] + 1))
        assert set(np.asarray(cache.positions[row])[np.asarray(cache.valid[row])]) == want
    # The window bites: the same weights with full attention give other logits.
    plain = create_model(lambda r: CausalLM(get_preset("tiny"), rngs=r), jax.random.key(3))
    plain_logits = np.asarray(_forward(plain[0])[0](plain[1], tokens, mask))
    assert not np.allclose(plain_logits[mask], reference[mask], atol=1e-3)


def test_chunked_prefill_longer_than_the_ring(model):
    # Chunks of 12 > S + W: a chunk overwrites ring slots its own queries read.
    tokens, mask = _rows([30, 11, 2], 36, seed=1)
    full, _ = _forward(model[0])
    reference = np.asarray(full(model[1], tokens, mask))
    ring, _ = _decode(model, KVCache.create_ring(CFG, 3), tokens, mask, [12, 12, 12])
    np.testing.assert_allclose(ring[mask], reference[mask], atol=2e-5, rtol=1e-5)


def test_ring_memory_does_not_grow_with_length(model):
    graphdef, state = model
    shape = (2, S + W, CFG.n_kv_heads, CFG.resolved_head_dim)
    for length in (32, 256):
        cache = KVCache.for_generation(CFG, 2, length)
        assert cache.window == W and cache.sinks == S
        assert all(k.shape == shape for k in cache.k + cache.v)
        assert cache.valid.shape == cache.positions.shape == (2, S + W)
    tokens, mask = _teacher_forced([5, 9])
    _, cache = _decode(model, KVCache.create_ring(CFG, 2), tokens, mask, [PROMPT] + [1] * NEW)
    assert all(k.shape == shape for k in cache.k + cache.v)
    # No window, or one no shorter than the sequence: slots in order, as before.
    assert KVCache.for_generation(get_preset("tiny"), 2, 64).k[0].shape[1] == 64
    assert KVCache.for_generation(CFG, 2, S + W).window == 0
    with pytest.raises(ValueError, match="max_seq_len"):
        KVCache.for_generation(CFG, 2, CFG.max_seq_len + 1)


def test_ring_refuses_models_it_cannot_serve():
    with pytest.raises(ValueError, match="sliding_window > 0"):
        KVCache.create_ring(get_preset("tiny"), 1)
    moba = CFG.replace(sparse_attention="moba", sparse_block=4, sparse_top_k=1)
    with pytest.raises(ValueError, match="sparse_attention"):
        KVCache.create_ring(moba, 1)
    assert KVCache.for_generation(moba, 1, 64).window == 0
    graphdef, state = create_model(
        lambda r: CausalLM(CFG.replace(sliding_window=4), rngs=r), jax.random.key(0)
    )
    tokens = jnp.ones((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="sliding_window=8"):
        nnx.merge(graphdef, state)(tokens, cache=KVCache.create_ring(CFG, 1))


def _greedy_by_full_forward(model, prompts, new, eos):
    """Greedy continuation from the full forward pass over the sequence so far (no cache)."""
    full, _ = _forward(model[0])
    tokens = np.zeros((len(prompts), PROMPT + new), np.int32)
    mask = np.zeros(tokens.shape, bool)
    for row, p in enumerate(prompts):
        tokens[row, PROMPT - len(p) : PROMPT] = p
        mask[row, PROMPT - len(p) : PROMPT] = True
    out = np.zeros((len(prompts), new), np.int32)
    done = np.zeros(len(prompts), bool)
    for i in range(new):
        # Later columns are masked out: the causal rule keeps them from the logits read.
        logits = np.asarray(full(model[1], tokens, mask))[:, PROMPT + i - 1]
        nxt = logits.argmax(-1)
        out[:, i] = np.where(done, 0, nxt)
        tokens[:, PROMPT + i] = nxt
        mask[:, PROMPT + i] = True
        done |= nxt == eos
    return out


def test_sampler_greedy_with_ring_equals_full_cache_and_forward(model, monkeypatch):
    graphdef, state = model
    prompts = [[5, 6, 7], list(range(20, 32))]
    eos = CFG.vocab_size - 1
    rings = []
    create_ring = KVCache.create_ring.__func__
    monkeypatch.setattr(
        KVCache, "create_ring",
        classmethod(lambda cls, *a: rings.append(a) or create_ring(cls, *a)),
    )  # fmt: skip
    out = Sampler(graphdef, CFG, eos_id=eos, pad_id=0).generate(
        state, prompts, jax.random.key(0), max_new_tokens=30
    )
    assert rings, "the sampler did not decode in a ring"
    monkeypatch.setattr(
        KVCache, "for_generation", classmethod(lambda cls, c, b, n: cls.create(c, b, n))
    )
    whole = Sampler(graphdef, CFG, eos_id=eos, pad_id=0).generate(
        state, prompts, jax.random.key(0), max_new_tokens=30
    )
    np.testing.assert_array_equal(out.tokens, whole.tokens)
    np.testing.assert_allclose(out.logprobs, whole.logprobs, atol=1e-5)
    expected = _greedy_by_full_forward(model, prompts, 30, eos)
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)


def test_ring_slots_write_each_slot_once_per_call():
    # A scatter's order among duplicate indices is unspecified (CPU happens to apply them
    # in order), so a call must not write one slot twice: each row keeps its sinks and last
    # W real positions, at distinct slots, and drops padding.
    cache = KVCache.create_ring(CFG, 3)
    tokens, mask = _rows([30, 11, 0], 36)
    positions = positions_from_mask(jnp.asarray(mask))
    slots = np.asarray(cache.ring_slots(positions, jnp.asarray(mask)))
    positions = np.asarray(positions)
    for row, n in enumerate([30, 11, 0]):
        kept = slots[row] < S + W
        want = set(range(min(S, n))) | set(range(max(n - W, 0), n))
        assert set(positions[row, kept]) == want and not (kept & ~mask[row]).any()
        assert len(set(slots[row, kept])) == kept.sum()
        for p, slot in zip(positions[row, kept], slots[row, kept]):
            assert slot == (p if p < S else S + (p - S) % W)
