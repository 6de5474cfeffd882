"""One sandbox worker: a long-lived, JAX-free interpreter that forks an isolated child per run.

The pool starts this file as a fresh interpreter (``python -I _worker.py CONFIG``), never by
forking a process that may hold JAX threads. It imports only the standard library, so a fork
of it is a pre-warmed Python that starts running a program in about a millisecond instead of
the ~20 ms a fresh ``python`` costs.

Namespaces and processes::

    relay   the process the pool started; only waits, so killing it kills the worker
      └─ worker  PID 1 of the slot's own PID namespace (which holds nothing but this worker
                 and its current run), in its own network namespace with no interface up,
                 and its own mount namespace where every host mount is read-only, private
                 and nosuid, /dev/shm and /var/tmp are empty, and /proc is this namespace's
           └─ run  per run: fresh mount, IPC and UTS namespaces with a private tmpfs /tmp
                   (cwd, gone with the namespace), rlimits, no_new_privs, the slot's own
                   uid, a clean environment and empty stdin; the bootstrap below runs the
                   program, then the tests

One fork per run keeps a run at a few milliseconds. When the run's process exits, times out or
floods its output, the worker, as init, sends ``kill(-1, SIGKILL)``, which reaches every other
process in its namespace (double-forked daemons included) and nothing outside, then reaps them
all, so the slot's uid owns no process when the next run starts. Sequential runs of a slot
share its PID and network namespaces, never at the same time: nothing of a run survives it.

The pass sentinel (why ``exit(0)`` is no pass):
  A run passes only if the bootstrap, after the last statement of the tests, writes a 128-bit
  secret onto a control pipe that the worker reads. The secret is created by the worker *after*
  the fork (so it is not in the child's copy of the worker's memory), sent over a one-shot pipe
  that the bootstrap reads and closes before compiling the program, and never placed in the
  program's source, arguments, environment, files or output streams. The control pipe sits on a
  random high fd with close-on-exec; a program that finds it (scanning ``/proc/self/fd``) can
  write garbage on it, and a program that exits early (``exit(0)``, ``os._exit(0)``, a signal)
  writes nothing; neither contains the secret, so neither passes. The worker checks for the
  secret itself, never an exit code.
  What this cannot stop, and no in-process design can: the bootstrap and the program share one
  interpreter and one uid, so a program that introspects the interpreter's own memory
  (``sys._getframe(1).f_locals``, ``gc.get_objects()``, ctypes) can find what the epilogue
  holds. A program with that power could as well return an object whose ``__eq__`` is always
  true and pass the assertions honestly, so the sentinel's job is the part a sandbox can do:
  early exits, fd scanning, and reading /proc, the environment, argv or its own source.
"""

from __future__ import annotations

# The imports marked F401 are never used here: they are loaded so that every forked run gets
# these common modules without paying for the import.
import bisect  # noqa: F401
import builtins
import collections  # noqa: F401
import contextlib
import ctypes
import functools  # noqa: F401
import gc
import hashlib  # noqa: F401
import heapq  # noqa: F401
import itertools  # noqa: F401
import json
import linecache
import math
import os
import random  # noqa: F401 - reseeds itself in every forked child
import re  # noqa: F401
import resource
import secrets
import select
import signal
import string  # noqa: F401
import struct
import sys
import time
import traceback
import typing  # noqa: F401

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.syscall.restype = ctypes.c_long

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
PR_CAPBSET_DROP = 24
SYS_MOUNT_SETATTR = 442  # x86_64 and aarch64 share the number
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429
OPEN_TREE_CLONE, MOVE_MOUNT_F_EMPTY_PATH = 1, 4

# Feature names, as reported in ``ExecutionResult.isolation`` when missing.
F_NET = "network namespace"
F_PID = "pid namespace"
F_MOUNT = "mount namespace (read-only host, private /tmp)"
F_IPC = "ipc/uts namespaces"
F_UID = "unprivileged per-slot uid"
F_LIBS = "interpreter readable by the slot uid"
ALL_FEATURES = (F_NET, F_PID, F_MOUNT, F_IPC, F_UID, F_LIBS)

