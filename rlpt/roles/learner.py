"""The learner role: trajectories with rewards in, a new train state out.

``PPOLearner`` owns the PPO train state (policy, optional critic, optimiser, KL
controller), the frozen reference, and the jitted, sharded steps of
``rlpt.rl.PPOTrainer``. ``make_batch`` lays trajectories out as the learner's
``RolloutBatch`` (token in, token out: the sampled ids are used as they are);
``step`` scores, computes advantages and updates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlpt.models import ValueModel, create_model
from rlpt.parallel import state_shardings
from rlpt.parallel.multihost import abstract_on, to_device
from rlpt.policy import full_policy
from rlpt.rl import (
    PPOConfig,
    PPOTrainer,
    RolloutBatch,
    init_train_state,
    new_rollout_batch,
    trace_advantages,
)
from rlpt.roles.rollout import Trajectories
from rlpt.sampling.chunked import ChunkRows, chunk_rows


class PPOLearner:
    """PPO on a policy graph (and a critic when the estimator needs one), on a mesh."""

    def __init__(
        self,
        cfg: PPOConfig,
        policy_graph,
        model_cfg,
        *,
        value_key: jax.Array,
        base_params=None,
        lora=None,
        mesh=None,
    ):
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.value_key = value_key
        self.base_params = base_params  # the frozen base under LoRA, else None
        self.lora = lora
        self.value_graph = None
        if cfg.uses_critic:
            self.value_graph, _ = create_model(
                lambda rngs: ValueModel(model_cfg, rngs=rngs), value_key
            )
        self.trainer = PPOTrainer(cfg, policy_graph, self.value_graph, frozen=base_params,
                                  mesh=mesh)  # fmt: skip
        self.state: Any = None  # rl.TrainState
        self.ref_params: Any = None

    # -- state ---------------------------------------------------------------------------------

    def start(self, params, key_data: jax.Array) -> None:
        """A fresh train state from the (warm-started) policy ``params``, which the
        reference keeps a copy of: the policy's buffers are donated to each update."""
        self.ref_params = jax.tree.map(jnp.copy, params)
        value = self.value_init(params) if self.cfg.uses_critic else None
        self.state = init_train_state(self.cfg, params, value, key_data)
        self.place()

    def place(self) -> None:
        """The state and the reference where the jitted steps keep them (on the mesh)."""
        self.state = self.trainer.shard_state(self.state)
        if self.trainer.mesh is not None:
            self.ref_params = to_device(
                self.ref_params, state_shardings(self.ref_params, self.trainer.mesh)
            )

    def value_init(self, policy_params):
        """The critic's trunk starts as the policy's trunk; its head starts at zero output."""
        _, value = create_model(lambda rngs: ValueModel(self.model_cfg, rngs=rngs), self.value_key)
        if self.lora is not None:
            from rlpt.models.lora import merge_lora

            # The critic trains in full: it starts from the adapted policy, adapters folded in.
            policy_params = merge_lora(self.lora, policy_params, self.base_params)
        value["trunk"] = jax.tree.map(jnp.copy, policy_params["trunk"])
        return value

    def state_template(self, init_params, key_data: jax.Array):
        """The abstract train state a checkpoint restores into."""
        value = None
        if self.cfg.uses_critic:
            value = jax.eval_shape(lambda: self.value_init(init_params))
        template = jax.eval_shape(lambda: init_train_state(self.cfg, init_params, value, key_data))
        return abstract_on(template, self.trainer.state_shardings(template))

    def trained_params(self):
        """What trains: the adapters under LoRA, else the full policy."""
        return self.state.policy

    def policy_params(self):
        """The policy's full state (adapters merged with the base under LoRA)."""
        return full_policy(self.state.policy, self.base_params)

    # -- batches and steps ---------------------------------------------------------------------

    def make_batch(
        self,
        traj: Trajectories,
        group_id: np.ndarray,
        *,
        prompt_buckets: Sequence[int],
        pad_id: int,
        step_id: int,
        max_new_tokens: int,
    ) -> tuple[RolloutBatch, dict[str, int]]:
        """The learner's batch for ``traj`` (verdicts required) and its layout: the
        sampled prompt length, the response width and, packed, the real tokens scored.
        The prompts are the loader's padded rows, used as they are. ``max_new_tokens``
        is the response width of the rollout (every turn and feedback of a multi-turn
        one); multi-turn rows train on ``traj.loss_mask`` and attend over ``traj.mask``."""
        v = traj.verdicts
        prompt_tokens, prompt_mask = traj.prompt_tokens, traj.prompt_mask
        layout = {"prompt_len": int(prompt_tokens.shape[1]), "scored_tokens": None}
        if self.cfg.pack_sequences:
            layout["scored_tokens"] = int(prompt_mask.sum()) + int(traj.lengths.sum())
            # Packed rows carry real tokens only, so padding is free: one batch shape
            # (the widest prompt bucket, every response column) compiles once.
            extra = max(max(prompt_buckets) - prompt_tokens.shape[1], 0)
            prompt_tokens = np.pad(prompt_tokens, ((0, 0), (extra, 0)), constant_values=pad_id)
            prompt_mask = np.pad(prompt_mask, ((0, 0), (extra, 0)))
            width = max_new_tokens
        else:
            # Most responses stop well before max_new_tokens, and the update's cost grows
            # with the padded width: cut to the longest response, rounded up to a multiple
            # of 8 so at most a few widths compile. Masked positions add nothing to any loss.
            width = min(max_new_tokens, -(-max(int(traj.lengths.max()), 1) // 8) * 8)
        layout["width"] = width
        trained, present, imitate = traj.mask, None, v.success
        if traj.loss_mask is not None:
            # Multi-turn rows: the feedback tokens are context, not actions. Self-imitation
            # takes rows solved at the first turn only: a row solved later holds wrong
            # attempts among its model tokens.
            trained, present = traj.loss_mask, traj.mask[:, :width]
            if traj.turns is not None:
                imitate = v.success * traj.turns.first_success
        batch = new_rollout_batch(
            prompt_tokens, prompt_mask, traj.tokens[:, :width], trained[:, :width],
            sequence_rewards=v.rewards, loss_weight=traj.loss_weight * v.weight,
            group_id=group_id, truncated=traj.truncated, step_token_id=step_id,
            imitation_weight=imitate, behaviour_logp=traj.logprobs[:, :width],
            present_mask=present,
        )  # fmt: skip
        return batch, layout

    def make_chunked_batch(
        self,
        traj: Trajectories,
        group_id: np.ndarray,
        *,
        chunk_tokens: int,
        carry_tokens: int,
        max_chunks: int,
        prompt_buckets: Sequence[int],
        pad_id: int,
        step_id: int,
    ) -> tuple[RolloutBatch, dict[str, Any], ChunkRows]:
        """Delethink's batch for chunked traces (``ChunkedRolloutWorker``): one row per
        chunk, its context (prompt + carried tokens) as the prompt and the chunk as the
        response, ``len(traj) * max_chunks`` rows (filler rows carry loss weight 0). The
        outcome reward sits on each trace's last chunk; ``advantages(batch, rows)`` gives
        every chunk its trace's advantage. Also returns the layout and the rows."""
        v = traj.verdicts
        prompts = [row[m] for row, m in zip(traj.prompt_tokens, traj.prompt_mask)]
        rows = chunk_rows(
            prompts, traj.tokens, traj.logprobs, traj.lengths, chunk_tokens=chunk_tokens,
            carry_tokens=carry_tokens, max_chunks=max_chunks, buckets=prompt_buckets,
            pad_id=pad_id,
        )  # fmt: skip
        real = rows.row_trace >= 0
        t = np.where(real, rows.row_trace, 0)
        context_tokens, context_mask = rows.context_tokens, rows.context_mask
        layout = {"prompt_len": int(context_tokens.shape[1]), "width": chunk_tokens,
                  "scored_tokens": None, "rows": int(real.sum())}  # fmt: skip
        if self.cfg.pack_sequences:
            layout["scored_tokens"] = int(context_mask[real].sum()) + int(rows.mask.sum())
            extra = max(max(prompt_buckets) - context_tokens.shape[1], 0)
            context_tokens = np.pad(context_tokens, ((0, 0), (extra, 0)), constant_values=pad_id)
            context_mask = np.pad(context_mask, ((0, 0), (extra, 0)))
        batch = new_rollout_batch(
            context_tokens, context_mask, rows.tokens, rows.mask,
            sequence_rewards=np.where(rows.last, v.rewards[t], 0.0),
            loss_weight=np.where(real, (traj.loss_weight * v.weight)[t], 0.0),
            group_id=np.where(real, np.asarray(group_id)[t], 0),
            truncated=rows.last & traj.truncated[t], step_token_id=step_id,
            imitation_weight=np.where(real, v.success[t], 0.0), behaviour_logp=rows.logprobs,
        )  # fmt: skip
        return batch, layout, rows

    def chunked_advantages(
        self, batch: RolloutBatch, rows: ChunkRows, group_id: np.ndarray
    ) -> RolloutBatch:
        """The estimator's terms (KL and overlong rewards, kept masks), then every chunk
        row's advantage replaced by its trace's (``rlpt.rl.trace_advantages``)."""
        batch = self.advantages(batch)
        cfg = self.cfg
        adv = trace_advantages(
            batch.rewards, batch.response_mask, jnp.asarray(rows.row_trace),
            jnp.asarray(np.asarray(group_id, np.int32)),
            (batch.loss_weight > 0).astype(jnp.float32),
            num_groups=cfg.num_groups or len(group_id), estimator=cfg.estimator,
        )  # fmt: skip
        return batch.replace(advantages=adv, returns=adv)

    def score(self, batch: RolloutBatch) -> RolloutBatch:
        """Old, reference (and value) log-probs of the batch under the current state."""
        return self.trainer.score(self.state, self.ref_params, batch)

    def advantages(self, batch: RolloutBatch) -> RolloutBatch:
        return self.trainer.advantages(self.state, batch)

    def update(self, batch: RolloutBatch) -> dict[str, Any]:
        """One PPO update (epochs x minibatches); the new state replaces the old."""
        self.state, metrics = self.trainer.update(self.state, batch)
        return metrics
