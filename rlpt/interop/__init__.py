"""Hugging Face interop: Llama / Qwen2 weights, tokenizers, export and LoRA adapters."""

from rlpt.interop.checkpoint import (
    adapter_dir,
    export_hf,
    import_hf,
    is_checkpoint,
    list_adapters,
    load_adapter,
    load_checkpoint,
    load_for_sampling,
    save_adapter,
    save_checkpoint,
)
from rlpt.interop.convert import (
    ConversionError,
    TensorLayout,
    config_from_hf,
    family_of,
    hf_config_from,
    tensor_layouts,
)
from rlpt.interop.model import (
    HFModel,
    LoadStats,
    copy_tokenizer_files,
    load_hf_model,
    save_hf_model,
)
from rlpt.interop.tokenizer import HFTokenizer, load_hf_tokenizer, render_chat_template

__all__ = [
    "ConversionError",
    "HFModel",
    "HFTokenizer",
    "LoadStats",
    "TensorLayout",
    "adapter_dir",
    "config_from_hf",
    "copy_tokenizer_files",
    "export_hf",
    "family_of",
    "hf_config_from",
    "import_hf",
    "is_checkpoint",
    "list_adapters",
    "load_adapter",
    "load_checkpoint",
    "load_for_sampling",
    "load_hf_model",
    "load_hf_tokenizer",
    "render_chat_template",
    "save_adapter",
    "save_checkpoint",
    "save_hf_model",
    "tensor_layouts",
]