_MAX_CTL = 65536
_MEMORY_REPORT = b'RLPT-REPORT {"phase": "run", "exc": "MemoryError", "kind": "memory"}\n'
_SENTINEL_TAG = b"\nRLPT-END "


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def _mount(
    src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    enc = lambda s: None if s is None else s.encode()
    _check(_libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _make_host_readonly() -> None:
    """Every mount in this (private) mount namespace read-only, nosuid and private."""
    attr = ctypes.create_string_buffer(
        struct.pack("QQQQ", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, MS_PRIVATE, 0), 32
    )
    ret = _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, attr, 32)
    if ret == 0:
        return
    # Kernels before 5.12 lack mount_setattr: remount each mount point one by one.
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in points:
        point = point.encode().decode("unicode_escape")
        try:
            _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)
        except OSError:
            # Keep locked flags (nodev/noexec) the kernel refuses to drop.
            _mount(
                None,
                point,
                None,
                MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
            )


def _interpreter_dirs() -> list[str]:
    dirs = {
        sys.base_prefix,
        sys.base_exec_prefix,
        sys.prefix,
        sys.exec_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
    }
    dirs.update(p for p in sys.path if p)
    return sorted({os.path.realpath(d) for d in dirs if os.path.isdir(d)})


def _hidden_ancestor(path: str) -> str | None:
    """The highest ancestor that others may not traverse (like a 0700 /root), if any."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        anc = "/" + "/".join(parts[:i])
        if not os.stat(anc).st_mode & 0o001:
            return anc
    return None


def _expose_interpreter() -> None:
    """Let the slot uid read the interpreter when it lives in a private home (e.g. /root/.pyenv).

    The private directory is covered by a read-only tmpfs holding only bind mounts of the
    interpreter's own trees, so the rest of that home stays invisible to the program.
    """
    groups: dict[str, list[str]] = {}
    for d in _interpreter_dirs():
        anc = _hidden_ancestor(d)
        if anc is not None:
            groups.setdefault(anc, []).append(d)
    for anc, dirs in groups.items():
        keep = [d for d in dirs if not any(d != o and d.startswith(o + "/") for o in dirs)]
        trees = []
        for d in keep:
            fd = _libc.syscall(
                SYS_OPEN_TREE, AT_FDCWD, d.encode(), OPEN_TREE_CLONE | AT_RECURSIVE | os.O_CLOEXEC
            )
            if fd < 0:
                _check(-1, f"open_tree {d}")
            trees.append((d, fd))
        _mount("tmpfs", anc, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=256,mode=0755")
        for d, fd in trees:
            os.makedirs(d, mode=0o755, exist_ok=True)
            _check(
                _libc.syscall(
                    SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, d.encode(), MOVE_MOUNT_F_EMPTY_PATH
                ),
                f"move_mount {d}",
            )
            os.close(fd)
        _mount(None, anc, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _close_all_but(keep: set[int]) -> None:
    low = 0
    for fd in sorted(keep):
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)


def _send(fd: int, obj: object) -> None:
    data = json.dumps(obj).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data) :]


def _recv(fd: int) -> object | None:
    head = _read_exact(fd, 4)
    if head is None:
        return None
    body = _read_exact(fd, struct.unpack(">I", head)[0])
    return None if body is None else json.loads(body)


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _log(msg: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"[rlpt.sandbox worker {os.getpid()}] {msg}\n".encode())


class Worker:
    """The per-slot state: which protections work here, and the run loop."""

    def __init__(self, cfg: dict):
        self.uid = int(cfg["uid"])
        self.features: set[str] = set()
        self.netns_per_run = bool(cfg.get("netns_per_run", False))
        self.wanted = set(cfg.get("features", ALL_FEATURES)) | {F_LIBS}
        # "rootless" can be forced to exercise the unprivileged path on a root machine.
        self.rootless = os.geteuid() != 0 or bool(cfg.get("rootless", False))
        self.is_init = False

    # -- start-up -------------------------------------------------------------------------------

    def setup(self) -> None:
        """Enter this slot's namespaces, find which protections work, and keep only those."""
        if self.wanted & {F_PID, F_MOUNT, F_NET, F_IPC}:
            self._become_namespace_init()
        if not self.is_init:
            self.wanted.discard(F_PID)
            try:
                _prctl(PR_SET_CHILD_SUBREAPER, 1)
            except OSError as e:
                _log(f"cannot become a child subreaper ({e}); orphans go to the host's init")
        if F_NET in self.wanted and not self.netns_per_run:
            try:
                _unshare(CLONE_NEWNET)
            except OSError as e:
                _log(f"no network namespace: {e}")
                self.wanted.discard(F_NET)
        if F_MOUNT in self.wanted:
            # Done once here: every run's mount namespace starts as a copy of this one, so a
            # run only adds its own /tmp.
            try:
                _unshare(CLONE_NEWNS)
                _make_host_readonly()
                if not self.rootless:
                    _expose_interpreter()
                _hide_shared_dirs()
                if self.is_init:
                    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
            except OSError as e:
                _log(f"no private read-only mounts: {e}")
                self.wanted.discard(F_MOUNT)
        self.features = self._probe()

    def _become_namespace_init(self) -> None:
        """Become PID 1 of a PID namespace that holds only this worker and its runs.

        As init, ``kill(-1, SIGKILL)`` ends every process of a finished run (double-forked
        daemons included) and nothing outside; orphans come to us to be reaped; and a run sees
        no host process. Without root, a user namespace provides the namespaces (not the
        distinct uids). The original process only relays the exit status.
        """
        uid, gid = os.getuid(), os.getgid()
        try:
            _unshare(CLONE_NEWPID | (CLONE_NEWUSER if self.rootless else 0))
            if self.rootless:
                with open("/proc/self/setgroups", "w") as f:
                    f.write("deny")
                with open("/proc/self/uid_map", "w") as f:
                    f.write(f"0 {uid} 1")
                with open("/proc/self/gid_map", "w") as f:
                    f.write(f"0 {gid} 1")
        except OSError as e:
            _log(f"no pid/user namespace ({e})")
            if self.rootless:
                self.wanted -= {F_PID, F_MOUNT, F_NET, F_IPC}
            return
        pid = os.fork()
        if pid:
            _close_all_but(set())
            while True:
                try:
                    _, status = os.waitpid(pid, 0)
                    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
                except InterruptedError:
                    continue
        # The relay's death (a killed worker) takes this init, hence all its runs, with it.
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        self.is_init = os.getpid() == 1
        if self.rootless:
            self.wanted.discard(F_UID)

    def _probe(self) -> set[str]:
        """Try the per-run protections in a throwaway child and keep those that worked."""
        got = self.wanted & {F_PID, F_NET, F_MOUNT}
        if self.rootless or F_UID not in self.wanted:
            got.add(F_LIBS)  # runs keep the worker's own uid, which reads the interpreter
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                found = _probe_child(self.wanted, self.uid, self.rootless, self.netns_per_run)
                os.write(w, json.dumps(sorted(found)).encode())
            finally:
                os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 4096):
            data += chunk
        os.close(r)
        self._reap(pid)
        try:
            found = set(json.loads(data))
        except ValueError:
            found = set()
        if self.netns_per_run and F_NET not in found:
            got.discard(F_NET)
        if F_MOUNT not in found:
            got.discard(F_MOUNT)
        return (got | (found & {F_IPC, F_UID, F_LIBS})) & self.wanted

    # -- one run --------------------------------------------------------------------------------

    def run_one(self, job: dict, stdin: str | None) -> dict:
        """Run the program once with ``stdin``; return the raw observations for the pool."""
        timeout_s = float(job["timeout_s"])
        out_cap = int(job["output_limit"])
        pipes = {name: os.pipe() for name in ("stdout", "stderr", "ctl", "status", "secret")}
        if stdin:
            stdin_fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
            data = stdin.encode()
            while data:
                data = data[os.write(stdin_fd, data) :]
            os.lseek(stdin_fd, 0, os.SEEK_SET)
        else:
            stdin_fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        run = {
            "job": job,
            "stdin_fd": stdin_fd,
            "stdout_w": pipes["stdout"][1],
            "stderr_w": pipes["stderr"][1],
            "ctl_w": pipes["ctl"][1],
            "status_w": pipes["status"][1],
            "secret_r": pipes["secret"][0],
        }
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        if job.get("deadline") is not None:
            deadline = min(deadline, float(job["deadline"]))
        try:
            pid = os.fork()
        except OSError as e:
            for r, w in pipes.values():
                os.close(r)
                os.close(w)
            os.close(stdin_fd)
            return {"error": f"fork failed: {e}"}
        if pid == 0:
            try:
                _user_main(self.features, self.uid, self.netns_per_run, run)
            except BaseException as e:  # noqa: BLE001 - set-up failed before any user code ran
                with contextlib.suppress(BaseException):
                    os.write(
                        run["status_w"],
                        json.dumps({"error": f"run set-up: {e!r}"}).encode() + b"\n",
                    )
            os._exit(71)
        os.close(stdin_fd)
        for name, (r, w) in pipes.items():
            os.close(r if name == "secret" else w)
        # Made only now, after the fork, so that it is not in the child's copy of our memory.
        secret = secrets.token_hex(16).encode()
        with contextlib.suppress(OSError):
            os.write(pipes["secret"][1], secret)
        os.close(pipes["secret"][1])
        sentinel = _SENTINEL_TAG + secret

        names = {pipes[n][0]: n for n in ("stdout", "stderr", "ctl", "status")}
        bufs = {n: bytearray() for n in names.values()}
        overflow = {"stdout": False, "stderr": False}
        reached = False
        killed = None
        exited = None
        t_end = None
        poller = select.poll()
        for fd in names:
            poller.register(fd, select.POLLIN)
        try:
            pidfd = os.pidfd_open(pid)
            poller.register(pidfd, select.POLLIN)
        except (OSError, AttributeError):
            pidfd = -1  # without pidfd, poll in short steps to notice the exit
        drain_until = None
        while names:
            now = time.monotonic()
            if exited is None:
                left = deadline - now
                if left <= 0:
                    killed = "timeout"
                    break
            else:
                # The run is over and its processes are killed; the pipes close at once.
                if drain_until is None:
                    drain_until = now + 1.0
                left = drain_until - now
                if left <= 0:
                    break
            step = left if pidfd >= 0 else min(left, 0.005)
            for fd, _ in poller.poll(max(1, int(step * 1000) + 1)):
                if fd == pidfd:
                    poller.unregister(pidfd)
                    continue
                name = names[fd]
                chunk = os.read(fd, 65536)
                if not chunk:
                    poller.unregister(fd)
                    os.close(fd)
                    del names[fd]
                    continue
                buf = bufs[name]
                if name in overflow:
                    room = out_cap - len(buf)
                    buf += chunk[: max(room, 0)]
                    if len(chunk) > room:
                        overflow[name] = True
                        killed = "output"
                elif name == "ctl":
                    buf += chunk
                    if sentinel in buf:
                        reached = True
                    if len(buf) > _MAX_CTL:
                        del buf[: len(buf) - _MAX_CTL]
                else:
                    buf += chunk
            if killed:
                break
            if exited is None:
                got, st, ru = os.wait4(pid, os.WNOHANG)
                if got == pid:
                    exited = (st, ru)
                    t_end = time.monotonic()
                    self._kill_all(pid)
        if t_end is None:
            t_end = time.monotonic()
        if exited is None:
            self._kill_all(pid)
        for fd in names:
            os.close(fd)
        if pidfd >= 0:
            os.close(pidfd)
        final = self._reap(pid)
        if exited is None:
            exited = final
        status: dict = {}
        # Written only by trusted code: the run's set-up, before the program starts.
        for line in bytes(bufs["status"]).splitlines():
            with contextlib.suppress(ValueError):
                status.setdefault("error", json.loads(line).get("error"))
        report = None
        for line in bytes(bufs["ctl"]).split(b"\n"):
            if line.startswith(b"RLPT-REPORT "):
                try:
                    report = json.loads(line[len(b"RLPT-REPORT ") :])
                except ValueError:
                    report = None
        res = {
            "reached_end": reached,
            "killed": killed,
            "report": report,
            "stdout": bytes(bufs["stdout"]).decode("utf-8", "replace"),
            "stderr": bytes(bufs["stderr"]).decode("utf-8", "replace"),
            "stdout_overflow": overflow["stdout"],
            "stderr_overflow": overflow["stderr"],
            "duration_s": t_end - t0,
            "exit_code": None,
            "signal": None,
            "cpu_s": None,
            "maxrss_kb": None,
        }
        if status.get("error"):
            res["error"] = status["error"]
        if exited is not None:
            ws, ru = exited
            res["cpu_s"] = ru.ru_utime + ru.ru_stime
            res["maxrss_kb"] = ru.ru_maxrss
            if os.WIFSIGNALED(ws):
                res["signal"] = os.WTERMSIG(ws)
            elif os.WIFEXITED(ws):
                res["exit_code"] = os.WEXITSTATUS(ws)
        elif not killed:
            res["error"] = "the run's process could not be waited for"
        return res

    def _kill_all(self, pid: int) -> None:
        """End every process of the run, however it tried to detach."""
        if self.is_init:
            # As PID 1 of our own namespace: everything but ourselves, and nothing outside.
            with contextlib.suppress(OSError):
                os.kill(-1, signal.SIGKILL)
            return
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        if F_UID in self.features:
            # Without a PID namespace, a process of the slot's uid kills all of that uid's.
            helper = os.fork()
            if helper == 0:
                try:
                    _drop_privileges(self.uid)
                    os.kill(-1, signal.SIGKILL)
                finally:
                    os._exit(0)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(helper, 0)

    def _reap(self, pid: int):
        """Wait for ``pid``, then for every other child; keep the slot uid's count at zero."""
        result = None
        while True:
            try:
                got, st, ru = os.wait4(pid, 0)
                if got == pid:
                    result = (st, ru)
                break
            except InterruptedError:
                continue
            except ChildProcessError:
                break
        # As init every other child was just SIGKILLed and goes at once; without a PID
        # namespace a daemon may have escaped the kill, and waiting for it would stall.
        deadline = time.monotonic() + (5.0 if self.is_init else 0.1)
        while time.monotonic() < deadline:
            try:
                got, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if got == 0:
                time.sleep(0.0005)
        return result

    def handle(self, job: dict) -> dict:
        runs = []
        for stdin in job.get("stdins") or [None]:
            if job.get("deadline") is not None and time.monotonic() >= float(job["deadline"]):
                runs.append(
                    {
                        "killed": "timeout",
                        "reached_end": False,
                        "duration_s": 0.0,
                        "not_started": True,
                    }
                )
                break
            res = self.run_one(job, stdin)
            runs.append(res)
            if not res.get("reached_end") or res.get("killed") or res.get("error"):
                break
        return {"runs": runs}


