"""Model configuration: one frozen dataclass for the whole transformer family.

The fields follow the Llama / Qwen2 parameterisation so Hugging Face
checkpoints of those families map onto it one to one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

_COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_ROPE_SCALING_TYPES = ("linear", "llama3")
# "dense" materialises [T, S] scores (the reference); "blockwise" is an online-softmax over
# key blocks in plain XLA (memory linear in length, any backend); "dot_product" is
# jax.nn.dot_product_attention (cuDNN flash attention on GPU); "splash" is the Pallas splash
# kernel on TPU; "auto" picks splash on TPU, dot_product on GPU, blockwise elsewhere.
ATTENTION_KINDS = ("dense", "blockwise", "dot_product", "splash", "auto")
# "none": every allowed key; "moba": each query reads its own block and the top-k earlier
# key blocks chosen by q . mean(K_block) (MoBA / NSA selected blocks).
SPARSE_ATTENTION_KINDS = ("none", "moba")
# What a rematerialised block keeps for the backward pass (jax.checkpoint policies).
REMAT_POLICIES = ("full", "dots", "dots_no_batch", "attention_out")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer.

    Parameters are always float32; ``dtype`` is the compute dtype of the matrix
    multiplications (inputs cast to it, accumulation in float32).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int | None = None  # None: d_model // n_heads
    max_seq_len: int = 2048
    rope_theta: float = 10_000.0
    # None, or a tuple of (key, value) pairs, e.g. (("type", "linear"), ("factor", 2.0)).
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = False
    dtype: str = "float32"
    remat: bool = False
    # Which activations a rematerialised block saves (used when ``remat`` is True).
    remat_policy: str = "full"
    # Tokens per chunk when log-probs, entropy and KL terms are taken over the vocabulary:
    # 0 holds the whole [B, T, V] logits; > 0 never holds more than [B, chunk, V].
    vocab_chunk: int = 0
    attention: str = "dense"
    # Query and key block length of the blockwise attention path.
    attention_block: int = 512
    # 0: full causal attention; W > 0: a query sees the W most recent positions (its own
    # included) plus the first ``attention_sinks`` positions of its sequence.
    sliding_window: int = 0
    attention_sinks: int = 0
    sparse_attention: str = "none"
    sparse_block: int = 64
    sparse_top_k: int = 4

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads "
                f"({self.n_heads}) when model.head_dim is not set"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads "
                f"({self.n_kv_heads}) for grouped-query attention"
            )
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.dtype not in _COMPUTE_DTYPES:
            raise ValueError(
                f"model.dtype must be one of {sorted(_COMPUTE_DTYPES)}, got {self.dtype!r}"
            )
        for name, value, allowed in (
            ("attention", self.attention, ATTENTION_KINDS),
            ("sparse_attention", self.sparse_attention, SPARSE_ATTENTION_KINDS),
            ("remat_policy", self.remat_policy, REMAT_POLICIES),
        ):
            if value not in allowed:
                raise ValueError(f"model.{name} must be one of {allowed}, got {value!r}")
        for name in ("vocab_chunk", "sliding_window", "attention_sinks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"model.{name} must be a non-negative integer, got {value!r}")
        for name in ("attention_block", "sparse_block", "sparse_top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.attention_sinks and not self.sliding_window:
            raise ValueError("model.attention_sinks needs model.sliding_window > 0")
        if self.max_seq_len <= 0:
            raise ValueError(f"model.max_seq_len must be positive, got {self.max_seq_len}")
        if self.rope_scaling is not None:
            kind = dict(self.rope_scaling).get("type")
            if kind not in _ROPE_SCALING_TYPES:
                raise ValueError(
                    f"model.rope_scaling type must be one of {_ROPE_SCALING_TYPES}, got {kind!r}"
                )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def compute_dtype(self):
        return _COMPUTE_DTYPES[self.dtype]

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(self.rope_scaling)
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(
                f"unknown model config fields {sorted(unknown)}; known: {sorted(known)}"
            )
        values = dict(values)
        if isinstance(values.get("rope_scaling"), Mapping):
            values["rope_scaling"] = tuple(sorted(values["rope_scaling"].items()))
        return cls(**values)


# Byte-level tokenizer vocabulary (256 bytes + 5 specials) rounded up to a multiple of 8.
BYTE_VOCAB_SIZE = 264

PRESETS: dict[str, ModelConfig] = {
    # Tests: a few tens of thousands of parameters.
    "tiny": ModelConfig(
        vocab_size=BYTE_VOCAB_SIZE, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
        ffn_dim=64, max_seq_len=256,
    ),
    # The CPU demo: about 1.9M parameters.
    "mini": ModelConfig(
        vocab_size=BYTE_VOCAB_SIZE, d_model=192, n_layers=4, n_heads=6, n_kv_heads=2,
        ffn_dim=512, max_seq_len=512, tie_embeddings=True,
    ),
    # About 20M parameters.
    "small": ModelConfig(
        vocab_size=BYTE_VOCAB_SIZE, d_model=512, n_layers=6, n_heads=8, n_kv_heads=4,
        ffn_dim=1536, max_seq_len=1024,
    ),
    # Llama 3.2 1B shape.
    "llama-1b": ModelConfig(
        vocab_size=128_256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
        ffn_dim=8192, max_seq_len=131_072, rope_theta=500_000.0, rms_eps=1e-5,
        tie_embeddings=True, dtype="bfloat16",
        rope_scaling=(("factor", 32.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                      ("original_max_position_embeddings", 8192), ("type", "llama3")),
    ),
    # Qwen2 1.5B shape (qkv bias, tied embeddings).
    "qwen2-1.5b": ModelConfig(
        vocab_size=151_936, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2,
        ffn_dim=8960, max_seq_len=32_768, rope_theta=1_000_000.0, rms_eps=1e-6,
        qkv_bias=True, tie_embeddings=True, dtype="bfloat16",
    ),
}  # fmt: skip


def get_preset(name: str, **overrides) -> ModelConfig:
    """The named preset, with field overrides applied (and re-validated)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; allowed: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
