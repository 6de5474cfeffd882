"""Reward-model maths: pairwise and step-level losses and their evaluation figures.

Pure functions of arrays; the adapters that run models live in ``rlpt.rewards.train``.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np


def bradley_terry_loss(
    chosen: jax.Array,  # [N] reward of the preferred completion
    rejected: jax.Array,  # [N] reward of the other one
    margin: jax.Array | float = 0.0,  # [N] or scalar
    weights: jax.Array | None = None,  # [N] per-pair weight (0 drops a padding pair)
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Bradley-Terry pairwise loss ``-log sigmoid(r_c - r_r - m)``, weighted mean over pairs.

    P(chosen > rejected) = sigmoid(r_c - r_r) (Bradley & Terry 1952; InstructGPT,
    Ouyang et al. 2022). The margin ``m`` (Llama 2, Touvron et al. 2023) asks the
    model to separate clearly preferred pairs by at least ``m``.
    Returns ``(loss, {"accuracy", "margin"})``: accuracy counts ``r_c > r_r``.
    """
    chex.assert_rank([chosen, rejected], 1)
    chex.assert_equal_shape([chosen, rejected])
    if weights is None:
        weights = jnp.ones_like(chosen)
    chex.assert_equal_shape([chosen, weights])
    diff = chosen.astype(jnp.float32) - rejected.astype(jnp.float32)  # [N]
    # -log sigmoid(x) = softplus(-x), stable for large |x|.
    per_pair = jax.nn.softplus(-(diff - margin))  # [N]
    total = jnp.maximum(jnp.sum(weights), 1e-9)
    loss = jnp.sum(per_pair * weights) / total
    accuracy = jnp.sum((diff > 0) * weights) / total
    return loss, {"accuracy": accuracy, "margin": jnp.sum(diff * weights) / total}


def binary_cross_entropy(
    logits: jax.Array,  # [B, T] step logits
    labels: jax.Array,  # [B, T] soft or hard labels in [0, 1]
    mask: jax.Array,  # [B, T] 1 where a label exists (step separators)
) -> jax.Array:
    """Mean over labelled positions of ``-(y log sigmoid(x) + (1 - y) log(1 - sigmoid(x)))``.

    Written as ``softplus(x) - y x``, which is exact and stable for any logit.
    Used for process reward models trained on Math-Shepherd labels (Wang et al. 2023).
    """
    chex.assert_equal_shape([logits, labels, mask])
    logits = logits.astype(jnp.float32)
    mask = mask.astype(jnp.float32)
    per_token = jax.nn.softplus(logits) - labels.astype(jnp.float32) * logits  # [B, T]
    return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve: P(score of a random positive > a random negative).

    The Mann-Whitney form with ties counted half. Host-side numpy (an evaluation
    figure, not a training signal). NaN when one class is absent.
    """
    scores = np.asarray(scores, np.float64).ravel()
    labels = np.asarray(labels).astype(bool).ravel()
    if scores.shape != labels.shape:
        raise ValueError(f"scores {scores.shape} and labels {labels.shape} differ in shape")
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), np.float64)
    sorted_scores = scores[order]
    # Average rank within ties, so tied positive/negative pairs count one half.
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def pairwise_accuracy(chosen: np.ndarray, rejected: np.ndarray) -> float:
    """Fraction of pairs the model orders correctly (ties count as wrong)."""
    chosen, rejected = np.asarray(chosen), np.asarray(rejected)
    if chosen.shape != rejected.shape or chosen.ndim != 1:
        raise ValueError(f"need two [N] arrays, got {chosen.shape} and {rejected.shape}")
    return float(np.mean(chosen > rejected)) if len(chosen) else float("nan")
