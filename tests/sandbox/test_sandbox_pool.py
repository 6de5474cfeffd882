"""The sandbox pool: outcome categories, the pass sentinel, hostile programs, pool life cycle.

Independent programs go through the pool in one batch each, so the folder runs in seconds.
"""

import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time

import pytest

from rlpt.sandbox import ExecutionRequest, IOCase, IsolationUnavailable, SandboxPool, Status

GOOD = ExecutionRequest(
    code="def double(x):\n    return 2 * x\n", tests="assert double(21) == 42\n", timeout_s=5.0
)


def _by_id(results):
    return {r.id: r for r in results}


def test_isolation_is_full_where_namespaces_exist(pool, isolation_unavailable_reason):
    reason = isolation_unavailable_reason
    if reason is not None:
        pytest.skip(reason)
    # On a machine with namespaces a missing protection is a failure, not a skip.
    assert pool.isolation == "full"
    res = pool.run_batch([ExecutionRequest(code="print(1)", id="x")])[0]
    assert res.isolation == "full"


def test_usable_from_a_process_that_imported_jax(pool):
    assert "jax" in sys.modules  # tests/conftest.py imports it before any pool starts
    assert pool.run_batch([GOOD])[0].passed


def test_every_outcome_category():
    big = "x = bytearray(10 ** 10)\n"
    growing = "a = []\nwhile True:\n    a.append(bytearray(10 ** 7))\n"
    requests = [
        ExecutionRequest(id="passed", code="print('hi')", timeout_s=5.0),
        ExecutionRequest(
            id="failed", timeout_s=5.0, code="def f():\n    return 1\n", tests="assert f() == 2"
        ),
        ExecutionRequest(id="syntax", timeout_s=5.0, code="def f(:\n    pass\n"),
        ExecutionRequest(id="syntax_nul", timeout_s=5.0, code="x = 1\x00\n"),
        ExecutionRequest(id="runtime", timeout_s=5.0, code="x = 1 / 0\n"),
        ExecutionRequest(
            id="runtime_tests", timeout_s=5.0, code="def f():\n    raise KeyError(1)\n", tests="f()"
        ),
        ExecutionRequest(id="timeout", code="while True:\n    pass\n", timeout_s=0.5),
        ExecutionRequest(id="memory", timeout_s=5.0, code=big),
        ExecutionRequest(id="memory_growing", timeout_s=5.0, code=growing),
        ExecutionRequest(id="output", timeout_s=5.0, code="while True:\n    print('y' * 100)\n"),
        ExecutionRequest(
            id="stderr_output",
            timeout_s=5.0,
            code="import sys\nwhile True:\n    sys.stderr.write('z' * 100)\n",
        ),
        ExecutionRequest(id="segfault", timeout_s=5.0, code="import ctypes\nctypes.string_at(0)\n"),
    ]
    # The pool's timeout is a ceiling; the program meant to hit the clock asks for 0.5 s.
    with SandboxPool(workers=4, timeout_s=5.0, memory_mb=128, output_limit_bytes=5000) as pool:
        res = _by_id(pool.run_batch(requests))
        # The sandbox's own failure: the worker dies under a running program (all workers
        # die, since any of them may have taken it; each is replaced when next needed).
        # A second into a 4 s sleep: the run has surely started, even on a loaded machine.
        killer = threading.Timer(1.0, lambda: [os.kill(s.proc.pid, 9) for s in pool._slots])
        killer.start()
        died = pool.run_batch(
            [ExecutionRequest(id="sandbox", code="import time\ntime.sleep(4)\n", timeout_s=5.0)]
        )[0]
        killer.join()
        after = pool.run_batch([GOOD] * 4)
    assert res["passed"].status == Status.PASSED and res["passed"].stdout == "hi\n"
    assert res["failed"].status == Status.FAILED
    assert res["failed"].exception == "AssertionError"
    assert res["syntax"].status == Status.SYNTAX_ERROR
    assert res["syntax_nul"].status == Status.SYNTAX_ERROR
    assert res["runtime"].status == Status.RUNTIME_ERROR
    assert res["runtime"].exception == "ZeroDivisionError"
    assert "ZeroDivisionError" in res["runtime"].stderr
    assert res["runtime_tests"].status == Status.RUNTIME_ERROR
    assert res["runtime_tests"].exception == "KeyError"
    assert res["timeout"].status == Status.TIMEOUT
    assert res["memory"].status == Status.MEMORY_LIMIT
    assert res["memory_growing"].status == Status.MEMORY_LIMIT
    assert res["output"].status == Status.OUTPUT_LIMIT
    assert len(res["output"].stdout.encode()) <= 5000
    assert res["stderr_output"].status == Status.OUTPUT_LIMIT
    assert len(res["stderr_output"].stderr.encode()) <= 5000
    assert res["segfault"].status == Status.RUNTIME_ERROR
    assert res["segfault"].signal == 11
    assert died.status == Status.SANDBOX_ERROR and not died.valid
    assert all(r.passed for r in after), [r.status for r in after]
    for r in res.values():
        assert r.duration_s < 5.0
        assert r.isolation == pool.isolation
    assert res["passed"].peak_memory_mb and res["passed"].peak_memory_mb > 1


