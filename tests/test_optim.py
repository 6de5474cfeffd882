"""The optimiser and schedule factory against hand-worked learning rates and Adam steps."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlpt.optim import make_optimizer, make_schedule

# float32 schedules: a relative 1e-6 covers the rounding of a handful of float32 ops.
RTOL = 1e-6


def _values(schedule, steps):
    return [float(schedule(s)) for s in steps]


def test_constant_and_warmup_by_hand():
    np.testing.assert_allclose(_values(make_schedule(0.5), [0, 7, 10_000]), [0.5] * 3, RTOL)
    # Warmup over 4 steps from 0.1 to 0.5: +0.1 per step, then constant.
    s = make_schedule(0.5, warmup_steps=4, init_value=0.1)
    np.testing.assert_allclose(
        _values(s, [0, 1, 2, 3, 4, 5, 100]), [0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5], RTOL
    )


def test_linear_decay_by_hand():
    # Warm up 0 -> 1 over 2 steps, then down to 0.2 at step 10: -0.1 per step over 8 steps.
    s = make_schedule(1.0, "linear", warmup_steps=2, total_steps=10, end_fraction=0.2)
    np.testing.assert_allclose(
        _values(s, [0, 1, 2, 3, 6, 10, 20]), [0.0, 0.5, 1.0, 0.9, 0.6, 0.2, 0.2], RTOL, 1e-7
    )
    # No warmup: the first step is at the peak.
    s = make_schedule(2.0, "linear", total_steps=4)
    np.testing.assert_allclose(_values(s, [0, 1, 2, 4, 5]), [2.0, 1.5, 1.0, 0.0, 0.0], RTOL)


def test_cosine_decay_by_hand():
    # lr(s) = end + (peak - end) (1 + cos(pi (s - w) / (T - w))) / 2 after a linear warmup.
    peak, end, w, total = 1.0, 0.1, 2, 12
    s = make_schedule(peak, "cosine", warmup_steps=w, total_steps=total, end_fraction=0.1)
    want = [0.0, 0.5] + [
        end + (peak - end) * (1 + math.cos(math.pi * (k - w) / (total - w))) / 2
        for k in range(w, total + 1)
    ]
    np.testing.assert_allclose(_values(s, range(total + 1)), want, RTOL, 1e-7)


def test_bad_schedule_settings_are_errors():
    with pytest.raises(ValueError, match="decay"):
        make_schedule(1.0, "exponential")
    with pytest.raises(ValueError, match="total_steps"):
        make_schedule(1.0, "cosine", warmup_steps=5, total_steps=5)
    with pytest.raises(ValueError, match="warmup_steps"):
        make_schedule(1.0, warmup_steps=-1)
    with pytest.raises(ValueError, match="max_grad_norm"):
        make_optimizer(1.0, max_grad_norm=0.0)


def _one_step(tx, params, grads):
    updates, _ = tx.update(grads, tx.init(params), params)
    return np.asarray(optax.apply_updates(params, updates))


def test_one_adamw_step_by_hand():
    # Adam's first step: m_hat = g, v_hat = g^2, so the update is -lr g / (|g| + eps);
    # AdamW also subtracts lr * wd * p. The gradient norm 5 is clipped to 2.5 first.
    p = jnp.array([1.0, -2.0], jnp.float32)
    g = jnp.array([3.0, -4.0], jnp.float32)
    lr, wd, eps = 0.1, 0.5, 1e-8
    clipped = np.array([3.0, -4.0]) * 2.5 / 5.0
    want = np.array([1.0, -2.0]) - lr * (clipped / (np.abs(clipped) + eps) + wd * np.array([1, -2]))
    tx = make_optimizer(lr, max_grad_norm=2.5, weight_decay=wd, eps=eps)
    np.testing.assert_allclose(_one_step(tx, p, g), want, RTOL)
    # The same step on a schedule reads schedule(0).
    tx = make_optimizer(make_schedule(lr, warmup_steps=3, init_value=lr / 2), weight_decay=wd)
    want = np.array([1.0, -2.0]) - lr / 2 * (np.sign([3.0, -4.0]) + wd * np.array([1, -2]))
    np.testing.assert_allclose(_one_step(tx, p, g), want, RTOL)


def test_adam_without_decay_keeps_no_decay_state():
    p = jnp.array([1.0, -2.0], jnp.float32)
    g = jnp.array([0.3, 0.4], jnp.float32)
    # Adam with eps 1e-5 on a gradient well under the clip: -lr g / (|g| + eps).
    tx = make_optimizer(0.1, weight_decay=None, eps=1e-5)
    want = np.array([1.0, -2.0]) - 0.1 * np.array([0.3, 0.4]) / (np.array([0.3, 0.4]) + 1e-5)
    np.testing.assert_allclose(_one_step(tx, p, g), want, RTOL)
    # Checkpoints hold the state tree: AdamW at 0 and Adam give different trees, and a
    # number as the learning rate keeps no step count where a schedule does.
    tree = lambda t: jax.tree.structure(t.init(p))
    assert tree(tx) != tree(make_optimizer(0.1, weight_decay=0.0))
    assert tree(make_optimizer(0.1)) != tree(make_optimizer(optax.constant_schedule(0.1)))
