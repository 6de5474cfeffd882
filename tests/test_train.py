"""rlpt.train: config checks, dispatch through the trainer registry, the command line."""

import json
import os
import subprocess
import sys

import jax
import ml_collections
import pytest

from rlpt import train, trainers

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**fields) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict({"trainer": "fake", "seed": 3, "lr": 0.1, **fields})
    config.lock()
    return config


@pytest.fixture
def fake_trainer(monkeypatch):
    """Registers a trainer `fake` that records its calls and returns a metric."""
    calls = []

    def fake_train(config, workdir):
        calls.append((config, workdir))
        return {"fake/metric": 1.0}

    def get_trainer(name):
        trainers.check_trainer(name)
        return fake_train

    # Registered so the name check passes; get_trainer is patched, so never imported.
    monkeypatch.setitem(trainers.TRAINERS, "fake", "unused.module:unused")
    monkeypatch.setattr(trainers, "get_trainer", get_trainer)
    return calls


def test_unknown_trainer_raises_before_compiling_or_writing(tmp_path):
    compile_events = []

    def listener(event, duration, **kwargs):
        if "compile" in event:
            compile_events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with pytest.raises(ValueError, match=r"'nope'.*allowed values.*ppo_gym"):
            train.train_and_evaluate(_config(trainer="nope"), str(tmp_path / "run"))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compile_events == []
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("field", ["trainer", "seed"])
def test_config_must_have_trainer_and_seed(tmp_path, field):
    fields = {"trainer": "ppo_gym", "seed": 0}
    del fields[field]
    with pytest.raises(ValueError, match=field):
        train.train_and_evaluate(ml_collections.ConfigDict(fields), str(tmp_path))


def test_dispatches_and_writes_resolved_config(tmp_path, fake_trainer):
    config = _config()
    workdir = str(tmp_path / "run")
    result = train.train_and_evaluate(config, workdir)
    assert result == {"fake/metric": 1.0}
    assert fake_trainer == [(config, workdir)]
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
        assert json.load(f) == {"trainer": "fake", "seed": 3, "lr": 0.1}


def test_ppo_gym_is_registered():
    from rlpt.trainers import ppo_gym

    assert trainers.get_trainer("ppo_gym") is ppo_gym.train_and_evaluate


def _run_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "rlpt.train", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_rejects_unknown_config_override(tmp_path):
    proc = _run_cli(
        f"--config={REPO_ROOT}/experiments/cartpole_ppo.py:runlocal",
        "--config.no_such_field=1",
        f"--workdir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "no_such_field" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_cli_runs_the_runlocal_config_end_to_end(tmp_path):
    workdir = tmp_path / "run"
    proc = _run_cli(
        f"--config={REPO_ROOT}/experiments/cartpole_ppo.py:runlocal",
        "--config.seed=5",
        f"--workdir={workdir}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["env_steps"] > 0
    with open(workdir / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    assert config["trainer"] == "ppo_gym" and config["seed"] == 5
    assert (workdir / "metrics.jsonl").exists()
