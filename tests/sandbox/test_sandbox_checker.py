"""The slot's long-lived checker: reused run after run, replaced when a run leaves it unusable.

One worker per pool, so every run below goes through the same slot and the same checker.
"""

import pytest

from rlpt.sandbox import ExecutionRequest, SandboxPool, Status

SQUARE = "def f(x):\n    return x * x\n"

# Signals every other process it can see in its namespace (the checker among them in rootless
# mode, where the checker has the program's uid), then answers wrongly.
SABOTEUR = r"""
import os, signal
for p in os.listdir("/proc"):
    if p.isdigit() and int(p) != os.getpid():
        try:
            os.kill(int(p), signal.{sig})
        except OSError:
            pass
def f(x):
    return x + 1
"""


@pytest.fixture(scope="module", params=["root", "rootless"])
def one_slot(request):
    options = {"rootless": True} if request.param == "rootless" else None
    with SandboxPool(workers=1, timeout_s=5.0, memory_mb=256, worker_options=options) as pool:
        yield pool


def _honest(i: int) -> ExecutionRequest:
    return ExecutionRequest(id=f"honest-{i}", code=SQUARE, tests=f"assert f({i}) == {i * i}\n")


def _statuses(pool, requests):
    return [(r.id, r.status) for r in pool.run_batch(requests)]


def test_runs_after_runs_share_no_globals(one_slot):
    first, second = one_slot.run_batch(
        [
            ExecutionRequest(id="set", code=SQUARE, tests="LEFT_BEHIND = f(3)\nassert f(2) == 4\n"),
            ExecutionRequest(id="look", code=SQUARE, tests="assert 'LEFT_BEHIND' not in dir()\n"),
        ]
    )
    assert (first.status, second.status) == (Status.PASSED, Status.PASSED), second.details


@pytest.mark.parametrize(
    "breaker, status",
    [
        # The program never answers: the checker waits on it until the deadline.
        (
            ExecutionRequest(
                id="program-hangs",
                code="import time\ndef f(x):\n    time.sleep(60)\n",
                tests="assert f(1) == 1\n",
                timeout_s=0.5,
            ),
            Status.TIMEOUT,
        ),
        # The tests themselves never end: the checker is busy past the deadline.
        (
            ExecutionRequest(
                id="tests-hang",
                code=SQUARE,
                tests="assert f(1) == 1\nwhile True:\n    pass\n",
                timeout_s=0.5,
            ),
            Status.TIMEOUT,
        ),
        # A value cheap to send and dear to rebuild: the checker runs out of memory decoding it.
        (
            ExecutionRequest(
                id="checker-oom",
                code="def f():\n    return [[]] * 2_000_000\n",
                tests="assert len(f()) > 0\n",
                memory_mb=200,
            ),
            Status.MEMORY_LIMIT,
        ),
    ],
    ids=lambda v: v.id if isinstance(v, ExecutionRequest) else str(v),
)
def test_a_broken_run_leaves_the_next_ones_working(one_slot, breaker, status):
    before, broken, *after = one_slot.run_batch([_honest(2), breaker, _honest(3), _honest(4)])
    assert before.passed
    assert not broken.passed and broken.valid, broken.details
    if status is not None:
        assert broken.status == status, broken.details
    assert [r.status for r in after] == [Status.PASSED, Status.PASSED], [r.details for r in after]


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_a_program_that_signals_the_checker_gains_nothing(one_slot, sig):
    saboteur = ExecutionRequest(
        id=f"saboteur-{sig}",
        code=SABOTEUR.replace("{sig}", sig),
        tests="assert f(2) == 4\n",
        timeout_s=1.0,
    )
    res = one_slot.run_batch([_honest(5), saboteur, _honest(6), saboteur, _honest(7)])
    assert not res[1].passed and not res[3].passed, res[1].details
    assert [r.status for r in res[0::2]] == [Status.PASSED] * 3, [r.details for r in res]
