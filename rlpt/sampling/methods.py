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


def sample_rows(
    logits: jax.Array,  # [B, V]
    keys: jax.Array,  # [B, 2] uint32
    params: jax.Array,  # [B, 4] float32: greedy, temperature, top_k (0: off), top_p
    filtered: bool,
) -> tuple[jax.Array, jax.Array]:
    """Per-row sampling settings: tokens [B] and their sampling log-probs [B].

    The same rule as ``rlpt.sampling.methods.sampling_log_probs`` row by row: greedy takes
    the arg-max of the temperature-1 distribution; otherwise logits / temperature, then top-k,
    then top-p on what top-k kept, renormalised. ``filtered`` (static) skips the sort when no
    row uses top-k or top-p.
    """
    greedy = params[:, 0] > 0
    temperature = jnp.where(greedy, 1.0, params[:, 1])
    logits = logits.astype(jnp.float32) / temperature[:, None]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    if filtered:
        neg_inf = jnp.finfo(jnp.float32).min
        top_k = params[:, 2].astype(jnp.int32)
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        rank = jnp.arange(logits.shape[-1])[None, :]
        keep_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
        sorted_logits = jnp.where(keep_k, sorted_logits, neg_inf)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = keep_k & ((params[:, 3:4] >= 1.0) | (mass_before < params[:, 3:4]))
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(keep_sorted)
        )
        filtered_lp = jax.nn.log_softmax(jnp.where(keep, logits, neg_inf), axis=-1)
        log_probs = jnp.where(greedy[:, None], log_probs, filtered_lp)
    drawn = jax.vmap(jax.random.categorical)(keys, log_probs)
    tokens = jnp.where(greedy, jnp.argmax(log_probs, axis=-1), drawn).astype(jnp.int32)
    chosen = jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen
