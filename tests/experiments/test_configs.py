"""Every ``experiments/*.py`` config loads, and runs two steps of its runlocal variant."""

import glob
import importlib.util
import os

import pytest

from rlpt import policy as policy_lib
from rlpt import train, trainers
from rlpt.config import parse_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_FILES = sorted(glob.glob(os.path.join(REPO_ROOT, "experiments", "*.py")))
# Each config file's runlocal argument(s): files with variants list each one.
RUNLOCAL_ARGS = {
    "demo_controls.py": ["sft_more,runlocal", "uniform,runlocal"],
    "efficacy.py": ["sft,runlocal", "rl_curriculum,runlocal", "sft_more,runlocal"],
    "curriculum_mix.py": ["learned,runlocal"],
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

    config = _load(os.path.join(REPO_ROOT, "experiments", "hf_post_train.py")).get_config()
    with pytest.raises(ValueError, match="model.hf_path"):
        parse_config(config)
    config.model.hf_path = _tiny_hf_checkpoint(tmp_path / "hf")
    config = parse_config(config)
    model_cfg = policy_lib.model_config(config)
    assert (model_cfg.vocab_size, model_cfg.d_model, model_cfg.n_layers) == (264, 32, 2)
    _, params = policy_lib.initial_policy(config, model_cfg, key=None)
    weights = safetensors.numpy.load_file(str(tmp_path / "hf" / "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(params["lm_head"][...]), weights["lm_head.weight"].T)
    tokenizer = policy_lib.make_tokenizer(config, model_cfg)
    text = "12+7=19<step>19*2=38<answer>38"
    ids = tokenizer.encode(text)
    assert tokenizer.step_id in ids and tokenizer.answer_id in ids
    assert tokenizer.decode(ids) == text


def test_hf_post_train_with_lora_saves_an_adapter_that_exports_and_evaluates(tmp_path):
    import json
    import subprocess
    import sys

    import numpy as np

    config = _load(os.path.join(REPO_ROOT, "experiments", "hf_post_train.py")).get_config(
        "runlocal"
    )
    config.model.hf_path = _tiny_hf_checkpoint(tmp_path / "hf")
    config.model.lora.rank = 4
    config.model.lora.name = "arith"
    config.domains = ("arithmetic",)
    config.ppo.learning_rate = 1e-2  # so three steps move the adapters visibly
    config.lock()
    workdir = tmp_path / "run"
    train.train_and_evaluate(config, str(workdir))
    model_dir = workdir / "model"
    assert (model_dir / "adapters" / "arith" / "adapter_config.json").exists()

    import jax
    import torch
    from flax import nnx
    from transformers import AutoModelForCausalLM

    from rlpt.interop.checkpoint import export_hf, load_for_sampling

    out = str(tmp_path / "exported")
    export_hf(str(model_dir), out, adapter="arith")
    _, graph, state, _ = load_for_sampling(str(model_dir), adapter="arith")
    tokens = np.array([[5, 17, 45, 9, 30], [5, 8, 100, 7, 7]])
    expected = np.asarray(jax.jit(lambda s, t: nnx.merge(graph, s)(t)[0])(state, tokens))

    def hf(path):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        with torch.no_grad():
            return model(input_ids=torch.tensor(tokens)).logits.float().numpy()

    np.testing.assert_allclose(hf(out), expected, atol=1e-4, rtol=0)
    # The adapter changed the model: the export is not the checkpoint it started from.
    assert np.abs(hf(str(tmp_path / "hf")) - expected).max() > 1e-4

    proc = subprocess.run(
        [sys.executable, "-m", "rlpt.eval", f"--hf={model_dir}", "--adapter=arith",
         "--domains=arithmetic", "--max_level=1", "--heldout_items=4", "--ood_items=0",
         "--n_samples=2", "--k=2", "--max_new_tokens=8"],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["adapter"] == "arith"
    assert result["results"]["heldout"]["arithmetic"]["items"] == 4
