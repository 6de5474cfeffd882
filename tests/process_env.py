"""For tests that start several JAX processes on this host: a free port, the environment
of a process with a given number of host CPU devices, and ``rlpt.train`` run as such a
multi-process program."""

import os
import socket
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def env_with_devices(count: int) -> dict[str, str]:
    """This environment with ``count`` host CPU devices a process (the test run's other
    XLA flags carry over) and the repository importable."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]  # fmt: skip
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={count}"]),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO_ROOT,
    )
    return env


def run_train_processes(workdir, config: str, *args, processes: int = 2, devices: int = 4):
    """``python -m rlpt.train --config=CONFIG --workdir=WORKDIR ARGS`` as ``processes`` JAX
    processes of ``devices`` host devices each on localhost; asserts each exits 0 and
    returns their outputs in process order."""
    port, env = free_port(), env_with_devices(devices)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlpt.train",
                f"--config={config}",
                f"--workdir={workdir}",
                f"--coordinator_address=localhost:{port}",
                f"--num_processes={processes}",
                f"--process_id={i}",
                *args,
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(processes)
    ]
    outs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=540)
        assert proc.returncode == 0, out[-4000:]
        outs.append(out)
    return outs
