"""rlpt.train: config checks, dispatch through the trainer registry, the command line."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import jax
import ml_collections
import pytest

from rlpt import config as rlpt_config
from rlpt import train, trainers
from rlpt.config import ConfigError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_experiment(name):
    path = os.path.join(REPO_ROOT, "experiments", name)
    spec = importlib.util.spec_from_file_location("experiments_" + name[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass(frozen=True)
class FakeConfig:
    """The typed config of the test trainer ``fake``."""

    trainer: str = "fake"
    seed: int = 3
    lr: float = 0.1

    def __post_init__(self):
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")

    def to_dict(self):
        return dataclasses.asdict(self)


def _config(**fields) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict({"trainer": "fake", "seed": 3, "lr": 0.1, **fields})
    config.lock()
    return config


@pytest.fixture
def fake_trainer(monkeypatch):
    """Registers a trainer `fake` (and its config type) that records its calls."""
    calls = []

    def fake_train(config, workdir):
        calls.append((config, workdir))
        return {"fake/metric": 1.0}

    def get_trainer(name):
        trainers.check_trainer(name)
        return fake_train

    # Registered so the name check passes; get_trainer is patched, so never imported.
    monkeypatch.setitem(trainers.TRAINERS, "fake", "unused.module:unused")
    monkeypatch.setitem(rlpt_config.CONFIG_TYPES, "fake", FakeConfig)
    monkeypatch.setattr(trainers, "get_trainer", get_trainer)
    return calls


def test_unknown_trainer_raises_before_compiling_or_writing(tmp_path):
    compile_events = []

    def listener(event, duration, **kwargs):
        if "compile" in event:
            compile_events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with pytest.raises(ConfigError, match=r"^trainer must be one of .*'ppo_gym'.*got 'nope'$"):
            train.train_and_evaluate(_config(trainer="nope"), str(tmp_path / "run"))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compile_events == []
    assert not (tmp_path / "run").exists()


def test_config_must_name_its_trainer(tmp_path):
    with pytest.raises(ConfigError, match="trainer must be set"):
        train.train_and_evaluate(ml_collections.ConfigDict({"seed": 0}), str(tmp_path))


def test_a_bad_value_raises_before_anything_is_written(tmp_path, fake_trainer):
    with pytest.raises(ConfigError, match=r"^lr must be > 0, got -1.0$"):
        train.train_and_evaluate(_config(lr=-1.0), str(tmp_path / "run"))
    assert fake_trainer == [] and not (tmp_path / "run").exists()


def test_dispatches_and_writes_resolved_config(tmp_path, fake_trainer):
    workdir = str(tmp_path / "run")
    result = train.train_and_evaluate(_config(seed=4), workdir)
    assert result == {"fake/metric": 1.0}
    [(passed, passed_workdir)] = fake_trainer
    assert passed_workdir == workdir
    assert passed.to_dict() == {"trainer": "fake", "seed": 4, "lr": 0.1}
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
        assert json.load(f) == {"trainer": "fake", "seed": 4, "lr": 0.1}


def test_the_trainer_gets_the_derived_values(tmp_path, monkeypatch):
    """A post-training run's trainer sees ppo.total_steps filled in, not None."""
    calls = []
    monkeypatch.setattr(trainers, "get_trainer", lambda name: lambda c, w: calls.append(c) or {})
    config = _load_experiment("demo.py").get_config("runlocal")
    config.ppo_steps = 5
    train.train_and_evaluate(config, str(tmp_path / "run"))
    [passed] = calls
    # Hand-worked: 5 PPO steps, 1 epoch, 1 minibatch (the runlocal shape).
    assert passed.ppo.total_steps == 5 and passed.ppo.num_groups == 8 // 4
    assert passed.model.hf_path is None  # a preset model, not a Hugging Face run
    with open(tmp_path / "run" / "config.json", encoding="utf-8") as f:
        assert json.load(f)["ppo"]["total_steps"] == 5


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


