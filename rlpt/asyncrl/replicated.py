"""Several rollout engines behind one engine interface: data-parallel replicas.

``ReplicatedEngine(engines)`` is what ``AsyncRunner`` drives when the actors are more than
one engine: engines on disjoint sub-meshes of one host, engines in other JAX processes
(``rlpt.asyncrl.remote.ProcessEngine``, one per actor host) or on Ray actors. Each request
goes whole to the replica with the fewest samples outstanding (a group's samples share
its prompt's KV blocks, so a group never splits), ``step`` steps every busy replica at
once (threads: a remote replica's step is a wait) and returns their completions
together, and new weights reach every replica before the next step. Sampling is seeded
per request, so a request's tokens do not depend on which replica ran it: replicas
sample exactly what one engine samples.

Replicas rather than one engine whose mesh spans several hosts: a replica's programs
need no collective across hosts, and an engine mesh over several processes stalled in
its cross-process collectives on CPU (``rlpt.asyncrl.remote``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from rlpt.sampling.engine import Completion, EngineStats, Request


class ReplicatedEngine:
    """Data-parallel replicas of the rollout engine behind its interface (module doc)."""

    def __init__(self, engines: Sequence):
        self.engines = list(engines)
        if not self.engines:
            raise ValueError("ReplicatedEngine needs at least one engine")
        versions = {int(e.version) for e in self.engines}
        if len(versions) != 1:
            raise ValueError(f"the replicas hold different policy versions: {sorted(versions)}")
        self._owner: dict[Hashable, int] = {}  # request id -> replica, until it finishes
        self._unfinished: dict[Hashable, int] = {}  # request id -> samples not returned yet
        self._load = [0] * len(self.engines)  # samples outstanding per replica
        self._threads = ThreadPoolExecutor(len(self.engines), thread_name_prefix="replica")

    @property
    def version(self) -> int:
        return int(self.engines[0].version)

    def submit(self, requests: Iterable[Request]) -> None:
        """Queues each request on the least-loaded replica, in order; a bad request raises
        there, after the ones before it were queued (as one engine does)."""
        for request in requests:
            if request.id in self._owner:
                raise ValueError(f"request {request.id!r} is already running")
            i = min(range(len(self.engines)), key=lambda j: (self._load[j], j))
            self.engines[i].submit([request])
            self._owner[request.id] = i
            self._unfinished[request.id] = request.params.n
            self._load[i] += request.params.n

    def has_work(self) -> bool:
        return any(self._load)

    def step(self) -> list[Completion]:
        busy = [i for i, load in enumerate(self._load) if load]
        if len(busy) == 1:
            results = [self.engines[busy[0]].step()]
        else:
            results = list(self._threads.map(lambda i: self.engines[i].step(), busy))
        done: list[Completion] = []
        for i, completions in zip(busy, results, strict=True):
            for c in completions:
                self._load[i] -= 1
                self._unfinished[c.request_id] -= 1
                if not self._unfinished[c.request_id]:
                    del self._unfinished[c.request_id], self._owner[c.request_id]
            done += completions
        return done

    def update_weights(self, state, version: int, *, in_flight: str = "continue") -> None:
        for engine in self.engines:
            engine.update_weights(state, version, in_flight=in_flight)

    def abort(self, request_id: Hashable, *, requeue: bool = False) -> None:
        i = self._owner.get(request_id)
        if i is not None:  # an unknown or finished request: nothing to stop, as for one engine
            self.engines[i].abort(request_id, requeue=requeue)

    def generate(self, requests: Iterable[Request]) -> list[Completion]:
        """Run ``requests`` to the end; completions in request order, then sample index."""
        requests = list(requests)
        self.submit(requests)
        wanted = {r.id for r in requests}
        done: list[Completion] = []
        while any(r in self._owner for r in wanted):
            done += self.step()
        order = {r.id: i for i, r in enumerate(requests)}
        return sorted(done, key=lambda c: (order.get(c.request_id, -1), c.index))

    @property
    def stats(self) -> EngineStats:
        """Every replica's counts and times added up (peak blocks: the sum of peaks)."""
        total = EngineStats()
        for engine in self.engines:
            for field in dataclasses.fields(EngineStats):
                name = field.name
                setattr(total, name, getattr(total, name) + getattr(engine.stats, name))
        return total

    def close(self) -> None:
        for engine in self.engines:
            close = getattr(engine, "close", None)
            if close is not None:
                close()
        self._threads.shutdown(wait=False)
