"""Training the reward roles: reward-model and process-reward-model objectives.

The objectives are adapters from a model and a batch of arrays to the pure losses in
``rlpt.rewards.losses``; ``rlpt.supervised.SupervisedTrainer`` runs them
(jitted, sharded, donated, a non-finite step skipped), as it runs SFT.

- ``rm_objective``: Bradley-Terry on chosen/rejected rows (one forward pass of 2N rows).
- ``prm_objective``: binary cross-entropy at step-separator positions.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from rlpt.models.transformer import positions_from_mask
from rlpt.parallel.sharding import DEFAULT_RULES, Rules
from rlpt.rewards.losses import binary_cross_entropy, bradley_terry_loss
from rlpt.supervised import SupervisedTrainer, TrainConfig

Batch = Mapping[str, jax.Array]


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


def rm_trainer(
    cfg: TrainConfig,
    graphdef,
    *,
    margin: float = 0.0,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
) -> SupervisedTrainer:
    """A reward-model trainer; ``margin`` is added to every pair's own margin."""
    objective = functools.partial(rm_objective, margin=margin)
    return SupervisedTrainer(cfg, graphdef, objective, mesh=mesh, rules=rules)


def prm_trainer(
    cfg: TrainConfig, graphdef, *, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES
) -> SupervisedTrainer:
    return SupervisedTrainer(cfg, graphdef, prm_objective, mesh=mesh, rules=rules)


__all__ = [
    "TrainConfig",
    "prm_objective",
    "prm_trainer",
    "rm_objective",
    "rm_trainer",
    "sequence_scores",
    "step_logits",
    "with_trunk",
]