def test_early_exit_is_never_a_pass(pool):
    failing_tests = "assert False, 'tests must not be skipped'\n"
    codes = {
        "exit": "exit(0)\n",
        "sys_exit": "import sys\nsys.exit(0)\n",
        "raise_system_exit": "raise SystemExit\n",
        "os_exit": "import os\nos._exit(0)\n",
        "kill_self": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
        "exit_in_atexit": "import atexit, os\natexit.register(lambda: os._exit(0))\nexit(0)\n",
    }
    requests = [
        ExecutionRequest(id=k, code=c, tests=failing_tests, timeout_s=5.0) for k, c in codes.items()
    ]
    requests.append(
        ExecutionRequest(id="no_tests_exit", code="import os\nos._exit(0)\n", timeout_s=5.0)
    )
    res = _by_id(pool.run_batch(requests))
    for key, r in res.items():
        assert r.status != Status.PASSED, key
    assert res["exit"].status == Status.FAILED
    assert res["os_exit"].status == Status.FAILED
    assert res["os_exit"].exit_code == 0
    assert res["no_tests_exit"].status == Status.FAILED
    assert res["kill_self"].status == Status.RUNTIME_ERROR


FORGER = r"""
import os, sys
blobs = [b"RLPT-END ", b"\nRLPT-END " + b"0" * 32 + b"\n"]
for path in ("/proc/self/environ", "/proc/self/cmdline", "/proc/1/cmdline",
             "/proc/1/environ", "/proc/self/maps"):
    try:
        blobs.append(open(path, "rb").read()[:100000])
    except OSError:
        pass
import linecache, inspect
blobs.append("".join(linecache.getlines("solution.py")).encode())
blobs.append(" ".join(sys.argv).encode())
fds = sorted(int(n) for n in os.listdir("/proc/self/fd"))
# Anything readable (a still-open secret pipe would be) is echoed back as well.
for fd in fds:
    try:
        os.set_blocking(fd, False)
        blobs.append(os.read(fd, 4096))
    except OSError:
        pass
for fd in fds:
    for blob in blobs:
        for data in (blob, b"\nRLPT-END " + blob + b"\n", b"\nRLPT-END " + blob[:32] + b"\n"):
            try:
                os.write(fd, data)
            except OSError:
                pass
os._exit(0)
"""


def test_blind_protocol_writes_do_not_pass(pool):
    """Echoing what the program can read onto every descriptor passes neither tests nor cases.

    (Introspection, patched builtins and the rest: ``test_sandbox_forgery.py``.)
    """
    requests = [
        ExecutionRequest(id="forge_tests", code=FORGER, tests="assert False\n"),
        ExecutionRequest(
            id="forge_io", code=FORGER + "\nprint('unreachable')\n", io_cases=(IOCase("", "42"),)
        ),
        ExecutionRequest(
            id="forge_exit", code=FORGER.replace("os._exit(0)", "exit(0)"), tests="assert False\n"
        ),
    ]
    res = pool.run_batch(requests)
    for r in res:
        assert r.status != Status.PASSED, r
        assert r.valid, r


