"""For tests that start several JAX processes on this host: a free port and the
environment of a process with a given number of host CPU devices."""

import os
import socket

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
