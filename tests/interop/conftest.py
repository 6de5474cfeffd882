"""Tiny Hugging Face models built locally with transformers (PyTorch on CPU), once per session.

Weights are random with spread-out norms and biases (not the ones and zeros
a fresh model starts with), so every parameter's mapping is exercised.
"""

import json
import os

import numpy as np
import pytest

VOCAB = 300  # the model's vocabulary; the tokenizer uses 288 ids plus the 2 rlpt adds
WORDS = 284


def write_tokenizer(path: str, *, bos: bool = True, reserved: int = 0) -> None:
    """A WordLevel tokenizer: <unk> <pad> <s> </s>, words w0..w283, then ``reserved``
    Llama-3-style reserved special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<pad>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": len(specials) + i for i in range(WORDS)})
    extra = [f"<|reserved_special_token_{i}|>" for i in range(reserved)]
    vocab.update({t: len(vocab) + i for i, t in enumerate(extra)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials + extra)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "chat_template": (
            "{{ bos_token }}{% for m in messages %}{{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}w1 {% endif %}"
        ),
    }
    if bos:
        # The AddedToken form older tokenizer_config.json files use.
        config["bos_token"] = {
            "__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True,
        }  # fmt: skip
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def randomise(model, seed: int, scale: float = 0.15) -> None:
    """Every parameter random: matrices N(0, scale), norms 1 + N(0, 0.3), biases N(0, 0.3)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(scale * noise)


def build_model(family: str, path: str, *, seed: int = 0, max_shard_size=None, **overrides):
    """Build, randomise and save a tiny model of ``family``; returns the torch model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=2, eos_token_id=3, pad_token_id=1,
    )  # fmt: skip
    if family == "llama":
        common.update(
            rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 50_000.0, "factor": 4.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )  # fmt: skip
        common.update(overrides)
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        common.update(
            rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 2.0},
        )  # fmt: skip
        common.update(overrides)
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    randomise(model, seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    write_tokenizer(path, bos=family == "llama")
    return model


@pytest.fixture(scope="session")
def torch_and_transformers():
    pytest.importorskip("torch", reason="the Hugging Face parity tests need PyTorch")
    pytest.importorskip("transformers", reason="the Hugging Face parity tests need transformers")
    pytest.importorskip("tokenizers", reason="the Hugging Face tests need tokenizers")
    pytest.importorskip("safetensors", reason="the Hugging Face tests need safetensors")


@pytest.fixture(scope="session")
def hf_models(torch_and_transformers, tmp_path_factory):
    """{family: (directory, torch model)} for llama (untied, llama3 rotary scaling, written in
    transformers 5's rope_parameters) and qwen2 (tied, qkv biases, linear scaling, rewritten in
    the older top-level rope_theta / rope_scaling style)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family in ("llama", "qwen2"):
        path = str(root / family)
        out[family] = (path, build_model(family, path))
    config_path = os.path.join(out["qwen2"][0], "config.json")
    with open(config_path) as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    with open(config_path, "w") as f:
        json.dump(config, f)
    return out


def hf_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """transformers' float32 logits, with the positions rlpt uses for padded rows."""
    import torch

    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0) * mask
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(positions, dtype=torch.long),
        )
    return out.logits.float().numpy()


def rlpt_logits(graphdef, state, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    import jax
    from flax import nnx

    fn = jax.jit(lambda s, t, m: nnx.merge(graphdef, s)(t, mask=m)[0])
    return np.asarray(fn(state, tokens, mask.astype(bool)))


def padded_batch(rows, pad_id: int = 1):
    """Left-padded [B, L] tokens and int mask."""
    length = max(len(r) for r in rows)
    tokens = np.full((len(rows), length), pad_id, np.int64)
    mask = np.zeros((len(rows), length), np.int64)
    for i, r in enumerate(rows):
        tokens[i, length - len(r) :] = r
        mask[i, length - len(r) :] = 1
    return tokens, mask


@pytest.fixture(scope="session")
def hf_helpers():
    """The helpers above, for test modules (importlib import mode cannot import conftest)."""
    import types

    return types.SimpleNamespace(
        build_model=build_model, write_tokenizer=write_tokenizer, hf_logits=hf_logits,
        rlpt_logits=rlpt_logits, padded_batch=padded_batch,
    )  # fmt: skip
