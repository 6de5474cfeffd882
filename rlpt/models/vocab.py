"""Statistics over the vocabulary (log-probabilities, entropy, argmax) from hidden states.

Scoring, the PPO update, SFT and the reward models' likelihood term need, per token, the
log-probability of one target id, the entropy of the next-token distribution and its most
likely id: a few numbers out of V logits. Computing them from dense float32 logits
[B, T, V] costs 4 * B * T * V bytes (10 GB for one 16k-token row at a 152k vocabulary), and
autodiff keeps several such arrays for the backward pass. ``token_log_probs`` with
``chunk > 0`` instead projects ``chunk`` tokens at a time inside a ``lax.scan`` whose body
is rematerialised (``jax.checkpoint``): the forward pass keeps only the [B, T] results and
the backward pass recomputes one chunk's logits at a time, so at most O(B * chunk * V)
floats of logits exist at once in either pass (the approach of Liger-Kernel's fused linear
cross-entropy and of SkyRL / TRL's chunked log-probs, in plain XLA).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from rlpt.models.transformer import _matmul
from rlpt.parallel.sharding import constrain


class TokenStats(NamedTuple):
    """Per-token statistics of ``softmax(logits / temperature)``; None where not asked for."""

    log_probs: jax.Array  # [B, T] float32, log p(target)
    entropy: jax.Array | None = None  # [B, T] float32
    argmax: jax.Array | None = None  # [B, T] int32, most likely id


def vocab_logits(hidden: jax.Array, projection: jax.Array, *, tied: bool, dtype) -> jax.Array:
    """[B, T, D] hidden states to float32 logits [B, T, V].

    ``projection`` is the embedding table [V, D] when ``tied``, else the output head [D, V].
    """
    equation = "btd,vd->btv" if tied else "btd,dv->btv"
    return constrain(_matmul(equation, hidden, projection, dtype), ("batch", "length", "act_vocab"))


def _stats(
    logits: jax.Array, targets: jax.Array, temperature: float, with_entropy: bool,
    with_argmax: bool,
) -> TokenStats:  # fmt: skip
    """The statistics of one block of logits [B, C, V] at targets [B, C]."""
    scaled = logits.astype(jnp.float32) / temperature  # [B, C, V]
    log_probs = jax.nn.log_softmax(scaled, axis=-1)
    target = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]  # [B, C]
    entropy = argmax = None
    if with_entropy:
        # An id with logit -inf has p = 0 and adds 0, not 0 * -inf = NaN (as token_entropy).
        finite = jnp.where(jnp.isfinite(log_probs), log_probs, 0.0)
        entropy = -jnp.sum(jnp.exp(log_probs) * finite, axis=-1)  # [B, C]
    if with_argmax:
        argmax = jnp.argmax(scaled, axis=-1).astype(jnp.int32)  # [B, C]
    return TokenStats(target, entropy, argmax)


def token_log_probs(
    hidden: jax.Array,
    projection: jax.Array,
    targets: jax.Array,
    *,
    tied: bool,
    dtype,
    temperature: float = 1.0,
    chunk: int = 0,
    with_entropy: bool = False,
    with_argmax: bool = False,
) -> TokenStats:
    """log p(targets) under ``softmax(hidden @ projection / temperature)``, per token.

        log_probs[b, t] = z[b, t, targets[b, t]] - logsumexp_v z[b, t, v],
        entropy[b, t] = -sum_v p[b, t, v] log p[b, t, v],  z = logits / temperature.

    Args:
      hidden: [B, T, D] float hidden states (cast to ``dtype`` for the projection).
      projection: [V, D] embedding table when ``tied``, else the output head [D, V].
      targets: [B, T] int ids in [0, V).
      tied: which layout ``projection`` has.
      dtype: compute dtype of the projection (accumulation is float32).
      temperature: divides the logits; the argmax does not depend on it.
      chunk: 0 builds the dense [B, T, V] logits; > 0 never holds more than [B, chunk, V]
        logits, in the forward or the backward pass. Results agree to float rounding.
      with_entropy, with_argmax: also return those (else their fields are None).
    """
    chex.assert_rank([hidden, projection, targets], [3, 2, 2])
    chex.assert_equal_shape_prefix([hidden, targets], 2)
    if chunk < 0:
        raise ValueError(f"chunk must be >= 0, got {chunk}")
    stats = functools.partial(
        _stats, temperature=temperature, with_entropy=with_entropy, with_argmax=with_argmax
    )
    if chunk == 0:
        return stats(vocab_logits(hidden, projection, tied=tied, dtype=dtype), targets)

    b, t, d = hidden.shape
    chunk = min(chunk, t)  # a chunk longer than the sequence would only add padding
    n = -(-t // chunk)
    pad = n * chunk - t
    # Padded tokens (zero hidden state, target 0) give finite logits and are sliced off
    # below, so they reach neither the results nor the gradients.
    hidden_chunks = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    hidden_chunks = hidden_chunks.reshape(b, n, chunk, d).swapaxes(0, 1)  # [n, B, C, D]
    target_chunks = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)

    # Rematerialised: the backward pass keeps only this body's inputs per chunk and
    # recomputes its [B, C, V] logits, instead of storing every chunk's logits and softmax.
    # prevent_cse=False is safe (and recommended) inside a scan body.
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one_chunk(proj, h, y):  # [B, C, D], [B, C] -> TokenStats of [B, C]
        return stats(vocab_logits(h, proj, tied=tied, dtype=dtype), y)

    def step(carry, xs):
        return carry, one_chunk(projection, *xs)

    _, out = jax.lax.scan(step, None, (hidden_chunks, target_chunks))  # leaves [n, B, C]

    def unchunk(x):
        return None if x is None else x.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]  # [B, T]

    return TokenStats(*(unchunk(x) for x in out))


__all__ = ["TokenStats", "token_log_probs", "vocab_logits"]
