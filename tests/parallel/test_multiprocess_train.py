"""``rlpt.train`` across two JAX processes (4 host CPU devices each, collectives over
gloo) against the one-process, 8-device reference.

The two processes run the runlocal demo from flags, stop after a step mid-PPO, and
resume with the same command: every deterministic metric of every step must equal the
golden record of the one-process run (``tests/trainers/golden``), within the float
tolerance that reduction order over a differently split mesh allows. Only process 0
writes the run's files, and each checkpoint is written once.
"""

import json
import os

import numpy as np

from tests.process_env import run_train_processes

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(REPO_ROOT, "tests", "trainers", "golden", "demo_runlocal_seed0.json")


def _run_two_processes(workdir, *extra):
    return run_train_processes(workdir, "experiments/demo.py:runlocal", *extra)


def test_two_processes_match_one_process_and_resume(tmp_path):
    workdir = str(tmp_path / "run")
    # Stop after the first PPO step (SFT takes steps 1-3), then resume to the end.
    _run_two_processes(workdir, "--config.stop_after_step=4")
    outs = _run_two_processes(workdir)
    assert all("Resumed from checkpoint at step 4" in out for out in outs)

    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    resumed = [r for r in records if r.get("event") == "resumed"]
    assert [r["resumed_from_step"] for r in resumed] == [4]  # written once, by process 0
    got = [{k: v for k, v in r.items() if not k.startswith("time/")}
           for r in records if "event" not in r]  # fmt: skip
    with open(GOLDEN, encoding="utf-8") as f:
        recording = json.load(f)
    golden = recording["records"]
    added = {k: v for k, v in recording.get("added_since_recording", {}).items()
             if not k.startswith("_")}  # fmt: skip
    assert [r["step"] for r in got] == [r["step"] for r in golden]  # each step once
    for want, have in zip(golden, got):
        for key, (low, high) in added.items():  # logged since the recording: a range
            if key.split("/")[0] == want["stage"]:
                assert low <= have.pop(key) <= high, f"step {want['step']} {key}"
        assert sorted(have) == sorted(want), f"step {want['step']}: keys differ"
        for key, value in want.items():
            if isinstance(value, float):
                # Reductions split 4 + 4 across processes instead of over 8 local devices.
                np.testing.assert_allclose(have[key], value, rtol=1e-4, atol=1e-6,
                                           err_msg=f"step {want['step']} {key}")  # fmt: skip
            else:
                assert have[key] == value, f"step {want['step']} {key}"

    # One checkpoint directory per saved step, no per-process copies.
    steps = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
    assert steps and steps[-1] == golden[-1]["step"]
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        assert set(json.load(f)["eval"]["final"]) == {
            "arithmetic", "stepwise_math", "program_synthesis"
        }  # fmt: skip
