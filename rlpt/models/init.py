"""Building models as (graphdef, state), optionally sharded on a mesh.

Initialisation runs inside jit with output shardings, so each device only ever
holds its own shards (a model larger than one host can be created on a pod).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import Mesh

from rlpt.parallel.sharding import DEFAULT_RULES, Rules, state_shardings


def abstract_model(constructor: Callable[[nnx.Rngs], nnx.Module]):
    """(graphdef, abstract state) with shapes and dtypes only; allocates nothing."""
    abstract = nnx.eval_shape(lambda: constructor(nnx.Rngs(0)))
    return nnx.split(abstract)


def create_model(
    constructor: Callable[[nnx.Rngs], nnx.Module],
    key: jax.Array,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
):
    """(graphdef, state) of ``constructor(rngs)``; sharded by the logical-axis rules on ``mesh``.

    ``constructor`` takes an ``nnx.Rngs`` and returns a module, for example
    ``lambda rngs: CausalLM(config, rngs=rngs)``.
    """
    graphdef, abstract_state = abstract_model(constructor)

    def init(k):
        return nnx.split(constructor(nnx.Rngs(params=k)))[1]

    if mesh is None:
        return graphdef, jax.jit(init)(key)
    shardings = state_shardings(abstract_state, mesh, rules)
    return graphdef, jax.jit(init, out_shardings=shardings)(key)


def count_params(state) -> int:
    return sum(x.size for x in jax.tree.leaves(state))
