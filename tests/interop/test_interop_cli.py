"""The command lines: import / export, and sampling an HF model or a checkpoint with a named
adapter; plus several domain adapters over one frozen base, saved apart and picked by name."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from rlpt.interop import (
    HFTokenizer,
    list_adapters,
    load_adapter,
    load_checkpoint,
    load_hf_model,
    save_adapter,
)
from rlpt.models.lora import LoRAConfig, combine_lora, create_lora
from rlpt.sampling import GREEDY, Sampler

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT_IDS = [2, 17, 45, 9]
ADAPTERS = {"math": LoRAConfig(rank=4, alpha=8.0), "code": LoRAConfig(rank=2, alpha=2.0)}


def _start(*args):
    return subprocess.Popen(
        [sys.executable, "-m", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def _result(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _adapter_state(config, lora, seed):
    """A fresh adapter with random (non-zero) B, standing in for a trained one."""
    graphdef, state = create_lora(config, lora, jax.random.key(seed))
    flat = [
        (p, v.replace(0.5 * jax.random.normal(jax.random.key(seed + i), v.shape)))
        if p[-1] == "b" else (p, v)
        for i, (p, v) in enumerate(nnx.to_flat_state(state))
    ]  # fmt: skip
    return graphdef, nnx.from_flat_state(flat)


def _greedy(config, graphdef, state, tokenizer, prompt):
    sampler = Sampler(graphdef, config, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    out = sampler.generate(state, [prompt], jax.random.key(0), max_new_tokens=8, sampling=GREEDY)
    return out.tokens[0, : out.lengths[0]].tolist()


@pytest.fixture(scope="module")
def imported(hf_models, tmp_path_factory):
    """The Llama model imported through the CLI, with two adapters saved beside it."""
    hf_dir = hf_models["llama"][0]
    ckpt = str(tmp_path_factory.mktemp("cli") / "ckpt")
    result = _result(_start("rlpt.interop.hf", "import", hf_dir, ckpt))
    assert result["family"] == "llama" and result["checkpoint"] == ckpt
    model = load_checkpoint(ckpt)
    adapters = {}
    for seed, (name, lora) in enumerate(ADAPTERS.items()):
        graphdef, state = _adapter_state(model.config, lora, 10 * seed)
        save_adapter(ckpt, name, lora, state)
        adapters[name] = (graphdef, state)
    return hf_dir, ckpt, model, adapters


def test_imported_checkpoint_holds_params_config_and_tokenizer(imported):
    hf_dir, ckpt, model, _ = imported
    reference = load_hf_model(hf_dir)
    for a, b in zip(jax.tree.leaves(model.state), jax.tree.leaves(reference.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert model.config == reference.config
    assert os.path.exists(os.path.join(ckpt, "tokenizer", "tokenizer.json"))


def test_adapters_are_saved_apart_and_chosen_by_name(imported, hf_helpers):
    _, ckpt, model, adapters = imported
    assert list_adapters(ckpt) == ["code", "math"]
    tokens, mask = hf_helpers.padded_batch([PROMPT_IDS])
    logits = {}
    for name, (_, state) in adapters.items():
        lora, loaded_graph, loaded = load_adapter(ckpt, name, model.config)
        assert lora == ADAPTERS[name]
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        logits[name] = hf_helpers.rlpt_logits(
            loaded_graph, combine_lora(loaded, model.state), tokens, mask
        )
    assert np.abs(logits["math"] - logits["code"]).max() > 1e-2
    with pytest.raises(FileNotFoundError, match=r"no adapter 'poetry'.*\['code', 'math'\]"):
        load_adapter(ckpt, "poetry", model.config)


def test_command_lines_sample_and_export(imported, hf_helpers, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir, ckpt, model, adapters = imported
    tokenizer = HFTokenizer(hf_dir)
    graphdef, lora_state = adapters["math"]
    # Expected values first, so the subprocesses find the programs in the compilation cache.
    want_adapter = _greedy(
        model.config, graphdef, combine_lora(lora_state, model.state), tokenizer, PROMPT_IDS
    )
    text_prompt = tokenizer.encode("w5 w6", add_bos=True)
    want_text = _greedy(model.config, model.graphdef, model.state, tokenizer, text_prompt)
    export_dir = str(tmp_path / "exported")
    ids = ",".join(map(str, PROMPT_IDS))
    procs = [
        _start("rlpt.sample", f"--hf={ckpt}", "--adapter=math", f"--prompt_ids={ids}",
               "--max_new_tokens=8", "--greedy"),
        _start("rlpt.sample", f"--hf={hf_dir}", "--prompt=w5 w6", "--max_new_tokens=8",
               "--greedy"),
        _start("rlpt.interop.hf", "export", ckpt, export_dir, "--adapter=code"),
    ]  # fmt: skip
    by_adapter, by_text, exported = [_result(p) for p in procs]

    assert by_adapter["ids"] == [want_adapter]
    assert by_text["ids"] == [want_text]
    assert by_text["text"] == [tokenizer.decode(want_text)] and by_text["text"][0].strip()

    assert exported["adapter"] == "code"
    reloaded = AutoModelForCausalLM.from_pretrained(export_dir, attn_implementation="eager")
    tokens, mask = hf_helpers.padded_batch([PROMPT_IDS])
    code_graph, code_state = adapters["code"]
    expected = hf_helpers.rlpt_logits(
        code_graph, combine_lora(code_state, model.state), tokens, mask
    )
    np.testing.assert_allclose(
        hf_helpers.hf_logits(reloaded.eval(), tokens, mask), expected, atol=1e-4, rtol=0
    )
