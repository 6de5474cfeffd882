"""LoRA as a post-training option: only the adapters train, over one frozen base shared
with the reference, and the saved adapter is chosen by name at evaluation time."""

import importlib.util
import os

import jax
import numpy as np
import pytest
from flax import nnx

from rlpt import eval as eval_lib
from rlpt import policy as policy_lib
from rlpt.config import parse_config
from rlpt.trainers import post_train

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**overrides):
    spec = importlib.util.spec_from_file_location(
        "demo", os.path.join(REPO_ROOT, "experiments/demo.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("runlocal")
    config.model.lora.rank = 4
    for key, value in overrides.items():
        node = config
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    config.lock()
    return config


def _leaves(state):
    return {
        "/".join(map(str, path)): np.asarray(jax.device_get(v.get_value()))
        for path, v in nnx.to_flat_state(state)
    }


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("lora") / "run")
    config = _config(**{"model.lora.name": "arith", "domains": ("arithmetic",)})
    run = post_train.PostTrainRun(config, workdir)
    try:
        summary = run.run()
    finally:
        run.close()
    return config, workdir, run, summary


def test_only_adapters_train_and_the_reference_holds_no_second_base(lora_run):
    config, _, run, _ = lora_run
    trained = _leaves(run._trained_params())
    assert trained and all("lora_" in path for path in trained)
    # The reference is the SFT adapters: adapter-sized, never a copy of the base.
    assert set(_leaves(run.learner.ref_params)) == set(trained)
    typed = parse_config(config)
    fresh_graph, fresh_adapters, fresh_base = policy_lib.build_policy(
        typed, run.model_cfg, policy_lib.policy_init_key(typed)
    )
    base_now, base_init = _leaves(run.base_params), _leaves(fresh_base)
    assert base_now.keys() == base_init.keys()
    for path, value in base_init.items():
        np.testing.assert_array_equal(base_now[path], value, err_msg=path)
    # Training moved the adapters (B starts at zero, so any change shows in B).
    moved = [p for p, v in _leaves(fresh_adapters).items() if not np.array_equal(trained[p], v)]
    assert any(p.endswith("/b") for p in moved)


def test_adapter_is_saved_and_chosen_by_name_at_evaluation(lora_run):
    _, workdir, _, summary = lora_run
    adapter_dir = os.path.join(workdir, "adapters", "arith")
    assert os.path.exists(os.path.join(adapter_dir, "adapter_config.json"))
    own = eval_lib.evaluate_checkpoint(workdir)
    by_name = eval_lib.evaluate_checkpoint(workdir, adapter="arith")
    by_path = eval_lib.evaluate_checkpoint(workdir, adapter=adapter_dir)
    assert by_name["adapter"] == "arith"
    for result in (by_name, by_path):
        assert result["results"] == own["results"]
    # The run's own final evaluation used the same policy and eval draw.
    assert own["results"]["heldout"]["arithmetic"]["items"] == 4
    with pytest.raises(FileNotFoundError, match="no adapter 'code'.*arith"):
        eval_lib.evaluate_checkpoint(workdir, adapter="code")


def test_bad_lora_settings_are_refused_before_anything_runs(tmp_path):
    bad_targets = r"model.lora.targets must be a non-empty subset of .*, got \('nope',\)"
    with pytest.raises(ValueError, match=bad_targets):
        post_train.PostTrainRun(_config(**{"model.lora.targets": ("nope",)}), str(tmp_path))
    with pytest.raises(ValueError, match="model.lora.name"):
        post_train.PostTrainRun(_config(**{"model.lora.name": "a/b"}), str(tmp_path))
    assert not os.listdir(tmp_path)
