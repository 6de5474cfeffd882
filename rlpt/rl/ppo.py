"""The PPO update for language models: one pure, jitted, sharded step.

``ppo_update(state, batch) -> (state, metrics)`` runs several epochs over
shuffled minibatches inside one program (``lax.scan``), accumulates gradients
over microbatches so large batches fit in memory, multiplies in per-sequence
loss weights, clips the global gradient norm, follows an optax learning-rate
schedule (optionally scaled by a controller that watches KL or the clip
fraction), and skips any step whose loss or gradients are not finite.

Around it: ``score_rollout`` recomputes the policy's own log-probabilities (at
the rollout's sampling temperature), the reference log-probabilities and the values for a
freshly sampled batch; ``compute_advantages`` turns rewards into advantages
(GAE with a critic, or critic-free GRPO / RLOO); ``PPOTrainer`` binds it all
to a mesh with explicit shardings and donation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding

from rlpt.optim import make_optimizer, make_schedule
from rlpt.parallel.multihost import to_device, to_host
from rlpt.parallel.sharding import (
    DEFAULT_RULES,
    Rules,
    activation_sharding,
    batch_sharding,
    data_parallel_size,
    logical_to_spec,
    replicated,
    state_shardings,
    tree_shardings,
)
from rlpt.rl.advantages import (
    grpo_advantages,
    last_token_mask,
    process_group_advantages,
    rloo_advantages,
    sequence_to_tokens,
)
from rlpt.rl.batch import RolloutBatch
from rlpt.rl.gae import gae, whiten
from rlpt.rl.kl import (
    KLControllerState,
    init_kl_controller,
    kl_estimate,
    kl_loss,
    kl_penalty_rewards,
    update_kl_controller,
)
from rlpt.rl.losses import (
    AGGREGATION_MODES,
    aggregate,
    behaviour_weights,
    imitation_loss,
    masked_mean,
    policy_loss,
    value_loss,
)
from rlpt.rl.packing import PackedRows, UpdatePlan, pack_batch, plan_update

ESTIMATORS = ("gae", "grpo", "rloo", "dr_grpo")
SCHEDULES = ("constant", "warmup_cosine", "warmup_linear")
OVERLONG = ("none", "mask", "penalty")
KL_PLACEMENTS = ("reward", "loss", "none")
ADAPTIVE_LR = ("none", "kl", "clip_frac")
OLD_LOGPROBS = ("recompute", "behaviour")
BEHAVIOUR_CORRECTIONS = ("none", "truncate", "mask")


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """Static settings of the PPO update (hashable, so it can bind a jitted function)."""

    epochs: int = 1
    num_minibatches: int = 1
    grad_accum: int = 1  # microbatches per minibatch
    estimator: str = "gae"  # "gae" needs a critic; the others are critic-free
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    clip_low: float = 0.2
    clip_high: float | None = None  # None: symmetric
    dual_clip: float | None = None
    value_clip: float | None = 0.2
    vf_coef: float = 0.5
    ent_coef: float = 0.0
    aggregation: str = "token_mean"
    kl_kind: str = "k3"
    kl_placement: str = "reward"
    kl_coef: float = 0.05
    kl_adaptive: bool = False
    kl_target: float = 0.05
    kl_horizon: float = 10_000.0
    learning_rate: float = 1e-5
    value_learning_rate: float = 5e-5
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1_000
    end_lr_fraction: float = 0.1
    adaptive_lr: str = "none"
    adaptive_lr_target: float = 0.02
    adaptive_lr_bounds: tuple[float, float] = (0.1, 10.0)
    adaptive_lr_factor: float = 1.5
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    overlong: str = "none"
    overlong_penalty: float = 1.0
    num_groups: int | None = None  # GRPO/RLOO: groups per batch (default: batch size)
    # grpo/dr_grpo: credit each token with the group-normalised rewards of the steps at and
    # after it (process supervision) instead of one scalar per sequence. Every step end
    # (a step token) and the last token is a reward entry, so use it with process rewards.
    step_advantages: bool = False
    # The temperature the rollout was sampled at. Old, new and reference log-probabilities
    # all come from logits / temperature: that is the distribution the samples were drawn
    # from, so the ratio starts at 1 on-policy and k3 stays an unbiased KL estimate;
    # scoring at 1 would treat tempered samples as draws from the untempered policy.
    sampling_temperature: float = 1.0
    # Score and update on packed rows (``rlpt.rl.packing``): the real tokens of several
    # sequences share a row, so padding costs nothing. Same losses up to float rounding.
    pack_sequences: bool = False
    # > 0: add this times the negative log-likelihood of the rows marked for imitation
    # (``RolloutBatch.imitation_weight``: the trainer marks verified-correct samples), a
    # self-imitation term beside the clipped surrogate (``losses.imitation_loss``).
    imitation_coef: float = 0.0
    # Where the ratio's anchor ``old_logp`` comes from. "recompute": the policy's current
    # parameters score the batch (the proximal policy of decoupled PPO when the samples
    # are older). "behaviour": the sampler's own log-probabilities of the ids it drew
    # (``RolloutBatch.behaviour_logp``), which saves one forward pass of the policy; exact
    # only when the sampler ran the same parameters in the same precision (synchronous,
    # float32: the rollout engine's equal the recomputed ones to 1e-5).
    old_logprobs: str = "recompute"
    # Correction for samples drawn by a policy other than ``old_logp``'s (older weights,
    # or the same weights in another precision or kernel): each token's objective is
    # weighted by w = exp(old_logp - behaviour_logp) = pi_old / pi_behaviour (decoupled
    # PPO, Hilton et al. 2021 arXiv:2110.00641; AReaL, Fu et al. 2025 arXiv:2505.24298).
    # "truncate": min(w, is_cap) (truncated importance sampling, Ionides 2008; verl's
    # TIS). "mask": w where 1/is_cap <= w <= is_cap, else 0 (masked importance sampling:
    # tokens whose behaviour and proximal probabilities disagree too much leave the loss;
    # they stay in the aggregation's denominator, so the normaliser does not depend on
    # the weights). "none": no weight (naive PPO on stale samples).
    behaviour_correction: str = "none"
    is_cap: float = 2.0

    def __post_init__(self):
        _check_choice("estimator", self.estimator, ESTIMATORS)
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("overlong", self.overlong, OVERLONG)
        _check_choice("kl_placement", self.kl_placement, KL_PLACEMENTS)
        _check_choice("adaptive_lr", self.adaptive_lr, ADAPTIVE_LR)
        _check_choice("aggregation", self.aggregation, AGGREGATION_MODES)
        _check_choice("old_logprobs", self.old_logprobs, OLD_LOGPROBS)
        _check_choice("behaviour_correction", self.behaviour_correction, BEHAVIOUR_CORRECTIONS)
        if not self.is_cap > 1.0:
            raise ValueError(f"ppo.is_cap must be > 1, got {self.is_cap}")
        if self.step_advantages and self.estimator not in ("grpo", "dr_grpo"):
            raise ValueError(
                f"ppo.step_advantages needs estimator 'grpo' or 'dr_grpo', got {self.estimator!r}"
            )
        if self.step_advantages and self.kl_placement == "reward":
            # A per-token KL reward is not a step reward: it would enter the group statistics
            # as hundreds of entries per sample. Put the KL in the loss instead.
            raise ValueError("ppo.step_advantages needs ppo.kl_placement 'loss' or 'none'")
        if not self.sampling_temperature > 0:
            raise ValueError(
                f"ppo.sampling_temperature must be > 0, got {self.sampling_temperature}"
            )
        if not self.imitation_coef >= 0:
            raise ValueError(f"ppo.imitation_coef must be >= 0, got {self.imitation_coef}")
        for name in ("epochs", "num_minibatches", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"ppo.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def uses_critic(self) -> bool:
        return self.estimator == "gae"

    @classmethod
    def from_config(cls, config) -> PPOConfig:
        """From a mapping or ConfigDict; unknown keys are an error naming them."""
        values = dict(config.to_dict() if hasattr(config, "to_dict") else config)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ppo config fields {unknown}; known: {sorted(known)}")
        if "adaptive_lr_bounds" in values:
            values["adaptive_lr_bounds"] = tuple(values["adaptive_lr_bounds"])
        return cls(**values)


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"ppo.{name} must be one of {allowed}, got {value!r}")


def learning_rate_schedule(cfg: PPOConfig, peak: float) -> optax.Schedule:
    """Warmup then cosine or linear decay to ``end_lr_fraction * peak``, or constant.

    A decaying schedule always warms up for at least one step (from 0), and the linear
    decay lasts ``total_steps - warmup_steps`` steps after it.
    """
    if cfg.schedule == "constant":
        return make_schedule(peak)
    warmup = max(cfg.warmup_steps, 1)
    if cfg.schedule == "warmup_cosine":
        total = max(cfg.total_steps, cfg.warmup_steps + 1)
        decay = "cosine"
    else:
        total = warmup + max(cfg.total_steps - cfg.warmup_steps, 1)
        decay = "linear"
    return make_schedule(
        peak, decay, warmup_steps=warmup, total_steps=total, end_fraction=cfg.end_lr_fraction
    )


def _optimizer(cfg: PPOConfig, peak: float) -> optax.GradientTransformation:
    return make_optimizer(
        learning_rate_schedule(cfg, peak), max_grad_norm=cfg.max_grad_norm,
        weight_decay=cfg.weight_decay,
    )  # fmt: skip


@struct.dataclass
class TrainState:
    """Everything the PPO update changes. The reference policy is kept outside (not donated)."""

    step: jax.Array  # int32 count of optimiser steps taken
    policy: Any  # nnx.State of the policy
    value: Any  # nnx.State of the critic, or None in critic-free mode
    policy_opt: Any
    value_opt: Any
    kl: KLControllerState
    lr_scale: jax.Array  # float32, scales the schedule (adaptive learning rate)
    skipped: jax.Array  # int32 count of updates skipped for non-finite loss or gradients
    key: jax.Array


def init_train_state(cfg: PPOConfig, policy_params, value_params, key: jax.Array) -> TrainState:
    if cfg.uses_critic and value_params is None:
        raise ValueError("ppo.estimator='gae' needs a value model; use grpo/rloo for critic-free")
    if not cfg.uses_critic:
        value_params = None
    value_opt = None
    if value_params is not None:
        value_opt = _optimizer(cfg, cfg.value_learning_rate).init(value_params)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        policy=policy_params,
        value=value_params,
        policy_opt=_optimizer(cfg, cfg.learning_rate).init(policy_params),
        value_opt=value_opt,
        kl=init_kl_controller(cfg.kl_coef),
        lr_scale=jnp.ones((), jnp.float32),
        skipped=jnp.zeros((), jnp.int32),
        key=key,
    )


def response_log_probs(
    logits: jax.Array, tokens: jax.Array, prompt_len: int, temperature: float = 1.0
):
    """Log-probabilities [B, T] of response tokens and the response logits [B, T, V],
    both of the distribution ``softmax(logits / temperature)``.

    For callers that already hold full logits (a sampler's); the update and scoring go
    through ``CausalLM.target_log_probs``, which can avoid the [B, T, V] logits.
    """
    resp_logits = logits[:, prompt_len - 1 : -1].astype(jnp.float32) / temperature  # [B, T, V]
    log_probs = jax.nn.log_softmax(resp_logits, axis=-1)
    targets = tokens[:, prompt_len:]  # [B, T]
    return jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0], resp_logits


def _gather_packed(per_position: jax.Array, packed: PackedRows) -> jax.Array:
    """[N, L, ...] outputs on packed rows to the batch's response layout [b, T, ...]."""
    flat = per_position.reshape((-1,) + per_position.shape[2:])  # [N * L, ...]
    return jnp.take(flat, packed.logit_index, axis=0)


def _policy_logp(
    policy_graph, params, batch: RolloutBatch, frozen=None, temperature=1.0,
    packed: PackedRows | None = None, with_entropy: bool = False,
):  # fmt: skip
    """Response log-probabilities [b, T] of ``softmax(logits / temperature)``, and their
    entropy [b, T] when ``with_entropy`` (else None).

    The trunk's hidden states are taken to the response layout first and projected to the
    vocabulary afterwards (``CausalLM.target_log_probs``), so with ``vocab_chunk`` > 0 no
    [b, T, V] logits exist, here or in the backward pass.
    """
    # `frozen`: parameters outside the trained state (a LoRA policy's shared base).
    states = (params,) if frozen is None else (params, frozen)
    model = nnx.merge(policy_graph, *states)
    targets = batch.tokens[:, batch.prompt_len :]  # [b, T]
    if packed is None:
        hidden, _ = model.trunk(batch.tokens, batch.positions, batch.input_mask)  # [b, L, D]
        resp_hidden = hidden[:, batch.prompt_len - 1 : -1]  # [b, T, D]
    else:
        hidden, _ = model.trunk(
            packed.tokens, packed.positions, packed.input_mask, packed.segment_ids
        )  # [N, L, D]
        resp_hidden = _gather_packed(hidden, packed)  # [b, T, D]
    stats = model.target_log_probs(resp_hidden, targets, temperature, with_entropy=with_entropy)
    return stats.log_probs, stats.entropy


def _values(value_graph, params, batch: RolloutBatch, packed: PackedRows | None = None):
    model = nnx.merge(value_graph, params)
    if packed is None:
        scores = model(batch.tokens, batch.positions, batch.input_mask)
        return scores[:, batch.prompt_len - 1 : -1]
    scores = model(packed.tokens, packed.positions, packed.input_mask, packed.segment_ids)
    return _gather_packed(scores, packed)


def score_rollout(
    policy_graph,
    value_graph,
    policy_params,
    ref_params,
    value_params,
    batch: RolloutBatch,
    frozen=None,
    temperature: float = 1.0,
    packed: PackedRows | None = None,
    old_from_behaviour: bool = False,
) -> RolloutBatch:
    """Fill old_logp (the policy itself), ref_logp and values.

    Both log-probabilities are of ``softmax(logits / temperature)``: pass the
    temperature the batch was sampled at. With ``frozen`` (a LoRA policy's base),
    policy and reference are adapter states merged with that one shared base.
    ``packed``: the whole batch's packed layout (``rlpt.rl.packing.pack_batch``).
    ``old_from_behaviour``: old_logp is the sampler's ``behaviour_logp`` (no policy pass).
    """
    mask = batch.response_mask
    if old_from_behaviour:
        old_logp = batch.behaviour_logp
    else:
        old_logp, _ = _policy_logp(policy_graph, policy_params, batch, frozen, temperature, packed)
    ref_logp, _ = _policy_logp(policy_graph, ref_params, batch, frozen, temperature, packed)
    values = batch.values
    if value_params is not None:
        values = _values(value_graph, value_params, batch, packed) * mask
    return batch.replace(old_logp=old_logp * mask, ref_logp=ref_logp * mask, values=values)


def compute_advantages(cfg: PPOConfig, kl: KLControllerState, batch: RolloutBatch):
    """Rewards (with KL and overlong terms) to advantages and returns."""
    mask = batch.response_mask
    rewards = batch.rewards
    loss_weight = batch.loss_weight
    if cfg.overlong == "penalty":
        last = last_token_mask(mask)
        rewards = rewards - cfg.overlong_penalty * batch.truncated[:, None] * last
    elif cfg.overlong == "mask":
        loss_weight = loss_weight * (1.0 - batch.truncated.astype(jnp.float32))
    # A weight-0 row (a sandbox failure, a non-finite reward, an overlong row under "mask")
    # is out of the loss: its tokens must not count in token-mean denominators or in the
    # whitening statistics either, or every other row's share shrinks by the dropped tokens.
    kept_mask = mask * (loss_weight > 0).astype(mask.dtype)[:, None]  # [B, T]
    if cfg.kl_placement == "reward":
        rewards = kl_penalty_rewards(
            rewards, batch.old_logp, batch.ref_logp, mask, coef=kl.coef, kind=cfg.kl_kind
        )
    if cfg.estimator == "gae":
        advantages, returns = gae(rewards, batch.values, mask, gamma=cfg.gamma, lam=cfg.lam)
    elif cfg.step_advantages:
        valid = (loss_weight > 0).astype(jnp.float32)
        positions = jnp.maximum(batch.step_mask * mask, last_token_mask(mask))  # [B, T]
        advantages = process_group_advantages(
            rewards, positions, mask, batch.group_id, num_groups=cfg.num_groups or batch.batch_size,
            scale_by_std=cfg.estimator == "grpo", valid=valid,
        )  # fmt: skip
        returns = advantages
    else:
        # Critic-free: one scalar per sequence (its summed reward), compared within its group.
        seq_rewards = jnp.sum(rewards * mask, axis=1)
        groups = cfg.num_groups or batch.batch_size
        valid = (loss_weight > 0).astype(jnp.float32)
        if cfg.estimator == "rloo":
            seq_adv = rloo_advantages(seq_rewards, batch.group_id, num_groups=groups, valid=valid)
        else:
            seq_adv = grpo_advantages(
                seq_rewards, batch.group_id, num_groups=groups,
                scale_by_std=cfg.estimator == "grpo", valid=valid,
            )  # fmt: skip
        advantages = sequence_to_tokens(seq_adv, mask)
        returns = advantages
    if cfg.whiten_advantages and cfg.estimator == "gae":
        advantages = whiten(advantages, kept_mask)
    return batch.replace(
        rewards=rewards, advantages=advantages, returns=returns, loss_weight=loss_weight,
        response_mask=kept_mask,
    )  # fmt: skip


def _normaliser(mask: jax.Array, mode: str) -> jax.Array:
    """The count ``aggregate`` divides by, so microbatch losses can be rescaled exactly."""
    if mode == "token_mean":
        return jnp.sum(mask)
    if mode == "seq_mean_token_mean":
        return jnp.sum(jnp.sum(mask, axis=1) > 0).astype(jnp.float32)
    return jnp.asarray(mask.shape[0], jnp.float32)


def _microbatch_loss(
    cfg, policy_graph, value_graph, params, kl_coef, mb: RolloutBatch, scale, frozen=None,
    packed: PackedRows | None = None,
):  # fmt: skip
    policy_params, value_params = params
    mask = mb.response_mask
    logp, entropy_tokens = _policy_logp(
        policy_graph, policy_params, mb, frozen, cfg.sampling_temperature, packed,
        with_entropy=True,
    )  # fmt: skip
    token_weights, is_diag = None, {}
    if cfg.behaviour_correction != "none":
        token_weights, is_diag = behaviour_weights(
            mb.old_logp, mb.behaviour_logp, mask, mode=cfg.behaviour_correction, cap=cfg.is_cap
        )
    pg_loss, pg_diag = policy_loss(
        logp, mb.old_logp, mb.advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip, aggregation=cfg.aggregation, seq_weights=mb.loss_weight,
        token_weights=token_weights,
    )  # fmt: skip
    entropy = masked_mean(entropy_tokens, mask)
    kl_tokens = kl_estimate(logp, mb.ref_logp, kind=cfg.kl_kind)
    # The bonus is aggregated like the policy loss, so weights and microbatching treat it alike.
    entropy_bonus = aggregate(
        entropy_tokens, mask, mode=cfg.aggregation, seq_weights=mb.loss_weight
    )
    total = pg_loss - cfg.ent_coef * entropy_bonus
    if cfg.kl_placement == "loss":
        total = total + kl_coef * kl_loss(
            logp, mb.ref_logp, mask, kind=cfg.kl_kind, aggregation=cfg.aggregation,
            seq_weights=mb.loss_weight,
        )  # fmt: skip
    if cfg.imitation_coef > 0:
        imitation = imitation_loss(
            logp, mask, mb.imitation_weight, aggregation=cfg.aggregation,
            seq_weights=mb.loss_weight,
        )  # fmt: skip
        total = total + cfg.imitation_coef * imitation
    metrics = {
        "policy_loss": pg_loss,
        "entropy": entropy,
        "kl": masked_mean(kl_tokens, mask),
        **pg_diag,
        **{k: v for k, v in is_diag.items() if k in ("is_weight_mean", "is_capped_frac")},
    }
    if cfg.imitation_coef > 0:
        metrics["imitation_loss"] = imitation
    if value_params is not None:
        values = _values(value_graph, value_params, mb, packed)
        v_loss, v_diag = value_loss(
            values, mb.values, mb.returns, mask, clip_eps=cfg.value_clip,
            aggregation=cfg.aggregation, seq_weights=mb.loss_weight,
        )  # fmt: skip
        total = total + cfg.vf_coef * v_loss
        metrics.update(value_loss=v_loss, **v_diag)
    metrics["loss"] = total
    return total * scale, metrics


def _split(tree, n: int):
    """[B, ...] leaves to [n, B/n, ...]."""
    return jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), tree)


