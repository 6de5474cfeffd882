"""A run's policy: its model shape, tokenizer, initial weights and LoRA split, and the
trained policy read back from a run directory.

Library code shared by the trainer, the evaluation command line and notebooks; it
reads a run's configuration but never imports a trainer.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections

from rlpt import checkpoint as ckpt_lib
from rlpt.models import CausalLM, ValueModel, create_model, get_preset
from rlpt.rl import PPOConfig, init_train_state
from rlpt.runfiles import read_json
from rlpt.sampling import DEFAULT_BUCKETS, Sampler
from rlpt.tasks import Domain, get_domain
from rlpt.tokenizers import ByteTokenizer, Tokenizer
from rlpt.trainers import sft as sft_lib

# The run's identity (its config without the run-control fields), written when the run
# starts; readers rebuild the run's policy from it.
RUN_CONFIG_FILE = "run_config.json"
DEFAULT_ADAPTER_NAME = "policy"


def _plain(config: Any) -> Any:
    return config.to_dict() if hasattr(config, "to_dict") else config


def model_config(config: ml_collections.ConfigDict):
    """The model's shape: a Hugging Face checkpoint's (``model.hf_path``) or a preset's."""
    overrides = dict(_plain(config.model.get("overrides", {})) or {})
    hf_path = config.model.get("hf_path")
    if "hf_path" in config.model and not hf_path:
        raise ValueError("model.hf_path is empty: set it to a Hugging Face model directory")
    if hf_path:
        from rlpt.interop import config_from_hf
        from rlpt.interop.model import read_hf_config

        hf_config = read_hf_config(hf_path)
        cfg, _ = config_from_hf(hf_config, source=os.path.join(hf_path, "config.json"))
        return cfg.replace(**overrides) if overrides else cfg
    return get_preset(config.model.preset, **overrides)


def make_tokenizer(config: ml_collections.ConfigDict, model_cfg) -> Tokenizer:
    """The checkpoint's own tokenizer.json for a Hugging Face model, else the byte tokenizer."""
    hf_path = config.model.get("hf_path")
    if hf_path:
        from rlpt.interop import load_hf_tokenizer

        return load_hf_tokenizer(hf_path, model_vocab_size=model_cfg.vocab_size)
    return ByteTokenizer()


def initial_policy(config: ml_collections.ConfigDict, model_cfg, key: jax.Array):
    """(graphdef, params) of the policy before any training: loaded, or randomly initialised."""
    hf_path = config.model.get("hf_path")
    if hf_path:
        from rlpt.interop import load_hf_model

        loaded = load_hf_model(hf_path, max_seq_len=model_cfg.max_seq_len)
        return loaded.graphdef, loaded.state
    return create_model(lambda rngs: CausalLM(model_cfg, rngs=rngs), key)


def lora_config(config: ml_collections.ConfigDict):
    """The policy's LoRA settings (``model.lora``), or None when it trains full weights."""
    spec = config.model.get("lora")
    if spec is None or not spec.get("rank"):
        return None
    from rlpt.models.lora import LoRAConfig

    name = spec.get("name")
    if name is not None and (not name or os.sep in name or name.startswith(".")):
        raise ValueError(f"model.lora.name must be a plain directory name, got {name!r}")
    try:
        return LoRAConfig.from_dict({k: v for k, v in _plain(spec).items() if k != "name"})
    except ValueError as e:
        raise ValueError(f"model.lora: {e}") from None


def adapter_name(config: ml_collections.ConfigDict) -> str:
    spec = config.model.get("lora")
    return (spec.get("name") if spec is not None else None) or DEFAULT_ADAPTER_NAME


def policy_init_key(config: ml_collections.ConfigDict) -> jax.Array:
    return jax.random.fold_in(jax.random.key(config.seed), 0)


