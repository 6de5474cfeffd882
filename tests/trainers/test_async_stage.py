"""The asynchronous ppo stage end to end (experiments/demo_async.py:runlocal): the engine on
4 of the 8 host devices, the learner on the other 4; a run stopped between checkpoints and
rerun with the same command trains on every prompt exactly once."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlpt import train
from rlpt.checkpoint import latest_checkpoint_meta
from rlpt.config import ConfigError, parse_config
from tests.trainers.experiment_configs import experiment_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**overrides):
    return experiment_config("demo_async", **{"ppo_steps": 5, **overrides})


def _ppo_lines(workdir):
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    return [r for r in lines if r.get("stage") == "ppo"]


def test_killed_and_rerun_async_run_trains_on_every_prompt_once(tmp_path):
    """SIGKILL a run between checkpoints (reward threads and the actor mid-flight), rerun
    the same command: the run resumes from the checkpoint, whose pool and in-flight prompts
    come back, and the logged steps train on every prompt at most once, with every prompt
    drawn from the loader either trained on or still held."""
    workdir = str(tmp_path / "run")
    command = [
        sys.executable, "-m", "rlpt.train", "--config=experiments/demo_async.py:runlocal",
        f"--workdir={workdir}", "--config.ppo_steps=5",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
    )  # fmt: skip
    metrics = os.path.join(workdir, "metrics.jsonl")
    try:
        # SFT is steps 1-3; checkpoints every 2 steps: kill once step 7 is logged, so the
        # rerun restores step 6 and replays 7 and 8.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.exists(metrics) and any(r["step"] >= 7 for r in _ppo_lines(workdir)):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    killed_at = latest_checkpoint_meta(workdir)
    # Step 6's checkpoint is written in the background: a kill may find only step 4's.
    assert killed_at["step"] in (4, 6)
    held_at_kill = [p["key"] for p in killed_at["async"]["inflight"]]
    held_at_kill += [i["key"] for i in killed_at["async"]["pool"]["items"]]
    assert held_at_kill, "nothing was in flight or pooled at the kill: the test shows nothing"
    train.train_and_evaluate(_config(), workdir)
    lines = _ppo_lines(workdir)
    assert [r["step"] for r in lines] == [4, 5, 6, 7, 8]
    trained = [k for r in lines for k in r["async/prompt_keys"]]
    assert len(trained) == len(set(trained)) == 5 * 2  # 8 rows in groups of 4 per step
    final = latest_checkpoint_meta(workdir)["async"]
    held = [p["key"] for p in final["inflight"]] + [i["key"] for i in final["pool"]["items"]]
    assert sorted(trained + held) == list(range(final["started"]))
    assert set(held_at_kill) <= set(trained + held)
    for r in lines:
        hist = r["async/staleness_hist"]
        assert len(hist) == 3 and sum(hist) == r["async/groups"] == 2
        assert r["ppo/mismatch_kl"] >= 0 and r["ppo/is_weight_mean"] > 0


@pytest.mark.parametrize(
    "overrides, message",
    [({"rewards.reward_model": 0.5, "stages": ("sft", "rm", "ppo"),
       "reward_model.refresh_every": 2}, "reward_model.refresh_every"),
     ({"async_rl.priority": "newest"}, "async_rl.priority"),
     ({"async_rl.max_staleness": -1}, "async_rl.max_staleness"),
     ({"async_rl.token_budget": 64, "async_rl.max_batch_groups": 1},
      "async_rl.max_batch_groups"),
     ({"async_rl.token_budget": 64, "async_rl.enabled": False}, "needs async_rl.enabled"),
     ({"async_rl.engine": "gpu"}, "async_rl.engine"),
     ({"async_rl.engine": "ray", "async_rl.enabled": False},
      "async_rl.engine 'ray' needs async_rl.enabled"),
     ({"async_rl.engine": "process", "async_rl.engines": 2}, "async_rl.engines must be 1"),
     ({"async_rl.engines": 0}, "async_rl.engines must be >= 1")],
)  # fmt: skip
def test_async_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(_config(**overrides))


@pytest.mark.parametrize("engine", ["local", "ray"])
def test_several_training_processes_are_refused(tmp_path, monkeypatch, engine):
    """Only the driver may run the asynchronous schedule: as if two processes trained."""
    from rlpt.trainers import post_train

    monkeypatch.setattr(post_train, "trainer_process_count", lambda: 2)
    with pytest.raises(ConfigError, match="async_rl.enabled trains in one process"):
        post_train.PostTrainRun(_config(**{"async_rl.engine": engine}), str(tmp_path / "run"))


def test_staleness_zero_reproduces_the_synchronous_run(tmp_path):
    """async_rl.max_staleness = 0 against async.mode = 'sync' (the same parts strictly in turn):
    every logged metric but timings and waits is equal at every step."""
    runs = {}
    for name, overrides in (
        ("sync", {"async_rl.mode": "sync", "async_rl.max_staleness": 0}),
        ("eta0", {"async_rl.max_staleness": 0}),
    ):
        workdir = str(tmp_path / name)
        train.train_and_evaluate(_config(**overrides), workdir)
        runs[name] = [
            {k: v for k, v in r.items()
             if not k.startswith(("time/", "async/learner_wait_s", "async/pool_groups",
                                      "async/response_lengths"))}
            for r in _ppo_lines(workdir)
        ]  # fmt: skip
    assert len(runs["sync"]) == 5
    for a, b in zip(runs["sync"], runs["eta0"]):
        assert a == b


def test_token_budget_batches_and_dynamic_sampling_lose_no_prompt(tmp_path):
    """async_rl.token_budget: a batch takes the base count of groups (2 here), then more
    while the budget allows (here none: a budget of one token), and the learner sees
    async_rl.max_batch_groups groups every step, the missing ones as rows of zero weight:
    every step trains, on each prompt once, with finite metrics. With rollout.filter_groups
    in the same run (one run for both, to spare the suite's time): uniform groups are
    filtered (counted, never trained) and other prompts take their places, so every prompt
    drawn is trained once, held, or filtered."""
    overrides = {"async_rl.token_budget": 1, "async_rl.max_batch_groups": 3,
                 "rollout.filter_groups": True}  # fmt: skip
    config = parse_config(_config(**overrides))
    assert config.learner_groups == 3 and config.ppo.num_groups == 3
    workdir = str(tmp_path / "budget")
    train.train_and_evaluate(_config(**overrides), workdir)
    lines = _ppo_lines(workdir)
    assert len(lines) == 5
    assert all(r["async/groups"] == 2 for r in lines)  # so each layout has filler rows
    trained = [k for r in lines for k in r["async/prompt_keys"]]
    assert len(trained) == len(set(trained)) == sum(r["async/groups"] for r in lines)
    for r in lines:
        assert r["ppo/mismatch_kl"] >= 0
        for key in ("ppo/loss", "ppo/kl", "ppo/success"):
            assert key in r and r[key] == r[key], (key, r.get(key))  # present, not NaN
    final = latest_checkpoint_meta(workdir)["async"]
    held = [p["key"] for p in final["inflight"]] + [i["key"] for i in final["pool"]["items"]]
    # Filtered groups are reported at the step after they are judged: some may be pending.
    reported = sum(r["ppo/filtered_groups"] for r in lines)
    assert reported <= final["filtered"] == final["started"] - len(trained) - len(held)
    assert final["filtered"] > 0, "no group was filtered: the test shows nothing"


def test_learned_process_rewards_reach_the_asynchronous_learner(tmp_path):
    """An implicit PRM (updated online) in an async run: its step rewards reach the learner's
    batches, scored on the learner's sub-mesh, and pi_phi steps on every batch."""
    workdir = str(tmp_path / "learned")
    train.train_and_evaluate(_config(**{
        "stages": ("sft", "prm", "ppo"), "process_reward.kind": "implicit",
        "rewards.process": 0.5, "process_reward.online_learning_rate": 1e-3, "ppo_steps": 3,
    }), workdir)  # fmt: skip
    lines = _ppo_lines(workdir)
    assert len(lines) == 3
    for r in lines:
        assert r["reward/process"] == r["reward/process"] and r["reward/non_finite"] == 0.0
        assert r["prm/online_loss"] == r["prm/online_loss"]
    assert any(r["reward/process"] != 0.0 for r in lines)
