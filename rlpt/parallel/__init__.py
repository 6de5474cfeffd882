"""Meshes and sharding rules."""

from rlpt.parallel.mesh import MESH_AXES, make_mesh, mesh_from_config, resolve_mesh_shape
from rlpt.parallel.sharding import (
    DEFAULT_RULES,
    activation_sharding,
    batch_sharding,
    constrain,
    data_parallel_size,
    logical_to_spec,
    replicated,
    state_shardings,
    tree_shardings,
)

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "activation_sharding",
    "batch_sharding",
    "constrain",
    "data_parallel_size",
    "logical_to_spec",
    "make_mesh",
    "mesh_from_config",
    "replicated",
    "resolve_mesh_shape",
    "state_shardings",
    "tree_shardings",
]