def test_io_cases(pool):
    code = "a, b = map(int, input().split())\nprint(a + b)\n"
    requests = [
        ExecutionRequest(
            id="ok",
            code=code,
            io_cases=(
                IOCase("1 2\n", "3\n"),
                IOCase("5 5", "  10  "),
                IOCase("2 2", "4\n", "exact"),
            ),
        ),
        ExecutionRequest(id="exact_mismatch", code=code, io_cases=(IOCase("1 2", "3", "exact"),)),
        ExecutionRequest(
            id="wrong",
            code=code,
            io_cases=(IOCase("1 2", "3"), IOCase("1 1", "3"), IOCase("0 0", "0")),
        ),
        ExecutionRequest(id="crash", code=code, io_cases=(IOCase("x y", "3"),)),
        ExecutionRequest(
            id="stdin_echo",
            code="import sys\nprint(sys.stdin.read()[::-1])\n",
            io_cases=(IOCase("abc" * 30000, "cba" * 30000),),
        ),
    ]
    res = _by_id(pool.run_batch(requests))
    assert res["ok"].status == Status.PASSED and res["ok"].details["cases_run"] == 3
    assert res["exact_mismatch"].status == Status.FAILED
    assert res["wrong"].status == Status.FAILED
    assert res["wrong"].details["reason"] == "wrong answer"
    assert res["crash"].status == Status.RUNTIME_ERROR and res["crash"].exception == "ValueError"
    assert res["stdin_echo"].status == Status.OUTPUT_LIMIT  # 90 kB > the 10 kB cap


def _host_processes_with(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(name))
        except OSError:
            pass
    return found


