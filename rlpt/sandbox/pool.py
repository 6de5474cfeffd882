"""A pool of isolated code-execution workers for rewards and evaluation.

``SandboxPool`` starts ``workers`` long-lived interpreters running ``_worker.py`` as fresh
processes (``subprocess``, fork+exec), so it is safe to use from a process that has already
imported JAX: nothing that holds JAX's threads is ever forked. Each worker forks one isolated
child per run (see ``_worker`` for the process tree and the pass sentinel). One dispatcher
thread per worker feeds it from a shared queue, so concurrency is bounded by ``workers``.

Each worker slot runs programs as its own uid (a random base per pool plus the slot index), so
limits that count per user (``RLIMIT_NPROC``) never let one run's fork bomb starve a neighbour,
and two pools on one machine do not share uids.

Judging: a run passes only when execution falls off the end of ``tests`` (or of ``code`` when
there are none) and, with ``io_cases``, every case's stdout matches, compared here in the
parent. Any ``SystemExit`` counts as stopping early, so test code must not call ``exit``
(``unittest.main(exit=False)``, not ``unittest.main()``). Precedence when several causes
apply: sandbox failure, output cap, wall-clock timeout, pass, memory, CPU time, syntax,
assertion, early exit, other errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import queue
import secrets
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from rlpt.sandbox._seccomp import seccomp_program
from rlpt.sandbox.types import ExecutionRequest, ExecutionResult, IOCase, Status

log = logging.getLogger(__name__)

_WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
# Only what an interpreter needs: nothing from the caller's environment reaches a run.
_WORKER_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
_START_TIMEOUT_S = 30.0
# Beyond a run's own limit, time allowed for fork, namespace set-up and teardown.
_SLACK_S = 5.0
_TRACE_TEXT_CHARS = 4000


class _WorkerDied(RuntimeError):
    pass


class IsolationUnavailable(RuntimeError):
    """The machine cannot give programs the isolation the pool was asked to require."""


def _own_cgroup_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under ``""`` for the v2 hierarchy."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _cgroup_mounts() -> dict[str, str]:
    """Mount point per v1 controller (``memory``, ``pids``), and under ``""`` for cgroup2."""
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            point = left.split()[4]
            fstype, _, options = right.split()[:3]
            if fstype == "cgroup2":
                out.setdefault("", point)
            elif fstype == "cgroup":
                for opt in options.split(","):
                    if opt in ("memory", "pids"):
                        out.setdefault(opt, point)
    return out


class _SlotCgroup:
    """One slot's cgroup: memory and process count for all the processes of its runs together.

    cgroup v2 when this process's cgroup delegates the memory and pids controllers, else the
    v1 memory and pids hierarchies; None (and rlimits alone) when neither is writable.
    """

    def __init__(self, kind: str, dirs: list[str], worker_cfg: dict[str, Any]):
        self.kind, self.dirs, self.worker_cfg = kind, dirs, worker_cfg

    @classmethod
    def create(cls, name: str, max_processes: int) -> _SlotCgroup | None:
        try:
            mounts, own = _cgroup_mounts(), _own_cgroup_paths()
        except OSError:
            return None
        made: list[str] = []
        try:
            if "" in mounts and "" in own:
                parent = os.path.join(mounts[""], own[""].lstrip("/"))
                with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                    enabled = f.read().split()
                if {"memory", "pids"} <= set(enabled):
                    d = os.path.join(parent, name)
                    os.mkdir(d)
                    made.append(d)
                    _write(os.path.join(d, "pids.max"), str(max_processes))
                    with contextlib.suppress(OSError):
                        _write(os.path.join(d, "memory.swap.max"), "0")
                    cfg = {
                        "procs": [os.path.join(d, "cgroup.procs")],
                        "memory_max": os.path.join(d, "memory.max"),
                        "oom_events": os.path.join(d, "memory.events"),
                    }
                    return cls("cgroup v2", made, cfg)
            if "memory" in mounts and "pids" in mounts:
                mem = os.path.join(mounts["memory"], own.get("memory", "/").lstrip("/"), name)
                pids = os.path.join(mounts["pids"], own.get("pids", "/").lstrip("/"), name)
                for d in (mem, pids):
                    os.mkdir(d)
                    made.append(d)
                _write(os.path.join(pids, "pids.max"), str(max_processes))
                cfg = {
                    "procs": [
                        os.path.join(mem, "cgroup.procs"),
                        os.path.join(pids, "cgroup.procs"),
                    ],
                    "memory_max": os.path.join(mem, "memory.limit_in_bytes"),
                    "oom_events": os.path.join(mem, "memory.oom_control"),
                }
                return cls("cgroup v1", made, cfg)
        except OSError as e:
            log.debug("no slot cgroup: %s", e)
        for d in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(d)
        return None

    def remove(self) -> None:
        for d in reversed(self.dirs):
            with contextlib.suppress(OSError):
                os.rmdir(d)


def _seccomp_hex() -> str | None:
    """The filter for the workers, or None (and the worker reports it missing)."""
    try:
        return seccomp_program().hex()
    except Exception as e:  # noqa: BLE001 - pyseccomp or the system's libseccomp missing
        log.warning("cannot compile the seccomp filter: %r", e)
        return None


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _check_ceiling(name: str, value: Any, integer: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok or not math.isfinite(value) or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise ValueError(f"{name} must be {kind}, got {value!r}")


class _Slot:
    """One worker process and the pipes to it; used by exactly one dispatcher thread."""

    def __init__(
        self,
        index: int,
        uid: int,
        features: Sequence[str] | None,
        options: Mapping[str, Any] | None = None,
        cgroup: _SlotCgroup | None = None,
    ):
        self.index = index
        self.uid = uid
        self.features = features
        self.options = dict(options or {})
        self.cgroup = cgroup
        self.proc: subprocess.Popen | None = None
        self.missing: list[str] = []
        self.rootless = False
        self.has_cgroup = False

    def spawn(self) -> None:
        cfg: dict[str, Any] = {**self.options, "uid": self.uid, "checker_uid": self.uid + 1}
        cfg["seccomp_bpf"] = _seccomp_hex()
        if self.cgroup is not None:
            cfg["cgroup"] = self.cgroup.worker_cfg
        if self.features is not None:
            cfg["features"] = list(self.features)
        self.proc = subprocess.Popen(
            [sys.executable, "-I", _WORKER_PATH, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_WORKER_ENV,
            close_fds=True,
            start_new_session=True,
        )

    def wait_ready(self) -> None:
        msg = self._recv(time.monotonic() + _START_TIMEOUT_S)
        if not msg.get("ready"):
            raise _WorkerDied(f"worker {self.index} did not start: {msg.get('error', msg)}")
        self.missing = list(msg.get("missing", []))
        self.rootless = bool(msg.get("rootless"))
        self.has_cgroup = bool(msg.get("cgroup"))

    def start(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.spawn()
        self.wait_ready()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def call(self, job: dict, deadline: float) -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        data = json.dumps(job).encode()
        try:
            self.proc.stdin.write(struct.pack(">I", len(data)) + data)
            self.proc.stdin.flush()
        except OSError as e:
            raise _WorkerDied(f"worker {self.index} is gone: {e}") from e
        return self._recv(deadline)

    def _recv(self, deadline: float) -> dict:
        head = self._read(4, deadline)
        return json.loads(self._read(struct.unpack(">I", head)[0], deadline))

    def _read(self, n: int, deadline: float) -> bytes:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        parts, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _WorkerDied(f"worker {self.index} did not answer in time")
            chunk = os.read(fd, n - got)
            if not chunk:
                raise _WorkerDied(f"worker {self.index} exited (code {self.proc.poll()})")
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def stop(self, grace_s: float = 1.0) -> None:
        """Close stdin (an idle worker exits), then kill; its runs die with it.

        The Popen object stays in place: a dispatcher thread still reading from it sees EOF.
        """
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            # The worker's relay leads its own process group; the worker is PID 1 of the
            # namespace that holds its runs, so they all end with it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()


class _Batch:
    """Results of one submission, collected by index; cancelled when abandoned or late."""

    def __init__(self, n: int, deadline: float | None):
        self.deadline = deadline
        self.results: queue.Queue = queue.Queue()
        self.n = n
        self.lock = threading.Lock()
        self.cancelled = False  # set at the deadline or when the consumer goes away
        self.started: set[int] = set()
        self.done: set[int] = set()


class SandboxPool:
    """Run untrusted programs in isolated children of long-lived worker interpreters.

    Args:
      workers: number of worker processes, i.e. of programs running at once.
      timeout_s: ceiling on the wall-clock time of a run (CPU time is capped at
        ceil(timeout_s)); a request may ask for less, never more.
      memory_mb: ceiling on a run's memory: the address space of each process and, where a
        slot cgroup is available, all of the run's processes together; a request may ask for
        less, never more.
      output_limit_bytes: cap on each of stdout and stderr; passing it ends the run.
      trace_path: if set, every finished request is appended to this JSONL file.
      file_size_mb: largest file a run may write (in its private /tmp).
      max_processes: processes and threads a run may have (per slot, all together).
      max_open_files: open file descriptors a run may have.
      require_isolation: raise ``IsolationUnavailable`` when a protection is unavailable
        (the default); False runs without it, with a warning.
      packages: import names of installed packages that programs may import (e.g.
        ``("numpy",)``); the standard library is always there, nothing else is.
      features: restrict the protections tried (testing the degraded path); None tries all.
      worker_options: extra worker settings, for tests: ``{"rootless": True}`` takes the
        unprivileged (user-namespace) path even as root.
    """

    def __init__(
        self,
        workers: int = 4,
        timeout_s: float = 2.0,
        memory_mb: int = 256,
        output_limit_bytes: int = 64_000,
        trace_path: str | None = None,
        *,
        file_size_mb: int = 16,
        max_processes: int = 32,
        max_open_files: int = 64,
        require_isolation: bool = True,
        packages: Sequence[str] = (),
        features: Sequence[str] | None = None,
        worker_options: Mapping[str, Any] | None = None,
    ):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        _check_ceiling("timeout_s", timeout_s)
        _check_ceiling("memory_mb", memory_mb, integer=True)
        for name, value in (
            ("output_limit_bytes", output_limit_bytes),
            ("file_size_mb", file_size_mb),
            ("max_processes", max_processes),
            ("max_open_files", max_open_files),
        ):
            _check_ceiling(name, value, integer=True)
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.output_limit_bytes = int(output_limit_bytes)
        self.trace_path = trace_path
        self._limits = {
            "file_size_mb": int(file_size_mb),
            "max_processes": int(max_processes),
            "max_open_files": int(max_open_files),
        }
        self._trace_lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        # Two uids per slot: the program's and its checker's.
        uid_base = 100_000 + secrets.randbelow(1 << 20) * 64
        tag = f"rlpt-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        options = dict(worker_options or {})
        options["packages"] = list(packages)
        self._slots = []
        for i in range(workers):
            cgroup = None
            if features is None or "slot cgroup" in features:
                # The worker and the checker live in the slot's cgroup beside the program.
                cgroup = _SlotCgroup.create(f"{tag}-{i}", int(max_processes) + 2)
            self._slots.append(_Slot(i, uid_base + 2 * i, features, options, cgroup))
        try:
            for slot in self._slots:
                slot.spawn()
            for slot in self._slots:
                slot.wait_ready()
        except BaseException:
            for slot in self._slots:
                slot.stop(grace_s=0.1)
                if slot.cgroup is not None:
                    slot.cgroup.remove()
            raise
        missing = sorted({m for s in self._slots for m in s.missing})
        self.isolation = "full" if not missing else "missing: " + ", ".join(missing)
        self.rootless = any(s.rootless for s in self._slots)
        kinds = {s.cgroup.kind if s.cgroup and s.has_cgroup else None for s in self._slots}
        if len(kinds) == 1 and None not in kinds:
            self.aggregate_limits = kinds.pop()
        else:
            self.aggregate_limits = (
                "rlimits (per user namespace)" if self.rootless else ("rlimits (per slot uid)")
            )
        if missing:
            msg = (
                f"SandboxPool runs WITHOUT full isolation; missing: {', '.join(missing)}. "
                "Programs may reach what these protections would have hidden."
            )
            if require_isolation:
                self.close()
                raise IsolationUnavailable(msg)
            log.warning(msg)
        self._threads = [
            threading.Thread(
                target=self._dispatch, args=(slot,), daemon=True, name=f"sandbox-slot-{slot.index}"
            )
            for slot in self._slots
        ]
        for t in self._threads:
            t.start()

    # -- public API ---------------------------------------------------------------------------

    def run_batch(
        self,
        requests: Sequence[ExecutionRequest],
        deadline_s: float | None = None,
        metadata: Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]] | None = None,
    ) -> list[ExecutionResult]:
        """Run all ``requests``; results come back in the same order."""
        out: list[ExecutionResult | None] = [None] * len(requests)
        for index, res in self._submit(requests, deadline_s, metadata):
            out[index] = res
        return out  # type: ignore[return-value]

    def as_completed(
        self,
        requests: Sequence[ExecutionRequest],
        deadline_s: float | None = None,
        metadata: Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Iterator[ExecutionResult]:
        """Yield results as runs finish (``details["index"]`` is the request's position).

        ``deadline_s`` bounds the whole batch: runs still queued then come back as
        ``timeout`` at once, and running ones are cut at the deadline by their worker.
        ``metadata`` (one mapping per request, or a mapping keyed by request id) is only
        written to the trace log, e.g. ``task_id``, ``domain``, ``prompt``, ``completion``.
        """
        return (res for _, res in self._submit(requests, deadline_s, metadata))

    def close(self) -> None:
        """Stop every worker; no process started by the pool survives this call."""
        if self._closed:
            return
        self._closed = True
        for _ in self._slots:
            self._jobs.put(None)
        # Stopping the workers first cuts short the runs the dispatchers are waiting on.
        for slot in self._slots:
            slot.stop(grace_s=0.2)
        for t in getattr(self, "_threads", []):
            t.join(timeout=30.0)
        for slot in self._slots:
            slot.stop(grace_s=0.2)  # again: a dispatcher may have restarted one meanwhile
            if slot.proc is not None and slot.proc.stdout is not None:
                slot.proc.stdout.close()
            if slot.cgroup is not None:
                slot.cgroup.remove()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # At interpreter shutdown the modules close() needs may already be gone.
        with contextlib.suppress(Exception):
            self.close()

    # -- internals ----------------------------------------------------------------------------

    def _submit(self, requests, deadline_s, metadata) -> Iterator[tuple[int, ExecutionResult]]:
        """Queue the batch now and return the iterator over its results."""
        if self._closed:
            raise RuntimeError("SandboxPool is closed")
        requests = list(requests)
        deadline = None if deadline_s is None else time.monotonic() + float(deadline_s)
        batch = _Batch(len(requests), deadline)
        metas = _metadata_list(requests, metadata)
        for i, req in enumerate(requests):
            self._jobs.put((batch, i, req))
        return self._collect(batch, requests, metas)

    def _collect(self, batch: _Batch, requests, metas) -> Iterator[tuple[int, ExecutionResult]]:
        try:
            while len(batch.done) < batch.n:
                try:
                    left = None
                    if batch.deadline is not None and not batch.cancelled:
                        left = max(0.0, batch.deadline - time.monotonic())
                    index, res = batch.results.get(timeout=left)
                    ready = [(index, res)]
                except queue.Empty:
                    # Deadline: what has not started is a timeout now; what is running is cut
                    # by its worker at the same deadline and arrives in a moment.
                    ready = []
                    with batch.lock:
                        batch.cancelled = True
                        for i, req in enumerate(requests):
                            if i not in batch.started and i not in batch.done:
                                ready.append((i, self._late(req)))
                for index, res in ready:
                    if index in batch.done:
                        continue
                    batch.done.add(index)
                    res.details["index"] = index
                    if self.trace_path:
                        self._trace(requests[index], res, metas[index])
                    yield index, res
        finally:
            # An abandoned iterator must not keep the workers busy.
            with batch.lock:
                batch.cancelled = True

    def _late(self, req: ExecutionRequest) -> ExecutionResult:
        return ExecutionResult(
            id=req.id,
            status=Status.TIMEOUT,
            isolation=self.isolation,
            details={"reason": "batch deadline passed before the run"},
        )

    def _dispatch(self, slot: _Slot) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            batch, index, req = item
            with batch.lock:
                if batch.cancelled:
                    continue  # already answered as a timeout, or nobody is listening
                batch.started.add(index)
            try:
                res = self._run_on(slot, batch, req)
            except Exception as e:  # noqa: BLE001 - a dispatcher must never die
                log.exception("sandbox dispatcher failed")
                res = self._sandbox_error(req, f"{type(e).__name__}: {e}")
            batch.results.put((index, res))

    def _run_on(self, slot: _Slot, batch: _Batch, req: ExecutionRequest) -> ExecutionResult:
        now = time.monotonic()
        if batch.deadline is not None and now >= batch.deadline:
            return self._late(req)
        # The pool's limits are ceilings: a request may ask for less, never more.
        timeout_s = self.timeout_s if req.timeout_s is None else min(req.timeout_s, self.timeout_s)
        memory_mb = self.memory_mb if req.memory_mb is None else min(req.memory_mb, self.memory_mb)
        job = {
            "code": req.code,
            "tests": req.tests,
            "stdins": [c.stdin for c in req.io_cases] or None,
            "timeout_s": float(timeout_s),
            "deadline": batch.deadline,
            "memory_mb": int(memory_mb),
            "output_limit": self.output_limit_bytes,
            **self._limits,
        }
        n_runs = max(1, len(req.io_cases))
        call_deadline = now + n_runs * (timeout_s + _SLACK_S)
        if batch.deadline is not None:
            call_deadline = min(call_deadline, batch.deadline + _SLACK_S)
        if self._closed:
            return self._sandbox_error(req, "the pool was closed before the run")
        if not slot.alive():
            log.warning("sandbox worker %d died; starting a new one", slot.index)
            slot.stop(grace_s=0.1)
            slot.start()
        try:
            reply = slot.call(job, call_deadline)
        except _WorkerDied as e:
            if self._closed:
                return self._sandbox_error(req, "the pool was closed during the run")
            log.warning("sandbox worker %d failed (%s); replacing it", slot.index, e)
            slot.stop(grace_s=0.1)
            try:
                slot.start()
            except Exception as e2:  # noqa: BLE001
                log.error("could not restart sandbox worker %d: %s", slot.index, e2)
            return self._sandbox_error(req, str(e))
        if "error" in reply:
            return self._sandbox_error(req, reply["error"])
        res = _judge(req, reply["runs"], self.isolation, timeout_s)
        res.details["limits"] = {"timeout_s": float(timeout_s), "memory_mb": int(memory_mb)}
        return res

    def _sandbox_error(self, req: ExecutionRequest, why: str) -> ExecutionResult:
        return ExecutionResult(
            id=req.id,
            status=Status.SANDBOX_ERROR,
            isolation=self.isolation,
            details={"reason": why},
        )

    def _trace(self, req: ExecutionRequest, res: ExecutionResult, meta: Mapping[str, Any]):
        record = {
            "task_id": meta.get("task_id", req.id),
            "domain": meta.get("domain"),
            "prompt": meta.get("prompt"),
            "completion": meta.get("completion"),
            "program": req.code,
            "tests": req.tests,
            "io_cases": [dataclasses.asdict(c) for c in req.io_cases] or None,
            "outcome": res.status.value,
            "exception": res.exception,
            "exit_code": res.exit_code,
            "signal": res.signal,
            "stdout": res.stdout[:_TRACE_TEXT_CHARS],
            "stderr": res.stderr[:_TRACE_TEXT_CHARS],
            "duration_s": res.duration_s,
            "peak_memory_mb": res.peak_memory_mb,
            "isolation": res.isolation,
            "time": time.time(),
        }
        extra = {k: v for k, v in meta.items() if k not in record}
        record.update(extra)
        line = json.dumps(record, default=str) + "\n"
        with self._trace_lock, open(self.trace_path, "a", encoding="utf-8") as f:
            f.write(line)


def _metadata_list(requests: Sequence[ExecutionRequest], metadata) -> list[Mapping[str, Any]]:
    if metadata is None:
        return [{} for _ in requests]
    if isinstance(metadata, Mapping):
        return [metadata.get(r.id, {}) for r in requests]
    metadata = list(metadata)
    if len(metadata) != len(requests):
        raise ValueError(f"{len(metadata)} metadata entries for {len(requests)} requests")
    return metadata


def outputs_match(actual: str, expected: str, match: str = "whitespace") -> bool:
    """Competitive-programming comparison: exact bytes, or whitespace-separated tokens."""
    if match == "exact":
        return actual == expected
    if match == "whitespace":
        return actual.split() == expected.split()
    raise ValueError(f"unknown match mode {match!r}")


def _classify(run: dict, timeout_s: float) -> tuple[Status, dict[str, Any]]:
    """Status of one raw run; the order encodes which cause wins when several apply."""
    report = run.get("report") or {}
    kind = report.get("kind")
    info: dict[str, Any] = {}
    if run.get("error"):
        return Status.SANDBOX_ERROR, {"reason": run["error"]}
    if run.get("killed") == "output" or run.get("stdout_overflow") or run.get("stderr_overflow"):
        return Status.OUTPUT_LIMIT, info
    if run.get("killed") == "timeout":
        return Status.TIMEOUT, {"reason": "wall-clock"}
    if run.get("oom_killed"):
        # A process of the run was killed for the slot's memory: the budget is the run's, so
        # finishing anyway is no pass.
        return Status.MEMORY_LIMIT, {"reason": "the slot's memory limit"}
    if run.get("checked"):
        # With tests, only the checker's verdict can pass a run: nothing the program reports
        # about itself (its exit status, its control pipe) is read as a pass.
        verdict = run.get("verdict") or {}
        if verdict.get("passed") is True:
            return Status.PASSED, info
        decided = _classify_verdict(verdict)
        if decided is not None:
            return decided
    elif run.get("reached_end"):
        return Status.PASSED, info
    sig = run.get("signal")
    # A MemoryError can also strike while the bootstrap reports, leaving only the traceback.
    if kind == "memory" or (not kind and "MemoryError" in (run.get("stderr") or "")[-2000:]):
        return Status.MEMORY_LIMIT, info
    cpu_s = run.get("cpu_s") or 0.0
    if sig == 24 or (sig == 9 and cpu_s >= max(1.0, timeout_s) - 0.05):  # SIGXCPU / SIGKILL
        return Status.TIMEOUT, {"reason": "cpu time"}
    if kind == "syntax":
        return Status.SYNTAX_ERROR, info
    if kind == "assert":
        return Status.FAILED, {"reason": "assertion failed"}
    if kind == "exit":
        if not report.get("code"):
            return Status.FAILED, {"reason": "exited before the end"}
        return Status.RUNTIME_ERROR, {"reason": f"exit status {report.get('code')}"}
    if kind == "exception":
        return Status.RUNTIME_ERROR, {"reason": "uncaught exception"}
    if sig is not None:
        return Status.RUNTIME_ERROR, {"reason": f"killed by signal {sig}"}
    if run.get("exit_code") == 0:
        return Status.FAILED, {"reason": "exited before the end"}
    return Status.RUNTIME_ERROR, {"reason": f"exit status {run.get('exit_code')}"}


def _classify_verdict(verdict: Mapping[str, Any]) -> tuple[Status, dict[str, Any]] | None:
    """Status from the checker's verdict; None when it leaves the program's own exit to tell."""
    kind = verdict.get("kind")
    if kind == "assert":
        return Status.FAILED, {"reason": "assertion failed"}
    if kind == "memory":
        return Status.MEMORY_LIMIT, {}
    if kind == "exit":
        return Status.FAILED, {"reason": "exited before the end of the tests"}
    if kind == "exception":
        return Status.RUNTIME_ERROR, {"reason": "uncaught exception"}
    if kind == "protocol":
        return Status.FAILED, {"reason": "the program broke the test protocol"}
    if kind == "tests_invalid":
        return Status.SANDBOX_ERROR, {"reason": "the tests do not compile"}
    return None


def _judge(
    req: ExecutionRequest, runs: list[dict], isolation: str, timeout_s: float
) -> ExecutionResult:
    """Fold the raw runs of one request (one per IO case) into one result."""
    cases: Iterable[IOCase | None] = req.io_cases or [None]
    status, info, last = Status.PASSED, {}, runs[-1]
    for case, run in zip(cases, runs):
        last = run
        status, info = _classify(run, timeout_s)
        if (
            status == Status.PASSED
            and case is not None
            and not outputs_match(run.get("stdout", ""), case.expected_stdout, case.match)
        ):
            status, info = Status.FAILED, {"reason": "wrong answer"}
        if status != Status.PASSED:
            break
    if status == Status.PASSED and len(runs) < len(req.io_cases):
        status, info = Status.SANDBOX_ERROR, {"reason": "runs missing from the worker's reply"}
    report = last.get("report") or {}
    verdict = last.get("verdict") or {}
    if verdict.get("kind") not in (None, "gone"):
        report = verdict  # the tests' failure, seen by the checker
    details = dict(info)
    if req.io_cases:
        details["cases_run"] = len(runs)
        details["cases_total"] = len(req.io_cases)
    if report.get("msg"):
        details["message"] = report["msg"]
    if report.get("phase"):
        details["phase"] = report["phase"]
    if last.get("checker_cpu_s") is not None:
        details["checker_cpu_s"] = last["checker_cpu_s"]
    maxrss = [r["maxrss_kb"] for r in runs if r.get("maxrss_kb")]
    return ExecutionResult(
        id=req.id,
        status=status,
        stdout=last.get("stdout", ""),
        stderr=last.get("stderr", ""),
        exit_code=last.get("exit_code"),
        signal=last.get("signal"),
        duration_s=sum(r.get("duration_s", 0.0) for r in runs),
        peak_memory_mb=max(maxrss) / 1024.0 if maxrss else None,
        exception=report.get("exc"),
        isolation=isolation,
        details=details,
    )
