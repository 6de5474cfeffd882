"""Programs that try to be reported ``passed`` without passing their tests.

Each hostile program runs against tests that no honest program passes (``assert False``, or
assertions its functions fail), in the default (root) mode and in the rootless mode; it is
``passed`` only if the tests genuinely pass. The honest controls at the end show that the same
tests do pass a correct program, so the failures are the checks working, not a broken harness.
"""

import pytest

from rlpt.sandbox import ExecutionRequest, SandboxPool, Status

# Walks every frame above the program and every object the collector knows, takes anything
# that could be the harness's secret (bytes or str of 32 characters) or a descriptor, and
# writes the end marker with each candidate to every descriptor it has; then stops early.
FRAME_FORGER = r"""
import gc, os, sys
secrets_, fds = set(), set(range(0, 1024))
for frame in [sys._getframe(), *sys._current_frames().values()]:
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if isinstance(value, (bytes, bytearray)) and len(value) == 32:
                secrets_.add(bytes(value))
            elif isinstance(value, str) and len(value) == 32:
                secrets_.add(value.encode())
            elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 4096:
                fds.add(value)
        frame = frame.f_back
for obj in gc.get_objects():
    if isinstance(obj, dict):
        for value in list(obj.values()):
            if isinstance(value, bytes) and len(value) == 32:
                secrets_.add(value)
for fd in sorted(fds):
    for s in secrets_:
        try:
            os.write(fd, b"\nRLPT-END " + s + b"\n")
        except OSError:
            pass
os._exit(0)
"""

# Writes everything that looks like either side of any protocol to every descriptor: the old
# end marker, an exception report, a verdict, length-prefixed answers.
PROTOCOL_FORGER = r"""
import json, os, struct
def framed(obj):
    data = json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data
blobs = [
    b"\nRLPT-END " + b"0" * 32 + b"\n",
    b'RLPT-REPORT {"phase": "tests", "kind": "exit", "code": 0}\n',
    b'{"passed": true}\n',
    framed(["names", {}]),
    framed(["ok", True]),
    framed({"passed": True}),
]
for fd in range(0, 1024):
    for blob in blobs:
        try:
            os.write(fd, blob)
        except OSError:
            pass
for blob in blobs:
    print(blob.decode("latin-1"), end="", flush=True)
"""

EXEC_PATCHER = r"""
import builtins
builtins.exec = lambda *args, **kwargs: None
builtins.compile = lambda *args, **kwargs: compile_("pass", "tests.py", "exec")
compile_ = compile
"""

BUILTIN_PATCHER = r"""
import builtins
builtins.abs = lambda x: 0
builtins.len = lambda x: 3
builtins.isinstance = lambda *a: True
abs = lambda x: 0
len = lambda x: 3
def f(x):
    return -1
def g():
    return []
"""
BUILTIN_TESTS = "assert abs(f(1) - 5) < 1e-9\nassert len(g()) == 3\nassert isinstance(f(1), str)\n"

ALWAYS_EQUAL = r"""
class AlwaysEqual:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
class EqualInt(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
class EqualStr(str):
    def __eq__(self, other):
        return True
    __hash__ = str.__hash__
def f(x):
    return AlwaysEqual()
def g(x):
    return EqualInt(0)
def h(x):
    return [EqualStr("no")]
"""

# Runs the forger from hooks that fire while the harness handles the failed tests: a
# finaliser (when the harness clears the globals) and an exception's ``__str__`` (when it
# prints the traceback).
DEL_FORGER = (
    f"FORGE = {FRAME_FORGER!r}\n"
    "class Forger:\n    def __del__(self, forge=FORGE):\n        exec(forge, {})\n"
    "keep = Forger()\n"
)
EXCEPTION_FORGER = (
    f"FORGE = {FRAME_FORGER!r}\n"
    "class Loud(Exception):\n    def __str__(self, forge=FORGE):\n        exec(forge, {})\n"
    "def f(x):\n    raise Loud()\n"
)

