"""Ahead-of-time compilation of the PPO step for a mesh on fake devices."""

import json
import subprocess
import sys


def _aot(*flags):
    return subprocess.run(
        [sys.executable, "-m", "rlpt.aot", *flags], capture_output=True, text=True, timeout=600
    )


def test_compiles_for_a_mesh_and_reports_memory_per_device():
    out = _aot("--preset=tiny", "--devices=4", "--data=1", "--fsdp=2", "--tensor=2", "--batch=4")
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert (
        report["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2, "sequence": 1}
        and report["devices"] == 4
    )
    assert 0 < report["total_gib_per_device"] < 0.1


def test_impossible_layouts_are_refused_naming_the_fields():
    out = _aot("--devices=8", "--data=3", "--fsdp=1", "--tensor=1")
    assert out.returncode != 0 and "mesh sizes" in out.stderr
    out = _aot("--devices=8", "--data=8", "--batch=4")
    assert out.returncode != 0 and "data-parallel" in out.stderr


def test_an_experiment_config_compiles_its_own_ppo_step():
    # The runlocal demo's step (tiny model, 8 sequences, GRPO) on a mesh given in part by
    # flags over the config's own mesh section.
    out = _aot("--config=experiments/demo.py:runlocal", "--devices=4", "--data=2", "--fsdp=2")
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert (
        report["mesh"] == {"data": 2, "fsdp": 2, "tensor": 1, "sequence": 1}
        and report["preset"] == "tiny"
    )
    assert report["batch"] == 8 and report["seq"] == 64 + 16  # widest bucket + max_new_tokens
    out = _aot("--config=experiments/demo.py:runlocal", "--config.ppo.clip_low=-1")
    assert out.returncode != 0 and "ppo.clip_low must be in (0, 1), got -1" in out.stderr
