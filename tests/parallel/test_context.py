"""Context parallelism: attention over rows split along the `sequence` mesh axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlpt.models import CausalLM, create_model, get_preset
from rlpt.parallel import activation_sharding, logical_to_spec, make_mesh
from rlpt.parallel.context import STRATEGIES, context_parallel_attention

B, T, N, K, H = 4, 16, 4, 2, 8  # 4 tokens per device on sequence=4; 2 query heads per key head


@pytest.fixture(scope="module")
def mesh(devices):
    return make_mesh(data=2, sequence=4, devices=devices)


def _rows():
    """Positions, key validity and segment ids of four rows that exercise the mask:
    left padding, two packed segments with right padding, a full row, and a row whose
    first nine slots are padding. Padding is segment 0, so a padding query sees no key."""
    pos = np.zeros((B, T), np.int32)
    valid = np.zeros((B, T), bool)
    seg = np.zeros((B, T), np.int32)
    valid[0, 3:] = True
    pos[0, 3:] = np.arange(T - 3)
    seg[0, 3:] = 1
    valid[1, :13] = True
    pos[1, :7], pos[1, 7:13] = np.arange(7), np.arange(6)
    seg[1, :7], seg[1, 7:13] = 1, 2
    valid[2] = True
    pos[2] = np.arange(T)
    seg[2] = 1
    valid[3, 9:] = True
    pos[3, 9:] = np.arange(T - 9)
    seg[3, 9:] = 1
    return pos, valid, seg


def _qkv(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(
        rng.normal(size=shape).astype(np.float32)
        for shape in ((B, T, N, H), (B, T, K, H), (B, T, K, H))
    )


def _numpy_attention(q, k, v, pos, valid, seg, window=0, sinks=0):
    """Loop over rows, queries and heads; also which queries may see at least one key."""
    out = np.zeros(q.shape, np.float64)
    seen = np.zeros(pos.shape, bool)
    for b in range(B):
        for t in range(T):
            keys = [
                s
                for s in range(T)
                if valid[b, s]
                and pos[b, s] <= pos[b, t]
                and seg[b, s] == seg[b, t]
                and (not window or pos[b, t] - pos[b, s] < window or pos[b, s] < sinks)
            ]
            if not keys:
                continue
            seen[b, t] = True
            for n in range(N):
                kh = n // (N // K)
                scores = np.array([q[b, t, n] @ k[b, s, kh] for s in keys]) / np.sqrt(H)
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                out[b, t, n] = sum(w * v[b, s, kh] for w, s in zip(weights, keys))
    return out, seen


def _dense_jax(q, k, v, pos, valid, seg):
    """Single-device dense attention (the same mask), for gradients."""
    allowed = (
        valid[:, None, :]
        & (pos[:, None, :] <= pos[:, :, None])
        & (seg[:, :, None] == seg[:, None, :])
    )
    qg = q.reshape(B, T, K, N // K, H) * H**-0.5
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k)
    scores = jnp.where(allowed[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(B, T, N, H)


def _sharded(mesh, strategy, window=0, sinks=0):
    def f(q, k, v, pos, valid, seg):
        return context_parallel_attention(
            q, k, v, pos, pos, valid, seg, mesh=mesh, strategy=strategy,
            sliding_window=window, attention_sinks=sinks,
        )  # fmt: skip

    return jax.jit(f)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("window,sinks", [(0, 0), (5, 2)])
def test_matches_a_numpy_loop_with_padding_packing_and_grouped_heads(mesh, strategy, window, sinks):
    q, k, v = _qkv()
    pos, valid, seg = _rows()
    want, seen = _numpy_attention(q, k, v, pos, valid, seg, window, sinks)
    got = _sharded(mesh, strategy, window, sinks)(q, k, v, pos, valid, seg)
    np.testing.assert_array_equal(seen, valid)
    # Queries that may see no key have no defined output; the rest match.
    np.testing.assert_allclose(np.asarray(got)[seen], want[seen], rtol=1e-5, atol=1e-5)
    # The result stays split like the queries: rows over `data`, tokens over `sequence`.
    assert tuple(got.sharding.spec)[:2] == ("data", "sequence")
    shard_shapes = {s.data.shape for s in got.addressable_shards}
    assert shard_shapes == {(B // 2, T // 4, N, H)}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradients_match_single_device_dense_attention(mesh, strategy):
    q, k, v = _qkv(1)
    pos, valid, seg = _rows()
    _, seen = _numpy_attention(q, k, v, pos, valid, seg)
    weights = np.random.default_rng(2).normal(size=(B, T, N, H)).astype(np.float32)
    weights *= seen[:, :, None, None]
    attend = _sharded(mesh, strategy)

    def loss_sharded(q, k, v):
        return jnp.sum(attend(q, k, v, pos, valid, seg) * weights)

    def loss_dense(q, k, v):
        return jnp.sum(_dense_jax(q, k, v, pos, valid, seg) * weights)

    got = jax.jit(jax.grad(loss_sharded, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss_dense, argnums=(0, 1, 2)))(q, k, v)
    for name, g, w in zip("qkv", got, want):
        assert np.abs(np.asarray(w)).max() > 1e-2, name  # a gradient that is really there
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=name)


def test_bad_inputs_are_refused(mesh):
    q, k, v = _qkv()
    pos, valid, seg = _rows()
    with pytest.raises(ValueError, match="strategy must be one of"):
        context_parallel_attention(q, k, v, pos, pos, valid, mesh=mesh, strategy="tree")
    with pytest.raises(ValueError, match="length 15 does not divide by the 4 devices"):
        cut = (x[:, :15] for x in (q, k, v, pos, pos, valid))
        context_parallel_attention(*cut, mesh=mesh)
    with pytest.raises(ValueError, match="N a multiple of K"):
        context_parallel_attention(q[:, :, :3], k, v, pos, pos, valid, mesh=mesh)


def test_length_is_split_over_the_sequence_axis(mesh):
    names = ("batch", "length", "act_embed")
    assert logical_to_spec(names, (4, 16, 8), mesh) == P(("data", "fsdp"), "sequence", None)
    # A length that does not divide stays whole (the attention then runs dense).
    assert logical_to_spec(names, (4, 10, 8), mesh) == P(("data", "fsdp"), None, None)


@pytest.mark.parametrize(
    "strategy, overrides",
    [(s, {}) for s in STRATEGIES]
    # The scanned, rematerialised blocks and a sliding window with sinks, split the same way.
    + [("ring", {"remat": True, "sliding_window": 5, "attention_sinks": 2})],
)
def test_a_tiny_transformer_on_a_sequence_mesh_matches_one_device(mesh, strategy, overrides):
    cfg = get_preset("tiny", **overrides)
    graphdef, state = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(0))
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, cfg.vocab_size, size=(B, T)).astype(np.int32)
    _, valid, seg = _rows()
    targets = rng.normal(size=(B, T, cfg.vocab_size)).astype(np.float32) * valid[:, :, None]

    def loss(state, tokens, valid, seg, sharded):
        def run():
            logits, _ = nnx.merge(graphdef, state)(tokens, mask=valid, segment_ids=seg)
            return jnp.sum(logits * targets), logits

        if not sharded:
            return run()
        with activation_sharding(mesh, context_strategy=strategy):
            return run()

    grad = jax.value_and_grad(loss, has_aux=True)
    plain = jax.jit(lambda *a: grad(*a, sharded=False))
    split_rows = NamedSharding(mesh, P("data", "sequence"))
    sharded = jax.jit(
        lambda *a: grad(*a, sharded=True),
        in_shardings=(NamedSharding(mesh, P()), split_rows, split_rows, split_rows),
    )
    (want_loss, want_logits), want_grads = plain(state, tokens, valid, seg)
    (got_loss, got_logits), got_grads = sharded(state, tokens, valid, seg)
    hlo = sharded.lower(state, tokens, valid, seg).as_text()
    assert ("collective_permute" in hlo) == strategy.startswith("ring")
    assert tuple(got_logits.sharding.spec)[:2] == ("data", "sequence")
    np.testing.assert_allclose(
        np.asarray(got_logits)[valid], np.asarray(want_logits)[valid], rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        # float32 sums in another order (the sharded matmuls, the ring's blocks): an entry's
        # rounding error scales with the terms summed into it, which the leaf's largest
        # entry bounds, not with the entry itself (a small entry can be a large cancellation).
        scale = max(1.0, float(np.abs(np.asarray(w)).max()))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_zigzag_layout_halves_the_busiest_devices_causal_work(size):
    """The ring moves in lockstep, so its time is the busiest device's. Under the plain
    causal mask, count the chunk pairs (a query chunk against a key chunk, a quarter of a
    block) with any allowed score that each device meets over the ring: contiguous shards
    give the last device every pair but its diagonal block's upper corner (4P - 1), the
    zigzag layout 2P + 1 on every device."""
    from rlpt.parallel.context import _allowed, zigzag_order

    length = 2 * size * 3  # chunks of 3 tokens
    chunk = length // (2 * size)

    def work(order):
        pos = np.asarray(order).reshape(size, 2, chunk)  # device, its two chunks, tokens
        counts = []
        for d in range(size):
            n = 0
            for step in range(size):
                src = (d - step) % size
                for qc in pos[d]:
                    for kc in pos[src]:
                        allowed = _allowed(qc[None], kc[None], np.ones((1, chunk), bool),
                                           None, None, 0, 0)  # fmt: skip
                        n += bool(np.any(allowed))
            counts.append(n)
        return counts

    contiguous = work(np.arange(length))
    zigzag = work(zigzag_order(size, length))
    assert contiguous == [4 * d + 3 for d in range(size)]
    assert sorted(zigzag_order(size, length)) == list(range(length))
    # Every device: three of its own four pairs, then two of four at each later step.
    assert zigzag == [2 * size + 1] * size
