"""rlpt checkpoints of imported models, and named LoRA adapters beside them.

An imported checkpoint directory::

    CKPT/model_config.json     {"model": ModelConfig, "family": ..., "hf_config": {...}}
    CKPT/params/               orbax (the CausalLM state as a pure dict)
    CKPT/tokenizer/            the tokenizer files, copied
    CKPT/adapters/NAME/        adapter.safetensors + adapter_config.json, one per adapter

Adapters (one per domain or task family) are trained over the same frozen
base and saved separately, so any of them can be picked by name at sampling
or evaluation time (``--adapter=NAME``), or merged in at export.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from rlpt.interop.model import (
    HFModel,
    copy_tokenizer_files,
    load_hf_model,
    read_hf_config,
    save_hf_model,
)
from rlpt.interop.tokenizer import HFTokenizer
from rlpt.models import CausalLM, ModelConfig, abstract_model
from rlpt.models.lora import LoRAConfig, combine_lora, lora_causal_lm, merge_lora, split_lora
from rlpt.parallel.sharding import DEFAULT_RULES, Rules, state_shardings
from rlpt.runfiles import atomic_write_json, read_json

CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"
TOKENIZER_DIR = "tokenizer"
ADAPTERS_DIR = "adapters"
ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def is_checkpoint(path: str) -> bool:
    return os.path.exists(os.path.join(path, CONFIG_FILE))


def _shardings(abstract: nnx.State, mesh: Mesh | None, rules: Rules) -> nnx.State:
    if mesh is None:
        return jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), abstract)
    return state_shardings(abstract, mesh, rules)


def save_checkpoint(
    out_dir: str,
    config: ModelConfig,
    state: nnx.State,
    *,
    family: str,
    hf_config: dict,
    tokenizer_dir: str | None = None,
) -> None:
    """Write an rlpt checkpoint of a plain CausalLM state (see the module docstring)."""
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(out_dir, PARAMS_DIR), nnx.to_pure_dict(state), force=True)
    checkpointer.wait_until_finished()
    if jax.process_index() == 0:
        meta = {"model": config.to_dict(), "family": family, "hf_config": hf_config}
        atomic_write_json(os.path.join(out_dir, CONFIG_FILE), meta, indent=2)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, os.path.join(out_dir, TOKENIZER_DIR))


def load_checkpoint(
    ckpt_dir: str, *, mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES
) -> HFModel:
    """An rlpt checkpoint back as an ``HFModel``; restored straight onto the mesh's shardings."""
    ckpt_dir = os.path.abspath(ckpt_dir)
    meta = read_json(os.path.join(ckpt_dir, CONFIG_FILE))
    config = ModelConfig.from_dict(meta["model"])
    graphdef, abstract = abstract_model(lambda rngs: CausalLM(config, rngs=rngs))
    shardings = _shardings(abstract, mesh, rules)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nnx.to_pure_dict(abstract),
        nnx.to_pure_dict(shardings),
    )
    restored = ocp.StandardCheckpointer().restore(os.path.join(ckpt_dir, PARAMS_DIR), target)
    nnx.replace_by_pure_dict(abstract, restored)
    return HFModel(config, meta["family"], graphdef, abstract, meta["hf_config"], ckpt_dir)


def import_hf(hf_dir: str, out_dir: str, *, mesh: Mesh | None = None) -> HFModel:
    """Hugging Face directory -> rlpt checkpoint (params, model config, tokenizer copy)."""
    model = load_hf_model(hf_dir, mesh=mesh)
    save_checkpoint(
        out_dir, model.config, model.state, family=model.family, hf_config=model.hf_config,
        tokenizer_dir=hf_dir,
    )  # fmt: skip
    return model


def export_hf(
    ckpt_dir: str, out_dir: str, *, adapter: str | None = None, mesh: Mesh | None = None
) -> list[str]:
    """rlpt checkpoint (optionally with adapter ``adapter`` merged in) -> HF directory."""
    model = load_checkpoint(ckpt_dir, mesh=mesh)
    state = model.state
    if adapter is not None:
        lora, _, lora_state = load_adapter(ckpt_dir, adapter, model.config, mesh=mesh)
        state = merge_lora(lora, lora_state, state)
    return save_hf_model(
        out_dir, model.config, state, family=model.family, hf_config=model.hf_config,
        tokenizer_dir=os.path.join(ckpt_dir, TOKENIZER_DIR),
    )  # fmt: skip


