"""Sharded loading onto a mesh, its host-memory bound, and refusals of bad input."""

import json
import os
import shutil
import tracemalloc

import jax
import numpy as np
import pytest
from flax import nnx

from rlpt.interop import ConversionError, HFTokenizer, load_hf_model, tensor_layouts
from rlpt.models import CausalLM, abstract_model
from rlpt.parallel import make_mesh, state_shardings


@pytest.fixture(scope="module")
def sharded_dir(torch_and_transformers, hf_helpers, tmp_path_factory):
    """A ~5 MB Llama in 1 MB shards (several files, an index)."""
    path = str(tmp_path_factory.mktemp("sharded") / "llama")
    model = hf_helpers.build_model(
        "llama", path, vocab_size=1024, hidden_size=128, intermediate_size=512,
        num_hidden_layers=4, max_shard_size="1MB",
    )  # fmt: skip
    return path, {k: v.numpy() for k, v in model.state_dict().items()}


def test_sharded_load_places_every_parameter_by_the_rules(sharded_dir, devices):
    path, torch_weights = sharded_dir
    shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(shards) >= 4 and os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    checkpoint_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in shards)
    mesh = make_mesh(2, 2, 2)

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        model = load_hf_model(path, mesh=mesh)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Blocks are read one tensor at a time: the host never holds the checkpoint.
    assert peak < checkpoint_bytes / 2, (peak, checkpoint_bytes)
    largest = max(v.nbytes for v in torch_weights.values())
    assert model.stats.peak_bytes <= largest < model.stats.total_bytes / 4

    _, abstract = abstract_model(lambda rngs: CausalLM(model.config, rngs=rngs))
    expected = dict(nnx.to_flat_state(state_shardings(abstract, mesh)))
    layouts = tensor_layouts(model.config)
    sharded_axes = 0
    for path_, variable in nnx.to_flat_state(model.state):
        value = variable.get_value()
        assert value.sharding == expected[path_].get_value(), path_
        sharded_axes += sum(axis is not None for axis in value.sharding.spec)
        layout = layouts[path_]
        np.testing.assert_array_equal(
            layout.to_hf(np.asarray(value)), torch_weights[layout.hf_name], err_msg=str(path_)
        )
    assert sharded_axes > 20  # the mesh really splits the parameters
    wq = model.state["trunk"]["blocks"][0]["attn"]["wq"][...]
    assert wq.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)


def _copy(src, tmp_path, name="bad"):
    dest = str(tmp_path / name)
    shutil.copytree(src, dest)
    return dest


def _edit_config(path, **changes):
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_path, "w") as f:
        json.dump(config, f)


def test_unsupported_architecture_is_refused(sharded_dir, tmp_path):
    path = _copy(sharded_dir[0], tmp_path)
    _edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ConversionError, match=r"config\.json.*unsupported architecture.*GPT2"):
        load_hf_model(path)


def test_missing_shard_is_refused_naming_file_and_tensor(sharded_dir, tmp_path):
    path = _copy(sharded_dir[0], tmp_path)
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[1]
    os.remove(os.path.join(path, shard))
    pattern = rf"missing shard .*{shard.replace('.', '[.]')}.*index\.json.*tensor '"
    with pytest.raises(ConversionError, match=pattern):
        load_hf_model(path)


def test_shape_mismatch_is_refused_naming_file_and_tensor(sharded_dir, tmp_path):
    path = _copy(sharded_dir[0], tmp_path)
    _edit_config(path, intermediate_size=256)
    pattern = (
        r"\.safetensors: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape "
        r"\[512, 128\] but config\.json implies \[256, 128\]"
    )
    with pytest.raises(ConversionError, match=pattern):
        load_hf_model(path)


def test_tensor_the_config_does_not_explain_is_refused(sharded_dir, tmp_path):
    path = _copy(sharded_dir[0], tmp_path)
    _edit_config(path, num_hidden_layers=3)
    with pytest.raises(ConversionError, match=r"unexpected tensor 'model\.layers\.3\."):
        load_hf_model(path)


def test_tokenizer_larger_than_the_vocabulary_is_refused(sharded_dir):
    with pytest.raises(ConversionError, match=r"tokenizer\.json.*290 ids.*embed_tokens.*200"):
        HFTokenizer(sharded_dir[0], model_vocab_size=200)
