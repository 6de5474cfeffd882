"""One pool for the sandbox tests, started after a secret is put in this process's environment."""

import os
import secrets

import pytest

from rlpt.sandbox import SandboxPool

# Set before any pool starts, so a leak from parent to program would be visible.
ENV_SECRET = "rlpt-env-secret-" + secrets.token_hex(8)
os.environ["RLPT_SANDBOX_TEST_SECRET"] = ENV_SECRET


@pytest.fixture(scope="session")
def env_secret() -> str:
    return ENV_SECRET


@pytest.fixture(scope="session")
def isolation_unavailable_reason() -> str | None:
    """Why namespaces cannot work on this machine, or None when they should."""
    if os.geteuid() == 0:
        return None
    try:
        with open("/proc/sys/kernel/unprivileged_userns_clone") as f:
            if f.read().strip() == "0":
                return "not root and unprivileged user namespaces are disabled"
    except OSError:
        pass
    try:
        with open("/proc/sys/user/max_user_namespaces") as f:
            if f.read().strip() == "0":
                return "not root and user.max_user_namespaces is 0"
    except OSError:
        pass
    return None


@pytest.fixture(scope="session")
def pool():
    with SandboxPool(
        workers=4,
        # A ceiling: programs meant to hit the clock ask for 0.5 s themselves.
        timeout_s=5.0,
        memory_mb=128,
        output_limit_bytes=10_000,
        file_size_mb=1,
        max_processes=16,
    ) as p:
        yield p