def test_hostile_programs_are_contained(pool, tmp_path, env_secret):
    tag = secrets.token_hex(6)
    host_paths = [
        f"/tmp/rlpt-escape-{tag}",
        f"/work/rlpt-escape-{tag}",
        os.path.join(os.path.expanduser("~"), f"rlpt-escape-{tag}"),
        f"/var/tmp/rlpt-escape-{tag}",
        f"/dev/shm/rlpt-escape-{tag}",
        str(tmp_path / f"escape-{tag}"),
    ]
    os.chmod(tmp_path, 0o777)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    sleep_marker = f"{700 + secrets.randbelow(200)}.{secrets.randbelow(10**6):06d}"
    hostile = {
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n"
        "    except OSError:\n        pass\n",
        "thread_bomb": "import threading, time\nwhile True:\n"
        "    threading.Thread(target=time.sleep, args=(9,)).start()\n",
        "memory_bomb": "a = []\nwhile True:\n    a.append(' ' * 10 ** 6)\n",
        "infinite_loop": "while True:\n    pass\n",
        "sleeper": "import time\ntime.sleep(30)\n",
        "endless_output": "while True:\n    print('spam' * 1000)\n",
        "huge_file": "with open('big', 'wb') as f:\n    while True:\n"
        "        f.write(b'0' * 1000000)\n",
        "fd_hog": "fs = []\nwhile True:\n    fs.append(open('/dev/null'))\n",
        "write_outside": (
            f"paths = {host_paths!r}\nok = []\n"
            "for p in paths:\n    try:\n        open(p, 'w').write('x')\n        ok.append(p)\n"
            "    except OSError:\n        pass\nprint(ok)\n"
        ),
        "network": (
            "import socket, time\nt = time.time()\nout = []\n"
            f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 80), ('8.8.8.8', 53)]:\n"
            "    try:\n        socket.create_connection(addr, timeout=5)\n"
            "        out.append('connected')\n"
            "    except OSError as e:\n        out.append(type(e).__name__)\n"
            "try:\n    socket.getaddrinfo('example.com', 80)\n    out.append('resolved')\n"
            "except OSError:\n    out.append('no-dns')\n"
            "print(out, time.time() - t)\n"
        ),
        "environment": (
            "import os\nprint(dict(os.environ))\n"
            "for p in ['/proc/self/environ', '/proc/1/environ', '/proc/self/cmdline']:\n"
            "    try:\n        print(open(p, 'rb').read())\n    except OSError as e:\n"
            "        print(p, e)\n"
        ),
        "kill_everything": "import os\nfor pid in (-1, os.getppid(), 1):\n    try:\n"
        "        os.kill(pid, 9)\n    except OSError as e:\n"
        "        print(pid, e)\nprint('still here')\n",
        "daemon": (
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv('/bin/sleep', ['sleep', '{sleep_marker}'])\n    os._exit(0)\n"
            "time.sleep(0.05)\nprint('parent done')\n"
        ),
        "shell": f"import os\nprint(os.system('echo from-shell; touch /work/rlpt-sh-{tag}'))\n",
        "segfault": "import ctypes\nctypes.string_at(0)\n",
        "stdin_block": "print(input())\n",
        "stdin_read": "import sys\nprint(repr(sys.stdin.read()))\n",
        "early_exit": "exit(0)\n",
        "early_os_exit": "import os\nos._exit(0)\n",
    }
    # Only programs meant to hit the clock get the short timeout: the others must not time
    # out on a busy machine.
    clocked = {"fork_bomb", "thread_bomb", "infinite_loop", "sleeper"}
    requests = [
        ExecutionRequest(id=k, code=c, timeout_s=0.5 if k in clocked else 5.0)
        for k, c in hostile.items()
    ]
    # Half the good programs fork: a bomb's processes (same slot earlier, or another slot
    # now) must not have used up their process limit.
    forker = (
        "import os\nkids = []\nfor _ in range(8):\n    pid = os.fork()\n"
        "    if pid == 0:\n        os._exit(0)\n    kids.append(pid)\n"
        "assert all(os.waitpid(p, 0)[1] == 0 for p in kids)\n"
    )
    goods = [
        ExecutionRequest(
            id=f"good{i}",
            code=forker if i % 2 else GOOD.code,
            tests=GOOD.tests if i % 2 == 0 else None,
            timeout_s=5.0,
        )
        for i in range(8)
    ]
    # Good programs interleaved with the bombs, so they run side by side on other slots.
    mixed = [x for pair in zip(requests, goods * 3) for x in pair] + requests[len(goods) * 3 :]
    t0 = time.monotonic()
    res = _by_id(pool.run_batch(mixed))
    wall = time.monotonic() - t0
    try:
        conn, _ = listener.accept()
        conn.close()
        pytest.fail("a sandboxed program reached a socket of the host")
    except BlockingIOError:
        pass
    finally:
        listener.close()

    for k in [g.id for g in goods]:
        assert res[k].status == Status.PASSED, (k, res[k])
    assert res["fork_bomb"].status == Status.TIMEOUT
    assert res["thread_bomb"].status in (Status.TIMEOUT, Status.RUNTIME_ERROR)
    assert res["memory_bomb"].status == Status.MEMORY_LIMIT
    assert res["infinite_loop"].status == Status.TIMEOUT
    assert res["sleeper"].status == Status.TIMEOUT
    assert res["endless_output"].status == Status.OUTPUT_LIMIT
    assert res["huge_file"].status == Status.RUNTIME_ERROR
    assert "File too large" in res["huge_file"].stderr
    assert res["fd_hog"].status == Status.RUNTIME_ERROR
    assert "Too many open files" in res["fd_hog"].stderr
    assert res["write_outside"].status == Status.PASSED
    net = res["network"]
    assert net.status == Status.PASSED and "connected" not in net.stdout
    assert "resolved" not in net.stdout
    assert float(net.stdout.split()[-1]) < 0.3  # refused at once, not timed out
    env = res["environment"]
    assert env.status == Status.PASSED
    assert env_secret not in env.stdout and "RLPT_SANDBOX_TEST_SECRET" not in env.stdout
    assert res["kill_everything"].status == Status.PASSED
    assert "still here" in res["kill_everything"].stdout
    assert res["daemon"].status == Status.PASSED
    assert res["shell"].status == Status.PASSED and "from-shell" in res["shell"].stdout
    assert res["segfault"].status == Status.RUNTIME_ERROR and res["segfault"].signal == 11
    assert res["stdin_block"].status == Status.RUNTIME_ERROR
    assert res["stdin_block"].exception == "EOFError"
    assert res["stdin_read"].status == Status.PASSED and res["stdin_read"].stdout == "''\n"
    assert res["early_exit"].status == Status.FAILED
    assert res["early_os_exit"].status == Status.FAILED
    assert wall < 30

    # The host is unchanged.
    for p in host_paths + [f"/work/rlpt-sh-{tag}"]:
        assert not os.path.exists(p), p
    assert _host_processes_with(sleep_marker) == []
    # ... and the pool still serves.
    assert all(r.passed for r in pool.run_batch([GOOD] * 4))


