"""Meshes and logical-axis rules."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rlpt.models import CausalLM, create_model, get_preset
from rlpt.parallel import logical_to_spec, make_mesh, resolve_mesh_shape


def test_resolve_mesh_shape_fills_the_rest():
    assert resolve_mesh_shape(8, -1, 2, 2) == (2, 2, 2, 1)
    assert resolve_mesh_shape(8, 2, -1, 1) == (2, 4, 1, 1)
    assert resolve_mesh_shape(8, 8, 1, 1) == (8, 1, 1, 1)
    assert resolve_mesh_shape(8, 2, 1, 1, -1) == (2, 1, 1, 4)
    assert resolve_mesh_shape(8, -1, 1, 1, 4) == (2, 1, 1, 4)


@pytest.mark.parametrize(
    "sizes, match",
    [
        ((-1, 3, 1), "do not divide"),
        ((2, 2, 1), "use 4 devices but 8"),
        ((-1, -1, 1), "at most one"),
        ((0, 1, 1), "mesh.data"),
        ((2, 1, 1, 0), "mesh.sequence"),
        ((-1, 1, 1, 3), "do not divide"),
    ],
)
def test_impossible_meshes_are_refused(sizes, match):
    with pytest.raises(ValueError, match=match):
        resolve_mesh_shape(8, *sizes)


def test_logical_to_spec_skips_axes_that_do_not_divide(devices):
    mesh = make_mesh(2, 2, 2)
    assert logical_to_spec(("embed", "mlp"), (64, 128), mesh) == P("fsdp", "tensor")
    assert logical_to_spec(("embed", "mlp"), (63, 128), mesh) == P(None, "tensor")
    # `length` goes to the `sequence` axis, here of size 1: it divides every length.
    assert logical_to_spec(("batch", "length"), (8, 5), mesh) == P(("data", "fsdp"), "sequence")
    assert logical_to_spec(("batch", "length"), (2, 5), mesh) == P("data", "sequence")
    long_rows = make_mesh(data=2, sequence=4)
    assert logical_to_spec(("batch", "length"), (8, 12), long_rows) == P(
        ("data", "fsdp"), "sequence"
    )
    assert logical_to_spec(("batch", "length"), (8, 10), long_rows) == P(("data", "fsdp"), None)


def test_parameters_are_split_as_the_rules_say(devices):
    mesh = make_mesh(2, 2, 2)
    cfg = get_preset("tiny")
    _, state = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(0), mesh)
    wq = state["trunk"]["blocks"][0]["attn"]["wq"][...]
    assert wq.sharding.spec == P("fsdp", "tensor", None)
    # Each device holds a quarter of the query projection.
    shard_shapes = {s.data.shape for s in wq.addressable_shards}
    assert shard_shapes == {(cfg.d_model // 2, cfg.n_heads // 2, cfg.resolved_head_dim)}
    table = state["trunk"]["embedding"][...]
    assert table.sharding.spec == P(None, "tensor")
    # Same values as an unsharded initialisation with the same key.
    _, plain = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(0))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
