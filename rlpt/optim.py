"""The one optimiser and learning-rate schedule factory of every trainer.

Every trainer (PPO on language models, gymnasium PPO, SFT, reward and process-reward
models) clips the global gradient norm and then runs Adam or AdamW on a schedule
built here from optax pieces:

    warmup: linear from ``init_value`` to ``peak`` over ``warmup_steps``
    then:   "constant" at ``peak``
            "linear" to ``end_fraction * peak`` at ``total_steps``
            "cosine" to ``end_fraction * peak`` at ``total_steps`` (Loshchilov & Hutter 2017)

``total_steps`` counts the warmup too, as optax's ``warmup_cosine_decay_schedule``
does. The learning rate of step ``s`` (0-based) is ``schedule(s)``; optax counts the
updates already applied, so the first update uses ``schedule(0)``.
"""

from __future__ import annotations

import optax

DECAYS = ("constant", "linear", "cosine")


def make_schedule(
    peak: float,
    decay: str = "constant",
    *,
    warmup_steps: int = 0,
    init_value: float = 0.0,
    total_steps: int | None = None,
    end_fraction: float = 0.0,
) -> optax.Schedule:
    """Linear warmup from ``init_value`` to ``peak``, then ``decay`` (see the module doc).

    Args:
      peak: the learning rate after warmup.
      decay: "constant", "linear" or "cosine".
      warmup_steps: steps of linear warmup (0: none, the first step is at ``peak``).
      init_value: the learning rate of step 0 when there is a warmup.
      total_steps: where a decay ends, warmup included (needed unless constant).
      end_fraction: the final learning rate as a fraction of ``peak``.
    """
    if decay not in DECAYS:
        raise ValueError(f"schedule decay must be one of {DECAYS}, got {decay!r}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if decay != "constant" and (total_steps is None or total_steps <= warmup_steps):
        raise ValueError(
            f"a {decay} decay needs total_steps > warmup_steps={warmup_steps}, got {total_steps}"
        )
    end = end_fraction * peak
    if decay == "cosine":
        # optax's own warmup + cosine, so the decay's alpha is exactly what optax computes.
        return optax.warmup_cosine_decay_schedule(init_value, peak, warmup_steps, total_steps, end)
    if decay == "linear":
        after = optax.linear_schedule(peak, end, total_steps - warmup_steps)
    else:
        after = optax.constant_schedule(peak)
    if warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(init_value, peak, warmup_steps)
    return optax.join_schedules([warmup, after], [warmup_steps])


def make_optimizer(
    learning_rate: float | optax.Schedule,
    *,
    max_grad_norm: float = 1.0,
    weight_decay: float | None = 0.0,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
    """Clip by global norm, then Adam(W) at ``learning_rate`` (a number or a schedule).

    ``weight_decay=None`` is plain Adam (no decay transform in the chain); a number, 0
    included, is AdamW. The two give the same updates at 0 but different optimiser-state
    trees, and checkpoints hold the tree, so each trainer keeps the one it saves. Likewise
    a number as ``learning_rate`` keeps no step count in the state, a schedule does.
    """
    if not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    if weight_decay is None:
        adam = optax.adam(learning_rate, eps=eps)
    else:
        adam = optax.adamw(learning_rate, eps=eps, weight_decay=weight_decay)
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adam)


__all__ = ["DECAYS", "make_optimizer", "make_schedule"]
