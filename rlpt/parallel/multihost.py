"""Moving host data on and off a mesh that may span several JAX processes.

A post-training run keeps its host-side logic (prompt order, curriculum, group
filtering, packing plans) identical in every process: each process computes the same
host values from the same seed. Device work is sharded over the global mesh:
``to_device`` places a host value every process holds in full onto its sharding
(each process supplies its own devices' shards), and ``to_host`` brings a global
array back to every process. Work that must not be repeated (running model-written
code in the sandbox) is split by ``process_rows`` and its results exchanged with
``allgather_json``. With one process all of these are the plain single-process
operations.

A run may also leave some processes out of the trainer: with the rollout engine served
by another process (``async_rl.engine = "process"``) only the driver trains, and
``set_trainer_process`` makes these helpers, the data shards, the verdict exchange and
the checkpoint barriers treat it as the run's only process (``trainer_process_count``,
``trainer_process_index``, ``trainer_devices``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from rlpt.parallel.sharding import replicated

# None: every JAX process runs the trainer; an index: only that process does.
_trainer_process: int | None = None


def set_trainer_process(index: int | None) -> None:
    """Only JAX process ``index`` runs the trainer (the others serve roles for it, such as
    the rollout engine of ``rlpt.asyncrl.remote``); ``None``: every process does."""
    global _trainer_process
    if index is not None and not 0 <= index < jax.process_count():
        raise ValueError(f"trainer process {index} not in [0, {jax.process_count()})")
    _trainer_process = index


def trainer_process_count() -> int:
    """How many processes run the trainer: split data and work among these."""
    return jax.process_count() if _trainer_process is None else 1


def trainer_process_index() -> int:
    """This process's index among the trainer's processes."""
    return jax.process_index() if _trainer_process is None else 0


def trainer_devices() -> list:
    """The devices the trainer's mesh spans: every device, or the trainer process's own."""
    return jax.devices() if _trainer_process is None else jax.local_devices()


def trainer_processes() -> set[int]:
    """The JAX process indices that run the trainer (checkpoint barriers span these)."""
    if _trainer_process is None:
        return set(range(jax.process_count()))
    return {_trainer_process}


def to_device(tree, shardings):
    """``tree`` (host values equal in every process) placed on ``shardings`` (a matching
    tree, or one sharding for every leaf); ``None`` leaves stay ``None``. A leaf already
    placed there is returned as it is."""
    if shardings is None:
        return tree
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: _place(x, shardings), tree)
    return jax.tree.map(_place, tree, shardings)


def _place(x, sharding):
    if (
        trainer_process_count() > 1
        and isinstance(x, jax.Array)
        and x.is_fully_addressable
        and not sharding.is_fully_addressable
    ):
        # A process-local array cannot be resharded onto devices of other processes
        # directly; every process holds the same value, so each contributes its shards
        # from the host copy.
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(x)
            data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding)
            return jax.random.wrap_key_data(data, impl=impl)
        x = np.asarray(x)
    return jax.device_put(x, sharding)


def to_global(tree, mesh):
    """``tree`` with every process-local array replicated over ``mesh``, as a checkpoint
    written by several processes needs (arrays already on the mesh stay as they are).
    With one process the tree is returned unchanged."""
    if trainer_process_count() == 1 or mesh is None:
        return tree
    everywhere = replicated(mesh)

    def one(x):
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            return _place(x, everywhere)
        return x

    return jax.tree.map(one, tree)


def abstract_on(tree, shardings):
    """``tree``'s shapes and dtypes as ``jax.ShapeDtypeStruct``s carrying ``shardings``:
    a restore target that places every leaf where the run keeps it."""
    if shardings is None:
        return tree
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def to_host(tree):
    """Every leaf of ``tree`` as a numpy array in every process.

    A leaf held in part by other processes is gathered (a collective: every process
    must call this at the same point); other leaves are plain ``device_get``.
    """

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)


def process_rows(n: int) -> np.ndarray:
    """The rows of an ``n``-row host batch this process works on alone (contiguous)."""
    count, index = trainer_process_count(), trainer_process_index()
    bounds = np.linspace(0, n, count + 1).round().astype(int)
    return np.arange(bounds[index], bounds[index + 1])


def allgather_json(values: Sequence[Any]) -> list[Any]:
    """Every process's ``values`` (JSON-able), concatenated in process order."""
    if trainer_process_count() == 1:
        return list(values)
    payload = np.frombuffer(json.dumps(list(values)).encode("utf-8"), np.uint8)
    sizes = multihost_utils.process_allgather(np.asarray([payload.size], np.int64))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[: payload.size] = payload
    gathered = multihost_utils.process_allgather(padded)  # [processes, longest]
    out: list[Any] = []
    for row, size in zip(np.asarray(gathered), np.asarray(sizes).reshape(-1)):
        out += json.loads(bytes(row[: int(size)]).decode("utf-8"))
    return out
