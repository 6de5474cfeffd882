"""The transformer family and its heads."""

from rlpt.models.config import BYTE_VOCAB_SIZE, PRESETS, ModelConfig, get_preset
from rlpt.models.heads import (
    CausalLM,
    ProcessRewardModel,
    RewardModel,
    ValueModel,
    last_token_index,
)
from rlpt.models.init import abstract_model, count_params, create_model
from rlpt.models.lora import (
    LoRAConfig,
    add_lora,
    combine_lora,
    create_lora,
    lora_causal_lm,
    merge_lora,
    split_lora,
    zero_lora,
)
from rlpt.models.transformer import KVCache, Transformer, positions_from_mask
from rlpt.models.vocab import TokenStats, token_log_probs, vocab_logits

__all__ = [
    "BYTE_VOCAB_SIZE",
    "PRESETS",
    "CausalLM",
    "KVCache",
    "LoRAConfig",
    "ModelConfig",
    "ProcessRewardModel",
    "RewardModel",
    "Transformer",
    "TokenStats",
    "ValueModel",
    "abstract_model",
    "add_lora",
    "combine_lora",
    "count_params",
    "create_lora",
    "create_model",
    "get_preset",
    "last_token_index",
    "lora_causal_lm",
    "merge_lora",
    "positions_from_mask",
    "split_lora",
    "token_log_probs",
    "vocab_logits",
    "zero_lora",
]