def _key(path) -> str:
    return ".".join(str(p) for p in path)


def adapter_dir(directory: str, name: str) -> str:
    """Where adapter ``name`` lives: ``name`` itself if it is an adapter directory, else
    ``directory/adapters/name``."""
    if os.path.exists(os.path.join(name, ADAPTER_CONFIG)):
        return name
    return os.path.join(directory, ADAPTERS_DIR, name)


def list_adapters(directory: str) -> list[str]:
    root = os.path.join(directory, ADAPTERS_DIR)
    if not os.path.isdir(root):
        return []
    return sorted(
        n for n in os.listdir(root) if os.path.exists(os.path.join(root, n, ADAPTER_CONFIG))
    )


def save_adapter(directory: str, name: str, lora: LoRAConfig, lora_state: nnx.State) -> str:
    """Save one adapter as ``directory/adapters/NAME`` (safetensors + config). Returns the path."""
    from safetensors.numpy import save_file

    out = os.path.join(directory, ADAPTERS_DIR, name)
    os.makedirs(out, exist_ok=True)
    tensors = {
        _key(p): np.asarray(jax.device_get(v.get_value()), np.float32)
        for p, v in nnx.to_flat_state(lora_state)
    }
    if jax.process_index() == 0:
        save_file(tensors, os.path.join(out, ADAPTER_WEIGHTS))
        atomic_write_json(
            os.path.join(out, ADAPTER_CONFIG), {"name": name, "lora": lora.to_dict()}, indent=2
        )
    return out


def load_adapter(
    directory: str,
    name: str,
    config: ModelConfig,
    *,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
) -> tuple[LoRAConfig, nnx.GraphDef, nnx.State]:
    """(LoRA config, graphdef of the adapted model, adapter state) of adapter ``name``."""
    from safetensors import safe_open

    path = adapter_dir(directory, name)
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.exists(config_path):
        known = list_adapters(directory)
        raise FileNotFoundError(f"no adapter {name!r} at {path}; adapters here: {known}")
    lora = LoRAConfig.from_dict(read_json(config_path)["lora"])
    graphdef, abstract = abstract_model(lora_causal_lm(config, lora))
    abstract_lora, _ = split_lora(abstract)
    shardings = _shardings(abstract_lora, mesh, rules)
    sharding_of = {p: v.get_value() for p, v in nnx.to_flat_state(shardings)}
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    flat = []
    with safe_open(weights, framework="numpy") as f:
        stored = set(f.keys())
        for p, variable in nnx.to_flat_state(abstract_lora):
            key = _key(p)
            if key not in stored:
                raise ValueError(f"{weights}: tensor {key!r} missing")
            value = f.get_tensor(key)
            if tuple(value.shape) != tuple(variable.shape):
                raise ValueError(
                    f"{weights}: tensor {key!r} has shape {list(value.shape)}, the model "
                    f"({CONFIG_FILE}) implies {list(variable.shape)}"
                )
            flat.append((p, variable.replace(jax.device_put(value, sharding_of[p]))))
    return lora, graphdef, nnx.from_flat_state(flat)


def load_for_sampling(
    path: str, *, adapter: str | None = None, mesh: Mesh | None = None
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State, HFTokenizer]:
    """(config, graphdef, state, tokenizer) from a HF directory or an rlpt checkpoint,
    with adapter ``adapter`` (looked up beside the checkpoint) switched on."""
    if is_checkpoint(path):
        model = load_checkpoint(path, mesh=mesh)
        tokenizer_path = os.path.join(path, TOKENIZER_DIR)
    else:
        read_hf_config(path)  # a clear error when this is neither kind of directory
        model = load_hf_model(path, mesh=mesh)
        tokenizer_path = path
    # Sampling needs no step/answer tokens: a vocabulary with no spare embedding rows loads.
    tokenizer = HFTokenizer(
        tokenizer_path, model_vocab_size=model.config.vocab_size, role_tokens="none"
    )
    graphdef, state = model.graphdef, model.state
    if adapter is not None:
        _, graphdef, lora_state = load_adapter(path, adapter, model.config, mesh=mesh)
        state = combine_lora(lora_state, state)
    return model.config, graphdef, state, tokenizer


__all__ = [
    "ADAPTERS_DIR",
    "adapter_dir",
    "export_hf",
    "import_hf",
    "is_checkpoint",
    "list_adapters",
    "load_adapter",
    "load_checkpoint",
    "load_for_sampling",
    "save_adapter",
    "save_checkpoint",
]
