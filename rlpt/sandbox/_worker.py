"""One sandbox worker: a long-lived, JAX-free interpreter that forks isolated children per run.

The pool starts this file as a fresh interpreter (``python -I _worker.py CONFIG``), never by
forking a process that may hold JAX threads. It imports only the standard library, loads the
modules programs commonly use and runs a warm-up (the first ``compile()`` of a process builds
the AST types), so a fork of it is a pre-warmed Python that runs a trivial program for about
a millisecond of CPU instead of the ~9 ms a fresh ``python -I -S`` costs.

Namespaces and processes::

    relay   the process the pool started; only waits, so killing it kills the worker
      └─ worker   PID 1 of the slot's own PID namespace, in the slot's cgroup, in its own
                  network (no interface up), IPC and UTS namespaces, and its own mount
                  namespace whose root is a fresh tmpfs holding
                  only the interpreter, its standard library, the allowed packages, the system
                  binaries and libraries, a few device nodes and this namespace's /proc, all
                  read-only (no home directory, project tree, /etc, /run or host socket)
           ├─ program  per run: a fresh tmpfs /tmp (its working directory, mounted anew by the
           │           worker before each run), rlimits, the slot's cgroup, no_new_privs, the
           │           seccomp filter, the slot's uid, a clean environment; runs ``code``
           └─ checker  one per slot, started with the first run that has ``tests`` and kept:
                       the same limits but CPU time (each run has a wall-clock deadline),
                       another uid (as root), non-dumpable; for each run it receives the tests
                       and that run's pipes over a socket, runs the tests, calls the program's
                       functions over the pipes accepting only plain values, and is the only
                       one that can say "pass"

Why the tests run in another process: a program shares everything with code in its own
interpreter, so no secret, sentinel or check kept there is safe from it (``sys._getframe``,
``gc.get_objects``, ctypes, patched builtins, ``__eq__`` that is always true, exceptions from
``__del__``). The checker never runs the program's code and never sees its objects: a call
crosses the pipe as JSON of exact built-in types (``_encode``/``_decode``), the result comes back
the same way, and the assertions run on those plain values with the checker's own, unpatched
builtins. The program never sees the tests either. The checker writes its verdict on a pipe only
it and the worker hold; the program cannot see the checker's process (another uid as root,
non-dumpable and behind a seccomp filter that forbids ``ptrace`` in both modes). The checker is
kept between runs because forking, faulting in and tearing down an interpreter per run cost
more than the tests themselves; it is replaced whenever a run ends without its verdict (a
timeout, a crash, a kill) or with a MemoryError, and it keeps no state of a run: fresh globals
and fresh pipes each time.

Without ``tests`` there is nothing to check but that the program ran to its end: the bootstrap
then writes an end marker on a control pipe (on a random high descriptor) after the last
statement, so ``exit(0)`` and ``os._exit(0)`` are not taken for a finished run. That signal is
the program's own to give by definition (a program that forged it could as well not stop
early), so it is no secret; with ``io_cases`` the verdict is the parent's comparison of stdout.

When a run ends, the worker, as init, SIGKILLs every process of its namespace but the checker
(listed by the namespace's own /proc, again until none is left, so double-forked daemons go
too) and nothing outside, then reaps them all, so the slot owns no process of the run when the
next one starts.
"""

from __future__ import annotations

# The imports marked F401 are never used here: they are loaded so that every forked run gets
# these common modules without paying for the import.
import bisect  # noqa: F401
import builtins
import collections  # noqa: F401
import contextlib
import copy  # noqa: F401
import ctypes
import functools  # noqa: F401
import gc
import heapq  # noqa: F401
import importlib.util
import itertools  # noqa: F401
import json
import linecache
import math
import os
import random  # noqa: F401 - reseeds itself in every forked child
import re
import resource
import select
import signal
import socket
import string  # noqa: F401
import struct
import sys
import time
import traceback
import types
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
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
PR_GET_DUMPABLE = 3
PR_CAPBSET_DROP, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 24, 22, 2
SYS_MOUNT_SETATTR = 442  # x86_64 and aarch64 share the number
SYS_PIVOT_ROOT = 155 if os.uname().machine == "x86_64" else 41
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
AT_FDCWD, AT_RECURSIVE = -100, 0x8000

# Feature names, as reported in ``ExecutionResult.isolation`` when missing.
F_NET = "network namespace"
F_PID = "pid namespace"
F_MOUNT = "minimal read-only root (no host files), private /tmp"
F_IPC = "ipc/uts namespaces"
F_UID = "unprivileged per-slot uid"
F_LIBS = "interpreter readable by the slot uid"
F_SECCOMP = "seccomp system-call filter"
ALL_FEATURES = (F_NET, F_PID, F_MOUNT, F_IPC, F_UID, F_LIBS, F_SECCOMP)

_KERNEL = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
_MAX_CTL = 65536
# Beyond a run's own budget, for what the checker and the worker charge to the slot's cgroup.
_CGROUP_HEADROOM_MB = 32
_MAX_MESSAGE = 64 << 20  # one call's arguments or result, encoded
_MEMORY_REPORT = b'RLPT-REPORT {"phase": "run", "exc": "MemoryError", "kind": "memory"}\n'
_END_MARKER = b"\nRLPT-END\n"


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


# -- the minimal root ---------------------------------------------------------------------------

# System binaries and libraries: /bin/sh for os.system, and the shared libraries that the
# standard library's extension modules link against (libssl, libffi, libz, ...).
_SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_DEVICES = ("null", "zero", "full", "random", "urandom")
# Where the new root is assembled inside the worker's private mount namespace (shadowing the
# host directory there only); the first that holds none of the bound trees is used.
_ASSEMBLY_POINTS = ("/mnt", "/media", "/srv", "/opt", "/tmp", "/var/tmp")


