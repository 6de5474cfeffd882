"""The Ray backend gives the same results as the local pool, on a local ``ray.init``."""

import pytest

from rlpt.sandbox import ExecutionRequest, IOCase, RayPool, Status, make_pool

ray = pytest.importorskip("ray", reason="the ray backend needs: pip install 'rlpt[ray]'")


@pytest.fixture(scope="session")
def ray_pool():
    # One Ray session for the whole run: starting one costs seconds.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    pool = make_pool(
        "ray",
        workers=2,
        timeout_s=5.0,
        memory_mb=128,
        workers_per_actor=1,
        actor_options={"num_cpus": 0},
        output_limit_bytes=10_000,
        max_processes=16,
    )
    yield pool
    pool.close()
    ray.shutdown()


def _mixed_batch():
    return [
        ExecutionRequest(id="print", code="print(sum(range(10)))"),
        ExecutionRequest(id="pass", code="def f(x):\n    return x * 2\n", tests="assert f(2) == 4"),
        ExecutionRequest(id="fail", code="def f(x):\n    return x\n", tests="assert f(2) == 4"),
        ExecutionRequest(id="raise", code="1 / 0\n"),
        ExecutionRequest(id="timeout", code="while True:\n    pass\n", timeout_s=0.5),
        ExecutionRequest(id="asks_more", code="import time\ntime.sleep(0.2)\n", timeout_s=60),
        ExecutionRequest(
            id="io", code="print(int(input()) + 1)", io_cases=(IOCase("1", "2"), IOCase("5", "7"))
        ),
        ExecutionRequest(
            id="forge",
            code="class E:\n    def __eq__(self, o):\n        return True\n"
            "def f():\n    return E()\n",
            tests="assert f() == 3",
        ),
        ExecutionRequest(id="home", code="import os\nprint(os.listdir(os.path.expanduser('~')))"),
    ]


def test_ray_backend_matches_the_local_pool(ray_pool, pool):
    assert isinstance(ray_pool, RayPool)
    assert ray_pool.isolation == "full"
    batch = _mixed_batch()
    remote = ray_pool.run_batch(batch)
    local = pool.run_batch(batch)
    assert [r.id for r in remote] == [r.id for r in batch]
    assert [(r.status, r.stdout, r.exception) for r in remote] == [
        (r.status, r.stdout, r.exception) for r in local
    ]
    by_id = {r.id: r.status for r in remote}
    assert by_id["pass"] == Status.PASSED and by_id["forge"] != Status.PASSED
    assert by_id["timeout"] == Status.TIMEOUT
    assert {r.id: r.details["limits"]["timeout_s"] for r in remote}["asks_more"] == 5.0


def test_ray_backend_streams_results_and_honours_deadlines(ray_pool):
    quick = [ExecutionRequest(id=f"q{i}", code=f"print({i})") for i in range(4)]
    slow = [ExecutionRequest(id="s", code="import time\ntime.sleep(4)\n")]
    seen = list(ray_pool.as_completed(slow + quick, deadline_s=1.0))
    assert sorted(r.details["index"] for r in seen) == list(range(5))
    assert {r.id: r.status for r in seen}["s"] == Status.TIMEOUT
    assert all(r.passed for r in seen if r.id != "s")
