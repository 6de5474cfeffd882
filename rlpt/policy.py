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

from rlpt import checkpoint as ckpt_lib
from rlpt import sft as sft_lib
from rlpt.config import PostTrainConfig, parse_config
from rlpt.models import CausalLM, ValueModel, create_model, get_preset
from rlpt.rl import init_train_state
from rlpt.runfiles import read_json
from rlpt.sampling import make_sampler
from rlpt.tasks import Domain, get_domain
from rlpt.tokenizers import ByteTokenizer, Tokenizer

# The run's identity (its config without the run-control fields), written when the run
# starts; readers rebuild the run's policy from it.
RUN_CONFIG_FILE = "run_config.json"
DEFAULT_ADAPTER_NAME = "policy"


def model_config(config: PostTrainConfig):
    """The model's shape: a Hugging Face checkpoint's (``model.hf_path``) or a preset's."""
    overrides = dict(config.model.overrides)
    hf_path = config.model.hf_path
    if hf_path:
        from rlpt.interop import config_from_hf
        from rlpt.interop.model import read_hf_config

        hf_config = read_hf_config(hf_path)
        cfg, _ = config_from_hf(hf_config, source=os.path.join(hf_path, "config.json"))
        return cfg.replace(**overrides) if overrides else cfg
    return get_preset(config.model.preset, **overrides)


def make_tokenizer(config: PostTrainConfig, model_cfg) -> Tokenizer:
    """The checkpoint's own tokenizer.json for a Hugging Face model, else the byte tokenizer."""
    if config.model.hf_path:
        from rlpt.interop import load_hf_tokenizer

        return load_hf_tokenizer(config.model.hf_path, model_vocab_size=model_cfg.vocab_size)
    return ByteTokenizer()


def initial_policy(config: PostTrainConfig, model_cfg, key: jax.Array):
    """(graphdef, params) of the policy before any training: another run's policy
    (``model.init_from``), loaded from Hugging Face, or randomly initialised."""
    if config.model.init_from:
        source = restore_policy(config.model.init_from)
        if source.base is not None:
            raise ValueError(
                f"model.init_from {config.model.init_from!r} trained LoRA adapters; start "
                "from a run that trained full weights"
            )
        if source.model_cfg != model_cfg:
            differ = [
                f.name for f in dataclasses.fields(model_cfg)
                if getattr(source.model_cfg, f.name) != getattr(model_cfg, f.name)
            ]  # fmt: skip
            raise ValueError(
                f"model.init_from {config.model.init_from!r} has another model: {differ} differ"
            )
        return source.graph, source.trained
    if config.model.hf_path:
        from rlpt.interop import load_hf_model

        loaded = load_hf_model(config.model.hf_path, max_seq_len=model_cfg.max_seq_len)
        return loaded.graphdef, loaded.state
    return create_model(lambda rngs: CausalLM(model_cfg, rngs=rngs), key)


def adapter_name(config: PostTrainConfig) -> str:
    return config.model.lora.name or DEFAULT_ADAPTER_NAME


def policy_init_key(config: PostTrainConfig) -> jax.Array:
    return jax.random.fold_in(jax.random.key(config.seed), 0)


def build_policy(config: PostTrainConfig, model_cfg, key: jax.Array):
    """(graphdef, trainable params, frozen base or None) of the policy before training.

    With ``model.lora.rank > 0`` only the adapters train; the loaded or initialised
    weights are the frozen base, shared by policy and reference, never copied.
    """
    graph, params = initial_policy(config, model_cfg, key)
    lora = config.model.lora.lora_config()
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


def train_levels(config: PostTrainConfig, domains: Mapping[str, Domain]) -> dict:
    """The highest difficulty each domain trains at (the OOD split is one above)."""
    spec = config.train_max_level
    out = {}
    for name, domain in domains.items():
        level = spec.get(name, spec.get("default", 1)) if isinstance(spec, Mapping) else spec
        out[name] = min(int(level), domain.max_difficulty)
    return out


def make_domains(config: PostTrainConfig) -> dict[str, Domain]:
    return {name: get_domain(name) for name in config.domains}


@dataclasses.dataclass(frozen=True)
class RestoredPolicy:
    """A run's trained policy, read back from its latest checkpoint."""

    config: PostTrainConfig
    model_cfg: Any
    tokenizer: Tokenizer
    graph: Any  # the policy's nnx graph definition
    params: Any  # the full policy state (LoRA adapters merged with the base)
    trained: Any  # what trained: the adapters under LoRA, else the same as ``params``
    base: Any  # the frozen base under LoRA, else None
    step: int
    stage: str

    def sampler(self, **kwargs):
        """The run's sampler (``rollout.sampler``) for this policy, with its tokenizer."""
        kwargs.setdefault("buckets", tuple(self.config.rollout.buckets))
        rollout = self.config.rollout
        return make_sampler(rollout.sampler, self.graph, self.model_cfg, slots=rollout.slots,
                            eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id,
                            **kwargs)  # fmt: skip


def restore_policy(workdir: str) -> RestoredPolicy:
    """The policy of ``workdir``'s latest checkpoint (read only: the run is not touched)."""
    config = parse_config(read_json(os.path.join(workdir, RUN_CONFIG_FILE)))
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
        cfg = config.ppo
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
