"""Shared measuring helpers for the benchmark scripts."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, float]:
    """(first-call seconds including compile, median seconds of ``repeats`` timed calls)."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


@jax.jit
def _dot(x, y):
    return jnp.dot(x, y, preferred_element_type=jnp.float32)


def matmul_peak_gflops(dtype: str = "float32", sizes=(1024, 2048, 3072, 4096)) -> float:
    """Best jitted square matmul rate on this device.

    For ``bfloat16`` the inputs are bfloat16 with float32 accumulation, the way
    rlpt's layers compute.
    """
    best = 0.0
    for n in sizes:
        key_a, key_b = jax.random.split(jax.random.key(n))
        a = jax.random.normal(key_a, (n, n), jnp.float32).astype(dtype)
        b = jax.random.normal(key_b, (n, n), jnp.float32).astype(dtype)
        _, seconds = timed(functools.partial(_dot, a, b), repeats=5, warmup=2)
        best = max(best, 2 * n**3 / seconds / 1e9)
    return best
