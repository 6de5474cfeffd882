"""Limits only the operator sets, the host a program cannot see, and the pool factory."""

import json
import logging
import os
import secrets
import socket
import subprocess
import sys

import pytest

import rlpt
from rlpt.sandbox import (
    ExecutionRequest,
    IOCase,
    IsolationUnavailable,
    SandboxPool,
    Status,
    make_pool,
)


@pytest.fixture(scope="module")
def rootless_pool():
    with SandboxPool(
        workers=2, timeout_s=5.0, memory_mb=128, worker_options={"rootless": True}
    ) as pool:
        yield pool


# -- ceilings -------------------------------------------------------------------------------------


def test_requests_cannot_raise_the_pools_limits():
    with SandboxPool(workers=2, timeout_s=1.0, memory_mb=128) as pool:
        res = pool.run_batch(
            [
                ExecutionRequest(id="slow", code="import time\ntime.sleep(3)\n", timeout_s=30.0),
                ExecutionRequest(
                    id="big", code="x = b'x' * (300 << 20)\nprint(len(x))\n", memory_mb=2000
                ),
                ExecutionRequest(id="less", code="import time\ntime.sleep(0.6)\n", timeout_s=0.3),
                ExecutionRequest(id="fits", code="x = b'x' * (30 << 20)\n", memory_mb=2000),
            ]
        )
    slow, big, less, fits = res
    assert slow.status == Status.TIMEOUT and slow.duration_s < 2.0
    assert slow.details["limits"] == {"timeout_s": 1.0, "memory_mb": 128}
    assert big.status == Status.MEMORY_LIMIT
    assert less.status == Status.TIMEOUT  # asking for less is honoured
    assert less.details["limits"]["timeout_s"] == 0.3
    assert fits.status == Status.PASSED


@pytest.mark.parametrize(
    "field, value",
    [
        ("timeout_s", -1),
        ("timeout_s", 0),
        ("timeout_s", float("nan")),
        ("timeout_s", float("inf")),
        ("timeout_s", "3"),
        ("timeout_s", True),
        ("memory_mb", 0),
        ("memory_mb", -5),
        ("memory_mb", 1.5),
    ],
)
def test_invalid_request_limits_are_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        ExecutionRequest(code="print(1)", **{field: value})


@pytest.mark.parametrize(
    "field, value", [("timeout_s", 0), ("timeout_s", -1.0), ("memory_mb", 0), ("workers", 0)]
)
def test_invalid_pool_limits_are_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SandboxPool(**{field: value})


def test_slot_memory_and_processes_are_limited_together(pool):
    """Forked children share one budget: four 60 MB children exceed a 128 MB slot."""
    forker = (
        "import os, time\nkids = []\nfor _ in range(4):\n    pid = os.fork()\n"
        "    if pid == 0:\n        x = b'x' * (60 << 20)\n        time.sleep(2)\n"
        "        os._exit(0)\n    kids.append(pid)\n"
        "print([os.waitpid(k, 0)[1] for k in kids])\n"
    )
    bomb = (
        "import os\nn = 0\ntry:\n    while True:\n        os.fork() or os.pause()\n        n += 1\n"
        "except OSError:\n    print(n)\n"
    )
    res = pool.run_batch(
        [
            ExecutionRequest(id="mem", code=forker),
            ExecutionRequest(id="nproc", code=bomb, timeout_s=2.0),
        ]
    )
    assert pool.aggregate_limits.startswith("cgroup"), pool.aggregate_limits
    assert res[0].status == Status.MEMORY_LIMIT, (res[0].status, res[0].stdout)
    assert res[1].status == Status.PASSED
    assert int(res[1].stdout) < 16  # the fixture's max_processes, for the slot as a whole


# -- what a program can see of the host ------------------------------------------------------------

