"""The rollout engine on a Ray actor: actors on other machines than the learner.

``RayEngine`` has the engine interface ``AsyncRunner`` drives (``submit``, ``step``,
``has_work``, ``update_weights``, ``abort``, ``generate``, ``version``) and forwards each
call to an ``Engine`` living in a Ray actor process, which may sit on any node of the
cluster (``actor_options`` such as ``{"num_gpus": 1}`` or a placement-group strategy
choose where). Weights travel as host arrays through Ray's object store; the actor places
them on its own devices. Nothing else changes: the runner's admission, staleness bound,
pool and learner are the same with a local or a remote engine.

Needs ``pip install 'rlpt[ray]'`` and a running ``ray.init()`` (or ``RAY_ADDRESS``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import jax
import numpy as np

from rlpt.sampling.engine import Completion, Engine, Request


class _EngineActor:
    """Holds one ``Engine`` in the Ray actor's process (a fresh interpreter: its own JAX)."""

    def __init__(self, graphdef, state, config, engine_kwargs: dict[str, Any]):
        self.engine = Engine(graphdef, state, config, **engine_kwargs)

    def submit(self, requests: list[Request]) -> None:
        self.engine.submit(requests)

    def step(self) -> tuple[list[Completion], bool]:
        return self.engine.step(), self.engine.has_work()

    def has_work(self) -> bool:
        return self.engine.has_work()

    def update_weights(self, state, version: int, in_flight: str) -> None:
        self.engine.update_weights(state, version, in_flight=in_flight)

    def abort(self, request_id: Hashable, requeue: bool) -> None:
        self.engine.abort(request_id, requeue=requeue)

    def generate(self, requests: list[Request]) -> list[Completion]:
        return self.engine.generate(requests)

    def stats(self):
        return self.engine.stats


def _to_host(tree):
    """Parameters as numpy arrays: what crosses processes (and machines) through Ray."""
    return jax.tree.map(np.asarray, jax.device_get(tree))


class RayEngine:
    """An ``Engine`` in a Ray actor, behind the same interface (see the module doc)."""

    def __init__(
        self,
        graphdef,
        state,
        config,
        *,
        actor_options: dict[str, Any] | None = None,
        version: int = 0,
        **engine_kwargs,
    ):
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RayEngine needs ray.init() (or RAY_ADDRESS) first")
        self._ray = ray
        remote = ray.remote(_EngineActor).options(**(actor_options or {}))
        self._actor = remote.remote(
            graphdef, _to_host(state), config, {**engine_kwargs, "version": version}
        )
        self.version = int(version)
        self._has_work = False

    def _call(self, method: str, *args):
        return self._ray.get(getattr(self._actor, method).remote(*args))

    def submit(self, requests: Iterable[Request]) -> None:
        requests = list(requests)
        self._call("submit", requests)
        self._has_work = self._has_work or bool(requests)

    def step(self) -> list[Completion]:
        done, self._has_work = self._call("step")
        return done

    def has_work(self) -> bool:
        self._has_work = self._call("has_work")
        return self._has_work

    def update_weights(self, state, version: int, *, in_flight: str = "continue") -> None:
        self._call("update_weights", _to_host(state), int(version), in_flight)
        self.version = int(version)

    def abort(self, request_id: Hashable, *, requeue: bool = False) -> None:
        self._call("abort", request_id, requeue)

    def generate(self, requests: Iterable[Request]) -> list[Completion]:
        return self._call("generate", list(requests))

    @property
    def stats(self):
        return self._call("stats")

    def close(self) -> None:
        self._ray.kill(self._actor)