def _hide_shared_dirs() -> None:
    """Empty, read-only world-writable host directories, so a run cannot read what is there."""
    for d in ("/dev/shm", "/var/tmp"):
        if os.path.isdir(d):
            _mount(
                "tmpfs",
                d,
                "tmpfs",
                MS_NOSUID | MS_NODEV | MS_RDONLY,
                "size=4k,nr_inodes=16,mode=0755",
            )


def _probe_child(wanted: set[str], uid: int, rootless: bool, netns_per_run: bool) -> set[str]:
    got = set()
    if F_NET in wanted and netns_per_run:
        try:
            _unshare(CLONE_NEWNET)
            got.add(F_NET)
        except OSError as e:
            _log(f"no network namespace: {e}")
    if F_IPC in wanted:
        try:
            _unshare(CLONE_NEWIPC | CLONE_NEWUTS)
            got.add(F_IPC)
        except OSError as e:
            _log(f"no ipc/uts namespace: {e}")
    if F_MOUNT in wanted:
        try:
            _unshare(CLONE_NEWNS)
            _mount_scratch(0 if rootless else uid)
            got.add(F_MOUNT)
        except OSError as e:
            _log(f"no private scratch mount: {e}")
    if F_UID in wanted and not rootless:
        try:
            _drop_privileges(uid)
            got.add(F_UID)
            # Runs are forked from this already-loaded interpreter and never exec it again, so
            # what they must still read is the standard library (a venv's bin/ may sit under
            # the private /tmp, as a checkout in /tmp does, and is not needed).
            stdlib = os.path.dirname(os.__file__)
            for path in (stdlib, os.path.join(stdlib, "lib-dynload")):
                if os.path.isdir(path) or path == stdlib:
                    os.listdir(path)
            got.add(F_LIBS)
        except OSError as e:
            _log(f"slot uid {uid}: {e}")
    return got


