"""Supervised training: one jitted, sharded, donated step for SFT, reward and process-reward
models.

``SupervisedTrainer(cfg, graphdef, objective)`` binds an objective (an adapter from a
model and a batch of arrays to a pure loss: next-token NLL in ``rlpt.sft``,
Bradley-Terry and process-reward BCE in ``rlpt.rewards.train``) to the optimiser of
``rlpt.optim``, and jits ``step(state, batch) -> (state, metrics)`` like the PPO
update: on a mesh, parameters and optimiser moments sharded by the logical-axis rules
and the batch over the data-parallel axes, explicit in/out shardings, the state donated.
A step with a non-finite loss or gradient changes nothing (parameters and moments kept)
and is counted in ``state.skipped``.

An objective is ``objective(graphdef, params, batch) -> (loss, metrics)``; with
``frozen`` (a LoRA policy's base, held fixed) it is called as
``objective(graphdef, params, batch, frozen=frozen)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh

from rlpt.optim import make_optimizer, make_schedule
from rlpt.parallel.multihost import to_device
from rlpt.parallel.sharding import (
    DEFAULT_RULES,
    Rules,
    activation_sharding,
    batch_sharding,
    data_parallel_size,
    replicated,
    state_shardings,
    tree_shardings,
)

Batch = Mapping[str, jax.Array]
Objective = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimiser settings of a supervised run (SFT, reward model, process reward model).

    The learning rate warms up linearly from ``warmup_init`` to ``learning_rate`` over
    ``warmup_steps``; with ``decay_steps`` > 0 it then follows a cosine to 10% of the peak
    at ``decay_steps`` (warmup included), which settles a fine-tune that a constant rate
    leaves noisy near its end; otherwise it stays at the peak.
    """

    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    decay_steps: int = 0
    warmup_init: float = 0.0

    def __post_init__(self):
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_steps and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"decay_steps={self.decay_steps} must exceed warmup_steps={self.warmup_steps}"
            )
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")

    def schedule(self) -> float | optax.Schedule:
        """The learning rate: a plain number when it never changes (no step count kept)."""
        if self.decay_steps:
            return make_schedule(
                self.learning_rate, "cosine", warmup_steps=self.warmup_steps,
                init_value=self.warmup_init, total_steps=self.decay_steps, end_fraction=0.1,
            )  # fmt: skip
        if self.warmup_steps:
            return make_schedule(
                self.learning_rate, warmup_steps=self.warmup_steps, init_value=self.warmup_init
            )
        return self.learning_rate

    def learning_rate_at(self, step: int) -> float:
        """The learning rate of 0-based update ``step``, as the optimiser applies it."""
        schedule = self.schedule()
        return float(schedule(step)) if callable(schedule) else float(schedule)

    def optimizer(self) -> optax.GradientTransformation:
        return make_optimizer(
            self.schedule(), max_grad_norm=self.max_grad_norm, weight_decay=self.weight_decay
        )


@struct.dataclass
class SupervisedState:
    step: jax.Array  # int32 optimiser steps taken (skipped ones included)
    params: Any  # nnx.State being trained
    opt_state: Any
    skipped: jax.Array  # int32 steps skipped for a non-finite loss or gradient


def init_state(cfg: TrainConfig, params) -> SupervisedState:
    return SupervisedState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=cfg.optimizer().init(params),
        skipped=jnp.zeros((), jnp.int32),
    )  # fmt: skip


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def train_step(
    cfg: TrainConfig,
    graphdef,
    objective: Objective,
    state: SupervisedState,
    batch: Batch,
    frozen: Any = None,
) -> tuple[SupervisedState, dict[str, jax.Array]]:
    """One optimiser step on ``objective``; a non-finite step changes nothing. Pure.

    ``frozen``: variables merged into the model but not trained (a LoRA base).
    """
    tx = cfg.optimizer()
    extra = {} if frozen is None else {"frozen": frozen}
    grad_fn = jax.value_and_grad(lambda p: objective(graphdef, p, batch, **extra), has_aux=True)
    (loss, metrics), grads = grad_fn(state.params)
    finite = _all_finite(grads) & jnp.isfinite(loss)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_state = SupervisedState(
        step=state.step + 1, params=keep(params, state.params),
        opt_state=keep(opt_state, state.opt_state),
        skipped=state.skipped + (~finite).astype(jnp.int32),
    )  # fmt: skip
    metrics = dict(
        metrics, loss=loss, grad_norm=optax.global_norm(grads),
        skipped=1.0 - finite.astype(jnp.float32),
    )  # fmt: skip
    return new_state, metrics


