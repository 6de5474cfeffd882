"""Sampling methods: pick the next token from logits, with an explicit key."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. Frozen and hashable, so it can be a static jit argument.

    ``greedy`` takes the arg-max. Otherwise logits are divided by
    ``temperature``, then restricted to the ``top_k`` largest and to the
    smallest set whose probability reaches ``top_p``, renormalised, and sampled.
    """

    greedy: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (or use greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k <= 0:
            raise ValueError(f"top_k must be a positive integer, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


GREEDY = SamplingParams(greedy=True)


def sampling_log_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Log-probabilities [B, V] of the distribution tokens are drawn from.

    With greedy decoding this is the model's own temperature-1 distribution
    (the arg-max is taken from it).
    """
    logits = logits.astype(jnp.float32)
    if params.greedy:
        return jax.nn.log_softmax(logits, axis=-1)
    logits = logits / params.temperature
    neg_inf = jnp.finfo(jnp.float32).min
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, neg_inf, logits)
    if params.top_p is not None and params.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep a token when the mass strictly before it is below top_p (the top token always).
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < params.top_p
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(keep_sorted)
        )
        logits = jnp.where(keep, logits, neg_inf)
    return jax.nn.log_softmax(logits, axis=-1)


def sample_tokens(
    logits: jax.Array, key: jax.Array, params: SamplingParams
) -> tuple[jax.Array, jax.Array]:
    """Next tokens [B] and their log-probabilities under the sampling distribution [B]."""
    log_probs = sampling_log_probs(logits, params)
    if params.greedy:
        tokens = jnp.argmax(log_probs, axis=-1)
    else:
        tokens = jax.random.categorical(key, log_probs, axis=-1)
    chosen = jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
    return tokens.astype(jnp.int32), chosen
