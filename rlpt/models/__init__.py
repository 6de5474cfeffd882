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
from rlpt.models.transformer import KVCache, Transformer, positions_from_mask

__all__ = [
    "BYTE_VOCAB_SIZE",
    "PRESETS",
    "CausalLM",
    "KVCache",
    "ModelConfig",
    "ProcessRewardModel",
    "RewardModel",
    "Transformer",
    "ValueModel",
    "abstract_model",
    "count_params",
    "create_model",
    "get_preset",
    "last_token_index",
    "positions_from_mask",
]
