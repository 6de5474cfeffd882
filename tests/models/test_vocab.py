"""Chunked vocabulary statistics: against a numpy reference, dense autodiff and memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlpt.models import (
    CausalLM,
    ProcessRewardModel,
    RewardModel,
    create_model,
    get_preset,
    token_log_probs,
)

B, T, D, V = 2, 7, 16, 37


def _reference(hidden, projection, targets, *, tied, temperature):
    """log p(target), entropy and argmax in float64 numpy, written out from the definitions."""
    w = projection.T if tied else projection  # [D, V]
    logits = hidden.astype(np.float64) @ w.astype(np.float64)  # [B, T, V]
    z = logits / temperature
    top = z.max(axis=-1, keepdims=True)
    log_norm = top + np.log(np.exp(z - top).sum(axis=-1, keepdims=True))
    log_p = z - log_norm  # -inf where the logit is -inf
    p = np.exp(log_p)
    terms = np.where(p > 0, p * np.where(np.isfinite(log_p), log_p, 0.0), 0.0)
    target = np.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
    return target, -terms.sum(axis=-1), logits.argmax(axis=-1)


def _inputs(tied, seed=0, length=T):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(B, length, D)).astype(np.float32)
    shape = (V, D) if tied else (D, V)
    projection = (rng.normal(size=shape) * 0.7).astype(np.float32)
    targets = rng.integers(0, V, size=(B, length))
    return hidden, projection, targets


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", [0, 1, 3, 5, 7, 16])  # 3 and 5 leave a ragged last chunk
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_a_numpy_reference(tied, chunk, temperature):
    hidden, projection, targets = _inputs(tied)
    fn = jax.jit(
        lambda h, w, y: token_log_probs(
            h, w, y, tied=tied, dtype=jnp.float32, temperature=temperature, chunk=chunk,
            with_entropy=True, with_argmax=True,
        )
    )  # fmt: skip
    got = fn(hidden, projection, targets)
    want_logp, want_entropy, want_argmax = _reference(
        hidden, projection, targets, tied=tied, temperature=temperature
    )
    assert got.log_probs.shape == got.entropy.shape == got.argmax.shape == (B, T)
    assert got.log_probs.dtype == got.entropy.dtype == jnp.float32
    # float32 logits of O(5) through a logsumexp over 37 ids: a few ulps of 5.
    np.testing.assert_allclose(got.log_probs, want_logp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got.entropy, want_entropy, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got.argmax, want_argmax)


def test_optional_fields_are_none_unless_asked_for():
    hidden, projection, targets = _inputs(False)
    for chunk in (0, 3):
        got = token_log_probs(hidden, projection, targets, tied=False, dtype=jnp.float32,
                              chunk=chunk)  # fmt: skip
        assert got.entropy is None and got.argmax is None


@pytest.mark.parametrize("chunk", [0, 3])
def test_minus_infinity_logits_add_nothing_to_the_entropy(chunk):
    """Ids with logit -inf have p = 0: entropy and log-probs stay finite and exact."""
    hidden, projection, targets = _inputs(False, seed=1)
    hidden = np.abs(hidden) + 0.1  # positive, so a -inf weight gives a -inf logit
    projection[:, 4] = -np.inf  # every feature: logit -inf
    projection[0, 9] = -np.inf  # one feature is enough
    targets = np.where(np.isin(targets, (4, 9)), 0, targets)
    got = token_log_probs(hidden, projection, targets, tied=False, dtype=jnp.float32,
                          chunk=chunk, with_entropy=True, temperature=0.8)  # fmt: skip
    want_logp, want_entropy, _ = _reference(
        hidden, projection, targets, tied=False, temperature=0.8
    )
    assert np.isfinite(got.entropy).all() and np.isfinite(got.log_probs).all()
    np.testing.assert_allclose(got.log_probs, want_logp, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got.entropy, want_entropy, atol=2e-5, rtol=1e-5)
    # The target of a -inf id has log-probability -inf, not NaN.
    targets[0, 0] = 4
    got = token_log_probs(hidden, projection, targets, tied=False, dtype=jnp.float32,
                          chunk=chunk)  # fmt: skip
    assert float(got.log_probs[0, 0]) == -np.inf


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", [3, 4])
def test_gradients_equal_the_dense_path(tied, chunk):
    hidden, projection, targets = _inputs(tied, seed=2)
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(2, B, T)).astype(np.float32)

    def loss(h, w, c):
        s = token_log_probs(h, w, targets, tied=tied, dtype=jnp.float32, temperature=0.9,
                            chunk=c, with_entropy=True)  # fmt: skip
        return jnp.sum(a * s.log_probs) + jnp.sum(b * s.entropy)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    dense = grad(hidden, projection, 0)
    chunked = grad(hidden, projection, chunk)
    assert float(jnp.abs(dense[1]).max()) > 1e-2  # the check has something to compare
    for got, want in zip(chunked, dense):
        assert float(jnp.abs(got - want).max()) <= 1e-5


def test_rejects_a_negative_chunk():
    hidden, projection, targets = _inputs(False)
    with pytest.raises(ValueError, match="chunk"):
        token_log_probs(hidden, projection, targets, tied=False, dtype=jnp.float32, chunk=-1)


def test_chunked_gradient_never_holds_the_full_logits():
    """Compiled scratch memory of the gradient: the dense path holds several [T, V]
    float32 arrays; the chunked one must not hold even one."""
    b, t, v, d, chunk = 1, 1024, 4096, 64, 64
    full = t * v * 4  # bytes of one [T, V] float32 array
    hidden = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    projection = jax.ShapeDtypeStruct((d, v), jnp.float32)
    targets = jnp.zeros((b, t), jnp.int32)

    def temp_bytes(c):
        def loss(h, w):
            s = token_log_probs(h, w, targets, tied=False, dtype=jnp.float32, chunk=c,
                                with_entropy=True)  # fmt: skip
            return jnp.sum(s.log_probs) + jnp.sum(s.entropy)

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, projection).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    dense, chunked = temp_bytes(0), temp_bytes(chunk)
    assert dense >= full  # the measure sees the logits
    assert chunked < full / 2


TINY = get_preset("tiny")


def _tokens(seed=4, shape=(3, 11)):
    return jnp.asarray(np.random.default_rng(seed).integers(3, TINY.vocab_size, size=shape))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_causal_lm_head_dense_is_the_logits_path_and_chunked_agrees(tied):
    tokens = _tokens()

    def model(vocab_chunk):  # the same key: the same parameters whatever the chunk
        cfg = TINY.replace(tie_embeddings=tied, vocab_chunk=vocab_chunk)
        graph, params = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(0))
        return nnx.merge(graph, params)

    def stats(m):
        hidden, _ = m.trunk(tokens)
        return m.target_log_probs(
            hidden[:, :-1], tokens[:, 1:], 0.8, with_entropy=True, with_argmax=True
        )

    dense_model = model(0)
    logits, _ = dense_model(tokens)
    log_probs = jax.nn.log_softmax(logits[:, :-1] / 0.8, axis=-1)
    want = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]
    dense, chunked = stats(dense_model), stats(model(4))
    np.testing.assert_array_equal(dense.log_probs, want)  # today's path, bit for bit
    np.testing.assert_array_equal(dense.argmax, jnp.argmax(logits[:, :-1], axis=-1))
    np.testing.assert_allclose(chunked.log_probs, dense.log_probs, atol=1e-5)
    np.testing.assert_allclose(chunked.entropy, dense.entropy, atol=1e-5)
    np.testing.assert_array_equal(chunked.argmax, dense.argmax)


@pytest.mark.parametrize("kind", ["rm", "prm"])
def test_reward_models_likelihood_term_is_the_same_chunked(kind):
    tokens = _tokens(shape=(2, 13))
    mask = jnp.asarray(np.arange(13)[None, :] < np.array([[13], [9]]))

    def score(vocab_chunk):
        cfg = TINY.replace(vocab_chunk=vocab_chunk)
        if kind == "rm":
            make = lambda r: RewardModel(cfg, likelihood=True, rngs=r)
        else:
            make = lambda r: ProcessRewardModel(cfg, 7, likelihood=True, rngs=r)
        graph, params = create_model(make, jax.random.key(1))

        def out(p):
            result = nnx.merge(graph, p)(tokens, mask=mask)
            return result if kind == "rm" else result[0]

        return out(params), jax.grad(lambda p: jnp.sum(out(p)))(params)

    (dense, dense_grads), (chunked, chunked_grads) = score(0), score(5)
    np.testing.assert_allclose(chunked, dense, atol=1e-4, rtol=1e-5)  # sums of ~13 log-probs
    head = dense_grads["lm_head"][...]
    assert float(jnp.abs(head).max()) > 0
    np.testing.assert_allclose(chunked_grads["lm_head"][...], head, atol=1e-5)
