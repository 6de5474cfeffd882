"""Where the asynchronous run's rollout engine lives (``async_rl.engine``) and how many
replicas it has (``async_rl.engines``): in the two other JAX processes of a
three-process ``rlpt.train`` (an engine each), as two replicas on 2 devices each, or on
two Ray actors, the run computes
what it computes with one engine on 4 of its own 8 devices (sampling is seeded per
request, so which replica samples a group does not matter).

The runs use the synchronous schedule (``async_rl.mode = 'sync'``, staleness 0), so every
metric is a function of the weights and the seed alone. From a random policy the outcome
reward is always 0, so a length reward gives the groups' rewards spread and a large
learning rate moves the weights each step: an engine that kept stale weights would sample
other tokens and change the behaviour log-probs, ``ppo/mismatch_kl`` and the losses.
"""

import json
import os

import numpy as np
import pytest

from rlpt import train
from tests.process_env import run_train_processes
from tests.trainers.experiment_configs import experiment_config

STEPS = 3
SETTINGS = {
    "stages": ("ppo",),
    "ppo_steps": STEPS,
    "async_rl.mode": "sync",
    "async_rl.max_staleness": 0,
    "async_rl.actor_devices": 4,
    "rewards.length": 1.0,
    "rewards.length_target_bytes": 0,
    "ppo.learning_rate": 1e-2,
}
# Wall-clock and scheduling readings, different from run to run.
VARYING = ("time/", "async/learner_wait_s", "async/pool_groups", "async/response_lengths")


def _ppo_lines(workdir):
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    return [
        {k: v for k, v in r.items() if not k.startswith(VARYING)}
        for r in lines
        if r.get("stage") == "ppo"
    ]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The reference: the engine on devices 0-3 of this process, the learner on 4-7."""
    workdir = str(tmp_path_factory.mktemp("local") / "run")
    train.train_and_evaluate(experiment_config("demo_async", **SETTINGS), workdir)
    return _ppo_lines(workdir)


def _assert_same_run(got, want):
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for have, ref in zip(got, want):
        assert sorted(have) == sorted(ref), f"step {ref['step']}: keys differ"
        for key, value in ref.items():
            if isinstance(value, float):
                # atol: the engine-vs-learner log-prob gap (ppo/mismatch_logp_max_abs) is
                # float rounding, 5e-7 to 1e-6 depending on the engine's device layout.
                np.testing.assert_allclose(have[key], value, rtol=1e-5, atol=1e-5, err_msg=key)
            else:
                assert have[key] == value, f"step {ref['step']} {key}"


def _three_processes(workdir, *extra):
    """``rlpt.train`` as a driver and two engine processes, 4 host devices each."""
    overrides = [f"--config.{k}={v!r}" if isinstance(v, tuple) else f"--config.{k}={v}"
                 for k, v in SETTINGS.items() if k != "async_rl.actor_devices"]  # fmt: skip
    return run_train_processes(
        workdir, "experiments/demo_async.py:runlocal", "--config.async_rl.engine=process",
        *overrides, *extra, processes=3,
    )  # fmt: skip


def test_engine_processes_run_the_same_run_and_resume(tmp_path, local_run):
    """Stopped after step 2 and rerun: the driver resumes from its own checkpoint, new
    engine processes take its weights, and every step equals the one-process run."""
    workdir = str(tmp_path / "run")
    first = _three_processes(workdir, "--config.stop_after_step=2")
    second = _three_processes(workdir)
    assert "Resumed from checkpoint at step 2" in second[0]
    for _, *actors in (first, second):
        for actor in actors:  # each served calls and ran nothing of its own
            assert "rollout engine served" in actor and "Running trainer" not in actor
    _assert_same_run(_ppo_lines(workdir), local_run)
    steps = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
    assert steps[-1] == STEPS


def test_two_local_replicas_run_the_same_run(tmp_path, local_run):
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(
        experiment_config("demo_async", **SETTINGS, **{"async_rl.engines": 2}), workdir
    )
    _assert_same_run(_ppo_lines(workdir), local_run)


def test_two_ray_engines_run_the_same_run(tmp_path, local_run):
    ray = pytest.importorskip("ray", reason="async_rl.engine='ray' needs: pip install 'rlpt[ray]'")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        workdir = str(tmp_path / "run")
        config = experiment_config(
            "demo_async", **SETTINGS, **{"async_rl.engine": "ray", "async_rl.engines": 2}
        )
        train.train_and_evaluate(config, workdir)
        _assert_same_run(_ppo_lines(workdir), local_run)
    finally:
        if started:
            ray.shutdown()
