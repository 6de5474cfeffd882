"""Imported Llama and Qwen2 models compute what transformers computes: logits and greedy text."""

import numpy as np
import pytest

from rlpt.interop import ConversionError, HFTokenizer, config_from_hf, load_hf_model
from rlpt.sampling import GREEDY, Sampler

PROMPTS = [[2, 17, 45, 9, 200, 31, 77, 5], [2, 8], [2, 250, 251, 252, 11]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def loaded(request, hf_models):
    path, torch_model = hf_models[request.param]
    return request.param, torch_model, load_hf_model(path)


def test_config_reads_family_bias_tying_and_rotary(loaded):
    family, _, model = loaded
    cfg = model.config
    assert model.family == family
    shape = (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim)
    assert shape == (64, 2, 4, 2, 128)
    if family == "llama":
        assert not cfg.qkv_bias and not cfg.tie_embeddings and cfg.rope_theta == 50_000.0
        assert dict(cfg.rope_scaling)["type"] == "llama3"
        assert dict(cfg.rope_scaling)["original_max_position_embeddings"] == 32
    else:  # written in the older top-level style by the fixture
        assert cfg.qkv_bias and cfg.tie_embeddings and cfg.rope_theta == 1_000_000.0
        assert dict(cfg.rope_scaling) == {"type": "linear", "factor": 2.0}
    assert cfg.dtype == "float32"


def test_rope_settings_read_from_either_style():
    base = dict(
        architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=16,
    )  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 7.0}
    new, _ = config_from_hf({**base, "rope_parameters": rope})
    old, _ = config_from_hf({**base, "rope_theta": 7.0})
    assert new.rope_theta == old.rope_theta == 7.0 and new.rope_scaling is old.rope_scaling is None
    scaled, _ = config_from_hf(
        {**base, "rope_theta": 3.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    )
    assert dict(scaled.rope_scaling) == {"type": "linear", "factor": 4.0}
    with pytest.raises(ConversionError, match=r"config\.json: unsupported rotary scaling.*yarn"):
        config_from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


def test_logits_match_transformers(loaded, hf_helpers):
    """float32 on both sides: the only differences are summation order (~1e-6)."""
    _, torch_model, model = loaded
    tokens, mask = hf_helpers.padded_batch(PROMPTS)
    expected = hf_helpers.hf_logits(torch_model, tokens, mask)
    got = hf_helpers.rlpt_logits(model.graphdef, model.state, tokens, mask)
    real = mask.astype(bool)
    assert np.abs(expected[real]).max() > 1.0  # spread-out logits: the comparison means something
    np.testing.assert_allclose(got[real], expected[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_generation_matches_transformers(loaded, hf_models, batch):
    import torch

    family, torch_model, model = loaded
    tokenizer = HFTokenizer(hf_models[family][0], model_vocab_size=model.config.vocab_size)
    prompts = PROMPTS[:batch]
    tokens, mask = _left_pad(prompts, tokenizer.pad_id)
    with torch.no_grad():
        hf_out = torch_model.generate(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
            max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_id,
            eos_token_id=tokenizer.eos_id,
        )[:, tokens.shape[1] :].numpy()  # fmt: skip
    sampler = Sampler(
        model.graphdef, model.config, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id
    )
    out = sampler.generate(model.state, prompts, _key(), max_new_tokens=32, sampling=GREEDY)
    for row in range(batch):
        ours = out.tokens[row, : out.lengths[row]].tolist()
        theirs = hf_out[row].tolist()
        if tokenizer.eos_id in theirs:
            theirs = theirs[: theirs.index(tokenizer.eos_id) + 1]
        assert ours == theirs, (family, row)
    assert max(out.lengths) > 8  # not stopped at once: the comparison covers real decoding


def _left_pad(prompts, pad_id):
    length = max(len(p) for p in prompts)
    tokens = np.full((len(prompts), length), pad_id, np.int64)
    mask = np.zeros((len(prompts), length), np.int64)
    for i, p in enumerate(prompts):
        tokens[i, length - len(p) :] = p
        mask[i, length - len(p) :] = 1
    return tokens, mask


def _key():
    import jax

    return jax.random.key(0)
