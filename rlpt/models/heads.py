"""Models of the RL roles: the shared trunk with a small head each.

- ``CausalLM``: next-token logits (policy and reference policy).
- ``ValueModel``: one scalar per token (the critic, a separate network).
- ``RewardModel``: one scalar per sequence, read at the last real token.
- ``ProcessRewardModel``: one score per reasoning step, read at step separators.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlpt.models.config import ModelConfig
from rlpt.models.transformer import KVCache, Transformer, _param
from rlpt.models.vocab import TokenStats, token_log_probs, vocab_logits


class CausalLM(nnx.Module):
    """Trunk plus the output projection to the vocabulary (tied or separate)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.trunk = Transformer(config, rngs=rngs)
        if not config.tie_embeddings:
            self.lm_head = _param(
                rngs, (config.d_model, config.vocab_size), ("embed", "vocab"),
                std=config.d_model**-0.5,
            )  # fmt: skip

    def _projection(self) -> jax.Array:
        """The output projection: the embedding table [V, D] if tied, else [D, V]."""
        return self.trunk.embedding[...] if self.config.tie_embeddings else self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[B, T, D] hidden states to float32 logits [B, T, V]."""
        cfg = self.config
        return vocab_logits(
            hidden, self._projection(), tied=cfg.tie_embeddings, dtype=cfg.compute_dtype
        )

    def target_log_probs(
        self,
        hidden: jax.Array,
        targets: jax.Array,
        temperature: float = 1.0,
        with_entropy: bool = False,
        with_argmax: bool = False,
    ) -> TokenStats:
        """log p(targets) [B, T] under ``softmax(logits(hidden) / temperature)``, and
        optionally the entropy and the argmax [B, T] of that distribution.

        ``hidden`` [B, T, D] comes from ``self.trunk``; ``targets`` [B, T] is the id each
        position predicts. ``config.vocab_chunk`` > 0 never materialises [B, T, V] logits
        (``rlpt.models.vocab``); 0 computes them densely.
        """
        cfg = self.config
        return token_log_probs(
            hidden, self._projection(), targets, tied=cfg.tie_embeddings,
            dtype=cfg.compute_dtype, temperature=temperature, chunk=cfg.vocab_chunk,
            with_entropy=with_entropy, with_argmax=with_argmax,
        )  # fmt: skip

    def __call__(self, tokens, positions=None, mask=None, segment_ids=None, cache=None):
        hidden, cache = self.trunk(tokens, positions, mask, segment_ids, cache)
        return self.logits(hidden), cache


class _ScalarHead(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.trunk = Transformer(config, rngs=rngs)
        self.head_w = _param(rngs, (config.d_model,), ("embed",), std=config.d_model**-0.5)
        self.head_b = _param(rngs, (), (), value=jnp.zeros((), jnp.float32))

    def _head(self, hidden: jax.Array) -> jax.Array:
        """[B, T, D] hidden states to one float32 scalar per token [B, T]."""
        return jnp.einsum("btd,d->bt", hidden, self.head_w[...]) + self.head_b[...]

    def token_scores(self, tokens, positions=None, mask=None, segment_ids=None) -> jax.Array:
        """One float32 scalar per token [B, T]."""
        hidden, _ = self.trunk(tokens, positions, mask, segment_ids)
        return self._head(hidden)


class ValueModel(_ScalarHead):
    """Critic: a value estimate at every token [B, T]."""

    def __call__(self, tokens, positions=None, mask=None, segment_ids=None) -> jax.Array:
        return self.token_scores(tokens, positions, mask, segment_ids)


def last_token_index(mask: jax.Array) -> jax.Array:
    """Index of the last real token of each row [B] (0 for an empty row)."""
    t = mask.shape[1]
    idx = jnp.where(mask.astype(bool), jnp.arange(t)[None, :], -1)
    return jnp.maximum(idx.max(axis=1), 0)


class _LikelihoodTerm(nnx.Module):
    """The trunk's own language-model head (kept from the policy the model starts from)
    and a learned multiple of a log-likelihood read through it."""

    def _init_likelihood(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        if not config.tie_embeddings:
            self.lm_head = _param(
                rngs, (config.d_model, config.vocab_size), ("embed", "vocab"),
                std=config.d_model**-0.5,
            )  # fmt: skip
        self.likelihood_scale = _param(rngs, (), (), value=jnp.ones((), jnp.float32))

    def _token_log_probs(self, hidden: jax.Array, tokens: jax.Array) -> jax.Array:
        """log p(token t | tokens before t) [B, T]; column 0 (no context) is 0."""
        cfg = self.config
        projection = self.trunk.embedding[...] if cfg.tie_embeddings else self.lm_head[...]
        target = token_log_probs(
            hidden[:, :-1],
            projection,
            tokens[:, 1:],
            tied=cfg.tie_embeddings,
            dtype=cfg.compute_dtype,
            chunk=cfg.vocab_chunk,
        ).log_probs  # [B, T - 1]
        return jnp.pad(target, ((0, 0), (1, 0)))


class RewardModel(_ScalarHead, _LikelihoodTerm):
    """Sequence reward [B], read at the last real token of each row.

    ``likelihood=True`` adds a learned multiple (``likelihood_scale``, initially 1) of the
    row's log-likelihood under the trunk's own language-model head, kept from the policy
    the reward model starts from. A policy already "knows" much of what is right: the
    answer it would write is in its next-token distribution at the answer, not in the
    hidden state at the last token that the scalar head reads, and a head trained on a
    few thousand pairs memorises them rather than learning to look there. The
    log-likelihood of the prompt is a per-prompt constant that pair comparisons and
    group baselines cancel.
    """

    def __init__(self, config: ModelConfig, *, likelihood: bool = False, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        self.likelihood = likelihood
        if likelihood:
            self._init_likelihood(config, rngs)

    def __call__(self, tokens, positions=None, mask=None, segment_ids=None) -> jax.Array:
        if mask is None:
            mask = jnp.ones(tokens.shape, bool)
        hidden, _ = self.trunk(tokens, positions, mask, segment_ids)  # [B, T, D]
        scores = self._head(hidden)
        out = jnp.take_along_axis(scores, last_token_index(mask)[:, None], axis=1)[:, 0]  # [B]
        if not self.likelihood:
            return out
        real = mask.astype(jnp.float32)
        # A token's likelihood counts when it and the token before it are real.
        real = real * jnp.pad(real[:, :-1], ((0, 0), (1, 0)))
        target = self._token_log_probs(hidden, tokens)  # [B, T]
        return out + self.likelihood_scale[...] * jnp.sum(target * real, axis=1)


class ProcessRewardModel(_ScalarHead, _LikelihoodTerm):
    """Step scores (logits of "this step is on a correct path") at step-separator tokens.

    Returns ``(scores [B, T], step_mask [B, T])``: scores at every token, and
    where the step separator sits (only those scores are meaningful).

    ``likelihood=True`` adds to each position's score a learned multiple of the
    log-likelihood, under the trunk's own language-model head, of the tokens since the
    previous separator (``step_token_id`` or ``answer_token_id``): at a separator, the
    step it ends. A policy's own slips are mostly unlikely tokens it happened to sample
    (a wrong digit), which its next-token distribution sees and a head reading one
    hidden state learns slowly. ``response_mask`` [B, T] limits the tokens that count
    (the prompt's likelihood says nothing about the first step); by default every real
    token counts.
    """

    def __init__(
        self, config: ModelConfig, step_token_id: int, *, likelihood: bool = False,
        answer_token_id: int | None = None, rngs: nnx.Rngs,
    ):  # fmt: skip
        super().__init__(config, rngs=rngs)
        for name, tid in (("step_token_id", step_token_id), ("answer_token_id", answer_token_id)):
            if tid is not None and not 0 <= tid < config.vocab_size:
                raise ValueError(f"{name} {tid} outside the vocabulary [0, {config.vocab_size})")
        self.step_token_id = step_token_id
        self.answer_token_id = answer_token_id
        self.likelihood = likelihood
        if likelihood:
            self._init_likelihood(config, rngs)

    def __call__(self, tokens, positions=None, mask=None, segment_ids=None, response_mask=None):
        if mask is None:
            mask = jnp.ones(tokens.shape, bool)
        mask = mask.astype(bool)
        hidden, _ = self.trunk(tokens, positions, mask, segment_ids)  # [B, T, D]
        scores = self._head(hidden)
        step_mask = (tokens == self.step_token_id) & mask
        if not self.likelihood:
            return scores, step_mask
        # A token counts when it and the token before it are real (and in the response).
        counted = mask & jnp.pad(mask[:, :-1], ((0, 0), (1, 0)))
        if response_mask is not None:
            counted &= response_mask.astype(bool)
        log_probs = self._token_log_probs(hidden, tokens) * counted  # [B, T]
        total = jnp.cumsum(log_probs, axis=1)  # [B, T]
        ends = tokens == self.step_token_id  # [B, T] positions that close a segment
        if self.answer_token_id is not None:
            ends |= tokens == self.answer_token_id
        if segment_ids is not None:  # packed rows: a sequence's last token closes it too
            ends |= jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (0, 1)))
        t = tokens.shape[1]
        last_end = jax.lax.cummax(jnp.where(ends, jnp.arange(t)[None, :], -1), axis=1)
        prev_end = jnp.pad(last_end[:, :-1], ((0, 0), (1, 0)), constant_values=-1)  # [B, T]
        before = jnp.take_along_axis(total, jnp.maximum(prev_end, 0), axis=1)
        segment = total - jnp.where(prev_end >= 0, before, 0.0)  # [B, T]
        return scores + self.likelihood_scale[...] * segment, step_mask


__all__ = [
    "CausalLM",
    "KVCache",
    "ProcessRewardModel",
    "RewardModel",
    "ValueModel",
    "last_token_index",
]