# A thread forges from the main thread's frames while the program sleeps; an atexit hook
# tries again at exit.
THREAD_FORGER = (
    "import atexit, threading, time\n"
    f"FORGE = {FRAME_FORGER!r}\n"
    "atexit.register(lambda: exec(FORGE, {}))\n"
    "threading.Thread(target=lambda: exec(FORGE, {}), daemon=True).start()\n"
    "def f(x):\n    return x\n"
    "time.sleep(0.3)\n"
)

# Tries to reach the process that runs the tests: signals, its descriptors through /proc,
# ptrace; writes a verdict wherever it can, and only then answers.
REACH_CHECKER = r"""
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
me = os.getpid()
pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
for pid in pids:
    libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            with open(f"/proc/{pid}/fd/{fd}", "wb", buffering=0) as f:
                f.write(b'{"passed": true}\n')
        except OSError:
            pass
    try:
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as f:
            f.write(b"x")
    except OSError:
        pass
def f(x):
    return x + 1
"""

FORGERIES = {
    "frame_introspection": (FRAME_FORGER, "assert False\n"),
    "frame_introspection_then_exit": (
        FRAME_FORGER.replace("os._exit(0)", "exit(0)"),
        "assert False\n",
    ),
    "protocol_imitation": (PROTOCOL_FORGER, "assert False\n"),
    "protocol_imitation_then_exit": (
        PROTOCOL_FORGER + "import os\nos._exit(0)\n",
        "assert False\n",
    ),
    "patched_exec": (EXEC_PATCHER, "assert False\n"),
    "patched_builtins": (BUILTIN_PATCHER, BUILTIN_TESTS),
    "always_equal_object": (ALWAYS_EQUAL, "assert f(1) == 2\n"),
    "always_equal_int": (ALWAYS_EQUAL, "assert g(1) == 5\n"),
    "always_equal_nested_str": (ALWAYS_EQUAL, "assert h(1) == ['yes']\n"),
    "del_hook": (DEL_FORGER, "assert False\n"),
    "exception_str_hook": (EXCEPTION_FORGER, "assert f(1) == 2\n"),
    "thread_and_atexit": (THREAD_FORGER, "assert f(1) == 2\n"),
    "reach_the_checker": (REACH_CHECKER, "assert f(1) == 3\n"),
}


@pytest.fixture(scope="module")
def rootless_pool():
    with SandboxPool(
        workers=2, timeout_s=5.0, memory_mb=256, worker_options={"rootless": True}
    ) as pool:
        yield pool


@pytest.fixture(scope="module")
def forgery_results(pool, rootless_pool):
    """Every forgery through both modes, each mode in one batch."""
    requests = [
        ExecutionRequest(id=name, code=code, tests=tests)
        for name, (code, tests) in FORGERIES.items()
    ]
    return {
        mode: {r.id: r for r in p.run_batch(requests)}
        for mode, p in (("root", pool), ("rootless", rootless_pool))
    }


@pytest.mark.parametrize("mode", ["root", "rootless"])
@pytest.mark.parametrize("name", list(FORGERIES))
def test_forgery_does_not_pass(forgery_results, name, mode):
    r = forgery_results[mode][name]
    assert not r.passed, (r.status, r.details, r.stderr[-300:])
    assert r.valid, r.details


def test_honest_programs_pass_the_same_tests(pool, rootless_pool):
    honest = [
        ExecutionRequest(
            id="builtins",
            code="def f(x):\n    return 5.0 * x\ndef g():\n    return [1, 2, 3]\n",
            tests=BUILTIN_TESTS.replace("isinstance(f(1), str)", "isinstance(f(1), float)"),
        ),
        ExecutionRequest(
            id="equal", code="def f(x):\n    return 2 * x\n", tests="assert f(1) == 2\n"
        ),
        ExecutionRequest(
            id="reach", code=REACH_CHECKER + "print('answering')\n", tests="assert f(1) == 2\n"
        ),
    ]
    for p in (pool, rootless_pool):
        res = p.run_batch(honest)
        assert [r.status for r in res] == [Status.PASSED] * 3, [(r.id, r.details) for r in res]


