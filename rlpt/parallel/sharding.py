"""Logical-axis rules: the one place where model axis names meet mesh axes.

Model code names logical axes (``embed``, ``mlp``, ``heads`` ...) on its
parameters and activations; this module turns those names into
``PartitionSpec``s for a given mesh. A logical axis whose size does not divide
by its mesh axes is left replicated, so one rule table serves every model size
and mesh shape.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    # Activations.
    ("batch", ("data", "fsdp")),
    # Long rows split over `sequence` (context parallelism: rlpt.parallel.context).
    ("length", "sequence"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # Parameters: fully sharded data parallel over `fsdp`, Megatron-style over `tensor`.
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    # The input embedding table is split over its feature axis, not the vocabulary:
    # a vocabulary-sharded gather made XLA rematerialise the whole table.
    ("table_vocab", None),
    ("table_embed", "tensor"),
    ("norm", None),
    ("scalar", None),
)


def _mesh_axes_for(name: str | None, rules: Rules) -> tuple[str, ...]:
    if name is None:
        return ()
    for logical, mesh_axes in rules:
        if logical == name:
            if mesh_axes is None:
                return ()
            return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    raise ValueError(f"no sharding rule for logical axis {name!r}; rules: {[r[0] for r in rules]}")


def logical_to_spec(
    names: Sequence[str | None],
    shape: Sequence[int] | None,
    mesh: Mesh,
    rules: Rules = DEFAULT_RULES,
) -> PartitionSpec:
    """PartitionSpec for an array whose axes carry logical ``names``.

    Mesh axes already used by an earlier array axis, and mesh axes whose size
    does not divide the array axis, are dropped (that axis stays replicated).
    """
    used: set[str] = set()
    spec = []
    for i, name in enumerate(names):
        kept = []
        divisor = 1
        for axis in _mesh_axes_for(name, rules):
            if axis in used or axis not in mesh.shape:
                continue
            size = mesh.shape[axis]
            if shape is not None and shape[i] % (divisor * size):
                continue
            kept.append(axis)
            divisor *= size
        used.update(kept)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*spec)


def _names_of(variable) -> tuple[str | None, ...] | None:
    metadata = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
    for key in ("sharding_names", "out_sharding", "sharding"):
        if metadata.get(key) is not None:
            return tuple(metadata[key])
    return None


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """NamedShardings for every variable of an NNX state, from its logical axis names."""

    def one(variable):
        if not isinstance(variable, nnx.Variable):
            return NamedSharding(mesh, PartitionSpec())
        names = _names_of(variable)
        shape = variable.get_value().shape
        if names is None:
            spec = PartitionSpec()
        else:
            if len(names) != len(shape):
                raise ValueError(f"logical axes {names} do not match parameter shape {shape}")
            spec = logical_to_spec(names, shape, mesh, rules)
        return variable.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def tree_shardings(tree, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """Shardings for an arbitrary pytree holding NNX states and plain arrays.

    NNX variables get their logical-axis sharding; other leaves are replicated.
    Use it for optimiser states, whose moments mirror the parameters.
    """

    def one(leaf):
        if isinstance(leaf, nnx.Variable):
            return state_shardings(leaf, mesh, rules)
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """Sharding of a batch-major array: the leading axis over the data-parallel axes."""
    spec = logical_to_spec(("batch",) + (None,) * (ndim - 1), None, mesh, rules)
    return NamedSharding(mesh, spec)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def data_parallel_size(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> int:
    """How many ways the batch axis is split on this mesh."""
    size = 1
    for axis in _mesh_axes_for("batch", rules):
        size *= mesh.shape.get(axis, 1)
    return size


# How attention meets a row split along its length: "ring", "ring_contiguous" or "allgather"
# (rlpt.parallel.context.STRATEGIES).
DEFAULT_CONTEXT_STRATEGY = "ring"

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules, str] | None] = contextvars.ContextVar(
    "rlpt_activation_sharding", default=None
)


@contextlib.contextmanager
def activation_sharding(
    mesh: Mesh | None,
    rules: Rules = DEFAULT_RULES,
    *,
    context_strategy: str = DEFAULT_CONTEXT_STRATEGY,
) -> Iterator[None]:
    """Within this context, ``constrain`` pins activations to the mesh.

    Enter it inside the function being traced so the constraint becomes part
    of that function's compiled program (jit caches do not see this context).
    ``context_strategy`` is how attention runs when the rules split ``length``
    over mesh axes (see ``context_parallelism``).
    """
    from rlpt.parallel.context import STRATEGIES

    if context_strategy not in STRATEGIES:
        raise ValueError(f"context_strategy must be one of {STRATEGIES}, got {context_strategy!r}")
    token = _ACTIVE.set(None if mesh is None else (mesh, rules, context_strategy))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrain an activation's sharding by logical axis names (no-op outside a context)."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules, _ = active
    spec = logical_to_spec(names, x.shape, mesh, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def context_parallelism(length: int) -> tuple[Mesh, Rules, str | tuple[str, ...], str] | None:
    """(mesh, rules, mesh axes, strategy) when the active context splits rows of ``length``
    tokens over mesh axes (the ``length`` rule, where its axes divide the length); else None.
    """
    active = _ACTIVE.get()
    if active is None:
        return None
    mesh, rules, strategy = active
    axes = logical_to_spec(("length",), (length,), mesh, rules)[0]
    if axes is None:
        return None
    sizes = [mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]
    if all(size == 1 for size in sizes):
        return None
    return mesh, rules, axes, strategy
