"""Where sandbox workers run: this host (``local``) or a Ray cluster (``ray``), behind one factory.

Both backends take the same ``ExecutionRequest`` values, give back the same ``ExecutionResult``
values in the same order, and have the same ``run_batch`` / ``as_completed`` / ``close``
methods, so task domains and the trainer use either without knowing which.

In a multi-process JAX run each process verifies its own shard with its own ``local`` pool (a
TPU VM host has many cores). ``ray`` places the pools on a Ray cluster instead, for a CPU fleet
beyond the training hosts: one actor per ``workers_per_actor`` workers, each actor holding an
ordinary ``SandboxPool`` on whichever node Ray schedules it, so every guarantee of the local
pool (isolation, ceilings, out-of-process verdicts) holds on every node.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rlpt.sandbox.pool import IsolationUnavailable, SandboxPool, _metadata_list
from rlpt.sandbox.types import ExecutionRequest, ExecutionResult, Status

log = logging.getLogger(__name__)

BACKENDS = ("local", "ray")
# Time for a result to come back from an actor beyond a run's own limit.
_RAY_SLACK_S = 30.0


def make_pool(
    backend: str = "local",
    *,
    workers: int,
    timeout_s: float,
    memory_mb: int,
    allow_unisolated: bool = False,
    **kwargs: Any,
) -> SandboxPool | RayPool:
    """The pool the trainer and evaluation use, refusing to run without isolation by default.

    Args:
      backend: ``"local"`` (worker processes on this host) or ``"ray"`` (pools on Ray actors;
        needs ``pip install rlpt[ray]`` and a running ``ray.init`` or ``RAY_ADDRESS``).
      workers: programs running at once, in total.
      timeout_s, memory_mb: the operator's ceilings per run (see ``SandboxPool``).
      allow_unisolated: the value of the config key ``sandbox.allow_unisolated``. False (the
        default) raises ``IsolationUnavailable`` naming that key when the machine cannot
        isolate programs fully; True runs anyway and logs an error saying so.
      **kwargs: passed to ``SandboxPool`` (``output_limit_bytes``, ``trace_path``,
        ``packages``, ...), or to ``RayPool`` (``workers_per_actor``, ``actor_options``).
    """
    if backend == "local":
        pool: SandboxPool | RayPool = SandboxPool(
            workers=workers,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            require_isolation=False,
            **kwargs,
        )
    elif backend == "ray":
        pool = RayPool(
            workers=workers,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            require_isolation=False,
            **kwargs,
        )
    else:
        raise ValueError(f"sandbox.backend must be one of {BACKENDS}, got {backend!r}")
    if pool.isolation != "full":
        if not allow_unisolated:
            pool.close()
            raise IsolationUnavailable(
                f"the sandbox cannot isolate programs on this machine ({pool.isolation}); "
                "refusing to run model-written code without isolation. Set "
                "sandbox.allow_unisolated=True to run it anyway."
            )
        log.error(
            "sandbox.allow_unisolated=True: model-written code runs WITHOUT full isolation "
            "(%s). Programs may read host files, reach the network or forge results that "
            "these protections would have stopped.",
            pool.isolation,
        )
    return pool


class _PoolActor:
    """One ``SandboxPool`` inside a Ray actor; threaded, so its workers all stay busy."""

    def __init__(self, pool_kwargs: dict[str, Any]):
        self.pool = SandboxPool(**pool_kwargs)

    def info(self) -> dict[str, Any]:
        return {
            "isolation": self.pool.isolation,
            "rootless": self.pool.rootless,
            "aggregate_limits": self.pool.aggregate_limits,
        }

    def run(self, requests: list[ExecutionRequest], deadline_s: float | None):
        return self.pool.run_batch(requests, deadline_s=deadline_s)

    def close(self) -> None:
        self.pool.close()


class RayPool:
    """``SandboxPool``'s interface, with its workers spread over Ray actors.

    Args:
      workers: programs running at once, in total over all actors.
      timeout_s, memory_mb, require_isolation, and any other keyword: as for ``SandboxPool``,
        applied on every actor.
      workers_per_actor: worker processes per actor (one actor sits on one node).
      actor_options: Ray options for each actor, e.g. ``{"num_cpus": 8}`` to give each one a
        node's cores; by default each actor asks for one CPU per worker.
    """

    def __init__(
        self,
        workers: int = 4,
        timeout_s: float = 2.0,
        memory_mb: int = 256,
        *,
        workers_per_actor: int = 8,
        actor_options: Mapping[str, Any] | None = None,
        trace_path: str | None = None,
        **pool_kwargs: Any,
    ):
        try:
            import ray
        except ImportError as e:
            raise ImportError("sandbox.backend='ray' needs ray: pip install 'rlpt[ray]'") from e
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        self._ray = ray
        if not ray.is_initialized():
            ray.init(log_to_driver=False)
        per_actor = max(1, min(int(workers_per_actor), workers))
        n_actors = math.ceil(workers / per_actor)
        sizes = [workers // n_actors + (i < workers % n_actors) for i in range(n_actors)]
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.trace_path = trace_path
        # The trace log is written here, by the driver; the actors' pools keep none.
        self._tracer = None
        remote = ray.remote(_PoolActor)
        self._actors = []
        for size in sizes:
            options = {"num_cpus": size, **dict(actor_options or {})}
            kwargs = dict(pool_kwargs, workers=size, timeout_s=timeout_s, memory_mb=memory_mb)
            self._actors.append(remote.options(max_concurrency=size + 1, **options).remote(kwargs))
        self._sizes = sizes
        self._closed = False
        try:
            infos = ray.get([a.info.remote() for a in self._actors])
        except Exception as e:  # noqa: BLE001 - an actor's constructor failed
            self.close()
            if "WITHOUT full isolation" in str(e):
                raise IsolationUnavailable(str(e).splitlines()[-1]) from e
            raise
        missing = sorted({i["isolation"] for i in infos if i["isolation"] != "full"})
        self.isolation = "full" if not missing else "; ".join(missing)
        self.rootless = any(i["rootless"] for i in infos)
        self.aggregate_limits = ", ".join(sorted({i["aggregate_limits"] for i in infos}))
        if trace_path:
            # A local pool only for its trace writer: same record format as a local run.
            self._tracer = _TraceWriter(trace_path)

    def run_batch(
        self,
        requests: Sequence[ExecutionRequest],
        deadline_s: float | None = None,
        metadata: Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]] | None = None,
    ) -> list[ExecutionResult]:
        """Run all ``requests``; results come back in the same order."""
        out: list[ExecutionResult | None] = [None] * len(requests)
        for res in self.as_completed(requests, deadline_s, metadata):
            out[res.details["index"]] = res
        return out  # type: ignore[return-value]

    def as_completed(
        self,
        requests: Sequence[ExecutionRequest],
        deadline_s: float | None = None,
        metadata: Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Iterator[ExecutionResult]:
        """Yield results as runs finish (``details["index"]`` is the request's position)."""
        if self._closed:
            raise RuntimeError("RayPool is closed")
        requests = list(requests)
        metas = _metadata_list(requests, metadata)
        return self._collect(requests, metas, deadline_s)

    def _collect(self, requests, metas, deadline_s) -> Iterator[ExecutionResult]:
        ray = self._ray
        t0 = time.monotonic()
        deadline = None if deadline_s is None else t0 + float(deadline_s)
        # At most as many requests in flight on an actor as it has workers, and the next one
        # to whichever actor frees up first: a slow program holds one worker, never a queue.
        todo = list(range(len(requests)))[::-1]
        free = [size for size in self._sizes]
        refs: dict[Any, tuple[int, int]] = {}

        def submit() -> None:
            for a, actor in enumerate(self._actors):
                while free[a] > 0 and todo:
                    index = todo.pop()
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    refs[actor.run.remote([requests[index]], left)] = (index, a)
                    free[a] -= 1

        submit()
        try:
            while refs:
                wait_s = self.timeout_s + _RAY_SLACK_S
                if deadline is not None:
                    wait_s = min(wait_s, max(0.0, deadline - time.monotonic()) + _RAY_SLACK_S)
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=wait_s)
                if not ready:
                    break
                for ref in ready:
                    index, a = refs.pop(ref)
                    free[a] += 1
                    try:
                        res = ray.get(ref)[0]
                    except Exception as e:  # noqa: BLE001 - the actor or its node failed
                        res = _error(requests[index], self.isolation, f"ray: {e!r}")
                    yield self._finish(requests, metas, index, res)
                if deadline is not None and time.monotonic() >= deadline:
                    # What has not started is a timeout now, as in the local pool.
                    while todo:
                        index = todo.pop()
                        yield self._finish(requests, metas, index, self._late(requests, index))
                submit()
            for index, _ in list(refs.values()):
                yield self._finish(requests, metas, index, self._late(requests, index))
            while todo:
                index = todo.pop()
                yield self._finish(requests, metas, index, self._late(requests, index))
        finally:
            for ref in refs:
                ray.cancel(ref)

    def _late(self, requests, index: int) -> ExecutionResult:
        return ExecutionResult(
            id=requests[index].id,
            status=Status.TIMEOUT,
            isolation=self.isolation,
            details={"reason": "batch deadline passed before the run"},
        )

    def _finish(self, requests, metas, index: int, res: ExecutionResult) -> ExecutionResult:
        res.details["index"] = index
        if self._tracer is not None:
            self._tracer.write(requests[index], res, metas[index])
        return res

    def close(self) -> None:
        """Stop every actor's pool, then the actors."""
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        for actor in self._actors:
            # An actor that died has nothing left to close.
            with contextlib.suppress(Exception):
                ray.get(actor.close.remote(), timeout=30)
            ray.kill(actor)

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _TraceWriter:
    """Writes trace records in ``SandboxPool``'s format, from the driver of a Ray pool."""

    def __init__(self, path: str):
        import threading

        self.trace_path = path
        self._trace_lock = threading.Lock()

    write = SandboxPool._trace


def _error(req: ExecutionRequest, isolation: str, why: str) -> ExecutionResult:
    return ExecutionResult(
        id=req.id, status=Status.SANDBOX_ERROR, isolation=isolation, details={"reason": why}
    )


def pool_from_config(sandbox) -> SandboxPool | RayPool:
    """``make_pool`` for a run config's ``sandbox`` section (``backend``, ``workers``,
    ``timeout_s``, ``memory_mb``, ``allow_unisolated``)."""
    get = sandbox.get if hasattr(sandbox, "get") else lambda k, d=None: getattr(sandbox, k, d)
    return make_pool(
        get("backend", "local"), workers=get("workers"), timeout_s=get("timeout_s"),
        memory_mb=get("memory_mb"), allow_unisolated=bool(get("allow_unisolated", False)),
    )  # fmt: skip