def _mount_scratch(uid: int) -> None:
    """The run's own /tmp: private, size-capped, gone with its mount namespace."""
    _mount(
        "tmpfs",
        "/tmp",
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size=32m,nr_inodes=4096,mode=0700,uid={uid},gid={uid}",
    )


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _drop_capabilities() -> None:
    """Give up every capability, for a run that keeps uid 0 (of a user namespace, rootless).

    Without this, root of the worker's user namespace could remount the host read-write.
    """
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) != 0:
            break  # past the last capability this kernel knows
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def _drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _user_main(features: set[str], uid: int, netns_per_run: bool, run: dict) -> None:
    """The run's process: its namespaces, limits and uid, then the bootstrap."""
    os.setsid()
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    flags = 0
    if F_NET in features and netns_per_run:
        flags |= CLONE_NEWNET
    if F_IPC in features:
        flags |= CLONE_NEWIPC | CLONE_NEWUTS
    if F_MOUNT in features:
        flags |= CLONE_NEWNS
    if flags:
        _unshare(flags)
    if F_MOUNT in features:
        _mount_scratch(uid if F_UID in features else 0)
    job = run["job"]
    os.dup2(run["stdin_fd"], 0)
    os.dup2(run["stdout_w"], 1)
    os.dup2(run["stderr_w"], 2)
    # A random high fd, close-on-exec: not where a program writing to fd 3 would land.
    ctl = os.dup2(run["ctl_w"], 300 + secrets.randbelow(700), inheritable=False)
    secret_r, status_w = run["secret_r"], run["status_w"]
    _close_all_but({0, 1, 2, ctl, secret_r, status_w})
    os.chdir("/tmp")
    mem = int(job["memory_mb"]) << 20
    cpu = max(1, math.ceil(float(job["timeout_s"])))
    fsize = int(job["file_size_mb"]) << 20
    limits = [
        (resource.RLIMIT_AS, mem, mem),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_FSIZE, fsize, fsize),
        (resource.RLIMIT_NOFILE, int(job["max_open_files"]), int(job["max_open_files"])),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    if F_UID in features:
        # Counted per uid: meaningful only because each slot runs as its own uid.
        limits.append((resource.RLIMIT_NPROC, int(job["max_processes"]), int(job["max_processes"])))
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if F_UID in features:
        _drop_privileges(uid)
    else:
        _drop_capabilities()
    os.environ.clear()
    os.environ.update(
        {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp",
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
        }
    )
    sys.argv = ["solution.py"]
    secret = _read_exact(secret_r, 32)
    os.close(secret_r)
    # From here on only the program's own failures are reported, never as the sandbox's.
    os.close(status_w)
    del run
    _bootstrap(job["code"], job.get("tests"), ctl, secret)


