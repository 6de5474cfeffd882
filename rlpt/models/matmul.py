"""Weight projections whose backward pass stays on the CPU's fast matmul path.

XLA:CPU hands a bfloat16 dot with float32 accumulation to its matmul library
(YNNPACK, which uses the AMX/AVX-512 bf16 units) only when the dot is canonical: the
left operand contracts its trailing dimensions and the right one its leading ones.
Autodiff writes the two gradient products of ``x @ w`` as dots that contract the
other way (``g @ w^T`` and ``x^T @ g``), and XLA folds any plain transpose placed in
front of them back into the dot. XLA then upcasts both operands to float32 and runs
the generic kernel: on the development machine's CPU a [4096, 512] x [512, 1536]
product runs at ~1450 GFLOP/s canonical and ~170 GFLOP/s transposed, and the backward
pass is two thirds of a training step's matmuls. ``projection`` gives the product a
custom gradient that writes each transposed operand out once (a copy the size of the
operand, small beside the product) and multiplies canonically, with the cotangent in
the compute dtype as mixed-precision training does on accelerators. Other backends
keep the plain einsum: their matmul units take transposed operands directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _physical_transpose(x: jax.Array, perm: tuple[int, ...]) -> jax.Array:
    """``x.transpose(perm)`` written out in memory, not folded into the dot that reads it.

    A trailing unit axis makes the transpose one that XLA's transpose folding does not
    take, so it stays a copy with the default layout."""
    if perm == tuple(range(x.ndim)):
        return x
    y = jnp.transpose(x[..., None], (*perm, x.ndim))
    return y.reshape(y.shape[:-1])


@functools.cache
def _parse(equation: str):
    """(lhs, rhs, out, contracted) letters when ``equation`` is a canonical projection
    (lhs contracts its trailing letters with rhs's leading ones, no batch letters), else None."""
    inputs, out = equation.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    contracted = "".join(c for c in lhs if c in rhs and c not in out)
    if not contracted or any(c in lhs and c in rhs for c in out):
        return None
    n = len(contracted)
    lhs_free, rhs_free = lhs[: len(lhs) - n], rhs[n:]
    if lhs[len(lhs) - n :] != contracted or rhs[:n] != contracted or out != lhs_free + rhs_free:
        return None
    return lhs, rhs, out, contracted


@functools.cache
def _canonical_form(equation: str):
    """(canonical equation, permutation of the right operand) for a projection whose right
    operand has its contracted axes in another place ("btd,vd->btv"), else None."""
    inputs, out = equation.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    contracted = "".join(c for c in lhs if c in rhs and c not in out)
    rhs_free = "".join(c for c in rhs if c not in contracted)
    canonical = f"{lhs},{contracted}{rhs_free}->{out}"
    if _parse(canonical) is None:
        return None
    return canonical, tuple(rhs.index(c) for c in contracted + rhs_free)


def _einsum(equation: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _canonical_projection(equation: str, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    return _einsum(equation, x.astype(dtype), w.astype(dtype))


def _projection_fwd(equation, x, w, dtype):
    xc, wc = x.astype(dtype), w.astype(dtype)
    # The zero-size arrays carry the primal dtypes to the backward pass.
    dtypes = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
    return _einsum(equation, xc, wc), (xc, wc, dtypes)


def _projection_bwd(equation, dtype, residuals, g):
    xc, wc, (x_dtype, w_dtype) = residuals
    lhs, rhs, out, contracted = _parse(equation)
    n = len(contracted)
    lhs_free, rhs_free = lhs[: len(lhs) - n], rhs[n:]
    g = g.astype(dtype)
    # dx = g . w^T: w laid out as [rhs free..., contracted...].
    w_t = _physical_transpose(wc, (*range(n, wc.ndim), *range(n)))
    dx = _einsum(f"{out},{rhs_free}{contracted}->{lhs}", g, w_t)
    # dw = x^T . g: x laid out as [contracted..., lhs free...].
    free = xc.ndim - n
    x_t = _physical_transpose(xc, (*range(free, xc.ndim), *range(free)))
    dw = _einsum(f"{contracted}{lhs_free},{out}->{rhs}", x_t, g)
    return dx.astype(x_dtype.dtype), dw.astype(w_dtype.dtype)


_canonical_projection.defvjp(_projection_fwd, _projection_bwd)


def projection(equation: str, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """``einsum(equation, x, w)`` with inputs in ``dtype`` and float32 accumulation.

    ``equation`` contracts trailing axes of ``x`` with axes of ``w`` ("btd,df->btf",
    "btnh,nhd->btd", "btd,vd->btv"); on CPU the product and its gradient run canonical
    dots (module docstring). Float32, any other equation, or another backend: a plain einsum.
    """
    # Float32 dots are never upcast, so they keep autodiff's own gradient (and its
    # summation order, which the float32 equivalence tests compare against).
    low_precision = jnp.dtype(dtype) != jnp.float32
    form = _canonical_form(equation) if low_precision and jax.default_backend() == "cpu" else None
    if form is None:
        return _einsum(equation, x.astype(dtype), w.astype(dtype))
    canonical, perm = form
    if perm != tuple(range(w.ndim)):
        # A right operand stored the other way (a tied embedding table [V, D]) is written
        # out once, in the compute dtype to halve the copy, so the forward product is
        # canonical too. Its gradient is then rounded to the compute dtype on the way
        # back, as the plain einsum's is; a weight in canonical order keeps a float32 one.
        w = _physical_transpose(w.astype(dtype), perm)
    return _canonical_projection(canonical, x, w, jnp.dtype(dtype))
