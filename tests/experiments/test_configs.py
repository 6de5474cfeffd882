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
        config.stop_after_step = 2
        config.lock()
        result = train.train_and_evaluate(config, str(tmp_path))
        assert result == {"stopped_at_step": 2}
    assert os.path.exists(tmp_path / "metrics.jsonl")