def test_batch_deadline_and_as_completed(pool):
    sleepy = [
        ExecutionRequest(id=f"s{i}", code="import time\ntime.sleep(10)\n", timeout_s=20.0)
        for i in range(6)
    ]
    quick = [ExecutionRequest(id=f"q{i}", code=f"print({i})", timeout_s=5.0) for i in range(2)]
    t0 = time.monotonic()
    seen = []
    for r in pool.as_completed(quick + sleepy, deadline_s=1.0):
        seen.append((r.id, r.status, time.monotonic() - t0))
    assert sorted(s[0] for s in seen) == sorted(r.id for r in quick + sleepy)
    statuses = {i: s for i, s, _ in seen}
    assert all(statuses[q.id] == Status.PASSED for q in quick)
    assert all(statuses[s.id] == Status.TIMEOUT for s in sleepy)
    assert seen[-1][2] < 3.0
    # Results come back as they finish: the quick ones first.
    assert {s[0] for s in seen[:2]} == {"q0", "q1"}


def test_batch_deadline_while_workers_are_busy(pool):
    # Another batch holds every worker; the deadline still answers on time.
    busy = [ExecutionRequest(code="import time\ntime.sleep(1.5)\n", timeout_s=5.0)] * 4
    other = threading.Thread(target=pool.run_batch, args=(busy,))
    other.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    res = pool.run_batch(
        [ExecutionRequest(id=str(i), code="print(1)") for i in range(3)], deadline_s=0.4
    )
    elapsed = time.monotonic() - t0
    other.join()
    assert [r.status for r in res] == [Status.TIMEOUT] * 3
    assert elapsed < 1.0
    assert pool.run_batch([GOOD])[0].passed


def test_run_batch_keeps_order(pool):
    requests = [
        ExecutionRequest(
            id=str(i), code=f"import time\ntime.sleep({0.01 * (i % 3)})\nprint({i})", timeout_s=5.0
        )
        for i in range(12)
    ]
    res = pool.run_batch(requests)
    assert [r.id for r in res] == [r.id for r in requests]
    assert [r.stdout for r in res] == [f"{i}\n" for i in range(12)]


def test_runs_do_not_share_random_state(pool):
    # Every run is forked from the same worker; each must still draw its own numbers.
    res = pool.run_batch(
        [ExecutionRequest(code="import random\nprint(random.random())", timeout_s=5.0)] * 6
    )
    assert all(r.passed for r in res)
    assert len({r.stdout for r in res}) == 6


def test_trace_log(tmp_path):
    trace = tmp_path / "trace.jsonl"
    requests = [
        ExecutionRequest(id="a", code="print(1)"),
        ExecutionRequest(id="b", code="def f():\n    return 0\n", tests="assert f()"),
    ]
    meta = {
        "a": {"task_id": "t/1", "domain": "code", "prompt": "p", "completion": "c"},
        "b": {"domain": "code", "extra": 3},
    }
    with SandboxPool(workers=2, timeout_s=2.0, trace_path=str(trace)) as pool:
        pool.run_batch(requests, metadata=meta)
        pool.run_batch(requests[:1], metadata=[{"task_id": "t/2"}])
    lines = [json.loads(s) for s in trace.read_text().splitlines()]
    assert len(lines) == 3
    by_task = {r["task_id"]: r for r in lines}
    assert by_task["t/1"]["outcome"] == "passed" and by_task["t/1"]["prompt"] == "p"
    assert by_task["t/1"]["program"] == "print(1)" and by_task["t/1"]["stdout"] == "1\n"
    assert by_task["b"]["outcome"] == "failed" and by_task["b"]["extra"] == 3
    assert by_task["b"]["tests"] == "assert f()"
    assert by_task["t/2"]["outcome"] == "passed"
    for r in lines:
        assert r["duration_s"] > 0 and "isolation" in r


