"""Host <-> mesh helpers in one process: placement, gathering, per-process rows."""

import jax
import numpy as np

from rlpt.parallel import batch_sharding, make_mesh, replicated
from rlpt.parallel.multihost import allgather_json, process_rows, to_device, to_host


def test_to_device_places_each_leaf_on_its_sharding_and_to_host_brings_it_back(devices):
    mesh = make_mesh(data=4, fsdp=2)
    rows = batch_sharding(mesh, 2)
    tree = {"a": np.arange(16, dtype=np.float32).reshape(8, 2), "b": None}
    placed = to_device(tree, {"a": rows, "b": None})
    assert placed["b"] is None
    assert placed["a"].sharding.is_equivalent_to(rows, 2)
    assert len({s.device for s in placed["a"].addressable_shards}) == 8
    np.testing.assert_array_equal(to_host(placed)["a"], tree["a"])
    everywhere = to_device(np.ones(3), replicated(mesh))
    assert everywhere.is_fully_replicated and to_host(everywhere).tolist() == [1.0, 1.0, 1.0]


def test_one_process_owns_every_row_and_gathers_its_own_values():
    assert jax.process_count() == 1
    assert process_rows(5).tolist() == [0, 1, 2, 3, 4]
    assert process_rows(0).tolist() == []
    values = [{"outcome": "correct", "score": 1.0}, None, "x"]
    assert allgather_json(values) == values
