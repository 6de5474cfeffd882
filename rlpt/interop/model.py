"""Hugging Face model directories in and out of rlpt's ``CausalLM``.

``load_hf_model`` reads ``config.json`` and the safetensors shards and places
every parameter straight onto its sharding on the mesh: each device's block is
read from the file on its own (``jax.make_array_from_callback``), one tensor
at a time, so no host ever holds more than one tensor of the checkpoint.
``save_hf_model`` writes the Hugging Face layout back (config, shards and
index, tokenizer files), gathering one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from rlpt.interop.convert import (
    IGNORED_SUFFIXES,
    ConversionError,
    config_from_hf,
    hf_config_from,
    tensor_layouts,
)
from rlpt.interop.weights import SafetensorsCheckpoint, plan_shards, write_safetensors
from rlpt.models import CausalLM, ModelConfig, abstract_model
from rlpt.parallel.sharding import DEFAULT_RULES, Rules, state_shardings
from rlpt.runfiles import atomic_write_json, read_json

# Files of a model directory that describe the tokenizer and generation defaults.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


@dataclasses.dataclass
class LoadStats:
    """Host memory the loader's own buffers held: the whole checkpoint vs the peak at once."""

    total_bytes: int = 0  # float32 bytes of every tensor loaded
    peak_bytes: int = 0  # the most bytes of read blocks alive at one time
    tensors: int = 0


@dataclasses.dataclass
class HFModel:
    """A loaded model: rlpt config and (graphdef, state), plus where it came from."""

    config: ModelConfig
    family: str
    graphdef: Any
    state: nnx.State
    hf_config: dict[str, Any]
    path: str
    stats: LoadStats = dataclasses.field(default_factory=LoadStats)


def read_hf_config(path: str) -> dict[str, Any]:
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ConversionError(f"{config_path}: not found (is {path} a Hugging Face model?)")
    return read_json(config_path)


def check_checkpoint(ckpt: SafetensorsCheckpoint, config: ModelConfig) -> dict:
    """Every tensor the config needs is present with the shape it implies; nothing else is.

    Returns the layouts by rlpt path.
    """
    layouts = tensor_layouts(config)
    expected = {layout.hf_name: layout for layout in layouts.values()}
    for name, layout in expected.items():
        if name not in ckpt:
            raise ConversionError(
                f"tensor {name!r} missing from {ckpt.index_file} (config.json needs it)"
            )
        shape, _ = ckpt.info(name)
        if shape != layout.hf_shape:
            raise ConversionError(
                f"{ckpt.file_of(name)}: tensor {name!r} has shape {list(shape)} but config.json "
                f"implies {list(layout.hf_shape)}"
            )
    for name in ckpt.names():
        if name in expected or name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and config.tie_embeddings:
            continue  # a tied output projection saved anyway: the embedding is the same tensor
        raise ConversionError(
            f"{ckpt.file_of(name)}: unexpected tensor {name!r}; rlpt's model has no such "
            "parameter (unsupported variant?)"
        )
    return layouts


def load_hf_model(
    path: str,
    *,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
    dtype: str | None = None,
    max_seq_len: int | None = None,
) -> HFModel:
    """A Hugging Face Llama / Qwen2 directory as an rlpt ``CausalLM``, sharded on ``mesh``.

    ``dtype`` overrides the compute dtype; ``max_seq_len`` caps the KV cache
    length (the config's ``max_position_embeddings`` by default).
    """
    hf_config = read_hf_config(path)
    config, family = config_from_hf(
        hf_config, source=os.path.join(path, "config.json"), dtype=dtype
    )
    if max_seq_len is not None:
        config = config.replace(max_seq_len=max_seq_len)
    ckpt = SafetensorsCheckpoint(path)
    layouts = check_checkpoint(ckpt, config)
    graphdef, abstract = abstract_model(lambda rngs: CausalLM(config, rngs=rngs))
    if mesh is None:
        shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), abstract)
    else:
        shardings = state_shardings(abstract, mesh, rules)
    sharding_of = {p: v.get_value() for p, v in nnx.to_flat_state(shardings)}
    stats = LoadStats()
    flat = []
    for var_path, variable in nnx.to_flat_state(abstract):
        layout = layouts[var_path]
        value = _read_sharded(ckpt, layout, sharding_of[var_path], stats)
        flat.append((var_path, variable.replace(value)))
    state = nnx.from_flat_state(flat)
    return HFModel(config, family, graphdef, state, hf_config, path, stats)


def _read_sharded(ckpt: SafetensorsCheckpoint, layout, sharding, stats: LoadStats) -> jax.Array:
    # Devices holding the same block (replicated axes) share one read of it.
    blocks: dict[tuple, np.ndarray] = {}

    def block(index):
        key = tuple(sl.indices(n)[:2] for sl, n in zip(index, layout.shape))
        if key not in blocks:
            hf_slices, finish = layout.hf_block(index)
            blocks[key] = finish(ckpt.read(layout.hf_name, hf_slices))
            stats.peak_bytes = max(stats.peak_bytes, sum(b.nbytes for b in blocks.values()))
        return blocks[key]

    value = jax.make_array_from_callback(layout.shape, sharding, block)
    stats.total_bytes += int(np.prod(layout.shape)) * 4
    stats.tensors += 1
    return value


def _to_host(value: jax.Array) -> np.ndarray:
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        value = multihost_utils.process_allgather(value, tiled=True)
    return np.asarray(jax.device_get(value), np.float32)


def copy_tokenizer_files(source: str, dest: str) -> list[str]:
    """Copy the tokenizer (and generation-config) files present in ``source``."""
    os.makedirs(dest, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(dest, name))
            copied.append(name)
    return copied


def save_hf_model(
    out_dir: str,
    config: ModelConfig,
    state: nnx.State,
    *,
    family: str,
    hf_config: Mapping[str, Any] | None = None,
    tokenizer_dir: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write ``state`` (a plain CausalLM state; merge LoRA first) as a HF model directory.

    Parameters are written as float32; one tensor is gathered to the host at a
    time and one shard's worth held. Returns the weight file names.
    """
    layouts = tensor_layouts(config)
    flat = {p: v for p, v in nnx.to_flat_state(state)}
    missing = sorted(str(p) for p in layouts if p not in flat)
    extra = sorted(str(p) for p in flat if p not in layouts)
    if missing or extra:
        raise ValueError(
            f"state does not match the model config: missing {missing[:5]}, extra {extra[:5]} "
            "(merge LoRA adapters with rlpt.models.lora.merge_lora before export)"
        )
    ordered = list(layouts.values())
    shards = plan_shards(
        ((lay.hf_name, int(np.prod(lay.hf_shape)) * 4) for lay in ordered), max_shard_bytes
    )
    os.makedirs(out_dir, exist_ok=True)
    order = [name for shard in shards for name in shard]
    by_name = {lay.hf_name: lay for lay in ordered}

    def tensors():
        for name in order:
            layout = by_name[name]
            yield name, layout.to_hf(_to_host(flat[layout.path].get_value()))

    if jax.process_index() != 0:
        # Other hosts take part in the gathers but write nothing.
        for _ in tensors():
            pass
        return []
    files = write_safetensors(out_dir, tensors(), shards)
    atomic_write_json(
        os.path.join(out_dir, "config.json"), hf_config_from(config, family, hf_config), indent=2
    )
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out_dir)
    return files


__all__ = [
    "TOKENIZER_FILES",
    "HFModel",
    "LoadStats",
    "check_checkpoint",
    "copy_tokenizer_files",
    "load_hf_model",
    "read_hf_config",
    "save_hf_model",
]