class SupervisedTrainer:
    """Jitted ``step`` (state donated) and ``evaluate`` around one objective.

    With a ``mesh``, ``init`` places the state by the logical-axis ``rules`` and every
    batch is split over the data-parallel axes (its leading size must divide by them);
    without one, everything stays where JAX puts it.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        graphdef,
        objective: Objective,
        *,
        mesh: Mesh | None = None,
        rules: Rules = DEFAULT_RULES,
        frozen: Any = None,
    ):
        self.cfg = cfg
        self.graphdef = graphdef
        self.objective = objective
        self.mesh = mesh
        self.rules = rules
        self.frozen = frozen
        if mesh is not None and frozen is not None:
            self.frozen = to_device(frozen, state_shardings(frozen, mesh, rules))
        self._step = None
        self._eval = None

    def init(self, params) -> SupervisedState:
        state = init_state(self.cfg, params)
        if self.mesh is None:
            return state
        return to_device(state, self.state_shardings(state))

    def state_shardings(self, state: SupervisedState):
        """Where the state lives on the mesh (None without one); ``state`` may be abstract."""
        if self.mesh is None:
            return None
        return tree_shardings(state, self.mesh, self.rules)

    def _frozen_sh(self):
        return None if self.frozen is None else state_shardings(self.frozen, self.mesh, self.rules)

    def _batch_sh(self, batch: Batch):
        return {k: batch_sharding(self.mesh, np.ndim(v), self.rules) for k, v in batch.items()}

    def shard_batch(self, batch: Batch) -> Batch:
        if self.mesh is None:
            return {k: jnp.asarray(v) for k, v in batch.items()}
        dp = data_parallel_size(self.mesh, self.rules)
        for k, v in batch.items():
            if np.shape(v)[0] % dp:
                raise ValueError(
                    f"batch[{k!r}] has {np.shape(v)[0]} rows, which do not split over the "
                    f"{dp} data-parallel devices of the mesh"
                )
        return to_device(dict(batch), self._batch_sh(batch))

    def learning_rate_at(self, step: int) -> float:
        return self.cfg.learning_rate_at(step)

    def step(self, state: SupervisedState, batch: Batch):
        """``(state, batch) -> (state, metrics)``; ``state`` is donated."""
        batch = self.shard_batch(batch)
        if self._step is None:

            def fn(state, batch, frozen):
                with activation_sharding(self.mesh, self.rules):
                    return train_step(self.cfg, self.graphdef, self.objective, state, batch, frozen)

            if self.mesh is None:
                self._step = jax.jit(fn, donate_argnums=0)
            else:
                state_sh = self.state_shardings(state)
                self._step = jax.jit(
                    fn, in_shardings=(state_sh, self._batch_sh(batch), self._frozen_sh()),
                    out_shardings=(state_sh, replicated(self.mesh)), donate_argnums=0,
                )  # fmt: skip
        return self._step(state, batch, self.frozen)

    def evaluate(self, params, batch: Batch) -> dict[str, jax.Array]:
        """The objective's loss (``loss``) and metrics on a batch, without updating."""
        batch = self.shard_batch(batch)
        if self._eval is None:

            def fn(params, batch, frozen):
                extra = {} if frozen is None else {"frozen": frozen}
                with activation_sharding(self.mesh, self.rules):
                    loss, metrics = self.objective(self.graphdef, params, batch, **extra)
                return dict(metrics, loss=loss)

            self._eval = jax.jit(fn)
        return self._eval(params, batch, self.frozen)


__all__ = [
    "Batch",
    "Objective",
    "SupervisedState",
    "SupervisedTrainer",
    "TrainConfig",
    "init_state",
    "train_step",
]