def _processes_of_uids(uids: set[int]) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith("Uid:") and int(line.split()[1]) in uids:
                        found.append(int(name))
        except OSError:
            pass
    return found


def test_close_leaves_no_process():
    pool = SandboxPool(workers=2, timeout_s=5.0)
    pids = [s.proc.pid for s in pool._slots]
    uids = {s.uid for s in pool._slots}
    # Close while programs (and their daemons) are still running.
    runner = threading.Thread(
        target=pool.run_batch,
        args=(
            [
                ExecutionRequest(
                    code=(
                        "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
                        "    time.sleep(60)\ntime.sleep(60)\n"
                    )
                )
            ]
            * 2,
        ),
    )
    runner.start()
    time.sleep(0.5)
    assert _processes_of_uids(uids)
    pool.close()
    runner.join(timeout=10)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), pid
    deadline = time.monotonic() + 2.0
    while _processes_of_uids(uids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_of_uids(uids) == []
    with pytest.raises(RuntimeError):
        pool.run_batch([GOOD])


def test_missing_isolation_is_loud(caplog):
    with (
        caplog.at_level(logging.WARNING, logger="rlpt.sandbox.pool"),
        SandboxPool(workers=1, timeout_s=2.0, features=[], require_isolation=False) as pool,
    ):
        res = pool.run_batch([GOOD])[0]
    assert pool.isolation.startswith("missing: ")
    assert "network namespace" in pool.isolation
    assert any("WITHOUT full isolation" in r.message for r in caplog.records)
    assert res.passed and res.isolation == pool.isolation
    with pytest.raises(IsolationUnavailable, match="WITHOUT full isolation"):
        SandboxPool(workers=1, features=[])


def test_rootless_path_keeps_the_host_read_only(tmp_path):
    """The user-namespace path of an unprivileged machine, taken here on purpose as root."""
    tag = secrets.token_hex(6)
    remount = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.mount(None, b'/', None, 32 | 4096, None), ctypes.get_errno())\n"
        f"open('/work/rlpt-rootless-{tag}', 'w')\n"
    )
    requests = [
        ExecutionRequest(id="remount", code=remount),
        ExecutionRequest(
            id="daemon",
            code="import os, time\nif os.fork() == 0:\n"
            "    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '613.377'])\n"
            "print('ok')\n",
        ),
        ExecutionRequest(id="good", code=GOOD.code, tests=GOOD.tests),
    ]
    with SandboxPool(workers=2, timeout_s=2.0, worker_options={"rootless": True}) as pool:
        res = _by_id(pool.run_batch(requests))
    assert pool.isolation == "full" and pool.rootless
    assert res["remount"].status == Status.RUNTIME_ERROR
    assert res["remount"].stdout.split()[0] == "-1"  # EPERM: no capability left
    assert not os.path.exists(f"/work/rlpt-rootless-{tag}")
    assert res["daemon"].status == Status.PASSED
    assert _host_processes_with("613.377") == []
    assert res["good"].passed


def test_cli_run_jsonl(tmp_path):
    src = tmp_path / "in.jsonl"
    rows = [
        {"id": "a", "code": "print(2)"},
        {"id": "b", "code": "def f():\n    return 1\n", "tests": "assert f() == 2"},
        {"id": "c", "code": "while True:\n    pass\n"},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlpt.sandbox",
            "run-jsonl",
            str(src),
            "--workers=2",
            "--timeout_s",
            "0.5",
            "--memory_mb=128",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    got = [json.loads(s) for s in out.stdout.splitlines()]
    assert [g["id"] for g in got] == ["a", "b", "c"]
    assert [g["status"] for g in got] == ["passed", "failed", "timeout"]
    assert got[0]["stdout"] == "2\n"
    for g in got:
        assert {"id", "status", "stdout", "stderr", "duration_s"} <= set(g)
