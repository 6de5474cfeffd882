"""Every ``experiments/*.py`` config loads, and runs two steps of its runlocal variant."""

import glob
import importlib.util
import os

import pytest

from rlpt import train, trainers

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_FILES = sorted(glob.glob(os.path.join(REPO_ROOT, "experiments", "*.py")))
# Each config file's runlocal argument(s): files with variants list each one.
RUNLOCAL_ARGS = {
    "demo_controls.py": ["sft_more,runlocal", "uniform,runlocal"],
}


def _load(path):
    name = "experiments_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_hf_checkpoint(path) -> str:
    """A tiny random Llama with a byte-level BPE tokenizer.json, as a Hugging Face directory."""
    pytest.importorskip("torch", reason="the hf extra (torch, transformers) is not installed")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    import json

    import torch

    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for special in ("<pad>", "<s>", "</s>"):
        vocab[special] = len(vocab)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, f)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"],
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def _cases():
    for path in CONFIG_FILES:
        for arg in RUNLOCAL_ARGS.get(os.path.basename(path), ["runlocal"]):
            yield pytest.param(path, arg, id=f"{os.path.basename(path)}:{arg}")


def test_every_config_file_is_collected():
    names = {os.path.basename(p) for p in CONFIG_FILES}
    assert {"cartpole_ppo.py", "demo.py", "demo_controls.py"} <= names


@pytest.mark.parametrize("path,arg", list(_cases()))
def test_config_runs_two_steps(path, arg, tmp_path):
    module = _load(path)
    assert module.__doc__ and "python -m rlpt.train" in module.__doc__
    config = module.get_config(arg)
    trainers.check_trainer(config.trainer)
    assert "seed" in config
    if config.trainer == "ppo_gym":
        config.total_env_steps = 2 * config.num_envs * config.num_steps
        config.log_every = 1
        config.eval_episodes = 2
        config.lock()
        result = train.train_and_evaluate(config, str(tmp_path))
        assert result["env_steps"] == 2 * config.num_envs * config.num_steps
    else:
        if "hf_path" in config.model:
            config.model.hf_path = _tiny_hf_checkpoint(tmp_path / "hf")
        config.stop_after_step = 2
        config.lock()
        result = train.train_and_evaluate(config, str(tmp_path / "run"))
        assert result == {"stopped_at_step": 2}
    workdir = tmp_path if config.trainer == "ppo_gym" else tmp_path / "run"
    assert os.path.exists(workdir / "metrics.jsonl")


def test_hf_post_train_starts_from_the_checkpoint_weights_and_tokenizer(tmp_path):
    import numpy as np
    import safetensors.numpy

    from rlpt.trainers import post_train

    config = _load(os.path.join(REPO_ROOT, "experiments", "hf_post_train.py")).get_config()
    with pytest.raises(ValueError, match="model.hf_path"):
        post_train.model_config(config)
    config.model.hf_path = _tiny_hf_checkpoint(tmp_path / "hf")
    model_cfg = post_train.model_config(config)
    assert (model_cfg.vocab_size, model_cfg.d_model, model_cfg.n_layers) == (264, 32, 2)
    _, params = post_train.initial_policy(config, model_cfg, key=None)
    weights = safetensors.numpy.load_file(str(tmp_path / "hf" / "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(params["lm_head"][...]), weights["lm_head.weight"].T)
    tokenizer = post_train.make_tokenizer(config, model_cfg)
    text = "12+7=19<step>19*2=38<answer>38"
    ids = tokenizer.encode(text)
    assert tokenizer.step_id in ids and tokenizer.answer_id in ids
    assert tokenizer.decode(ids) == text
