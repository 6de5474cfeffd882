"""The PPO learner of an asynchronous run: a pool draw in, new actor weights out.

The batch is laid out token in, token out (the engine's ids and behaviour log-probs as
they are), groups in key order so a draw's layout does not depend on the order groups
finished. ``old_logp`` is recomputed with the learner's parameters when the batch is
formed: the proximal policy of decoupled PPO; the behaviour log-probs (per token, from
whichever version sampled it) weight the surrogate when ``ppo.behaviour_correction`` is
set. The pool's priority weights become the rows' loss weights.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlpt.asyncrl.pool import Draw
from rlpt.parallel.multihost import to_host
from rlpt.rl import PPOTrainer, RolloutBatch, new_rollout_batch


class PPOAsyncLearner:
    """``(draw, version) -> (actor weights, metrics)`` around a ``PPOTrainer``."""

    def __init__(
        self,
        trainer: PPOTrainer,
        state,
        ref_params,
        *,
        prompt_width: int,
        max_new_tokens: int,
        pad_id: int = 0,
        width_multiple: int = 16,
    ):
        self.trainer = trainer
        self.state = trainer.shard_state(state)
        self.ref_params = ref_params
        self.prompt_width = prompt_width
        self.max_new_tokens = max_new_tokens
        self.pad_id = pad_id
        self.width_multiple = width_multiple

    def make_batch(self, draw: Draw) -> RolloutBatch:
        order = sorted(range(len(draw.items)), key=lambda i: draw.items[i].key)
        groups = [draw.items[i].payload for i in order]
        weights = np.asarray(draw.weights, np.float32)[order]
        samples = [(gi, g, i) for gi, g in enumerate(groups) for i in range(len(g.tokens))]
        longest = max(max(len(t), 1) for g in groups for t in g.tokens)
        # Few response widths compile: the longest rounded up to a multiple.
        width = min(self.max_new_tokens, -(-longest // self.width_multiple) * self.width_multiple)
        n, p = len(samples), self.prompt_width
        prompt = np.full((n, p), self.pad_id, np.int32)
        prompt_mask = np.zeros((n, p), bool)
        tokens = np.full((n, width), self.pad_id, np.int32)
        mask = np.zeros((n, width), np.float32)
        logprobs = np.zeros((n, width), np.float32)
        rewards, truncated = np.zeros(n, np.float32), np.zeros(n, bool)
        group_id, loss_weight = np.zeros(n, np.int32), np.zeros(n, np.float32)
        for row, (gi, g, i) in enumerate(samples):
            ids = g.prompt.tokens[-p:]
            prompt[row, p - len(ids) :] = ids
            prompt_mask[row, p - len(ids) :] = True
            k = len(g.tokens[i])
            tokens[row, :k] = g.tokens[i]
            mask[row, :k] = 1.0
            logprobs[row, :k] = g.logprobs[i]
            rewards[row] = g.rewards[i]
            truncated[row] = g.finish[i] == "length"
            group_id[row] = gi
            loss_weight[row] = weights[gi]
        return new_rollout_batch(
            prompt, prompt_mask, tokens, mask, sequence_rewards=rewards, loss_weight=loss_weight,
            group_id=group_id, truncated=truncated, behaviour_logp=logprobs,
        )  # fmt: skip

    def __call__(self, draw: Draw, version: int) -> tuple[Any, dict[str, Any]]:
        batch = self.make_batch(draw)
        batch = self.trainer.score(self.state, self.ref_params, batch)
        mismatch = self.trainer.mismatch(batch)
        batch = self.trainer.advantages(self.state, batch)
        self.state, metrics = self.trainer.update(self.state, batch)
        # A copy for the actors: the next update donates the state's buffers.
        weights = jax.tree.map(jnp.copy, self.state.policy)
        metrics = to_host({**mismatch, **metrics})
        return weights, {f"ppo/{k}": float(v) for k, v in metrics.items()}
