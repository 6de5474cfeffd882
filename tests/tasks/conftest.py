"""Fixtures for the task tests: a stand-in sandbox pool and the real one when present.

``FakePool`` runs each request with a plain ``python`` subprocess (code, then
tests, then a marker print; passed if the marker comes out). It isolates
nothing: tests feed it only programs they wrote or generated.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time

import pytest

from rlpt.sandbox.types import ExecutionRequest, ExecutionResult, Status

_MARKER = "@@fake-pool-done@@"


class FakePool:
    def __init__(self, timeout_s: float = 5.0, workers: int = 4):
        self.timeout_s = timeout_s
        self.workers = workers
        self.calls: list[dict] = []

    def run_batch(self, requests, deadline_s=None, metadata=None) -> list[ExecutionResult]:
        self.calls.append({"n": len(requests), "metadata": metadata})
        with concurrent.futures.ThreadPoolExecutor(self.workers) as ex:
            return list(ex.map(self._run, requests))

    def _exec(
        self, source: str, stdin: str = ""
    ) -> tuple[subprocess.CompletedProcess | None, float]:
        start = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-c", source],
                input=stdin,
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
            )
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - start
        return proc, time.monotonic() - start

    def _run(self, req: ExecutionRequest) -> ExecutionResult:
        if req.io_cases:
            return self._run_io(req)
        source = req.code + "\n" + (req.tests or "") + f"\nprint({_MARKER!r})\n"
        proc, duration = self._exec(source)
        if proc is None:
            return ExecutionResult(req.id, Status.TIMEOUT, duration_s=duration)
        done = proc.stdout.rstrip().endswith(_MARKER)
        stdout = proc.stdout.replace(_MARKER + "\n", "")
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
        if proc.returncode == 0 and done:
            status = Status.PASSED
        elif last.startswith(("SyntaxError", "IndentationError")):
            status = Status.SYNTAX_ERROR
        elif last.startswith("AssertionError") or proc.returncode == 0:
            status = Status.FAILED
        else:
            status = Status.RUNTIME_ERROR
        return ExecutionResult(
            req.id, status, stdout, proc.stderr, proc.returncode, duration_s=duration
        )

    def _run_io(self, req: ExecutionRequest) -> ExecutionResult:
        for case in req.io_cases:
            proc, duration = self._exec(req.code, case.stdin)
            if proc is None:
                return ExecutionResult(req.id, Status.TIMEOUT, duration_s=duration)
            if proc.returncode != 0:
                return ExecutionResult(
                    req.id, Status.RUNTIME_ERROR, proc.stdout, proc.stderr, proc.returncode
                )
            if case.match == "exact":
                same = proc.stdout == case.expected_stdout
            else:
                same = proc.stdout.split() == case.expected_stdout.split()
            if not same:
                return ExecutionResult(req.id, Status.FAILED, proc.stdout, proc.stderr, 0)
        return ExecutionResult(req.id, Status.PASSED, exit_code=0)


class BrokenPool:
    """A pool whose sandbox always fails, to check that such samples are marked invalid."""

    def run_batch(self, requests, deadline_s=None, metadata=None) -> list[ExecutionResult]:
        return [ExecutionResult(r.id, Status.SANDBOX_ERROR, stderr="no workers") for r in requests]


@pytest.fixture
def fake_pool_cls() -> type[FakePool]:
    return FakePool


@pytest.fixture(scope="session")
def fake_pool() -> FakePool:
    return FakePool()


@pytest.fixture
def broken_pool() -> BrokenPool:
    return BrokenPool()


def _real_pool_class():
    try:
        from rlpt.sandbox import SandboxPool
    except ImportError:
        return None
    return SandboxPool


@pytest.fixture(scope="session")
def real_pool():
    pool_cls = _real_pool_class()
    if pool_cls is None:
        pytest.skip("rlpt.sandbox.SandboxPool is not available yet")
    with pool_cls(workers=2, timeout_s=1.0, memory_mb=256) as pool:
        yield pool


@pytest.fixture(params=["fake", "real"])
def any_pool(request):
    """Each test using it runs once with the fake pool and once with the real one."""
    if request.param == "fake":
        return request.getfixturevalue("fake_pool")
    return request.getfixturevalue("real_pool")
