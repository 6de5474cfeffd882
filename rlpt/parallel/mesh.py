"""Device meshes with the axes ``data``, ``fsdp``, ``tensor`` and ``sequence``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

# `sequence` (context parallelism) comes last, so the devices of one ring are neighbours in
# device order: ring attention's ppermute then crosses the fastest links.
MESH_AXES = ("data", "fsdp", "tensor", "sequence")


def resolve_mesh_shape(
    num_devices: int, data: int = -1, fsdp: int = 1, tensor: int = 1, sequence: int = 1
) -> tuple[int, int, int, int]:
    """Sizes of (data, fsdp, tensor, sequence); at most one may be -1, meaning "the rest"."""
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor, "sequence": sequence}
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got mesh sizes {sizes}")
    for name, size in sizes.items():
        if size != -1 and (not isinstance(size, int) or size <= 0):
            raise ValueError(f"mesh.{name} must be a positive integer or -1, got {size!r}")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"mesh sizes {sizes}: the fixed axes ({fixed} devices) do not divide the "
                f"{num_devices} available devices"
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"mesh sizes {sizes} use {fixed} devices but {num_devices} are available; "
            "set one axis to -1 to take the rest"
        )
    return sizes["data"], sizes["fsdp"], sizes["tensor"], sizes["sequence"]


def make_mesh(
    data: int = -1,
    fsdp: int = 1,
    tensor: int = 1,
    sequence: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A (data, fsdp, tensor, sequence) mesh over ``devices`` (default: the trainer's
    devices, ``rlpt.parallel.multihost.trainer_devices``: all of them unless only one
    process trains).

    Axis types are Auto so sharding is steered with ``with_sharding_constraint``
    and jit in/out shardings (the default Explicit types would change typing).
    """
    if devices is None:
        from rlpt.parallel.multihost import trainer_devices

        devices = trainer_devices()
    devices = list(devices)
    shape = resolve_mesh_shape(len(devices), data, fsdp, tensor, sequence)
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if devices == list(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


def mesh_from_config(mesh_config) -> Mesh:
    """A mesh from a config with fields ``data``, ``fsdp``, ``tensor``, ``sequence`` (any may
    be absent)."""
    get = (
        mesh_config.get if hasattr(mesh_config, "get") else lambda k, d: getattr(mesh_config, k, d)
    )
    return make_mesh(
        data=get("data", -1),
        fsdp=get("fsdp", 1),
        tensor=get("tensor", 1),
        sequence=get("sequence", 1),
    )
