"""Hugging Face Llama / Qwen2 configs and tensor names, mapped onto rlpt's model.

Two tables live here: ``config_from_hf`` / ``hf_config_from`` translate the
``config.json`` fields, and ``tensor_layouts`` says, for every rlpt parameter,
which Hugging Face tensor holds it and how its axes are rearranged.

HF stores a projection as ``[out, in]`` with heads flattened into one axis
(``q_proj.weight`` is ``[N * H, D]``); rlpt keeps ``[D, N, H]``. A layout
describes the move as a split of each HF axis into rlpt axes followed by a
transpose, so any rectangular block of the rlpt array can be read from a
rectangular block of the HF tensor (``hf_block``), which is what lets the
loader read only each device's shard.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlpt.models.config import ModelConfig

FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Tensors some checkpoints carry that rlpt recomputes instead of loading.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class ConversionError(ValueError):
    """A Hugging Face checkpoint that rlpt refuses, with the file and tensor named."""


def family_of(hf_config: Mapping[str, Any], source: str = "config.json") -> str:
    """``"llama"`` or ``"qwen2"``; anything else is refused."""
    archs = hf_config.get("architectures") or []
    if not archs and hf_config.get("model_type") in _MODEL_TYPES:
        archs = [_MODEL_TYPES[hf_config["model_type"]]]
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch]
    raise ConversionError(
        f"{source}: unsupported architecture {archs or hf_config.get('model_type')!r}; "
        f"supported: {sorted(FAMILIES)}"
    )


def _rope_settings(hf: Mapping[str, Any], source: str) -> tuple[float, tuple | None]:
    """(theta, rlpt rope_scaling) from ``rope_parameters`` (transformers 5) or the older
    top-level ``rope_theta`` / ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
    scaling = params if params.get("rope_type", "default") != "default" else legacy
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return float(theta), None
    if kind not in ("linear", "llama3"):
        raise ConversionError(
            f"{source}: unsupported rotary scaling type {kind!r}; supported: linear, llama3"
        )
    pairs = {k: scaling[k] for k in _ROPE_KEYS if k in scaling}
    pairs["type"] = kind
    return float(theta), tuple(sorted(pairs.items()))


def config_from_hf(
    hf: Mapping[str, Any], *, source: str = "config.json", dtype: str | None = None
) -> tuple[ModelConfig, str]:
    """(ModelConfig, family) of a Hugging Face ``config.json``; unsupported features refused.

    ``dtype`` is the compute dtype; by default bfloat16 for a bfloat16
    checkpoint, else float32 (parameters are float32 either way).
    """
    family = family_of(hf, source)
    if hf.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"{source}: hidden_act {hf['hidden_act']!r} unsupported (silu)")
    if family == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise ConversionError(
            f"{source}: Llama with attention_bias/mlp_bias (an o_proj or MLP bias) is unsupported"
        )
    if family == "qwen2" and hf.get("use_sliding_window"):
        raise ConversionError(f"{source}: Qwen2 sliding-window attention is unsupported")
    theta, scaling = _rope_settings(hf, source)
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim == hf["hidden_size"] // n_heads:
        head_dim = None
    if dtype is None:
        stored = hf.get("dtype") or hf.get("torch_dtype")
        dtype = "bfloat16" if stored == "bfloat16" else "float32"
    try:
        config = ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            ffn_dim=hf["intermediate_size"],
            head_dim=head_dim,
            max_seq_len=hf.get("max_position_embeddings", 2048),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_eps=hf.get("rms_norm_eps", 1e-6),
            qkv_bias=family == "qwen2",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=dtype,
        )
    except KeyError as e:
        raise ConversionError(f"{source}: missing field {e.args[0]!r}") from e
    except ValueError as e:
        raise ConversionError(f"{source}: {e}") from e
    return config, family


