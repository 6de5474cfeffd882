"""Low-rank adapters (LoRA, Hu et al. 2021) on the transformer's projections.

A projection ``y = x W`` gains a trainable low-rank path::

    y = x W + (alpha / rank) * (x A) B,    A [in..., r], B [r, out...]

with ``B`` initialised to zero, so a fresh adapter leaves the model unchanged.
The adapters are ``nnx.LoRAParam`` variables attached to the attention and MLP
modules (``trunk/blocks/<i>/attn/lora_wq/{a,b}`` ...); the transformer adds
their output next to the frozen matmul, so the full-rank update ``A B`` is never
materialised during training.

Training only the adapters: split a model's state into ``(lora, base)`` with
``split_lora``; the optimiser sees ``lora`` alone and ``base`` is a frozen,
shared argument. The reference policy is the same base with the adapters set
to zero (``zero_lora``), so post-training holds one copy of the base weights.
``merge_lora`` folds trained adapters into the base for export.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rlpt.models.config import ModelConfig
from rlpt.models.heads import CausalLM
from rlpt.models.init import abstract_model
from rlpt.parallel.sharding import state_shardings

# Projection name -> (module, logical names of the input axes, of the output axes).
_TARGETS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "wq": ("attn", ("embed",), ("heads", "head_dim")),
    "wk": ("attn", ("embed",), ("kv_heads", "head_dim")),
    "wv": ("attn", ("embed",), ("kv_heads", "head_dim")),
    "wo": ("attn", ("heads", "head_dim"), ("embed",)),
    "w_gate": ("mlp", ("embed",), ("mlp",)),
    "w_up": ("mlp", ("embed",), ("mlp",)),
    "w_down": ("mlp", ("mlp",), ("embed",)),
}
LORA_TARGETS = tuple(_TARGETS)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Which projections get adapters, their rank and scale ``alpha / rank``."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("wq", "wk", "wv", "wo")

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"lora.rank must be a positive integer, got {self.rank!r}")
        unknown = sorted(set(self.targets) - set(_TARGETS))
        if unknown or not self.targets:
            raise ValueError(
                f"lora.targets must be a non-empty subset of {LORA_TARGETS}, got {self.targets}"
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LoRAConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown lora config fields {unknown}; known: {sorted(known)}")
        values = dict(values)
        if "targets" in values:
            values["targets"] = tuple(values["targets"])
        return cls(**values)


class LoRAAdapter(nnx.Module):
    """The low-rank path of one projection: ``scale * (x A) B``."""

    def __init__(
        self,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        in_names: tuple[str, ...],
        out_names: tuple[str, ...],
        config: LoRAConfig,
        *,
        rngs: nnx.Rngs,
    ):
        fan_in = math.prod(in_shape)
        a = fan_in**-0.5 * jax.random.normal(rngs.params(), (*in_shape, config.rank), jnp.float32)
        # The rank axis is small: it stays replicated (None), the others follow the base weight.
        self.a = nnx.LoRAParam(a, out_sharding=(*in_names, None), eager_sharding=False)
        self.b = nnx.LoRAParam(
            jnp.zeros((config.rank, *out_shape), jnp.float32),
            out_sharding=(None, *out_names),
            eager_sharding=False,
        )
        self.scale = config.scale

    def __call__(self, x: jax.Array, dtype) -> jax.Array:
        """x [..., *in] -> float32 [..., *out]."""
        n_in = self.a.ndim - 1
        h = jnp.tensordot(
            x.astype(dtype), self.a[...].astype(dtype), axes=n_in,
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        out = jnp.tensordot(
            h.astype(dtype), self.b[...].astype(dtype), axes=1, preferred_element_type=jnp.float32
        )
        return out * self.scale


def add_lora(model: CausalLM, config: LoRAConfig, rngs: nnx.Rngs) -> CausalLM:
    """Attach adapters to ``model``'s projections named in ``config.targets`` (in place)."""
    for block in model.trunk.blocks:
        for name in config.targets:
            module_name, in_names, out_names = _TARGETS[name]
            module = getattr(block, module_name)
            weight = getattr(module, name)
            n_in = len(in_names)
            adapter = LoRAAdapter(
                weight.shape[:n_in], weight.shape[n_in:], in_names, out_names, config, rngs=rngs
            )
            # Attention / MLP look for `lora_<projection>` (rlpt.models.transformer._project).
            setattr(module, f"lora_{name}", adapter)
    return model


def lora_causal_lm(config: ModelConfig, lora: LoRAConfig) -> Callable[[nnx.Rngs], CausalLM]:
    """A constructor for ``create_model`` / ``abstract_model``: a CausalLM with adapters."""
    return lambda rngs: add_lora(CausalLM(config, rngs=rngs), lora, rngs)


def split_lora(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(adapter variables, everything else) of a model state."""
    return nnx.split_state(state, nnx.LoRAParam, ...)


def combine_lora(lora_state: nnx.State, base_state: nnx.State) -> nnx.State:
    """One state for the adapted model (references the arrays, copies nothing)."""
    return nnx.merge_state(lora_state, base_state)


def zero_lora(lora_state: nnx.State) -> nnx.State:
    """Adapters switched off: with these, the adapted model computes the base model."""
    return jax.tree.map(jnp.zeros_like, lora_state)


def create_lora(
    config: ModelConfig,
    lora: LoRAConfig,
    key: jax.Array,
    mesh=None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef of the adapted model, fresh adapter state), without building a base.

    The base weights are created inside jit but not returned, so XLA drops
    them: only the adapters are ever allocated.
    """
    constructor = lora_causal_lm(config, lora)
    graphdef, abstract = abstract_model(constructor)
    abstract_lora, _ = split_lora(abstract)

    def init(k):
        return split_lora(nnx.split(constructor(nnx.Rngs(params=k)))[1])[0]

    if mesh is None:
        return graphdef, jax.jit(init)(key)
    return graphdef, jax.jit(init, out_shardings=state_shardings(abstract_lora, mesh))(key)


def merge_lora(lora: LoRAConfig, lora_state: nnx.State, base_state: nnx.State) -> nnx.State:
    """The base state with every adapter folded in: ``W + scale * A B`` (for export)."""
    flat_base = dict(nnx.to_flat_state(base_state))
    flat_lora = dict(nnx.to_flat_state(lora_state))
    merged = {}
    for path, variable in flat_base.items():
        value = variable.get_value()
        *prefix, name = path
        a_path = (*prefix, f"lora_{name}", "a")
        if a_path in flat_lora:
            a = flat_lora[a_path].get_value()
            b = flat_lora[(*prefix, f"lora_{name}", "b")].get_value()
            delta = jnp.tensordot(a, b, axes=1, precision=jax.lax.Precision.HIGHEST)
            value = value + lora.scale * delta
        merged[path] = variable.replace(value)
    return nnx.from_flat_state(merged)


__all__ = [
    "LORA_TARGETS",
    "LoRAAdapter",
    "LoRAConfig",
    "add_lora",
    "combine_lora",
    "create_lora",
    "lora_causal_lm",
    "merge_lora",
    "split_lora",
    "zero_lora",
]
