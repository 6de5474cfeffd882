"""The rollout batch: one pytree carrying a rollout from sampling into the PPO update.

Layout: each row is a prompt left-padded to ``P`` columns followed by a
response of ``T`` columns, so ``L = P + T``. Token-level RL arrays cover the
response columns only and are ``[B, T]``; the logits that score response token
``t`` come from sequence position ``P - 1 + t``.

Two masks: ``input_mask`` [B, L] says which tokens are *present* (attention and rotary
positions cover them), ``response_mask`` [B, T] which response tokens are *trained*
(the loss, KL, entropy, advantages and token counts read only these). In a
single-turn rollout they agree on the response columns. In a multi-turn rollout
(``rlpt.roles.multiturn``) the response columns hold ``completion 1 | feedback 1 |
completion 2 | ...``: the environment's feedback tokens are present but not trained.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class RolloutBatch:
    """A rollout ready for ``ppo_update``.

    Fields filled at sampling time: ``tokens``, ``positions``, ``input_mask``,
    ``response_mask``, ``truncated``, ``behaviour_logp`` (the sampler's own log-probabilities
    of the ids it drew; zero where the sampler gave none). Filled by scoring
    (``score_rollout``): ``old_logp`` (the proximal policy of the ratio: the policy's
    log-probabilities at the sampling temperature, recomputed, or with
    ``PPOConfig.old_logprobs = "behaviour"`` the sampler's), ``ref_logp``, ``values``.
    Filled by ``compute_advantages``: ``advantages``, ``returns`` (and ``rewards`` may
    gain a KL penalty).
    """

    tokens: jax.Array  # [B, L] int32
    positions: jax.Array  # [B, L] int32 rotary positions
    input_mask: jax.Array  # [B, L] bool, tokens present: prompt, model and environment tokens
    response_mask: jax.Array  # [B, T] float32, 1 for trained tokens (the model's own)
    rewards: jax.Array  # [B, T] float32 per-token rewards
    old_logp: jax.Array  # [B, T] float32
    behaviour_logp: jax.Array  # [B, T] float32, from the sampler (per token, any version)
    ref_logp: jax.Array  # [B, T] float32
    values: jax.Array  # [B, T] float32 critic values before each response token
    advantages: jax.Array  # [B, T] float32
    returns: jax.Array  # [B, T] float32
    loss_weight: jax.Array  # [B] float32 per-sequence loss weight (the curriculum sets it)
    group_id: jax.Array  # [B] int32, rows sampled from the same prompt share it
    step_mask: jax.Array  # [B, T] float32, 1 at the last token of each reasoning step
    truncated: jax.Array  # [B] bool, cut at the length limit without an end token
    # [B] float32: 1 for rows the self-imitation term (``ppo.imitation_coef``) trains on,
    # the policy's own verified-correct completions; 0 elsewhere.
    imitation_weight: jax.Array

    @property
    def prompt_len(self) -> int:
        return self.tokens.shape[1] - self.response_mask.shape[1]

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]


def new_rollout_batch(
    prompt_tokens: np.ndarray,  # [B, P] left-padded
    prompt_mask: np.ndarray,  # [B, P] bool
    response_tokens: np.ndarray,  # [B, T]
    response_mask: np.ndarray,  # [B, T] 1 for trained (model) tokens
    *,
    sequence_rewards: np.ndarray | None = None,  # [B], placed on each row's last trained token
    loss_weight: np.ndarray | None = None,
    group_id: np.ndarray | None = None,
    truncated: np.ndarray | None = None,
    step_token_id: int | None = None,
    imitation_weight: np.ndarray | None = None,
    behaviour_logp: np.ndarray | None = None,  # [B, T] the sampler's log-probs
    present_mask: np.ndarray | None = None,  # [B, T] response tokens in the context
) -> RolloutBatch:
    """A batch from sampler output, with scoring and advantage fields zeroed.

    ``present_mask`` (default ``response_mask > 0``) marks the response tokens the
    model sees as context, ``response_mask`` those it is trained on; every trained
    token must be present. Multi-turn rows pass the environment's tokens as present
    but untrained: they get input_mask and positions, and no loss, KL or reward.
    """
    prompt_mask = np.asarray(prompt_mask, bool)
    response_mask = np.asarray(response_mask, np.float32)
    batch, t = response_mask.shape
    present = response_mask > 0
    if present_mask is not None:
        present_mask = np.asarray(present_mask) > 0
        if present_mask.shape != (batch, t):
            raise ValueError(
                f"present_mask must be [B, T] = {(batch, t)} like the responses, "
                f"got {present_mask.shape}"
            )
        if np.any(present & ~present_mask):
            raise ValueError("every trained token (response_mask > 0) must be present")
        present = present_mask
    tokens = np.concatenate([prompt_tokens, response_tokens], axis=1).astype(np.int32)
    input_mask = np.concatenate([prompt_mask, present], axis=1)
    positions = (np.maximum(np.cumsum(input_mask, axis=1) - 1, 0) * input_mask).astype(np.int32)
    rewards = np.zeros((batch, t), np.float32)
    if sequence_rewards is not None:
        # The last trained token: the model's last action (rows are left-aligned, so a
        # single-turn row's is column length - 1; an empty row's reward is masked out).
        last = np.where(response_mask > 0, np.arange(t)[None, :], 0).max(axis=1)
        rewards[np.arange(batch), last] = np.asarray(sequence_rewards, np.float32)
        rewards *= response_mask
    step_mask = np.zeros((batch, t), np.float32)
    if step_token_id is not None:
        step_mask = (np.asarray(response_tokens) == step_token_id).astype(
            np.float32
        ) * response_mask
    zeros = np.zeros((batch, t), np.float32)
    if loss_weight is None:
        loss_weight = np.ones(batch, np.float32)
    if group_id is None:
        group_id = np.arange(batch, dtype=np.int32)
    if truncated is None:
        truncated = np.zeros(batch, bool)
    if imitation_weight is None:
        imitation_weight = np.zeros(batch, np.float32)
    if behaviour_logp is None:
        behaviour_logp = zeros
    behaviour_logp = np.asarray(behaviour_logp, np.float32) * response_mask
    if behaviour_logp.shape != (batch, t):
        raise ValueError(
            f"behaviour_logp must be [B, T] = {(batch, t)} like the responses, "
            f"got {behaviour_logp.shape}"
        )
    return RolloutBatch(
        tokens=jnp.asarray(tokens),
        positions=jnp.asarray(positions),
        input_mask=jnp.asarray(input_mask),
        response_mask=jnp.asarray(response_mask),
        rewards=jnp.asarray(rewards),
        old_logp=jnp.asarray(zeros),
        behaviour_logp=jnp.asarray(behaviour_logp),
        ref_logp=jnp.asarray(zeros),
        values=jnp.asarray(zeros),
        advantages=jnp.asarray(zeros),
        returns=jnp.asarray(zeros),
        loss_weight=jnp.asarray(np.asarray(loss_weight, np.float32)),
        group_id=jnp.asarray(np.asarray(group_id, np.int32)),
        step_mask=jnp.asarray(step_mask),
        truncated=jnp.asarray(np.asarray(truncated, bool)),
        imitation_weight=jnp.asarray(np.asarray(imitation_weight, np.float32)),
    )