def _bootstrap(code: str, tests: str | None, ctl: int, secret: bytes | None) -> None:
    """Run the program then the tests; only falling off the end writes the secret."""
    write, exit_ = os.write, os._exit
    memory_report = _MEMORY_REPORT  # bound now: after a MemoryError nothing may allocate
    g = {"__name__": "__main__", "__builtins__": builtins}
    # Tracebacks then show the offending lines, as they would for a file on disk.
    for name, src in (("solution.py", code), ("tests.py", tests or "")):
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    phase = "compile"
    try:
        code_obj = compile(code, "solution.py", "exec")
        tests_obj = compile(tests, "tests.py", "exec") if tests else None
        phase = "code"
        exec(code_obj, g)
        phase = "tests"
        if tests_obj is not None:
            exec(tests_obj, g)
    except MemoryError:
        g.clear()
        _flush()
        write(ctl, memory_report)
        exit_(1)
    except BaseException as e:  # noqa: BLE001 - every exception is an outcome to report
        kind = "exception"
        # compile() raises ValueError, not SyntaxError, for a NUL byte in the source.
        if phase == "compile" and isinstance(e, SyntaxError | ValueError):
            kind = "syntax"
        elif isinstance(e, AssertionError):
            kind = "assert"
        elif isinstance(e, SystemExit):
            kind = "exit"
        info = {"phase": phase, "exc": type(e).__name__, "kind": kind}
        if kind == "exit":
            info["code"] = e.code if isinstance(e.code, int | None) else 1
            if e.code is not None and not isinstance(e.code, int):
                _print_err(str(e.code))
        else:
            try:
                # Without the bootstrap's own frame, as Python would print it.
                tb = None if kind == "syntax" else e.__traceback__.tb_next
                traceback.print_exception(type(e), e, tb)
            except BaseException:  # noqa: BLE001
                pass
            with contextlib.suppress(BaseException):
                info["msg"] = str(e)[:500]
        del e
        g.clear()
        _flush()
        write(ctl, b"RLPT-REPORT " + json.dumps(info).encode() + b"\n")
        exit_(1 if kind != "exit" or info.get("code") else 0)
    _flush()
    if secret is not None:
        write(ctl, _SENTINEL_TAG + secret + b"\n")
    exit_(0)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()


def _print_err(text: str) -> None:
    with contextlib.suppress(BaseException):
        print(text, file=sys.stderr)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    worker = Worker(cfg)
    worker.setup()
    # Everything loaded so far stays out of the collector's sight, so neither the worker nor a
    # forked run writes to those pages (copy-on-write faults) when collecting garbage.
    gc.freeze()
    missing = [f for f in ALL_FEATURES if f not in worker.features]
    _send(1, {"ready": True, "pid": os.getpid(), "missing": missing})
    while True:
        try:
            job = _recv(0)
        except OSError:
            job = None
        if job is None:
            os._exit(0)
        try:
            reply = worker.handle(job)
        except Exception as e:  # noqa: BLE001 - report, keep serving
            reply = {"error": f"{type(e).__name__}: {e}"}
            if worker.is_init:
                # Whatever that run left behind must not meet the next one.
                with contextlib.suppress(OSError):
                    os.kill(-1, signal.SIGKILL)
                worker._reap(-1)
        _send(1, reply)


if __name__ == "__main__":
    main()