def test_values_cross_as_plain_data(pool):
    """Tests see the program's results as exact built-in values, whatever their shape."""
    code = (
        "import math\n"
        "LIMIT = (3, {'a': [1.5, None]}, frozenset({2}))\n"
        "def shapes():\n"
        "    return [(1, 'x'), {1: {2, 3}}, b'\\x00z', 2 + 3j, float('inf'), True, 10 ** 30]\n"
        "def echo(*args, **kwargs):\n    return [list(args), kwargs]\n"
        "def fails(x):\n    raise KeyError(x)\n"
        "class Custom(Exception):\n    pass\n"
        "def custom():\n    raise Custom('mine')\n"
        "def gen():\n    yield 1\n"
    )
    tests = (
        "assert LIMIT == (3, {'a': [1.5, None]}, frozenset({2}))\n"
        "s = shapes()\n"
        "assert s == [(1, 'x'), {1: {2, 3}}, b'\\x00z', 2 + 3j, float('inf'), True, 10 ** 30]\n"
        "assert type(s[0]) is tuple and s[5] is True and type(s[6]) is int\n"
        "assert echo(1, (2,), k={3}) == [[1, (2,)], {'k': {3}}]\n"
        "assert math.sqrt(4) == 2\n"
        "try:\n    fails(7)\nexcept KeyError as e:\n    assert e.args == ('7',)\n"
        "else:\n    raise AssertionError('no KeyError')\n"
        "try:\n    custom()\nexcept Exception as e:\n    assert 'Custom: mine' in str(e)\n"
        "try:\n    gen()\nexcept TypeError as e:\n    assert 'generator' in str(e)\n"
        "else:\n    raise AssertionError('a generator crossed')\n"
    )
    res = pool.run_batch([ExecutionRequest(id="v", code=code, tests=tests)])[0]
    assert res.status == Status.PASSED, (res.details, res.stderr)


def test_failures_in_the_checked_tests_keep_their_categories(pool):
    code = "def f(x):\n    return 1 // x\ndef big():\n    return bytearray(10 ** 10)\n"
    requests = [
        ExecutionRequest(id="assert", code=code, tests="assert f(1) == 2\n"),
        ExecutionRequest(id="raise", code=code, tests="f(0)\n"),
        ExecutionRequest(id="memory", code=code, tests="big()\n"),
        ExecutionRequest(id="crash", code="import os\ndef f():\n    os._exit(3)\n", tests="f()\n"),
        ExecutionRequest(
            id="swallowed_crash",
            code="import os\ndef f():\n    os.kill(os.getpid(), 9)\n",
            tests="try:\n    f()\nexcept BaseException:\n    pass\n",
        ),
        ExecutionRequest(id="missing", code="x = 1\n", tests="assert f(1) == 1\n"),
        ExecutionRequest(id="bad_tests", code=code, tests="assert (\n"),
    ]
    res = {r.id: r for r in pool.run_batch(requests)}
    assert res["assert"].status == Status.FAILED and res["assert"].exception == "AssertionError"
    assert "assert f(1) == 2" in res["assert"].stderr
    assert res["raise"].status == Status.RUNTIME_ERROR
    assert res["raise"].exception == "ZeroDivisionError"
    assert "ZeroDivisionError" in res["raise"].stderr
    assert res["memory"].status == Status.MEMORY_LIMIT
    assert res["crash"].status == Status.RUNTIME_ERROR and res["crash"].exit_code == 3
    assert res["swallowed_crash"].status == Status.RUNTIME_ERROR
    assert res["swallowed_crash"].signal == 9
    assert res["missing"].status == Status.RUNTIME_ERROR and res["missing"].exception == "NameError"
    assert res["bad_tests"].status == Status.SANDBOX_ERROR and not res["bad_tests"].valid