def _root_sources(packages: list[str]) -> tuple[list[str], list[str]]:
    """Paths bound read-only into the new root, and directories masked there by an empty tmpfs.

    The standard library is bound without the base interpreter's own site-packages; of the
    installed packages only ``packages`` (import names) appear, each at the path it is imported
    from, with its ``NAME.libs`` directory of vendored shared libraries if it has one.
    """
    stdlib = os.path.dirname(os.__file__)
    binds = [stdlib, os.path.realpath(sys.executable)]
    binds += [p for p in sys.path if p and os.path.basename(p) == "lib-dynload"]
    binds += [d for d in _SYSTEM_TREES if os.path.lexists(d)]
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise ImportError(f"package {name!r} is not installed")
        locations = list(spec.submodule_search_locations or []) or [spec.origin]
        for loc in locations:
            binds.append(os.path.abspath(loc))
            libs = os.path.join(os.path.dirname(os.path.abspath(loc)), name + ".libs")
            if os.path.isdir(libs):
                binds.append(libs)
    masks = [os.path.join(stdlib, d) for d in ("site-packages", "dist-packages")]
    out: list[str] = []
    for b in binds:
        if os.path.lexists(b) and b not in out:
            out.append(os.path.abspath(b))
    return out, [m for m in masks if os.path.isdir(m)]


def _enter_minimal_root(packages: list[str], mount_proc: bool) -> None:
    """Make this mount namespace's root a fresh tmpfs holding only what a program needs.

    Works the same as root and inside an unprivileged user namespace (bind mounts, tmpfs,
    proc and pivot_root are all allowed to the owner of the mount namespace). Hand-written
    rather than through bubblewrap because the worker is a fork server: it must keep the
    capabilities to give every run its own /tmp and uid after the root is built, which
    bubblewrap drops for the process it starts.
    """
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    binds, masks = _root_sources(packages)
    base = next(
        p
        for p in _ASSEMBLY_POINTS
        if os.path.isdir(p) and not os.path.islink(p)
        and not any(b == p or b.startswith(p + "/") for b in binds)
    )  # fmt: skip
    _mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for src in binds:
        dst = base + _placed(src)
        if os.path.islink(src) and src in _SYSTEM_TREES:
            os.symlink(os.readlink(src), dst)  # /bin -> usr/bin on merged-/usr systems
            continue
        if os.path.isdir(src):
            os.makedirs(dst, mode=0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
            open(dst, "a").close()
        _mount(src, dst, None, MS_BIND | MS_REC)
    for d in masks:
        _mount("tmpfs", base + d, "tmpfs", MS_NOSUID | MS_NODEV, "size=4k,nr_inodes=16,mode=0755")
    dev = base + "/dev"
    os.makedirs(dev + "/shm", mode=0o755)
    for name in _DEVICES:
        open(f"{dev}/{name}", "a").close()
        _mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
        os.symlink(target, f"{dev}/{name}")
    os.symlink("/proc/self/fd/1", f"{dev}/stdout")
    os.symlink("/proc/self/fd/2", f"{dev}/stderr")
    for d in ("proc", "tmp", "etc", ".old"):
        os.makedirs(f"{base}/{d}", mode=0o755, exist_ok=True)
    if mount_proc:
        # Mounted while the host's /proc is still visible: an unprivileged user namespace may
        # mount proc only then.
        _mount("proc", base + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(base)
    _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b".old"), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "umount the host root")
    os.rmdir("/.old")
    _make_readonly()
    # Programs are forked from here: they import allowed packages from where they now are.
    sys.path[:] = [_placed(p) if p else p for p in sys.path]
    sys.path_importer_cache.clear()


# Each run mounts a fresh /tmp over the new root's, hiding whatever was bound below it: an
# allowed package installed under /tmp (a virtual environment in a temporary directory) is
# bound under this prefix instead, and the search path follows it.
_RELOCATED = "/.relocated"
_SHADOWED = ("/tmp", "/var/tmp")


def _placed(path: str) -> str:
    """Where a host path is bound in the new root."""
    if any(path == d or path.startswith(d + "/") for d in _SHADOWED):
        return _RELOCATED + path
    return path


def _make_readonly() -> None:
    """Every mount of the new root read-only and nosuid (device nodes stay writable)."""
    attr = ctypes.create_string_buffer(
        struct.pack("QQQQ", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0), 32
    )
    ret = _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, attr, 32)
    if ret == 0:
        return
    # Kernels before 5.12 lack mount_setattr: remount each mount point one by one.
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].encode().decode("unicode_escape") for line in f]
    for point in points:
        for extra in (0, MS_NODEV | MS_NOEXEC):  # keep flags the kernel has locked
            try:
                _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | extra)
                break
            except OSError:
                if extra:
                    raise


# -- the system-call filter ---------------------------------------------------------------------


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _SeccompFilter:
    """A compiled filter, laid out for the kernel once, in the worker.

    Each run then installs it with one call: building the ctypes objects in every forked
    child would touch (and copy) pages that the run has no other reason to write.
    """

    def __init__(self, program: bytes):
        self._buf = ctypes.create_string_buffer(program, len(program))
        self._fprog = _SockFprog(len(program) // 8, ctypes.addressof(self._buf))
        mode = ctypes.c_ulong(SECCOMP_MODE_FILTER)
        self._args = (PR_SET_SECCOMP, mode, ctypes.byref(self._fprog))

    def load(self) -> None:
        """Install the filter on this process (needs no_new_privs); its children inherit it."""
        _check(_libc.prctl(*self._args, 0, 0), "seccomp")


# -- plain values across the boundary -----------------------------------------------------------


def _encode(v, _remote=None):
    """A JSON-ready form of a value made only of exact built-in types; TypeError otherwise.

    Exact type checks (``type(v) is int``) refuse subclasses, so no object of the program's
    own making (an ``__eq__`` that is always true, a lying ``__repr__``) crosses over.
    """
    t = type(v)
    if v is None or t is bool or t is int or t is str or t is float:
        return v
    if t is list:
        return [_encode(x, _remote) for x in v]
    if t is tuple:
        return {"tuple": [_encode(x, _remote) for x in v]}
    if t is set or t is frozenset:
        return {t.__name__: [_encode(x, _remote) for x in v]}
    if t is dict:
        return {"dict": [[_encode(k, _remote), _encode(x, _remote)] for k, x in v.items()]}
    if t is bytes:
        return {"bytes": v.hex()}
    if t is complex:
        return {"complex": [v.real, v.imag]}
    if _remote is not None and t is types.FunctionType and hasattr(v, "_rlpt_remote"):
        return {"ref": v._rlpt_remote}
    raise TypeError(f"a value of type {t.__name__} cannot cross the sandbox boundary")


def _decode(x, _refs=None):
    """The value ``_encode`` made; ValueError for anything else."""
    t = type(x)
    if x is None or t is bool or t is int or t is str or t is float:
        return x
    if t is list:
        return [_decode(v, _refs) for v in x]
    if t is dict and len(x) == 1:
        ((tag, v),) = x.items()
        if tag == "tuple" and type(v) is list:
            return tuple(_decode(e, _refs) for e in v)
        if tag in ("set", "frozenset") and type(v) is list:
            items = [_decode(e, _refs) for e in v]
            return set(items) if tag == "set" else frozenset(items)
        if tag == "dict" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
            return {_decode(k, _refs): _decode(e, _refs) for k, e in v}
        if tag == "bytes" and type(v) is str:
            return bytes.fromhex(v)
        if tag == "complex" and type(v) is list and len(v) == 2:
            return complex(float(v[0]), float(v[1]))
        if tag == "ref" and type(v) is str and _refs is not None and v in _refs:
            return _refs[v]
    raise ValueError("not an encoded plain value")


def _send_msg(fd: int, obj: object) -> None:
    data = json.dumps(obj).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data) :]


