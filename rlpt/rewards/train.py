"""Training the reward roles: one jitted, sharded, donated step shared by RM, PRM and SFT.

``Trainer(graphdef, objective, cfg)`` binds an objective (an adapter from a
model and a batch of arrays to the pure losses in ``rlpt.rewards.losses``) to
an optax optimiser, and jits ``step(state, batch) -> (state, metrics)`` like
the PPO update: explicit in/out shardings on a mesh, the state donated, and a
step with non-finite loss or gradients skipped (parameters and moments kept)
and counted.

Objectives:

- ``rm_objective``: Bradley-Terry on chosen/rejected rows (one forward pass of 2N rows).
- ``prm_objective``: binary cross-entropy at step-separator positions.
- ``sft_objective``: next-token cross-entropy on completion tokens (warm starts).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from rlpt.models.transformer import positions_from_mask
from rlpt.parallel.sharding import (
    DEFAULT_RULES,
    Rules,
    activation_sharding,
    batch_sharding,
    replicated,
    tree_shardings,
)
from rlpt.rewards.losses import binary_cross_entropy, bradley_terry_loss

Batch = Mapping[str, jax.Array]
Objective = Callable[[Any, Any, Batch], tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimiser settings of a reward-model (or SFT) training run."""

    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    # > 0: cosine decay to 10% of the peak over this many steps (warmup included), which
    # settles a fine-tune that a constant rate leaves noisy near its end.
    decay_steps: int = 0


@struct.dataclass
class ModelTrainState:
    step: jax.Array  # int32 optimiser steps taken
    params: Any  # nnx.State
    opt_state: Any
    skipped: jax.Array  # int32 steps skipped for non-finite loss or gradients


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    lr: Any = cfg.learning_rate
    if cfg.decay_steps:
        if cfg.decay_steps <= cfg.warmup_steps:
            raise ValueError(
                f"decay_steps={cfg.decay_steps} must exceed warmup_steps={cfg.warmup_steps}"
            )
        lr = optax.warmup_cosine_decay_schedule(
            0.0, cfg.learning_rate, cfg.warmup_steps, cfg.decay_steps, 0.1 * cfg.learning_rate
        )
    elif cfg.warmup_steps:
        lr = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
    return optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm),
        optax.adamw(lr, weight_decay=cfg.weight_decay),
    )


def init_state(cfg: TrainConfig, params) -> ModelTrainState:
    return ModelTrainState(
        step=jnp.zeros((), jnp.int32), params=params,
        opt_state=make_optimizer(cfg).init(params), skipped=jnp.zeros((), jnp.int32),
    )  # fmt: skip


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def train_step(
    cfg: TrainConfig, graphdef, objective: Objective, state: ModelTrainState, batch: Batch
) -> tuple[ModelTrainState, dict[str, jax.Array]]:
    """One optimiser step on ``objective``; a non-finite step changes nothing. Pure."""
    tx = make_optimizer(cfg)
    grad_fn = jax.value_and_grad(lambda p: objective(graphdef, p, batch), has_aux=True)
    (loss, metrics), grads = grad_fn(state.params)
    finite = _all_finite(grads) & jnp.isfinite(loss)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    skipped = state.skipped + (~finite).astype(jnp.int32)
    new_state = ModelTrainState(
        step=state.step + 1, params=keep(params, state.params),
        opt_state=keep(opt_state, state.opt_state), skipped=skipped,
    )  # fmt: skip
    metrics = dict(
        metrics, loss=loss, grad_norm=optax.global_norm(grads),
        skipped=1.0 - finite.astype(jnp.float32),
    )  # fmt: skip
    return new_state, metrics


class Trainer:
    """Jitted, sharded ``step`` (state donated) and ``evaluate`` around one objective."""

    def __init__(
        self,
        cfg: TrainConfig,
        graphdef,
        objective: Objective,
        *,
        mesh: Mesh | None = None,
        rules: Rules = DEFAULT_RULES,
    ):
        self.cfg = cfg
        self.graphdef = graphdef
        self.objective = objective
        self.mesh = mesh
        self.rules = rules
        self._step = None
        self._eval = None

    def init(self, params) -> ModelTrainState:
        state = init_state(self.cfg, params)
        if self.mesh is None:
            return state
        return jax.device_put(state, tree_shardings(state, self.mesh, self.rules))

    def _batch_sh(self, batch: Batch):
        return {k: batch_sharding(self.mesh, np.ndim(v), self.rules) for k, v in batch.items()}

    def shard_batch(self, batch: Batch) -> Batch:
        if self.mesh is None:
            return {k: jnp.asarray(v) for k, v in batch.items()}
        return jax.device_put(dict(batch), self._batch_sh(batch))

    def step(self, state: ModelTrainState, batch: Batch):
        batch = self.shard_batch(batch)
        if self._step is None:

            def fn(state, batch):
                with activation_sharding(self.mesh, self.rules):
                    return train_step(self.cfg, self.graphdef, self.objective, state, batch)

            if self.mesh is None:
                self._step = jax.jit(fn, donate_argnums=0)
            else:
                state_sh = tree_shardings(state, self.mesh, self.rules)
                self._step = jax.jit(
                    fn, in_shardings=(state_sh, self._batch_sh(batch)),
                    out_shardings=(state_sh, replicated(self.mesh)), donate_argnums=0,
                )  # fmt: skip
        return self._step(state, batch)

    def evaluate(self, params, batch: Batch) -> dict[str, jax.Array]:
        """The objective's loss and metrics on a batch, without updating."""
        batch = self.shard_batch(batch)
        if self._eval is None:

            def fn(params, batch):
                with activation_sharding(self.mesh, self.rules):
                    loss, metrics = self.objective(self.graphdef, params, batch)
                return dict(metrics, loss=loss)

            self._eval = jax.jit(fn)
        return self._eval(params, batch)