def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def accumulated_gradients(
    cfg: PPOConfig,
    policy_graph,
    value_graph,
    params,
    kl_coef,
    minibatch: RolloutBatch,
    frozen=None,
    packed: PackedRows | None = None,
):
    """Gradients of the minibatch loss, summed over ``cfg.grad_accum`` microbatches.

    Each microbatch's aggregate is rescaled to its share of the minibatch's
    normaliser, so the sum equals the gradient of the whole minibatch's loss in
    every aggregation mode. Returns ``(grads, metrics)`` with ``grads`` matching
    ``params`` (a (policy, value) pair); ``loss`` is the minibatch loss, the other
    metrics are means over microbatches. ``packed``: one layout per microbatch
    (leading ``[grad_accum]``), or None for padded rows.
    """
    grad_fn = jax.value_and_grad(
        functools.partial(_microbatch_loss, cfg, policy_graph, value_graph, frozen=frozen),
        has_aux=True,
    )
    micro = _split(minibatch, cfg.grad_accum)
    total_norm = _normaliser(minibatch.response_mask, cfg.aggregation)

    def accumulate(acc, item):
        one, one_packed = item
        grads_acc, metrics_acc = acc
        share = _normaliser(one.response_mask, cfg.aggregation)
        scale = jnp.where(total_norm > 0, share / jnp.maximum(total_norm, 1e-9), 0.0)
        (scaled_loss, metrics), grads = grad_fn(params, kl_coef, one, scale, packed=one_packed)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        loss_acc = metrics_acc["loss"] + scaled_loss  # exact: the minibatch loss
        metrics_acc = jax.tree.map(lambda a, m: a + m / cfg.grad_accum, metrics_acc, metrics)
        metrics_acc["loss"] = loss_acc
        return (grads_acc, metrics_acc), None

    zero_grads = jax.tree.map(jnp.zeros_like, params)
    first = jax.tree.map(lambda x: x[0], (micro, packed))
    metric_shapes = jax.eval_shape(
        lambda: grad_fn(params, kl_coef, first[0], 1.0, packed=first[1])[0][1]
    )
    zero_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes)
    (grads, metrics), _ = jax.lax.scan(accumulate, (zero_grads, zero_metrics), (micro, packed))
    return grads, metrics


