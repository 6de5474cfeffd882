"""Shared measuring helpers for the benchmark scripts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax

from rlpt.metrics import matmul_peak_flops


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


def matmul_peak_gflops(dtype: str = "float32", sizes=(1024, 2048, 3072, 4096)) -> float:
    """Best jitted square matmul rate on this device, in GFLOP/s (``rlpt.metrics``)."""
    return matmul_peak_flops(dtype, sizes) / 1e9