_PROBE = r"""
import json, os, socket
out = {}
def attempt(name, fn):
    try:
        out[name] = repr(fn())[:200]
    except Exception as e:
        out[name] = "denied: " + type(e).__name__
attempt("home_file", lambda: open(HOME_FILE).read())
attempt("home_list", lambda: os.listdir(HOME))
attempt("project_file", lambda: open(PROJECT_FILE).read())
attempt("project_list", lambda: os.listdir(PROJECT))
attempt("etc_passwd", lambda: open("/etc/passwd").read())
for name, path in SOCKETS.items():
    def connect(path=path):
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        return "connected"
    attempt(name, connect)
attempt("root_list", lambda: sorted(os.listdir("/")))
attempt("proc_pids", lambda: sorted(p for p in os.listdir("/proc") if p.isdigit()))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def host_secrets(tmp_path_factory):
    tag = secrets.token_hex(6)
    home = os.path.expanduser("~")
    project = os.path.dirname(os.path.dirname(os.path.abspath(rlpt.__file__)))
    files = [
        os.path.join(home, f".rlpt-secret-{tag}"),
        os.path.join(project, f".rlpt-secret-{tag}"),
    ]
    for f in files:
        with open(f, "w") as fh:
            fh.write("secret-" + tag)
        os.chmod(f, 0o644)
    sockdir = tmp_path_factory.mktemp("sock")
    os.chmod(sockdir, 0o777)
    listeners, paths = (
        [],
        {
            "tmp_socket": str(sockdir / "s"),
            "home_socket": os.path.join(home, f".rlpt-sock-{tag}"),
            "abstract_socket": f"\0rlpt-{tag}",
        },
    )
    for path in paths.values():
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        if not path.startswith("\0"):
            os.chmod(path, 0o777)
        s.listen(4)
        listeners.append(s)
    yield {"tag": tag, "home": home, "project": project, "files": files, "sockets": paths}
    for s in listeners:
        s.close()
    for f in files + [paths["home_socket"]]:
        os.unlink(f)


@pytest.mark.parametrize("mode", ["root", "rootless"])
def test_program_sees_no_host_files_or_sockets(mode, pool, rootless_pool, host_secrets):
    p = pool if mode == "root" else rootless_pool
    head = (
        f"HOME = {host_secrets['home']!r}\nHOME_FILE = {host_secrets['files'][0]!r}\n"
        f"PROJECT = {host_secrets['project']!r}\nPROJECT_FILE = {host_secrets['files'][1]!r}\n"
        f"SOCKETS = {host_secrets['sockets']!r}\n"
    )
    res = p.run_batch([ExecutionRequest(id="probe", code=head + _PROBE)])[0]
    assert res.status == Status.PASSED, res.stderr
    assert host_secrets["tag"] not in res.stdout
    seen = json.loads(res.stdout)
    for key in [
        "home_file",
        "project_file",
        "project_list",
        "etc_passwd",
        *host_secrets["sockets"],
    ]:
        assert seen[key].startswith("denied"), (key, seen[key])
    # The interpreter's own tree may sit in the home directory; nothing else of it is there.
    assert seen["home_list"].startswith("denied") or seen["home_list"] in ("['.pyenv']", "[]")
    assert set(eval(seen["root_list"])) <= {
        "bin",
        "dev",
        "etc",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "proc",
        "root",
        "sbin",
        "tmp",
        "usr",
    }
    assert eval(seen["proc_pids"])  # its own /proc, which shows no host process
    assert len(eval(seen["proc_pids"])) < 5


def test_only_allowed_packages_are_importable(pool):
    code = (
        "import importlib\nfor m in ['numpy', 'rlpt', 'jax', 'pytest', 'json']:\n"
        "    try:\n        importlib.import_module(m)\n        print(m, 'ok')\n"
        "    except ImportError:\n        print(m, 'missing')\n"
    )
    with SandboxPool(workers=1, timeout_s=5.0, memory_mb=512, packages=["numpy"]) as numpy_pool:
        allowed = numpy_pool.run_batch([ExecutionRequest(code=code)])[0]
    plain = pool.run_batch([ExecutionRequest(code=code)])[0]
    assert plain.stdout.split("\n")[:5] == [
        "numpy missing",
        "rlpt missing",
        "jax missing",
        "pytest missing",
        "json ok",
    ]
    assert allowed.stdout.split("\n")[:5] == [
        "numpy ok",
        "rlpt missing",
        "jax missing",
        "pytest missing",
        "json ok",
    ]


def test_seccomp_denies_what_tests_never_need(pool):
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x10000000), ctypes.get_errno())\n"  # CLONE_NEWUSER
        "print(libc.ptrace(0, 0, 0, 0), ctypes.get_errno())\n"  # PTRACE_TRACEME
        "print(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())\n"
        "print(os.fork() or os._exit(0))\n"
    )
    res = pool.run_batch([ExecutionRequest(code=code)])[0]
    lines = res.stdout.split()
    assert lines[:6] == ["-1", "1", "-1", "1", "-1", "1"]  # EPERM each time
    assert res.status == Status.PASSED  # ordinary fork still works


# -- the factory and the command line --------------------------------------------------------------


def test_make_pool_refuses_to_run_without_isolation(caplog):
    with pytest.raises(IsolationUnavailable, match=r"sandbox\.allow_unisolated=True"):
        make_pool(workers=1, timeout_s=1.0, memory_mb=128, features=[])
    with caplog.at_level(logging.ERROR, logger="rlpt.sandbox.backends"):
        pool = make_pool(
            workers=1, timeout_s=1.0, memory_mb=128, allow_unisolated=True, features=[]
        )
    with pool:
        assert pool.isolation.startswith("missing")
        assert pool.run_batch([ExecutionRequest(code="print(1)")])[0].passed
    assert any("WITHOUT full isolation" in r.message for r in caplog.records)
    with pytest.raises(ValueError, match="sandbox.backend"):
        make_pool("docker", workers=1, timeout_s=1.0, memory_mb=128)
    with make_pool(workers=1, timeout_s=1.0, memory_mb=128) as full:
        assert full.isolation == "full"


def test_cli_answers_bad_lines_and_runs_the_rest(tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [
        json.dumps({"id": "a", "code": "print(2)"}),
        "{not json",
        json.dumps({"id": "nocode", "tests": "assert True"}),
        json.dumps({"id": "badcase", "code": "print(1)", "io_cases": [{"stdin": "", "out": "1"}]}),
        "",
        json.dumps({"id": "neg", "code": "print(1)", "timeout_s": -1}),
        json.dumps(
            {
                "id": "b",
                "code": "print(input())",
                "io_cases": [{"stdin": "7", "expected_stdout": "7"}],
            }
        ),
        json.dumps({"id": "slow", "code": "import time\ntime.sleep(3)", "timeout_s": 60}),
    ]
    src.write_text("\n".join(lines) + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "rlpt.sandbox", "run-jsonl", str(src), "--workers=2",
         "--timeout_s=0.5", "--memory_mb=128"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    got = [json.loads(s) for s in out.stdout.splitlines()]
    assert [g["status"] for g in got] == [
        "passed",
        "error",
        "error",
        "error",
        "error",
        "passed",
        "timeout",
    ]
    assert [g.get("line") for g in got if g["status"] == "error"] == [2, 3, 4, 6]
    errors = {g["line"]: g["error"] for g in got if g["status"] == "error"}
    assert errors[2].startswith("line 2:")
    assert "code" in errors[3] and got[2]["id"] == "nocode"
    assert "out" in errors[4] or "expected_stdout" in errors[4]
    assert "timeout_s" in errors[6]
    assert got[-1]["details"]["limits"]["timeout_s"] == 0.5


def test_io_case_fields_are_checked():
    with pytest.raises(ValueError, match="match"):
        IOCase("1", "1", "fuzzy")
    with pytest.raises(TypeError, match="stdin"):
        IOCase(1, "1")
