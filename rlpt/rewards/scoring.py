"""Learned rewards for a rollout batch, and refreshing the reward model from new traces.

``rollout_rm_scores`` and ``rollout_process_scores`` read a ``RolloutBatch``
(left-padded prompt then response) and return what ``assemble_rewards`` takes:
a sequence score [B] and step scores with their mask over response columns [B, T].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlpt.rewards.preferences import SkipCounts, Trace, encode_pairs, pairs_from_traces
from rlpt.rewards.process import separator_mask
from rlpt.rl.batch import RolloutBatch
from rlpt.supervised import SupervisedState, SupervisedTrainer


def rollout_rm_scores(graphdef, params, batch: RolloutBatch) -> jax.Array:
    """Reward-model score of each row [B], read at its last real token."""
    return nnx.merge(graphdef, params)(batch.tokens, batch.positions, batch.input_mask)


def rollout_process_scores(
    graphdef, params, batch: RolloutBatch, *, step_id: int, answer_id: int
) -> tuple[jax.Array, jax.Array]:
    """PRM step probabilities and the step mask over response columns, both [B, T].

    The PRM reads each separator token itself (it scores the step that token
    ends), so response column t is sequence position P + t.
    """
    cols = jnp.arange(batch.tokens.shape[1])[None, :]
    response = batch.input_mask.astype(bool) & (cols >= batch.prompt_len)  # [B, P + T]
    scores, _ = nnx.merge(graphdef, params)(
        batch.tokens, batch.positions, batch.input_mask, response_mask=response
    )
    resp = scores[:, batch.prompt_len :]  # [B, T]
    response_tokens = batch.tokens[:, batch.prompt_len :]
    steps = separator_mask(
        response_tokens, batch.response_mask, step_id=step_id, answer_id=answer_id
    )
    return jax.nn.sigmoid(resp) * steps, steps


@dataclasses.dataclass
class RewardModelRefresher:
    """Keeps the newest traces and retrains the reward model on them every ``every`` steps.

    The PPO loop calls ``add(traces)`` after verifying a batch and
    ``maybe_refresh(step, state, key)`` once per step; a refresh builds
    preference pairs from the buffered traces (``pairs_from_traces``), skips
    and counts unusable ones, and runs ``steps`` optimiser steps on minibatches
    of ``batch_size`` pairs padded to ``pad_to`` tokens (fixed shapes: one compile).
    """

    trainer: SupervisedTrainer
    tokenizer: Any
    max_len: int
    every: int = 10
    steps: int = 4
    batch_size: int = 16
    buffer_size: int = 1024
    min_pairs: int = 4
    pad_to: int | None = None
    traces: list[Trace] = dataclasses.field(default_factory=list)

    def add(self, traces: Sequence[Trace]) -> None:
        self.traces.extend(traces)
        del self.traces[: max(0, len(self.traces) - self.buffer_size)]

    def maybe_refresh(
        self, step: int, state: SupervisedState, key: jax.Array
    ) -> tuple[SupervisedState, dict[str, float]]:
        if step == 0 or step % self.every:
            return state, {}
        return refresh_reward_model(
            self.trainer, state, self.traces, self.tokenizer, key, max_len=self.max_len,
            steps=self.steps, batch_size=self.batch_size, min_pairs=self.min_pairs,
            pad_to=self.pad_to or self.max_len,
        )  # fmt: skip


def refresh_reward_model(
    trainer: SupervisedTrainer,
    state: SupervisedState,
    traces: Sequence[Trace],
    tokenizer: Any,
    key: jax.Array,
    *,
    max_len: int,
    steps: int = 4,
    batch_size: int = 16,
    min_pairs: int = 4,
    pad_to: int | None = None,
) -> tuple[SupervisedState, dict[str, float]]:
    """A few Bradley-Terry steps on pairs built from ``traces``; no-op below ``min_pairs``.

    Returns the new state and ``rm/refresh_*`` metrics (pairs used, skipped, loss, accuracy).
    """
    pairs = pairs_from_traces(traces)
    arrays, skipped = (None, SkipCounts())
    if pairs:
        arrays, skipped = encode_pairs(pairs, tokenizer, max_len, on_error="skip", pad_to=pad_to)
    n = 0 if arrays is None else len(arrays)
    metrics = {"rm/refresh_pairs": float(n), "rm/refresh_skipped": float(skipped.total)}
    if n < min_pairs:
        return state, metrics
    losses, accs = [], []
    for s in range(steps):
        pick = np.asarray(jax.random.randint(jax.random.fold_in(key, s), (batch_size,), 0, n))
        batch = {
            "chosen": arrays.chosen[pick], "chosen_mask": arrays.chosen_mask[pick],
            "rejected": arrays.rejected[pick], "rejected_mask": arrays.rejected_mask[pick],
            "margin": arrays.margin[pick], "weight": np.ones(batch_size, np.float32),
        }  # fmt: skip
        state, m = trainer.step(state, batch)
        losses.append(m["loss"])
        accs.append(m["accuracy"])
    metrics["rm/refresh_loss"] = float(jnp.mean(jnp.stack(losses)))
    metrics["rm/refresh_accuracy"] = float(jnp.mean(jnp.stack(accs)))
    return state, metrics