def ppo_update(
    cfg: PPOConfig,
    policy_graph,
    value_graph,
    state: TrainState,
    batch: RolloutBatch,
    *,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
    frozen=None,
    plan: UpdatePlan | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """Epochs of shuffled minibatch PPO updates on a scored, advantaged batch. Pure.

    ``frozen``: policy parameters held fixed outside ``state`` (a LoRA policy's base).
    ``plan``: packed rows for every microbatch (``rlpt.rl.packing.plan_update``), whose
    permutations must be ``epoch_permutations(cfg, state.key, batch_size)``.
    """
    with activation_sharding(mesh, rules):
        return _ppo_update(cfg, policy_graph, value_graph, state, batch, frozen, plan)


def epoch_permutations(cfg: PPOConfig, key: jax.Array, batch_size: int) -> jax.Array:
    """The row order of each epoch [E, B], drawn from the train state's key."""
    _, epoch_key = jax.random.split(key)
    epoch_keys = jax.random.split(epoch_key, cfg.epochs)
    return jnp.stack([jax.random.permutation(k, batch_size) for k in epoch_keys])


def _ppo_update(
    cfg, policy_graph, value_graph, state: TrainState, batch: RolloutBatch, frozen=None,
    plan: UpdatePlan | None = None,
):  # fmt: skip
    batch_size = batch.batch_size
    policy_tx = _optimizer(cfg, cfg.learning_rate)
    value_tx = _optimizer(cfg, cfg.value_learning_rate) if state.value is not None else None
    key, _ = jax.random.split(state.key)
    kl_coef = state.kl.coef

    def minibatch_step(carry, item):
        mb, mb_packed = item
        params, opts, lr_scale, skipped = carry
        grads, metrics = accumulated_gradients(
            cfg, policy_graph, value_graph, params, kl_coef, mb, frozen, mb_packed
        )
        finite = _all_finite(grads) & jnp.isfinite(metrics["loss"])
        policy_params, value_params = params
        policy_opt, value_opt = opts
        policy_grads, value_grads = grads
        updates, new_policy_opt = policy_tx.update(policy_grads, policy_opt, policy_params)
        updates = jax.tree.map(lambda u: u * lr_scale, updates)
        new_policy = optax.apply_updates(policy_params, updates)
        new_value, new_value_opt = value_params, value_opt
        if value_params is not None:
            v_updates, new_value_opt = value_tx.update(value_grads, value_opt, value_params)
            v_updates = jax.tree.map(lambda u: u * lr_scale, v_updates)
            new_value = optax.apply_updates(value_params, v_updates)
        new_params = (new_policy, new_value)
        new_opts = (new_policy_opt, new_value_opt)
        # A non-finite step changes nothing: parameters and optimiser moments stay put.
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        params = keep(new_params, params)
        opts = keep(new_opts, opts)
        metrics = dict(
            metrics,
            grad_norm=optax.global_norm(policy_grads),
            skipped=1.0 - finite.astype(jnp.float32),
        )
        return (params, opts, lr_scale, skipped + (~finite).astype(jnp.int32)), metrics

    def epoch_step(carry, item):
        perm, epoch_packed = item
        shuffled = jax.tree.map(lambda x: jnp.take(x, perm, axis=0), batch)
        minibatches = _split(shuffled, cfg.num_minibatches)
        return jax.lax.scan(minibatch_step, carry, (minibatches, epoch_packed))

    carry = (
        (state.policy, state.value),
        (state.policy_opt, state.value_opt),
        state.lr_scale,
        state.skipped,
    )
    if plan is None:
        perms, packed = epoch_permutations(cfg, state.key, batch_size), None
    else:
        perms, packed = plan.permutations, plan.rows
    # The first minibatch of the first epoch sees the parameters that scored the
    # batch, so its importance ratio must be 1 (exactly, unless packed rows differ
    # from the scoring pass's in summation order): record it as a check.
    carry, per_step = jax.lax.scan(epoch_step, carry, (perms, packed))
    (policy, value), (policy_opt, value_opt), lr_scale, skipped = carry
    metrics = jax.tree.map(jnp.mean, per_step)
    metrics["first_ratio_max_dev"] = jnp.maximum(
        jnp.abs(per_step["ratio_max"][0, 0] - 1.0), jnp.abs(per_step["ratio_min"][0, 0] - 1.0)
    )
    n_steps = cfg.epochs * cfg.num_minibatches
    kept_rows = (batch.loss_weight > 0).astype(jnp.float32)  # [B]
    observed_kl = masked_mean(
        kl_estimate(batch.old_logp, batch.ref_logp, kind=cfg.kl_kind), batch.response_mask
    )
    new_kl = update_kl_controller(
        state.kl, observed_kl, n_steps=batch_size, target=cfg.kl_target,
        horizon=cfg.kl_horizon, adaptive=cfg.kl_adaptive,
    )  # fmt: skip
    lr_scale = _adapt_lr(cfg, lr_scale, metrics)
    metrics.update(
        rollout_kl=observed_kl,
        kl_coef=new_kl.coef,
        lr=learning_rate_schedule(cfg, cfg.learning_rate)(state.step + n_steps) * lr_scale,
        lr_scale=lr_scale,
        skipped_total=skipped.astype(jnp.float32),
        advantage_mean=masked_mean(batch.advantages, batch.response_mask),
        # Over the rows in the loss (weight > 0): dropped rows have no tokens left in the mask.
        reward_mean=masked_mean(jnp.sum(batch.rewards * batch.response_mask, axis=1), kept_rows),
        response_len=masked_mean(jnp.sum(batch.response_mask, axis=1), kept_rows),
    )
    new_state = state.replace(
        step=state.step + n_steps, policy=policy, value=value, policy_opt=policy_opt,
        value_opt=value_opt, kl=new_kl, lr_scale=lr_scale, skipped=skipped, key=key,
    )  # fmt: skip
    return new_state, metrics


def _adapt_lr(cfg: PPOConfig, lr_scale: jax.Array, metrics) -> jax.Array:
    """Scale the learning rate down when KL (or clipping) overshoots its target, up when under."""
    if cfg.adaptive_lr == "none":
        return lr_scale
    measured = metrics["approx_kl"] if cfg.adaptive_lr == "kl" else metrics["clip_frac"]
    factor = cfg.adaptive_lr_factor
    target = cfg.adaptive_lr_target
    lr_scale = jnp.where(measured > 2 * target, lr_scale / factor, lr_scale)
    lr_scale = jnp.where(measured < target / 2, lr_scale * factor, lr_scale)
    low, high = cfg.adaptive_lr_bounds
    return jnp.clip(lr_scale, low, high)


def check_batch_layout(cfg: PPOConfig, batch_size: int, mesh: Mesh | None, rules=DEFAULT_RULES):
    """Refuse batch sizes that do not split into minibatches, microbatches and devices."""
    if batch_size % cfg.num_minibatches:
        raise ValueError(
            f"batch size {batch_size} does not divide into ppo.num_minibatches="
            f"{cfg.num_minibatches}"
        )
    mb = batch_size // cfg.num_minibatches
    if mb % cfg.grad_accum:
        raise ValueError(
            f"minibatch size {mb} (batch {batch_size} / ppo.num_minibatches "
            f"{cfg.num_minibatches}) does not divide into ppo.grad_accum={cfg.grad_accum}"
        )
    if mesh is not None:
        dp = data_parallel_size(mesh, rules)
        micro = mb // cfg.grad_accum
        if micro % dp:
            raise ValueError(
                f"microbatch size {micro} (batch {batch_size} / ppo.num_minibatches "
                f"{cfg.num_minibatches} / ppo.grad_accum {cfg.grad_accum}) does not divide "
                f"across the {dp} data-parallel devices (mesh.data x mesh.fsdp)"
            )


class PPOTrainer:
    """Jitted, sharded entry points around the pure functions above.

    ``update`` donates the train state; the reference parameters are a separate,
    non-donated argument of ``score``. With ``frozen`` (a LoRA policy: see
    ``rlpt.models.lora``), the train state's policy and the reference are adapter
    states only, and ``frozen`` is the one base both are merged with, passed to
    every jitted call and never donated or differentiated.
    """

    def __init__(
        self,
        cfg: PPOConfig,
        policy_graph,
        value_graph=None,
        *,
        mesh: Mesh | None = None,
        rules: Rules = DEFAULT_RULES,
        frozen=None,
    ):
        self.cfg = cfg
        self.frozen = frozen
        self.policy_graph = policy_graph
        self.value_graph = value_graph
        self.mesh = mesh
        self.rules = rules
        self._update = {}  # packed rows or not -> the jitted update
        self._score = None
        self._advantages = None
        self._mismatch = None
        self._permutations = None

    def _data_parallel(self) -> int:
        return 1 if self.mesh is None else data_parallel_size(self.mesh, self.rules)

    def _packed_sharding(self, tree, rows_axis: int):
        """Packed rows split over the data-parallel axes on their row dimension."""

        def one(x):
            names = [None] * x.ndim
            names[rows_axis] = "batch"
            spec = logical_to_spec(tuple(names), None, self.mesh, self.rules)
            return NamedSharding(self.mesh, spec)

        return jax.tree.map(one, tree)

    def plan(self, state: TrainState, batch: RolloutBatch) -> UpdatePlan | None:
        """The packed layout of this update (``cfg.pack_sequences``), planned on the host."""
        if not self.cfg.pack_sequences:
            return None
        if self._permutations is None:
            self._permutations = jax.jit(
                functools.partial(epoch_permutations, self.cfg), static_argnums=1
            )
        # The host plans the packing from the whole batch, which every process holds.
        perms = to_host(self._permutations(state.key, batch.batch_size))
        tokens, input_mask = to_host((batch.tokens, batch.input_mask))
        return plan_update(
            batch.replace(tokens=tokens, input_mask=input_mask), perms,
            self.cfg.num_minibatches, self.cfg.grad_accum, self._data_parallel(),
        )  # fmt: skip

    def _batch_shardings(self, batch: RolloutBatch):
        if self.mesh is None:
            return None
        return jax.tree.map(lambda x: batch_sharding(self.mesh, x.ndim, self.rules), batch)

    def state_shardings(self, state: TrainState):
        if self.mesh is None:
            return None
        return tree_shardings(state, self.mesh, self.rules)

    def shard_state(self, state: TrainState) -> TrainState:
        """Place a fresh state where the update keeps it, so the second update does not
        recompile for a change from uncommitted to committed arrays."""
        if self.mesh is None:
            return jax.device_put(state, jax.devices()[0])
        return to_device(state, self.state_shardings(state))

    def shard_batch(self, batch: RolloutBatch) -> RolloutBatch:
        if self.mesh is None:
            return batch
        return to_device(batch, self._batch_shardings(batch))

    def _place(self, tree, sharding_fn):
        """``tree`` on the mesh (host values of every process onto global shardings)."""
        if self.mesh is None or tree is None:
            return tree
        return to_device(tree, sharding_fn(tree))

    def _params_sharding(self, tree):
        return state_shardings(tree, self.mesh, self.rules)

    def update(self, state: TrainState, batch: RolloutBatch):
        check_batch_layout(self.cfg, batch.batch_size, self.mesh, self.rules)
        plan = self.plan(state, batch)
        update = self.jitted_update(state, batch, plan)
        if self.mesh is not None:
            batch = self.shard_batch(batch)
            if plan is not None:
                plan = to_device(plan, UpdatePlan(
                    permutations=replicated(self.mesh),
                    rows=self._packed_sharding(plan.rows, rows_axis=3),
                ))  # fmt: skip
        return update(state, batch, self._place(self.frozen, self._params_sharding), plan)

    def jitted_update(self, state: TrainState, batch: RolloutBatch, plan: UpdatePlan | None = None):
        """The jitted ``(state, batch, frozen, plan) -> (state, metrics)``; ``state``, ``batch``
        and ``plan`` may be abstract (``jax.ShapeDtypeStruct``s), for ahead-of-time lowering.
        ``plan`` is None for padded rows. One jitted function serves every packed shape
        (jit retraces per shape); shardings depend only on whether the rows are packed."""
        packed = plan is not None
        if packed not in self._update:
            update = functools.partial(
                ppo_update, self.cfg, self.policy_graph, self.value_graph, mesh=self.mesh,
                rules=self.rules,
            )  # fmt: skip
            fn = lambda state, batch, frozen, plan: update(state, batch, frozen=frozen, plan=plan)
            if self.mesh is None:
                jitted = jax.jit(fn, donate_argnums=0)
            else:
                state_sh = self.state_shardings(state)
                frozen_sh = (
                    None if self.frozen is None
                    else state_shardings(self.frozen, self.mesh, self.rules)
                )  # fmt: skip
                plan_sh = None
                if plan is not None:
                    # Rows of each unit [E, M, G, N, L] over the data axes; the gather index
                    # [E, M, G, b, T] like the unit's batch rows.
                    plan_sh = UpdatePlan(
                        permutations=replicated(self.mesh),
                        rows=self._packed_sharding(plan.rows, rows_axis=3),
                    )
                jitted = jax.jit(
                    fn,
                    in_shardings=(state_sh, self._batch_shardings(batch), frozen_sh, plan_sh),
                    out_shardings=(state_sh, replicated(self.mesh)),
                    donate_argnums=0,
                )
            self._update[packed] = jitted
        return self._update[packed]

    def score(self, state: TrainState, ref_params, batch: RolloutBatch) -> RolloutBatch:
        packed = pack_batch(batch, self._data_parallel()) if self.cfg.pack_sequences else None
        if self._score is None:

            def fn(policy, ref, value, batch, frozen, packed):
                with activation_sharding(self.mesh, self.rules):
                    return score_rollout(
                        self.policy_graph, self.value_graph, policy, ref, value, batch, frozen,
                        self.cfg.sampling_temperature, packed,
                        old_from_behaviour=self.cfg.old_logprobs == "behaviour",
                    )  # fmt: skip

            if self.mesh is None:
                self._score = jax.jit(fn)
            else:
                sh = lambda tree: (
                    None if tree is None else state_shardings(tree, self.mesh, self.rules)
                )
                batch_sh = self._batch_shardings(batch)
                packed_sh = None if packed is None else self._packed_sharding(packed, rows_axis=0)
                self._score = jax.jit(
                    fn,
                    in_shardings=(
                        sh(state.policy), sh(ref_params), sh(state.value), batch_sh,
                        sh(self.frozen), packed_sh,
                    ),
                    out_shardings=batch_sh,
                )  # fmt: skip
        if self.mesh is not None:
            ref_params = self._place(ref_params, self._params_sharding)
            batch = self.shard_batch(batch)
            if packed is not None:
                packed = to_device(packed, self._packed_sharding(packed, rows_axis=0))
        frozen = self._place(self.frozen, self._params_sharding)
        return self._score(state.policy, ref_params, state.value, batch, frozen, packed)

    def mismatch(self, batch: RolloutBatch) -> dict[str, jax.Array]:
        """How far the sampler's log-probs are from the scored ``old_logp`` on a scored
        batch: ``mismatch_kl`` (k3 of KL(behaviour || old)) and ``mismatch_logp_max_abs``
        (``behaviour_weights``)."""
        if self._mismatch is None:

            def fn(old, behaviour, mask):
                diag = behaviour_weights(old, behaviour, mask, mode="none", cap=self.cfg.is_cap)[1]
                return {k: diag[k] for k in ("mismatch_kl", "mismatch_logp_max_abs")}

            self._mismatch = jax.jit(fn)
        return self._mismatch(batch.old_logp, batch.behaviour_logp, batch.response_mask)

    def advantages(self, state: TrainState, batch: RolloutBatch) -> RolloutBatch:
        if self._advantages is None:
            fn = functools.partial(compute_advantages, self.cfg)
            if self.mesh is None:
                self._advantages = jax.jit(fn)
            else:
                batch_sh = self._batch_shardings(batch)
                self._advantages = jax.jit(
                    fn, in_shardings=(replicated(self.mesh), batch_sh), out_shardings=batch_sh
                )
        kl = state.kl if self.mesh is None else to_device(state.kl, replicated(self.mesh))
        return self._advantages(kl, batch)