def hf_config_from(
    config: ModelConfig, family: str, base: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A ``config.json`` for ``config``: ``base`` (the imported one) with the shape fields set.

    Rotary settings are written in the style ``base`` used (``rope_parameters``
    or top-level ``rope_theta`` / ``rope_scaling``); top-level without a base.
    """
    out = dict(base or {})
    out.update(
        architectures=[_MODEL_TYPES[family]],
        model_type=family,
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        intermediate_size=config.ffn_dim,
        head_dim=config.resolved_head_dim,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.rms_eps,
        tie_word_embeddings=config.tie_embeddings,
        hidden_act="silu",
    )
    if family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.setdefault("use_sliding_window", False)
    # Exported parameters are float32, whatever the compute dtype was.
    out["torch_dtype" if "torch_dtype" in out else "dtype"] = "float32"
    scaling = dict(config.rope_scaling) if config.rope_scaling else None
    if "rope_parameters" in out:
        params = {"rope_theta": config.rope_theta, "rope_type": "default"}
        if scaling:
            params.update({k: v for k, v in scaling.items() if k != "type"})
            params["rope_type"] = scaling["type"]
        out["rope_parameters"] = params
    else:
        out["rope_theta"] = config.rope_theta
        if scaling:
            legacy = {k: v for k, v in scaling.items() if k != "type"}
            out["rope_scaling"] = {**legacy, "rope_type": scaling["type"], "type": scaling["type"]}
        else:
            out.pop("rope_scaling", None)
    return out


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """Where one rlpt parameter lives in a Hugging Face checkpoint.

    The HF tensor ``[hf_shape]`` is reshaped to ``split_shape`` (each HF axis
    split into ``groups[i]`` consecutive axes) and transposed by ``perm``:
    rlpt axis ``i`` is split axis ``perm[i]``.
    """

    hf_name: str
    path: tuple[str | int, ...]
    hf_shape: tuple[int, ...]
    split_shape: tuple[int, ...]
    groups: tuple[int, ...]
    perm: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.split_shape[p] for p in self.perm)

    def hf_block(self, index: Sequence[slice]) -> tuple[tuple[slice, ...], Any]:
        """The HF block covering the rlpt block ``index``, and how to cut it down.

        Returns ``(hf_slices, finish)``: read ``tensor[hf_slices]`` from the
        file, then ``finish(block)`` gives the rlpt block.
        """
        ranges = [None] * len(self.split_shape)
        for axis, sl in enumerate(index):
            start, stop, step = sl.indices(self.shape[axis])
            if step != 1:
                raise ValueError(f"strided shard index {index} for {self.hf_name}")
            ranges[self.perm[axis]] = (start, stop)
        hf_slices, chunk_shape, cuts = [], [], []
        first = 0
        for n in self.groups:
            axes = range(first, first + n)
            rest = math.prod(self.split_shape[a] for a in axes[1:])
            lead_start, lead_stop = ranges[first]
            hf_slices.append(slice(lead_start * rest, lead_stop * rest))
            for a in axes:
                if a == first:
                    chunk_shape.append(lead_stop - lead_start)
                    cuts.append(slice(None))
                else:
                    chunk_shape.append(self.split_shape[a])
                    cuts.append(slice(*ranges[a]))
            first += n

        def finish(block: np.ndarray) -> np.ndarray:
            return np.transpose(block.reshape(chunk_shape)[tuple(cuts)], self.perm)

        return tuple(hf_slices), finish

    def to_hf(self, value: np.ndarray) -> np.ndarray:
        """A whole rlpt array in the HF layout."""
        return np.transpose(value, np.argsort(self.perm)).reshape(self.hf_shape)


def _layout(hf_name, path, split_shape, groups, perm) -> TensorLayout:
    hf_shape, first = [], 0
    for n in groups:
        hf_shape.append(math.prod(split_shape[first : first + n]))
        first += n
    return TensorLayout(hf_name, path, tuple(hf_shape), tuple(split_shape), groups, perm)


def tensor_layouts(config: ModelConfig) -> dict[tuple[str | int, ...], TensorLayout]:
    """Every rlpt parameter path of a ``CausalLM(config)`` and its HF tensor."""
    d, f, v = config.d_model, config.ffn_dim, config.vocab_size
    n, k, h = config.n_heads, config.n_kv_heads, config.resolved_head_dim
    out = [
        _layout("model.embed_tokens.weight", ("trunk", "embedding"), (v, d), (1, 1), (0, 1)),
        _layout("model.norm.weight", ("trunk", "final_norm", "scale"), (d,), (1,), (0,)),
    ]
    if not config.tie_embeddings:
        out.append(_layout("lm_head.weight", ("lm_head",), (v, d), (1, 1), (1, 0)))
    for i in range(config.n_layers):
        hf, rl = f"model.layers.{i}.", ("trunk", "blocks", i)
        out += [
            _layout(hf + "input_layernorm.weight", (*rl, "attn_norm", "scale"), (d,), (1,), (0,)),
            _layout(
                hf + "post_attention_layernorm.weight", (*rl, "mlp_norm", "scale"), (d,), (1,),
                (0,),
            ),
            _layout(hf + "self_attn.q_proj.weight", (*rl, "attn", "wq"), (n, h, d), (2, 1),
                    (2, 0, 1)),
            _layout(hf + "self_attn.k_proj.weight", (*rl, "attn", "wk"), (k, h, d), (2, 1),
                    (2, 0, 1)),
            _layout(hf + "self_attn.v_proj.weight", (*rl, "attn", "wv"), (k, h, d), (2, 1),
                    (2, 0, 1)),
            _layout(hf + "self_attn.o_proj.weight", (*rl, "attn", "wo"), (d, n, h), (1, 2),
                    (1, 2, 0)),
            _layout(hf + "mlp.gate_proj.weight", (*rl, "mlp", "w_gate"), (f, d), (1, 1), (1, 0)),
            _layout(hf + "mlp.up_proj.weight", (*rl, "mlp", "w_up"), (f, d), (1, 1), (1, 0)),
            _layout(hf + "mlp.down_proj.weight", (*rl, "mlp", "w_down"), (d, f), (1, 1), (1, 0)),
        ]  # fmt: skip
        if config.qkv_bias:
            out += [
                _layout(hf + "self_attn.q_proj.bias", (*rl, "attn", "bq"), (n, h), (2,), (0, 1)),
                _layout(hf + "self_attn.k_proj.bias", (*rl, "attn", "bk"), (k, h), (2,), (0, 1)),
                _layout(hf + "self_attn.v_proj.bias", (*rl, "attn", "bv"), (k, h), (2,), (0, 1)),
            ]
    return {layout.path: layout for layout in out}


__all__ = [
    "FAMILIES",
    "ConversionError",
    "TensorLayout",
    "config_from_hf",
    "family_of",
    "hf_config_from",
    "tensor_layouts",
]