def with_trunk(params, policy_params):
    """A scalar-head model's parameters (reward, process reward) with the trunk replaced
    by a copy of a policy's: the usual warm start, since a trunk that already reads the
    domain learns the judgement much faster."""
    params["trunk"] = jax.tree.map(jnp.copy, policy_params["trunk"])
    if "lm_head" in params and "lm_head" in policy_params:  # a likelihood-term reward model
        params["lm_head"] = jax.tree.map(jnp.copy, policy_params["lm_head"])
    return params


def _positions(mask: jax.Array) -> jax.Array:
    return positions_from_mask(mask.astype(bool))


def sequence_scores(graphdef, params, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Reward-model scores [N] of right- or left-padded rows [N, L]."""
    model = nnx.merge(graphdef, params)
    return model(tokens, _positions(mask), mask.astype(bool))


def step_logits(
    graphdef, params, tokens: jax.Array, mask: jax.Array, response_mask: jax.Array | None = None
) -> jax.Array:
    """Process-reward-model logits at every position [N, L] (meaningful at separators).

    ``response_mask`` [N, L]: the solution's tokens, whose likelihood a likelihood-term
    PRM reads (by default every real token)."""
    model = nnx.merge(graphdef, params)
    scores, _ = model(tokens, _positions(mask), mask.astype(bool), response_mask=response_mask)
    return scores


def rm_objective(graphdef, params, batch: Batch, margin: float = 0.0):
    """Bradley-Terry loss; batch: ``chosen``/``rejected`` [N, L], their masks, ``margin`` [N].

    Optional ``weight`` [N] (0 for padding pairs).
    """
    n = batch["chosen"].shape[0]
    tokens = jnp.concatenate([batch["chosen"], batch["rejected"]], axis=0)  # [2N, L]
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]], axis=0)
    scores = sequence_scores(graphdef, params, tokens, mask)  # [2N]
    loss, metrics = bradley_terry_loss(
        scores[:n], scores[n:], batch["margin"] + margin, batch.get("weight")
    )
    return loss, metrics


def prm_objective(graphdef, params, batch: Batch):
    """BCE at separators; batch: ``tokens``, ``mask``, ``labels``, ``label_mask`` [N, L]
    and optionally ``response_mask`` [N, L]."""
    logits = step_logits(
        graphdef, params, batch["tokens"], batch["mask"], batch.get("response_mask")
    )
    lm = batch["label_mask"].astype(jnp.float32)
    loss = binary_cross_entropy(logits, batch["labels"], lm)
    hits = ((logits > 0) == (batch["labels"] > 0.5)) * lm
    return loss, {"accuracy": jnp.sum(hits) / jnp.maximum(jnp.sum(lm), 1.0)}


def sft_objective(graphdef, params, batch: Batch):
    """Next-token cross-entropy on ``loss_mask`` [N, L] tokens of ``tokens``/``mask`` [N, L].

    ``loss_mask[:, t]`` marks token t as a target (completion tokens), predicted
    from position t - 1.
    """
    tokens, mask = batch["tokens"], batch["mask"]
    logits, _ = nnx.merge(graphdef, params)(tokens, _positions(mask), mask.astype(bool))
    log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    target_lp = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]  # [N, L-1]
    weight = batch["loss_mask"][:, 1:].astype(jnp.float32)
    loss = -jnp.sum(target_lp * weight) / jnp.maximum(jnp.sum(weight), 1.0)
    return loss, {
        "token_accuracy": jnp.sum((jnp.argmax(log_probs, -1) == tokens[:, 1:]) * weight)
        / jnp.maximum(jnp.sum(weight), 1.0)
    }


def rm_trainer(
    cfg: TrainConfig,
    graphdef,
    *,
    margin: float = 0.0,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
) -> Trainer:
    """A reward-model trainer; ``margin`` is added to every pair's own margin."""
    objective = functools.partial(rm_objective, margin=margin)
    return Trainer(cfg, graphdef, objective, mesh=mesh, rules=rules)


def prm_trainer(
    cfg: TrainConfig, graphdef, *, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES
) -> Trainer:
    return Trainer(cfg, graphdef, prm_objective, mesh=mesh, rules=rules)


def sft_trainer(
    cfg: TrainConfig, graphdef, *, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES
) -> Trainer:
    return Trainer(cfg, graphdef, sft_objective, mesh=mesh, rules=rules)
