"""The launch scripts' dry runs print what they would do, and refuse bad arguments."""

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script, *args):
    return subprocess.run(
        ["bash", os.path.join(ROOT, "launch", script), *args], capture_output=True, text=True,
        cwd=ROOT,
    )  # fmt: skip


def test_tpu_pod_dry_run_prints_the_whole_lifecycle():
    out = _run(
        "tpu_pod.sh", "--name=r1", "--zone=us-central2-b", "--type=v4-32",
        "--config=experiments/demo.py", "--workdir=gs://b/runs/r1", "--config.seed=3", "--dry-run",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("gcloud compute tpus tpu-vm create r1 ")
    assert "--worker=all" in lines[1] and "--config.seed=3" in lines[1]
    # Multi-host JAX starts from rlpt.train's flag, never from a config key.
    assert "rlpt.train" in lines[1] and "--workdir=gs://b/runs/r1\\ --distributed\\ " in lines[1]
    assert "config.distributed" not in out.stdout
    assert lines[-1].startswith("gcloud compute tpus tpu-vm delete r1")
    assert not os.path.exists(os.path.join(ROOT, "logs", "r1"))  # a dry run writes nothing


def test_slurm_dry_run_prints_the_batch_script():
    out = _run("slurm.sh", "--nodes=4", "--gpus_per_node=8", "--config=experiments/demo.py",
               "--workdir=/tmp/never-made", "--dry-run")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --nodes=4" in out.stdout and "#SBATCH --gpus-per-node=8" in out.stdout
    assert "srun python -m rlpt.train --config=experiments/demo.py" in out.stdout
    assert "--workdir=/tmp/never-made --distributed" in out.stdout
    assert "config.distributed" not in out.stdout
    assert not os.path.exists("/tmp/never-made")


def test_missing_arguments_are_refused():
    assert _run("tpu_pod.sh", "--name=x", "--dry-run").returncode == 2
    assert _run("slurm.sh", "--dry-run").returncode == 2
    assert "unknown argument" in _run("slurm.sh", "--bogus").stderr