def _recv_msg(fd: int) -> object | None:
    """One length-prefixed JSON message; None at end of file; ValueError if malformed."""
    head = _read_exact(fd, 4)
    if head is None:
        return None
    n = struct.unpack(">I", head)[0]
    if n > _MAX_MESSAGE:
        raise ValueError(f"message of {n} bytes")
    body = _read_exact(fd, n)
    if body is None:
        return None
    return json.loads(body)


_send = _send_msg


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


def _close_all_but(keep: set[int]) -> None:
    low = 0
    for fd in sorted(keep):
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)


def _log(msg: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"[rlpt.sandbox worker {os.getpid()}] {msg}\n".encode())


class _Checker:
    """The slot's long-lived checker process and the socket that hands it each run."""

    def __init__(self, pid: int, sock: socket.socket, key: tuple):
        self.pid = pid
        self.sock = sock
        self.key = key  # the limits it was started with


class Worker:
    """The per-slot state: which protections work here, and the run loop."""

    def __init__(self, cfg: dict):
        self.uid = int(cfg["uid"])
        self.checker_uid = int(cfg.get("checker_uid", self.uid + 1))
        self.features: set[str] = set()
        self.netns_per_run = bool(cfg.get("netns_per_run", False))
        self.wanted = set(cfg.get("features", ALL_FEATURES)) | {F_LIBS}
        self.packages = list(cfg.get("packages", ()))
        # "rootless" can be forced to exercise the unprivileged path on a root machine.
        self.rootless = os.geteuid() != 0 or bool(cfg.get("rootless", False))
        self.is_init = False
        self.seccomp: _SeccompFilter | None = None
        # The slot's cgroup: descriptors opened before the host's /sys goes out of sight.
        self.cg_procs: list[int] = []  # non-empty once the worker is in the slot's cgroup
        self.cg_memory: int | None = None
        self.cg_oom: int | None = None
        self.cg_memory_set: int | None = None
        self._cgroup_cfg = cfg.get("cgroup") or {}
        self._seccomp_hex = cfg.get("seccomp_bpf")
        self.checker: _Checker | None = None
        self.own_proc = False

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
        if F_IPC in self.wanted:
            # Once per slot rather than per run: the filter forbids creating IPC objects, so
            # nothing in this namespace outlives a run, and sethostname is forbidden too.
            try:
                _unshare(CLONE_NEWIPC | CLONE_NEWUTS)
            except OSError as e:
                _log(f"no ipc/uts namespace: {e}")
                self.wanted.discard(F_IPC)
        self._open_cgroup()
        if F_SECCOMP in self.wanted:
            # Compiled by the pool (with libseccomp), so that this process, which every run
            # is forked from, maps no more libraries than it must.
            if self._seccomp_hex:
                self.seccomp = _SeccompFilter(bytes.fromhex(self._seccomp_hex))
            else:
                _log("no seccomp filter: the pool could not compile one")
                self.wanted.discard(F_SECCOMP)
        if F_MOUNT in self.wanted:
            # Done once here: every run's mount namespace starts as a copy of this one, so a
            # run only adds its own /tmp.
            try:
                _unshare(CLONE_NEWNS)
                _enter_minimal_root(self.packages, mount_proc=self.is_init)
            except ImportError:
                raise
            except OSError as e:
                _log(f"no minimal root: {e}")
                self.wanted.discard(F_MOUNT)
        self.features = self._probe()
        # Whether /proc lists this PID namespace (the minimal root mounts its own): then the
        # processes of a run can be told from the checker's.
        self.own_proc = self.is_init and os.readlink("/proc/self") == "1"

    def _open_cgroup(self) -> None:
        """Join the slot's cgroup; keep its memory limit and OOM counter open for the runs.

        The worker joins once, so every run is born inside it: moving each run in would cost
        a cgroup migration (milliseconds on cgroup v1) per run. Pages the worker touched
        before joining stay charged where they were, so the limit bounds what the runs add.
        """
        cfg = self._cgroup_cfg
        if not cfg:
            return
        try:
            for path in cfg.get("procs", []):
                with open(path, "w") as f:
                    f.write("0")
            if cfg.get("memory_max"):
                self.cg_memory = os.open(cfg["memory_max"], os.O_WRONLY | os.O_CLOEXEC)
            if cfg.get("oom_events"):
                self.cg_oom = os.open(cfg["oom_events"], os.O_RDONLY | os.O_CLOEXEC)
            self.cg_procs = [1]  # joined
        except OSError as e:
            _log(f"cannot join the slot's cgroup: {e}")
            for fd in (self.cg_memory, self.cg_oom):
                if fd is not None:
                    os.close(fd)
            self.cg_procs, self.cg_memory, self.cg_oom = [], None, None

    def oom_kills(self) -> int | None:
        if self.cg_oom is None:
            return None
        for line in os.pread(self.cg_oom, 4096, 0).decode().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return None

    def set_memory_limit(self, memory_mb: int) -> None:
        """The slot's memory ceiling for this run: all of its processes together."""
        if self.cg_memory is None or memory_mb == self.cg_memory_set:
            return
        with contextlib.suppress(OSError):
            limit = (memory_mb + _CGROUP_HEADROOM_MB) << 20
            os.pwrite(self.cg_memory, str(limit).encode(), 0)
            self.cg_memory_set = memory_mb

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
        got = self.wanted & {F_PID, F_NET, F_MOUNT, F_SECCOMP}
        if self.rootless or F_UID not in self.wanted:
            got.add(F_LIBS)  # runs keep the worker's own uid, which reads the interpreter
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                found = _probe_child(self)
                os.write(w, json.dumps(sorted(found)).encode())
            finally:
                os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 4096):
            data += chunk
        os.close(r)
        self._reap({"probe": pid})
        try:
            found = set(json.loads(data))
        except ValueError:
            found = set()
        if self.netns_per_run and F_NET not in found:
            got.discard(F_NET)
        for f in (F_MOUNT, F_SECCOMP):
            if f not in found:
                got.discard(f)
        return (got | (found & {F_IPC, F_UID, F_LIBS})) & self.wanted

    # -- one run --------------------------------------------------------------------------------

    def _checker_for(self, job: dict) -> _Checker:
        """The slot's checker for limits like ``job``'s, started (again) if need be."""
        key = (int(job["memory_mb"]), int(job["file_size_mb"]), int(job["max_open_files"]))
        if self.checker is not None and self.checker.key != key:
            self.stop_checker()
        if self.checker is None:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            pid = os.fork()
            if pid == 0:
                ours.close()
                try:
                    _checker_main(self, job, theirs)
                finally:
                    os._exit(71)
            theirs.close()
            self.checker = _Checker(pid, ours, key)
        return self.checker

    def stop_checker(self) -> None:
        """Kill the checker; the next run with tests starts a new one."""
        checker, self.checker = self.checker, None
        if checker is None:
            return
        checker.sock.close()
        with contextlib.suppress(OSError):
            os.kill(checker.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(checker.pid, 0)

    def _spawn(self, main, *args) -> int:
        pid = os.fork()
        if pid == 0:
            status_w = args[-1]["status"]
            try:
                main(self, *args)
            except BaseException as e:  # noqa: BLE001 - set-up failed before any user code ran
                with contextlib.suppress(BaseException):
                    os.write(status_w, json.dumps({"error": f"run set-up: {e!r}"}).encode() + b"\n")
            os._exit(71)
        return pid

    def run_one(self, job: dict, stdin: str | None) -> dict:
        """Run the program once with ``stdin`` (and its tests); return raw observations."""
        timeout_s = float(job["timeout_s"])
        out_cap = int(job["output_limit"])
        checked = bool(job.get("tests"))
        checker = self._checker_for(job) if checked else None
        names = ["stdout", "stderr", "ctl", "status"]
        if checked:
            names += ["req", "resp", "verdict"]
        pipes = {name: os.pipe() for name in names}
        if stdin:
            stdin_fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
            data = stdin.encode()
            while data:
                data = data[os.write(stdin_fd, data) :]
            os.lseek(stdin_fd, 0, os.SEEK_SET)
        else:
            stdin_fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        prog = {
            "stdin": stdin_fd,
            "stdout": pipes["stdout"][1],
            "stderr": pipes["stderr"][1],
            "ctl": pipes["ctl"][1],
            "status": pipes["status"][1],
        }
        if checked:
            prog.update(req=pipes["req"][0], resp=pipes["resp"][1])
        self.set_memory_limit(int(job["memory_mb"]))
        if F_MOUNT in self.features:
            self._fresh_tmp()
        oom_before = self.oom_kills()
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        if job.get("deadline") is not None:
            deadline = min(deadline, float(job["deadline"]))
        pids: dict[str, int] = {}
        try:
            pids["program"] = self._spawn(_program_main, job, prog)
            if checker is not None:
                ends = [pipes[n][e] for n, e in (("req", 1), ("resp", 0), ("stdout", 1))]
                ends += [pipes["stderr"][1], pipes["verdict"][1]]
                _send_run(checker.sock, job["tests"], ends)
        except OSError as e:
            if pids:
                self._kill_all(pids)
                self._reap(pids)
            self.stop_checker()
            for r, w in pipes.values():
                os.close(r)
                os.close(w)
            os.close(stdin_fd)
            return {"error": f"run start failed: {e}"}
        os.close(stdin_fd)
        keep_read = {"stdout", "stderr", "ctl", "status", "verdict"}
        for name, (r, w) in pipes.items():
            if name in keep_read:
                os.close(w)
            else:
                os.close(r)
                os.close(w)
        sentinel = _END_MARKER

        readers = {pipes[n][0]: n for n in keep_read if n in pipes}
        bufs = {n: bytearray() for n in readers.values()}
        overflow = {"stdout": False, "stderr": False}
        killed = None
        exited: dict[str, tuple] = {}
        t_end = None
        poller = select.poll()
        for fd in readers:
            poller.register(fd, select.POLLIN)
        pidfds: dict[int, str] = {}
        for role, pid in pids.items():
            with contextlib.suppress(OSError, AttributeError):
                pidfds[os.pidfd_open(pid)] = role
        for fd in pidfds:
            poller.register(fd, select.POLLIN)

        def verdict_done() -> bool:
            # A whole line, or the checker closed the pipe (it died) without one.
            return b"\n" in bufs["verdict"] or pipes["verdict"][0] not in readers

        def finished() -> bool:
            if not checked:
                return "program" in exited
            if not verdict_done():
                return False
            # A decisive verdict ends the run; "the program is gone" waits for its exit status.
            v = _parse_verdict(bufs["verdict"])
            return "program" in exited or (v is not None and v.get("kind") != "gone")

        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                killed = "timeout"
                break
            # Without pidfds, poll in short steps to notice the exits.
            step = left if len(pidfds) == len(pids) else min(left, 0.005)
            for fd, _ in poller.poll(max(1, int(step * 1000) + 1)):
                if fd not in readers:  # a pidfd: the wait below collects the exit
                    continue
                name = readers[fd]
                chunk = os.read(fd, 65536)
                if not chunk:
                    poller.unregister(fd)
                    os.close(fd)
                    del readers[fd]
                    continue
                if not self._take(name, chunk, bufs[name], overflow, out_cap):
                    killed = "output"
            if killed:
                break
            for role, pid in pids.items():
                if role not in exited:
                    got, st, ru = os.wait4(pid, os.WNOHANG)
                    if got == pid:
                        exited[role] = (st, ru)
                        for fd, r in pidfds.items():
                            if r == role:
                                poller.unregister(fd)
                        if role == "program":
                            t_end = time.monotonic()
            if finished():
                break
        if t_end is None:
            t_end = time.monotonic()
        verdict = _parse_verdict(bufs["verdict"]) if checked else None
        if checked and (verdict is None or verdict.get("kind") == "memory"):
            # Cut off, dead or out of memory: the next run gets a fresh checker.
            self.stop_checker()
        self._kill_all(pids)
        # Every process of the run is gone, so the pipes close at once; read what is left.
        drain_until = time.monotonic() + 1.0
        while readers and time.monotonic() < drain_until:
            for fd, _ in poller.poll(50):
                if fd not in readers:
                    continue
                name = readers[fd]
                chunk = os.read(fd, 65536)
                if not chunk:
                    poller.unregister(fd)
                    os.close(fd)
                    del readers[fd]
                    continue
                if not self._take(name, chunk, bufs[name], overflow, out_cap) and not killed:
                    killed = "output"
        for fd in list(readers) + list(pidfds):
            os.close(fd)
        final = self._reap({r: p for r, p in pids.items() if r not in exited})
        exited.update(final)
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
        oom_after = self.oom_kills()
        res = {
            "checked": checked,
            "reached_end": (not checked) and sentinel in bufs["ctl"],
            "verdict": verdict,
            "killed": killed,
            "report": report,
            "oom_killed": oom_before is not None and (oom_after or 0) > oom_before,
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
        if "program" in exited:
            ws, ru = exited["program"]
            res["cpu_s"] = ru.ru_utime + ru.ru_stime
            res["maxrss_kb"] = ru.ru_maxrss
            if os.WIFSIGNALED(ws):
                res["signal"] = os.WTERMSIG(ws)
            elif os.WIFEXITED(ws):
                res["exit_code"] = os.WEXITSTATUS(ws)
        elif not killed:
            res["error"] = "the run's process could not be waited for"
        if verdict is not None and isinstance(verdict.get("cpu_s"), float):
            res["checker_cpu_s"] = verdict["cpu_s"]
        return res

    def _fresh_tmp(self) -> None:
        """A new, empty tmpfs on /tmp for this run; the last run's is unmounted and freed.

        Its processes are all dead by now, so nothing still holds a file of it. Cheaper than
        a mount namespace per run, whose creation and teardown cost more than the run.
        """
        with contextlib.suppress(OSError):
            _check(_libc.umount2(b"/tmp", MNT_DETACH), "umount /tmp")
        _mount_scratch(0 if self.rootless or F_UID not in self.features else self.uid)

    @staticmethod
    def _take(name: str, chunk: bytes, buf: bytearray, overflow: dict, out_cap: int) -> bool:
        """Keep ``chunk``; False when an output stream passes its cap."""
        if name in overflow:
            room = out_cap - len(buf)
            buf += chunk[: max(room, 0)]
            if len(chunk) > room:
                overflow[name] = True
                return False
        elif name == "ctl":
            buf += chunk
            if len(buf) > _MAX_CTL:
                del buf[: len(buf) - _MAX_CTL]
        elif len(buf) < _MAX_CTL:
            buf += chunk
        return True

    def _others(self) -> list[int]:
        """As init: every process of the namespace but this one and the checker."""
        spare = {1} if self.checker is None else {1, self.checker.pid}
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in spare]

    def _kill_all(self, pids: dict[str, int]) -> None:
        """End every process of the run, however it tried to detach."""
        if self.is_init:
            # As PID 1 of our own namespace, whose /proc lists exactly its processes:
            # everything but ourselves and the checker, and nothing outside. The reaping
            # loop kills again whatever a dying process forked after this listing.
            if self.checker is not None and not self.own_proc:
                # /proc is not this namespace's: no way to list the run's processes, so the
                # checker goes with them and the next run starts another.
                self.checker.sock.close()
                self.checker = None
            if self.checker is None:
                with contextlib.suppress(OSError):
                    os.kill(-1, signal.SIGKILL)
                return
            for pid in self._others():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            return
        for pid in pids.values():
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

    def _reap(self, pids: dict[str, int]) -> dict[str, tuple]:
        """Wait for ``pids``, then for every other child; keep the slot uid's count at zero."""
        result = {}
        for role, pid in pids.items():
            while True:
                try:
                    got, st, ru = os.wait4(pid, 0)
                    if got == pid:
                        result[role] = (st, ru)
                    break
                except InterruptedError:
                    continue
                except ChildProcessError:
                    break
        # As init every other process was just SIGKILLed and goes at once (orphans come to us
        # to be reaped); the checker, a child too, lives on. Without a PID namespace a daemon
        # may have escaped the kill, and waiting for it would stall: reap what is dead.
        deadline = time.monotonic() + (5.0 if self.is_init else 0.0)
        while True:
            try:
                got, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if self.checker is not None and got == self.checker.pid:
                self.checker.sock.close()
                self.checker = None
            if got != 0:
                continue
            if not self.is_init or time.monotonic() >= deadline:
                break
            if self.checker is not None:
                others = self._others()
                if not others:
                    break
                for pid in others:  # forked after the kill's listing
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
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
            done = res.get("reached_end") or (res.get("verdict") or {}).get("passed") is True
            if not done or res.get("killed") or res.get("error"):
                break
        return {"runs": runs}


def _parse_verdict(buf: bytearray) -> dict | None:
    """The checker's verdict line, or None if it wrote none (it died, or was killed)."""
    line = bytes(buf).split(b"\n", 1)[0]
    if not bytes(buf).endswith(b"\n") and b"\n" not in buf:
        return None
    try:
        v = json.loads(line)
    except ValueError:
        return None
    return v if isinstance(v, dict) else None


def _probe_child(w: Worker) -> set[str]:
    got = set()
    if F_NET in w.wanted and w.netns_per_run:
        try:
            _unshare(CLONE_NEWNET)
            got.add(F_NET)
        except OSError as e:
            _log(f"no network namespace: {e}")
    if F_IPC in w.wanted:
        got.add(F_IPC)  # unshared by the worker itself
    if F_MOUNT in w.wanted:
        try:
            _unshare(CLONE_NEWNS)
            _mount_scratch(0 if w.rootless else w.uid)
            got.add(F_MOUNT)
        except OSError as e:
            _log(f"no private scratch mount: {e}")
    if F_UID in w.wanted and not w.rootless:
        try:
            _drop_privileges(w.uid)
            got.add(F_UID)
            # Runs are forked from this already-loaded interpreter and never exec it again, so
            # what they must still read is the standard library.
            stdlib = os.path.dirname(os.__file__)
            os.listdir(stdlib)
            os.listdir(os.path.join(stdlib, "encodings"))
            got.add(F_LIBS)
        except OSError as e:
            _log(f"slot uid {w.uid}: {e}")
    if F_SECCOMP in w.wanted and w.seccomp is not None:
        try:
            _prctl(PR_SET_NO_NEW_PRIVS, 1)
            w.seccomp.load()
            try:
                _unshare(CLONE_NEWUTS)
                _log("the seccomp filter let unshare through")
            except OSError:
                got.add(F_SECCOMP)
        except OSError as e:
            _log(f"cannot load the seccomp filter: {e}")
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

    Without this, root of the worker's user namespace could remount the root read-write.
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


_CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp"}


def _confine(w: Worker, job: dict, uid: int, *, cgroup: bool, cpu_limit: bool = True) -> None:
    """Limits, uid, capabilities and the seccomp filter, in the order the kernel requires."""
    mem = int(job["memory_mb"]) << 20
    fsize = int(job["file_size_mb"]) << 20
    nofile = int(job["max_open_files"])
    limits = [
        (resource.RLIMIT_AS, mem, mem),
        (resource.RLIMIT_FSIZE, fsize, fsize),
        (resource.RLIMIT_NOFILE, nofile, nofile),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    if cpu_limit:
        cpu = max(1, math.ceil(float(job["timeout_s"])))
        limits.append((resource.RLIMIT_CPU, cpu, cpu + 1))
    if F_UID in w.features:
        # Counted per uid: meaningful only because each slot runs as its own uids.
        nproc = int(job["max_processes"])
        limits.append((resource.RLIMIT_NPROC, nproc, nproc))
    elif w.rootless and _KERNEL >= (5, 14):
        # Since 5.14 the count is per user namespace, and each slot has its own: the worker,
        # the checker and the program's processes, all uid 0 there.
        nproc = int(job["max_processes"]) + 2
        limits.append((resource.RLIMIT_NPROC, nproc, nproc))
    del cgroup  # born in the slot's cgroup: the worker joined it
    for fd in (w.cg_memory, w.cg_oom):
        if fd is not None:
            os.close(fd)
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if F_UID in w.features:
        _drop_privileges(uid)
    else:
        _drop_capabilities()
    if F_SECCOMP in w.features and w.seccomp is not None:
        w.seccomp.load()


def _program_main(w: Worker, job: dict, fds: dict) -> None:
    """The program's process: its namespaces, limits and uid, then the bootstrap."""
    os.setsid()
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if F_NET in w.features and w.netns_per_run:
        _unshare(CLONE_NEWNET)
    os.dup2(fds["stdin"], 0)
    os.dup2(fds["stdout"], 1)
    os.dup2(fds["stderr"], 2)
    # Random high fds, close-on-exec: not where a program writing to fd 3 would land.
    high = 300 + int.from_bytes(os.urandom(2), "little") % 600
    ctl = os.dup2(fds["ctl"], high, inheritable=False)
    req = resp = None
    if "req" in fds:
        req = os.dup2(fds["req"], high + 1, inheritable=False)
        resp = os.dup2(fds["resp"], high + 2, inheritable=False)
    status_w = fds["status"]
    keep = {0, 1, 2, ctl, status_w}
    keep |= {fd for fd in (req, resp, w.cg_memory, w.cg_oom) if fd is not None}
    _close_all_but(keep)
    os.chdir("/tmp")
    _confine(w, job, w.uid, cgroup=True)
    sys.argv = ["solution.py"]
    # From here on only the program's own failures are reported, never as the sandbox's.
    os.close(status_w)
    _bootstrap(job["code"], ctl, req, resp)


def _bootstrap(code: str, ctl: int, req: int | None, resp: int | None) -> None:
    """Run the program; then serve the checker's calls, or write the end marker."""
    write, exit_ = os.write, os._exit
    memory_report = _MEMORY_REPORT  # bound now: after a MemoryError nothing may allocate
    g = {"__name__": "__main__", "__builtins__": builtins}
    # Tracebacks then show the offending lines, as they would for a file on disk.
    linecache.cache["solution.py"] = (len(code), None, code.splitlines(True), "solution.py")
    phase = "compile"
    try:
        code_obj = compile(code, "solution.py", "exec")
        phase = "code"
        exec(code_obj, g)
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
            _print_exception(e, skip_first=kind != "syntax")
            with contextlib.suppress(BaseException):
                info["msg"] = str(e)[:500]
        del e
        g.clear()
        _flush()
        write(ctl, b"RLPT-REPORT " + json.dumps(info).encode() + b"\n")
        exit_(1 if kind != "exit" or info.get("code") else 0)
    _flush()
    if req is not None and resp is not None:
        _serve(g, req, resp)
    write(ctl, _END_MARKER)
    exit_(0)


def _serve(g: dict, req: int, resp: int) -> None:
    """Answer the checker's requests from the program's globals until it hangs up.

    This loop runs in the program's interpreter and may be subverted like anything there; what
    it sends is only ever taken as plain values, so subverting it gains nothing a function
    returning those values would not.
    """
    while True:
        try:
            msg = _recv_msg(req)
        except (OSError, ValueError):
            msg = None
        if msg is None:
            _flush()
            os._exit(0)
        try:
            reply = _answer(g, msg)
        except MemoryError:
            reply = ["raise", "MemoryError", ""]
        _flush()
        try:
            _send_msg(resp, reply)
        except (OSError, MemoryError, TypeError, ValueError):
            os._exit(1)


def _answer(g: dict, msg: list) -> list:
    if msg[0] == "names":
        return ["names", {n: d for n in msg[1] if n in g and (d := _describe(g[n])) is not None}]
    _, name, args, kwargs = msg
    fn = g.get(name)
    if fn is None:
        return ["raise", "NameError", f"name {name!r} is not defined"]
    args = _decode(args, g)
    kwargs = _decode(kwargs, g)
    try:
        value = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - the checker decides what it means
        _print_exception(e, skip_first=True)
        text = ""
        with contextlib.suppress(BaseException):
            text = str(e)[:500]
        return ["raise", type(e).__name__, text]
    try:
        return ["ok", _encode(value)]
    except (TypeError, ValueError, RecursionError):
        return ["bad", type(value).__name__]


def _describe(v) -> list | None:
    if isinstance(v, types.ModuleType):
        return ["mod", v.__name__]
    if callable(v):
        return ["fn"]
    try:
        return ["val", _encode(v)]
    except (TypeError, ValueError, RecursionError):
        return None


# -- the checker --------------------------------------------------------------------------------


class _ProgramGone(BaseException):
    """The program stopped answering (it exited, crashed or was killed) during the tests.

    A BaseException, so that tests written with ``except Exception`` cannot swallow it.
    """


class _ProgramExited(BaseException):
    """The program raised SystemExit (``exit()``) inside a call."""


class _ProtocolBroken(BaseException):
    """The program sent something other than a well-formed answer."""


class ProgramError(Exception):
    """An exception of a type the checker does not know was raised inside the program."""


_EXCEPTIONS = {
    name: obj
    for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, Exception)
}


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _checker_main(w: Worker, job: dict, sock: socket.socket) -> None:
    """The slot's checker: its own uid and limits, then one run's tests after another.

    It lives as long as the slot (a fresh process per run would cost the fork, the copied
    pages and the exit of a whole interpreter each time), and holds nothing between runs but
    the tests' modules: every run gets fresh globals, fresh pipes to that run's program, and
    its own verdict pipe. The worker replaces it whenever a run ends without its verdict (a
    timeout, a crash, a kill) or with a MemoryError.
    """
    os.setsid()
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    keep = {0, 1, 2, null, sock.fileno()}
    _close_all_but(keep | {fd for fd in (w.cg_memory, w.cg_oom) if fd is not None})
    os.chdir("/")
    # No CPU limit: it would add up over runs; the worker's wall-clock deadline bounds each.
    _confine(w, job, w.checker_uid, cgroup=False, cpu_limit=False)
    # After the uid change, which resets it: no process of the same uid may attach to this one
    # or read its memory or descriptors through /proc.
    _prctl(PR_SET_DUMPABLE, 0)
    sys.argv = ["tests.py"]
    while True:
        got = _recv_run(sock)
        if got is None:
            os._exit(0)
        tests, (req, resp, stdout, stderr, verdict_fd) = got
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.close(stdout)
        os.close(stderr)
        cpu0 = time.process_time()
        verdict = _check_tests(tests, req, resp)
        _flush()
        verdict["cpu_s"] = time.process_time() - cpu0
        for fd in (req, resp):
            os.close(fd)
        # The program's output pipes must close with the run: only the worker reads them.
        os.dup2(null, 1)
        os.dup2(null, 2)
        try:
            os.write(verdict_fd, json.dumps(verdict).encode() + b"\n")
        finally:
            os.close(verdict_fd)
        if verdict.get("kind") == "memory":
            os._exit(0)  # start the next run from a clean heap


def _recv_run(sock: socket.socket) -> tuple[str, list[int]] | None:
    """One run's tests and its five descriptors from the worker; None when the worker is gone."""
    try:
        head, fds, _, _ = socket.recv_fds(sock, 4, 5)
    except OSError:
        return None
    if len(head) < 4 or len(fds) != 5:
        for fd in fds:
            os.close(fd)
        return None
    n = struct.unpack(">I", head)[0]
    body = bytearray()
    while len(body) < n:
        chunk = sock.recv(min(n - len(body), 1 << 20))
        if not chunk:
            return None
        body += chunk
    return body.decode(), fds


def _send_run(sock: socket.socket, tests: str, fds: list[int]) -> None:
    data = tests.encode()
    socket.send_fds(sock, [struct.pack(">I", len(data))], fds)
    sock.sendall(data)


def _check_tests(tests: str, req: int, resp: int) -> dict:
    """Run ``tests`` against the program's functions; return the one verdict."""
    state = {"gone": False, "broken": False}

    def decided(obj: dict) -> dict:
        # Once the program broke the protocol or went away, no verdict of the tests stands:
        # they may have caught what that raised.
        if state["broken"]:
            return {"kind": "protocol", "phase": "tests"}
        if state["gone"]:
            return {"kind": "gone", "phase": "tests"}
        return obj

    def exchange(msg: list) -> list:
        if state["gone"]:
            raise _ProgramGone
        if state["broken"]:
            raise _ProtocolBroken
        try:
            _send_msg(req, msg)
            reply = _recv_msg(resp)
        except OSError:
            reply = None
        except (ValueError, RecursionError) as e:
            state["broken"] = True
            raise _ProtocolBroken from e
        if reply is None:
            state["gone"] = True
            raise _ProgramGone
        if type(reply) is not list or not reply:
            state["broken"] = True
            raise _ProtocolBroken
        return reply

    def call(name: str, args: tuple, kwargs: dict):
        msg = ["call", name, _encode(list(args), _remote=True), _encode(kwargs, _remote=True)]
        reply = exchange(msg)
        try:
            if reply[0] == "ok" and len(reply) == 2:
                return _decode(reply[1])
            if reply[0] == "raise" and len(reply) == 3:
                exc, text = str(reply[1]), str(reply[2])
            elif reply[0] == "bad" and len(reply) == 2:
                exc, text = "bad", str(reply[1])
            else:
                raise ValueError(reply[0])
        except (ValueError, TypeError, RecursionError, MemoryError) as e:
            if isinstance(e, MemoryError):
                raise
            state["broken"] = True
            raise _ProtocolBroken from e
        if exc == "bad":
            raise TypeError(
                f"{name}() returned a value of type {text}, which cannot cross the sandbox "
                "boundary: only None, bool, int, float, complex, str, bytes, and lists, tuples, "
                "sets, frozensets and dicts of them"
            )
        if exc == "SystemExit":
            raise _ProgramExited
        cls = _EXCEPTIONS.get(exc)
        raise cls(text) if cls is not None else ProgramError(f"{exc}: {text}")

    def remote(name: str):
        def fn(*args, **kwargs):
            return call(name, args, kwargs)

        fn.__name__ = fn.__qualname__ = name
        fn._rlpt_remote = name
        return fn

    linecache.cache["tests.py"] = (len(tests), None, tests.splitlines(True), "tests.py")
    try:
        code = compile(tests, "tests.py", "exec")
    except (SyntaxError, ValueError) as e:
        return decided({"kind": "tests_invalid", "msg": str(e)[:500], "phase": "tests"})
    # Only names the tests use and do not find among the builtins come from the program: a
    # program's global ``len`` or ``abs`` must not replace the checker's own.
    wanted = sorted(
        n
        for n in _code_names(code)
        if not (n.startswith("__") and n.endswith("__")) and not hasattr(builtins, n)
    )
    g: dict = {"__name__": "__main__", "__builtins__": builtins}
    try:
        reply = exchange(["names", wanted])
        if reply[0] != "names" or type(reply[1]) is not dict:
            state["broken"] = True
            raise _ProtocolBroken
        for name, desc in reply[1].items():
            if name not in wanted or type(desc) is not list or not desc:
                continue
            if desc[0] == "fn":
                g[name] = remote(name)
            elif desc[0] == "val" and len(desc) == 2:
                g[name] = _decode(desc[1])
            elif desc[0] == "mod" and len(desc) == 2 and type(desc[1]) is str:
                with contextlib.suppress(Exception):
                    g[name] = importlib.import_module(desc[1])
    except (_ProgramGone, _ProtocolBroken):
        return decided({"kind": "gone"})
    except (ValueError, TypeError):
        state["broken"] = True
        return decided({"kind": "protocol"})
    try:
        exec(code, g)
    except _ProgramGone:
        return decided({"kind": "gone"})
    except _ProgramExited:
        return decided({"kind": "exit", "exc": "SystemExit", "code": 0, "phase": "tests"})
    except _ProtocolBroken:
        return decided({"kind": "protocol"})
    except MemoryError:
        return decided({"kind": "memory", "exc": "MemoryError", "phase": "tests"})
    except BaseException as e:  # noqa: BLE001 - every exception is an outcome to report
        kind = "exception"
        if isinstance(e, AssertionError):
            kind = "assert"
        elif isinstance(e, SystemExit):
            kind = "exit"
        info = {"phase": "tests", "exc": type(e).__name__, "kind": kind}
        if kind == "exit":
            info["code"] = e.code if isinstance(e.code, int | None) else 1
        _print_exception(e, skip_first=True)
        with contextlib.suppress(BaseException):
            info["msg"] = str(e)[:500]
        return decided(info)
    finally:
        g.clear()
    return decided({"passed": True})


def _print_exception(e: BaseException, skip_first: bool) -> None:
    try:
        # Without the bootstrap's own frame, as Python would print it.
        tb = e.__traceback__.tb_next if skip_first and e.__traceback__ else e.__traceback__
        traceback.print_exception(type(e), e, tb)
    except BaseException:  # noqa: BLE001
        pass


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()


def _print_err(text: str) -> None:
    with contextlib.suppress(BaseException):
        print(text, file=sys.stderr)


_WARM_UP_PROGRAM = """
def f(x, *args, **kwargs):
    return [x, args, kwargs, {x: str(x)}, (x, 1.5, None, True, b"x")]
print(f(1), f"{f(2)!r}", file=out)
try:
    assert f(3) == 0, "no"
except AssertionError as e:
    print(repr(e), file=out)
"""


def _warm_up() -> None:
    """Run the paths every program takes once here, before any fork.

    CPython builds some of its state on first use in each process: the first ``compile()``
    creates the AST types (about a millisecond, more than a whole trivial run otherwise costs),
    and a forked child would pay that again for every run. Done once in the worker, the
    children inherit it. The code is our own, run before any request is read.
    """
    import io

    out = io.StringIO()
    code = compile(_WARM_UP_PROGRAM, "warm_up.py", "exec")
    exec(code, {"__name__": "__warm_up__", "__builtins__": builtins, "out": out})
    try:
        exec(compile("1 / 0", "warm_up.py", "exec"), {})
    except ZeroDivisionError as e:
        traceback.print_exception(type(e), e, e.__traceback__, file=out)
    _decode(json.loads(json.dumps(_encode([1, 2.5, "s", b"b", (1,), {1: {2}}, None]))))
    # Binds the libc symbol and the ctypes conversions a run's set-up calls.
    _libc.prctl(PR_GET_DUMPABLE, ctypes.c_ulong(0), 0, 0, 0)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    worker = Worker(cfg)
    try:
        worker.setup()
    except ImportError as e:
        _send(1, {"ready": False, "error": str(e)})
        os._exit(1)
    # Set here rather than in each run: the runs inherit it, and changing ``os.environ`` in
    # a forked child runs enough Python to copy a hundred pages.
    os.environ.clear()
    os.environ.update({**_CLEAN_ENV, "LANG": "C.UTF-8"})
    _warm_up()
    # Everything loaded so far stays out of the collector's sight, so neither the worker nor a
    # forked run writes to those pages (copy-on-write faults) when collecting garbage.
    gc.freeze()
    # Without root there is one uid to run as: the user namespace stands in for the per-slot
    # uids (its own process count, its own uid 0 without capabilities).
    missing = [
        f
        for f in ALL_FEATURES
        if f not in worker.features and not (worker.rootless and f in (F_UID, F_LIBS))
    ]
    _send(
        1,
        {
            "ready": True,
            "pid": os.getpid(),
            "missing": missing,
            "rootless": worker.rootless,
            "cgroup": bool(worker.cg_procs),
        },
    )
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
            # Whatever that run left behind must not meet the next one, the checker included.
            worker.stop_checker()
            if worker.is_init:
                with contextlib.suppress(OSError):
                    os.kill(-1, signal.SIGKILL)
                worker._reap({})
        _send(1, reply)


if __name__ == "__main__":
    main()
