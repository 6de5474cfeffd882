"""Test-wide setup: 8 host CPU devices and a persistent compilation cache.

Both must be in place before jax is imported anywhere, so this module sets
environment variables at import time (pytest imports conftest first).
"""

import os
import tempfile

# Tests compile far more than they run (tiny models): LLVM's optimisation passes are a
# third of each compile, and the code they would speed up runs for milliseconds. The HLO
# passes (fusion, sharding, buffer assignment) are untouched, so the memory tests hold.
# Subprocesses started by tests inherit these flags (multi-process tests swap only the
# device count).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One cache shared by this process and the subprocesses tests start, so each
# shape compiles once per test run. It lives in the temp area, not the repo.
_CACHE_DIR = os.path.join(tempfile.gettempdir(), "rlpt-test-jax-cache")
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"expected 8 host CPU devices, got {len(devs)}"
    return devs


# The longest files, started first: with two xdist workers (the README's test command,
# `--dist loadfile --no-loadscope-reorder` keeps this order) a long file left for last
# runs alone on one core.
_LONGEST_FILES = (
    "tests/parallel/test_multiprocess_train.py",
    "tests/trainers/test_learned_rewards.py",
    "tests/parallel/test_multihost.py",
    "tests/trainers/test_post_train.py",
    "tests/experiments/test_configs.py",
)


def pytest_collection_modifyitems(config, items):
    del config

    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return _LONGEST_FILES.index(path) if path in _LONGEST_FILES else len(_LONGEST_FILES)

    items.sort(key=rank)  # stable: every other file keeps its order