def build_policy(config: ml_collections.ConfigDict, model_cfg, key: jax.Array):
    """(graphdef, trainable params, frozen base or None) of the policy before training.

    With ``model.lora.rank > 0`` only the adapters train; the loaded or initialised
    weights are the frozen base, shared by policy and reference, never copied.
    """
    graph, params = initial_policy(config, model_cfg, key)
    lora = lora_config(config)
    if lora is None:
        return graph, params, None
    from rlpt.models.lora import create_lora

    graph, adapters = create_lora(model_cfg, lora, jax.random.fold_in(key, 1))
    return graph, adapters, params


def full_policy(params, base):
    """The state the policy graph runs on: adapters merged with their base, or ``params``."""
    if base is None:
        return params
    from rlpt.models.lora import combine_lora

    return combine_lora(params, base)


def train_levels(config: ml_collections.ConfigDict, domains: Mapping[str, Domain]) -> dict:
    """The highest difficulty each domain trains at (the OOD split is one above)."""
    spec = _plain(config.train_max_level)
    out = {}
    for name, domain in domains.items():
        level = spec.get(name, spec.get("default", 1)) if isinstance(spec, dict) else spec
        out[name] = min(int(level), domain.max_difficulty)
    return out


def make_domains(config: ml_collections.ConfigDict) -> dict[str, Domain]:
    return {name: get_domain(name) for name in config.domains}


def ppo_config(config: ml_collections.ConfigDict) -> PPOConfig:
    values = dict(_plain(config.ppo))
    if values.get("num_groups") is None:
        values["num_groups"] = config.rollout.batch_size // config.rollout.group_size
    temperature = config.rollout.temperature
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"rollout.temperature must be a number > 0, got {temperature!r}")
    # The update scores samples under the distribution they were drawn from.
    values["sampling_temperature"] = float(temperature)
    return PPOConfig.from_config(values)


@dataclasses.dataclass(frozen=True)
class RestoredPolicy:
    """A run's trained policy, read back from its latest checkpoint."""

    config: ml_collections.ConfigDict
    model_cfg: Any
    tokenizer: Tokenizer
    graph: Any  # the policy's nnx graph definition
    params: Any  # the full policy state (LoRA adapters merged with the base)
    trained: Any  # what trained: the adapters under LoRA, else the same as ``params``
    base: Any  # the frozen base under LoRA, else None
    step: int
    stage: str

    def sampler(self, **kwargs) -> Sampler:
        """A ``Sampler`` for this policy with the run's tokenizer and prompt buckets."""
        kwargs.setdefault("buckets", tuple(self.config.rollout.get("buckets", DEFAULT_BUCKETS)))
        return Sampler(self.graph, self.model_cfg, eos_id=self.tokenizer.eos_id,
                       pad_id=self.tokenizer.pad_id, **kwargs)  # fmt: skip


def restore_policy(workdir: str) -> RestoredPolicy:
    """The policy of ``workdir``'s latest checkpoint (read only: the run is not touched)."""
    config = ml_collections.ConfigDict(read_json(os.path.join(workdir, RUN_CONFIG_FILE)))
    config.overwrite = False
    mcfg = model_config(config)
    tokenizer = make_tokenizer(config, mcfg)
    graph, params, base = build_policy(config, mcfg, policy_init_key(config))

    def targets(meta):
        if "sft" in meta["items"]:
            s = config.sft
            trainer = sft_lib.sft_trainer(
                sft_lib.train_config(s.learning_rate, s.warmup_steps, s.weight_decay), graph
            )
            return {"sft": trainer.init(params)}
        cfg = ppo_config(config)
        value = None
        if cfg.uses_critic:
            value = create_model(lambda rngs: ValueModel(mcfg, rngs=rngs), jax.random.key(1))[1]
        return {"ppo": init_train_state(cfg, params, value, jax.random.key_data(jax.random.key(0)))}

    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR), async_save=False)
    try:
        restored = ckpt.restore_latest(targets, only=True)
    finally:
        ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"no checkpoint in {workdir}")
    step, items, meta = restored
    policy = items["sft"].params if "sft" in items else items["ppo"].policy
    return RestoredPolicy(config, mcfg, tokenizer, graph, full_policy(policy, base), policy,
                          base, step, meta["stage"])  # fmt: skip