DEMO = f"--config={REPO_ROOT}/experiments/demo.py:runlocal"
# The bad command lines of the issue that asked for typed configs, and the one line each
# must now print (exit status 2, nothing written, nothing compiled).
BAD_COMMAND_LINES = {
    "negative clip and learning rate": (
        [DEMO, "--config.ppo.clip_low=-1", "--config.ppo.learning_rate=-0.01"],
        "ppo.clip_low must be in (0, 1), got -1",
    ),
    "negative ppo_steps": ([DEMO, "--config.ppo_steps=-1"], "ppo_steps must be >= 0, got -1"),
    "checkpoint every 0": (
        [DEMO, "--config.checkpoint.every=0"],
        "checkpoint.every must be >= 1, got 0",
    ),
    "misspelt key": (
        [DEMO, "--config.ppo.clip_lw=0.1"],
        "unknown config key ppo.clip_lw; did you mean ppo.clip_low?",
    ),
    "bad batch size": (
        [DEMO, "--config.rollout.batch_size=10"],
        "rollout.batch_size must be a multiple of rollout.group_size (4), got 10",
    ),
    "distributed config key": (
        [DEMO, "--config.distributed=True"],
        "unknown config key distributed: multi-process JAX starts from flags of rlpt.train: "
        "--coordinator_address=HOST:PORT --num_processes=N --process_id=I, or --distributed",
    ),
    "string for an int": (
        [DEMO, "--config.ppo_steps=abc"],
        "ppo_steps must be an integer, got 'abc'",
    ),
    "engine process without processes": (
        [DEMO, "--config.async_rl.enabled=True", "--config.async_rl.engine=process"],
        "async_rl.engine 'process' runs as two JAX processes: pass --coordinator_address, "
        "--num_processes=2 and --process_id (or --distributed)",
    ),
    "engine process on one process": (
        [
            DEMO,
            "--config.async_rl.enabled=True",
            "--config.async_rl.engine=process",
            "--coordinator_address=localhost:1",
            "--num_processes=1",
            "--process_id=0",
        ],
        "async_rl.engine 'process' runs as --num_processes >= 2 (the driver and one process "
        "per engine), got 1",
    ),
    "engine process, async off": (
        [DEMO, "--config.async_rl.engine=process"],
        "async_rl.engine 'process' needs async_rl.enabled",
    ),
    "half the process flags": (
        [DEMO, "--num_processes=2"],
        "--coordinator_address, --process_id must be set with --num_processes (or pass "
        "--distributed to read the rest from a TPU pod's or SLURM job's environment)",
    ),
}


def _popen_cli(*args, cwd):
    return subprocess.Popen(
        [sys.executable, "-m", "rlpt.train", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_cli_bad_input_prints_one_line_and_exits_2_before_writing(tmp_path):
    # Started together: each process's cost is the JAX import, and they overlap.
    procs = {}
    for name, (args, _) in BAD_COMMAND_LINES.items():
        workdir = tmp_path / name.replace(" ", "_")
        procs[name] = (_popen_cli(*args, f"--workdir={workdir}", cwd=tmp_path), workdir)
    for name, (proc, workdir) in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        message = BAD_COMMAND_LINES[name][1]
        assert (proc.returncode, stderr, stdout) == (2, message + "\n", ""), name
        assert not workdir.exists(), name


def test_a_workdir_that_cannot_be_a_directory_is_refused(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory\n")
    with pytest.raises(ConfigError) as error:
        train._check_workdir(str(a_file))
    assert str(error.value) == f"--workdir {a_file} is a file, not a directory"
    with pytest.raises(ConfigError) as error:
        train._check_workdir(str(a_file / "run"))
    assert str(error.value) == f"--workdir {a_file / 'run'} cannot be made: {a_file} is a file"
    assert a_file.read_text() == "not a directory\n"
    train._check_workdir(str(tmp_path / "new" / "run"))  # made later, by the run
    assert not (tmp_path / "new").exists()


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
