"""Projections with a canonical-dot gradient: the same values and gradients as einsum."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlpt.models import matmul
from rlpt.models.matmul import projection

# (equation, x shape, w shape): the model's projections, a tied embedding table, and a
# multi-axis contraction.
CASES = [
    ("btd,df->btf", (2, 5, 8), (8, 12)),
    ("btd,dnh->btnh", (2, 5, 8), (8, 3, 4)),
    ("btnh,nhd->btd", (2, 5, 3, 4), (3, 4, 8)),
    ("btd,vd->btv", (2, 5, 8), (11, 8)),
]


def _inputs(x_shape, w_shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=x_shape).astype(np.float32)
    w = rng.normal(size=w_shape).astype(np.float32)
    return x, w


@pytest.mark.parametrize("equation, x_shape, w_shape", CASES)
def test_float32_values_and_gradients_equal_einsum(equation, x_shape, w_shape):
    """Float32 takes the plain einsum; the canonical gradient (called directly) agrees."""
    x, w = _inputs(x_shape, w_shape)
    probe = np.random.default_rng(1).normal(size=np.einsum(equation, x, w).shape)

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w) * probe)

    np.testing.assert_array_equal(
        projection(equation, x, w, jnp.float32), jnp.einsum(equation, x, w)
    )
    canonical, perm = matmul._canonical_form(equation)

    def forced(x, w):
        w = matmul._physical_transpose(w, perm)
        return matmul._canonical_projection(canonical, x, w, jnp.dtype(jnp.float32))

    ours = jax.jit(jax.value_and_grad(loss(forced), argnums=(0, 1)))(x, w)
    theirs = jax.value_and_grad(loss(lambda x, w: jnp.einsum(equation, x, w)), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5)
    for got, want in zip(ours[1], theirs[1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("equation, x_shape, w_shape", CASES)
def test_bfloat16_gradients_are_the_rounded_products_in_float64(equation, x_shape, w_shape):
    """Inputs and the cotangent rounded to bfloat16, products summed exactly: the float64
    reference below, built with numpy's einsum on the rounded values."""
    x, w = _inputs(x_shape, w_shape, seed=2)
    out_shape = np.einsum(equation, x, w).shape
    g = np.random.default_rng(3).normal(size=out_shape).astype(np.float32)

    def bf16(a):
        return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)

    y, vjp = jax.vjp(lambda x, w: projection(equation, x, w, jnp.bfloat16), x, w)
    dx, dw = vjp(jnp.asarray(g))
    inputs, out = equation.split("->")
    lhs, rhs = inputs.split(",")
    np.testing.assert_allclose(y, np.einsum(equation, bf16(x), bf16(w)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        dx, np.einsum(f"{out},{rhs}->{lhs}", bf16(g), bf16(w)), rtol=1e-5, atol=1e-5
    )
    want_dw = np.einsum(f"{out},{lhs}->{rhs}", bf16(g), bf16(x))
    if equation == "btd,vd->btv":
        # The tied table is transposed in bfloat16, so its gradient comes back rounded.
        want_dw = bf16(want_dw)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32


def test_other_equations_are_plain_einsums():
    """A batch axis is not a projection: bfloat16 values and gradients are autodiff's own
    (the custom gradient would round the cotangent and differ)."""
    x, w = _inputs((2, 5, 8), (2, 8, 4))
    equation = "btd,bdf->btf"

    def plain(x, w):
        return jnp.einsum(equation, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)  # fmt: skip

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(fn(x, w) ** 3), argnums=(0, 1)))

    got = loss(lambda x, w: projection(equation, x, w, jnp.bfloat16))(x, w)
    jax.tree.map(np.testing.assert_array_equal, got, loss(plain)(x, w))


def test_bfloat16_gradient_dots_take_bfloat16_operands_on_cpu():
    """The point of the module: no gradient product is upcast to float32 by XLA, which it
    does when a dot contracts the non-canonical way (its bf16 matmul library refuses them)."""
    x, w = _inputs((4, 64, 32), (32, 48))
    grad = jax.jit(
        jax.grad(
            lambda x, w: jnp.sum(projection("btd,df->btf", x, w, jnp.bfloat16) ** 2), argnums=(0, 1)
        )  # fmt: skip
    )
    hlo = grad.lower(x, w).compile().as_text()
    computations = re.findall(r"^(?:ENTRY )?%.*?^}", hlo, re.M | re.S)
    dots = 0
    for body in computations:
        for operands in re.findall(r" dot\(([^)]*)\)", body):
            dots += 1
            for name in (o.strip().lstrip("%") for o in operands.split(",")):
                # Declared in this computation's header ("name: bf16[...]") or body
                # ("%name = bf16[...] ...").
                declared = re.search(rf"(?:\(|, |%){re.escape(name)}(?::| =) (\w+)\[", body)
                assert declared and declared.group(1) == "bf16", (name, body)
    assert dots == 3  # the forward product and the two gradient products
