"""The rollout engine in another JAX process: roles on disjoint hosts, one JAX program.

In a multi-controller JAX program (``jax.distributed``; one process per host) the roles
take disjoint processes: process 0, the driver, runs ``AsyncRunner`` and the learner on its
own devices; an actor process holds the rollout engine on a mesh over its devices.
``ProcessEngine`` is the engine's interface in the driver (``submit``, ``step``,
``has_work``, ``update_weights``, ``abort``, ``generate``, ``version``, ``stats``) and
``serve_engine`` runs in the actor process, calling its ``Engine`` as the driver asks.
Nothing else changes: the runner's admission, staleness bound, pool and learner are the
same with a local, a Ray or a process engine.

The schedule is decided in the driver alone: an asynchronous schedule follows timing
(when a reward finishes, when the learner publishes), which differs from process to
process, so no other process decides anything; the actor replays the driver's engine
calls in order.

What travels how:
- calls and their answers (prompt ids, sampled ids, per-token log-probs and versions) are
  host data: ordered messages through ``jax.distributed``'s key-value store (``Channel``;
  the coordinator relays them, so no other connection is needed);
- weights move device to device with JAX's cross-host transfers: driver and actor call
  ``jax.device_put`` at the same point of the call sequence, from a whole copy on as many
  of the driver's devices as the actor has to a whole copy on the actor's devices (JAX
  copies shard for shard between device lists of one size), and the actor keeps each of
  its devices' slices for the engine's shardings. ``enable_cross_host_transfers`` before
  ``jax.distributed.initialize`` gives each process the address these transfers use.

Launch: the same program on every process; process 0 builds the learner on
``jax.local_devices()`` and ``ProcessEngine(1)``; process 1 builds the ``Engine`` on
``actor_mesh(1)`` and calls ``serve_engine`` (``tests/asyncrl/multiprocess_engine.py`` is
a complete example). Or the driver describes the engine, ``ProcessEngine.build(1, graphdef,
state, config, **engine_kwargs)``, and the actor process needs nothing but
``serve_engine()``: it builds that engine on ``actor_mesh`` and takes the driver's weights
(how ``rlpt.train`` runs ``async_rl.engine = "process"``).

Several actor processes each serve an engine of their own, which the driver drives as
data-parallel replicas (``rlpt.asyncrl.replicated.ReplicatedEngine`` over one
``ProcessEngine`` per actor process). Every process takes part in each weight transfer,
in one order (the other actors make the same ``device_put``, holding none of its
shards): an actor left out of the transfers to the others waited for ever for its own.
Limits: one engine whose mesh spans several processes is refused (``serve_engine``):
given the same calls in each process, such an engine stalled inside its programs'
cross-process collectives on CPU; the learner stays in the driver's process.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Hashable, Iterable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlpt.parallel import make_mesh
from rlpt.sampling.engine import Completion, Engine, EngineStats, Request

DRIVER = 0
# A wait for a message is retried every POLL_MS, so an idle actor waits as long as the
# driver needs (a driver that dies takes the job down through jax.distributed's heartbeats).
POLL_MS = 60_000


def enable_cross_host_transfers(address: str) -> None:
    """Lets this process send and receive device arrays to and from other processes
    (``jax.device_put`` between shardings on different processes' devices). ``address``:
    ``host:port`` where this process listens, reachable by the others. Call it before
    ``jax.distributed.initialize``."""
    jax.config.update("jax_cross_host_transfer_socket_address", address)


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("the process engine needs jax.distributed.initialize() first")
    return client


class Channel:
    """Ordered messages from one process to one other through ``jax.distributed``'s
    key-value store. Each message is deleted once read, so the store holds only the
    messages in transit. Both ends are this program's own processes, which is why plain
    pickle carries the values (requests, completions: dataclasses of numpy arrays)."""

    def __init__(self, name: str):
        self.name = name
        self.sent = 0
        self.received = 0
        self._send_lock = threading.Lock()  # replicas' threads may send to one process

    def _key(self, n: int) -> str:
        return f"rlpt/{self.name}/{n}"

    def send(self, value: Any) -> None:
        with self._send_lock:
            _client().key_value_set_bytes(self._key(self.sent), pickle.dumps(value))
            self.sent += 1

    def recv(self) -> Any:
        client, key = _client(), self._key(self.received)
        while True:
            try:
                data = client.blocking_key_value_get_bytes(key, POLL_MS)
                break
            except jax.errors.JaxRuntimeError as e:  # the store's timeout: wait on
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        client.key_value_delete(key)
        self.received += 1
        return pickle.loads(data)


def actor_processes() -> list[int]:
    """The processes that serve an engine for the driver: every process but the driver."""
    return [p for p in range(jax.process_count()) if p != DRIVER]


def actor_mesh(actor_process: int = 1, **mesh_kwargs) -> Mesh:
    """A mesh over every device of ``actor_process`` (the engine's devices)."""
    devices = _local_devices_of(int(actor_process))
    if not devices:
        raise ValueError(f"no devices belong to process {actor_process}")
    return make_mesh(devices=devices, **mesh_kwargs)


# One Channel object per name in a process, so every sender and receiver of a stream
# counts its messages together (a release after a failed build lands in order).
_channels: dict[str, Channel] = {}
# Actor processes whose serve_engine this driver has ended.
_released: set[int] = set()


def _channel(name: str) -> Channel:
    if name not in _channels:
        _channels[name] = Channel(name)
    return _channels[name]


def _commands(process: int) -> Channel:
    return _channel(f"engine/commands/{process}")


def _answers(process: int) -> Channel:
    return _channel(f"engine/answers/{process}")


def _acks(process: int) -> Channel:
    return _channel(f"engine/acks/{process}")


def _local_devices_of(process: int) -> list:
    return sorted((d for d in jax.devices() if d.process_index == process), key=lambda d: d.id)


def _transfer_target(process: int) -> NamedSharding:
    """A whole copy on every device of ``process``."""
    return NamedSharding(Mesh(np.array(_local_devices_of(process)), ("copy",)), PartitionSpec())


def _transfer_source(process: int) -> NamedSharding:
    """A whole copy on as many of the driver's devices as ``process`` has."""
    need = len(_local_devices_of(process))
    driver = _local_devices_of(DRIVER)
    if len(driver) < need:
        raise ValueError(
            f"process {process} has {need} devices, the driver only {len(driver)}: weights "
            "cross processes between device lists of one size"
        )
    return NamedSharding(Mesh(np.array(driver[:need]), ("copy",)), PartitionSpec())


def _reshard_local(copy: jax.Array, target: NamedSharding) -> jax.Array:
    """The engine's array from a whole copy on each of this process's devices: each device
    keeps its own slice of the copy it already holds (no transfer)."""
    on_device = {shard.device: shard.data for shard in copy.addressable_shards}
    pieces = [
        on_device[device][index]
        for device, index in target.addressable_devices_indices_map(copy.shape).items()
    ]
    return jax.make_array_from_single_device_arrays(copy.shape, target, pieces)


class ProcessEngine:
    """The engine of ``serve_engine`` in another process, driven from the driver (module doc)."""

    def __init__(self, actor_process: int = 1, *, _spec: tuple | None = None):
        """Waits for ``serve_engine`` to start in ``actor_process`` and takes the engine's
        version and parameter count from it."""
        if jax.process_index() != DRIVER:
            raise ValueError(f"a ProcessEngine is driven from process {DRIVER}")
        if not 0 < int(actor_process) < jax.process_count():
            raise ValueError(
                f"actor_process must be one of processes 1..{jax.process_count() - 1}, "
                f"got {actor_process}"
            )
        self.actor = int(actor_process)
        self._commands = _commands(self.actor)
        self._answers = _answers(self.actor)
        self._acks = _acks(self.actor)
        if _spec is not None:  # the engine the actor's serve_engine() is to build
            self._send("build", *_spec)
        kind, value = self._answers.recv()
        if kind == "error":
            raise RuntimeError(f"the engine in process {self.actor} failed to start: {value}")
        version, num_leaves = value
        self.version = int(version)
        self._num_leaves = int(num_leaves)
        self._stats = EngineStats()
        # One call at a time: a call and its answer are matched by their order alone, and
        # the runner may reach the engine from more than one thread (actor, learner, drain).
        self._lock = threading.RLock()

    @classmethod
    def build(
        cls, actor_process: int, graphdef, state, config, *, version: int = 0, **engine_kwargs
    ) -> ProcessEngine:
        """An ``Engine(graphdef, state, config, **engine_kwargs)`` built by ``serve_engine()``
        in ``actor_process`` on ``actor_mesh(actor_process)``, holding ``state`` (the
        driver's weights, moved as ``update_weights`` moves them) at ``version``.
        ``engine_kwargs`` are the engine's other arguments but ``mesh`` (host values:
        they travel pickled)."""
        if "mesh" in engine_kwargs:
            raise ValueError("ProcessEngine.build: the engine's mesh is the actor's own")
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        engine = cls(actor_process, _spec=(graphdef, abstract, config, dict(engine_kwargs)))
        engine.update_weights(state, version)
        return engine

    @staticmethod
    def release(actor_process: int = 1) -> None:
        """Ends ``serve_engine`` in ``actor_process`` unless this driver already did (a
        ``close``, or a run that failed before or while building its engine)."""
        actor = int(actor_process)
        if actor not in _released:
            _released.add(actor)
            _commands(actor).send(("close",))

    def _send(self, *command) -> None:
        self._commands.send(command)

    def _ask(self, *command):
        with self._lock:
            self._send(*command)
            kind, value = self._answers.recv()
        if kind == "error":
            raise RuntimeError(f"the engine in process {self.actor} failed: {value}")
        return value

    def submit(self, requests: Iterable[Request]) -> None:
        # Validated by the engine in the actor; a bad request's error comes back here.
        self._ask("submit", list(requests))

    def step(self) -> list[Completion]:
        done, self._stats = self._ask("step")
        return done

    def has_work(self) -> bool:
        return self._ask("has_work")

    def update_weights(self, state, version: int, *, in_flight: str = "continue") -> None:
        with self._lock:
            leaves = jax.tree.leaves(state)
            if len(leaves) != self._num_leaves:
                raise ValueError(
                    f"update_weights: {len(leaves)} arrays, the engine's parameters have "
                    f"{self._num_leaves}"
                )
            shapes = [(tuple(x.shape), np.dtype(x.dtype).str) for x in leaves]
            # Every process takes part in each cross-process transfer, in one order: the
            # other actors make the same device_put (they hold none of its shards). An
            # actor left out waited for ever for its own next transfer.
            for other in actor_processes():
                if other != self.actor:
                    _commands(other).send(("observe_transfer", self.actor, shapes))
            self._send("update_weights", shapes, int(version), in_flight)
            # The actor receives a whole copy (JAX copies shard for shard between device
            # lists of one size, one process to one process): first gathered onto as many
            # of the driver's devices as it has, then sent.
            copies = jax.device_put(leaves, [_transfer_source(self.actor)] * len(leaves))
            jax.device_put(copies, [_transfer_target(self.actor)] * len(leaves))
            kind, value = self._acks.recv()  # the actor has its copy in place
            if kind == "error":
                raise RuntimeError(f"update_weights failed in process {self.actor}: {value}")
            self.version = int(version)

    def abort(self, request_id: Hashable, *, requeue: bool = False) -> None:
        self._ask("abort", request_id, requeue)

    def generate(self, requests: Iterable[Request]) -> list[Completion]:
        return self._ask("generate", list(requests))

    @property
    def stats(self) -> EngineStats:
        return self._stats

    def close(self) -> None:
        """Ends the actor's ``serve_engine``."""
        with self._lock:
            self.release(self.actor)


def _observe_transfer(other: int, shapes) -> None:
    """This process's part in the driver's weight transfer to actor ``other``: the same
    ``device_put``, holding none of its shards."""
    placeholders = [
        jax.make_array_from_single_device_arrays(
            shape, _transfer_source(other), [], dtype=np.dtype(dtype)
        )
        for shape, dtype in shapes
    ]
    jax.device_put(placeholders, [_transfer_target(other)] * len(shapes))


def _build_engine(graphdef, abstract, config, engine_kwargs) -> Engine:
    """The engine ``ProcessEngine.build`` describes, on this process's devices, holding
    zeros until the driver's weights arrive."""
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract)
    return Engine(graphdef, zeros, config, mesh=actor_mesh(jax.process_index()), **engine_kwargs)


def serve_engine(engine: Engine | None = None) -> int:
    """Runs ``engine`` (on this process's devices) for the driver's ``ProcessEngine`` until
    it closes; returns the number of calls served. Without ``engine``, the driver's
    ``ProcessEngine.build`` describes the engine to build (``ProcessEngine.release`` ends
    the wait for one, returning 0)."""
    me = jax.process_index()
    commands = _commands(me)
    answers = _answers(me)
    if engine is None:
        command, *args = commands.recv()
        while command == "observe_transfer":  # weights for another actor, built before us
            _observe_transfer(*args)
            command, *args = commands.recv()
        if command == "close":
            return 0
        if command != "build":
            raise ValueError(f"serve_engine: expected the engine's description, got {command!r}")
        try:
            engine = _build_engine(*args)
        except Exception as e:  # the driver raises it
            answers.send(("error", f"{type(e).__name__}: {e}"))
            raise
    if engine.mesh is None:
        raise ValueError("serve_engine needs an engine on the actor's mesh (actor_mesh)")
    if {d.process_index for d in engine.mesh.devices.flat} != {me}:
        # An engine mesh over several processes runs collectives between them; in tests on
        # CPU (gloo) such an engine, given the same calls in each process, stalled inside
        # its programs, so one actor process (all of one host's devices) is what is tested.
        raise ValueError(
            f"serve_engine: the engine's mesh must hold this process's devices only "
            f"(process {me}); got devices of processes "
            f"{sorted({d.process_index for d in engine.mesh.devices.flat})}"
        )
    served = 0
    leaves, treedef = jax.tree.flatten(engine.state)
    targets = [x.sharding for x in leaves]
    acks = _acks(me)

    def answer(kind, value=None):
        answers.send((kind, value))

    answer("hello", (engine.version, len(targets)))

    while True:
        command, *args = commands.recv()
        served += 1
        if command == "close":
            return served
        try:
            if command == "update_weights":
                shapes, version, in_flight = args
                try:
                    # The driver holds the source shards: placeholders stand in for them.
                    source = _transfer_source(me)
                    placeholders = [
                        jax.make_array_from_single_device_arrays(
                            shape, source, [], dtype=np.dtype(dtype)
                        )
                        for shape, dtype in shapes
                    ]
                    copies = jax.device_put(placeholders, [_transfer_target(me)] * len(shapes))
                    # Acknowledged once the bytes are here: the driver keeps its source
                    # copies alive until then, and goes on to the next actor only after.
                    jax.block_until_ready(copies)
                    moved = [_reshard_local(c, t) for c, t in zip(copies, targets, strict=True)]
                    engine.update_weights(
                        jax.tree.unflatten(treedef, moved), version, in_flight=in_flight
                    )
                except Exception as e:  # answered on this process's own channel
                    acks.send(("error", f"{type(e).__name__}: {e}"))
                else:
                    acks.send(("ok", None))
            elif command == "observe_transfer":
                _observe_transfer(*args)
            elif command == "submit":
                engine.submit(*args)
                answer("ok")
            elif command == "step":
                answer("ok", (engine.step(), engine.stats))
            elif command == "has_work":
                answer("ok", engine.has_work())
            elif command == "abort":
                request_id, requeue = args
                engine.abort(request_id, requeue=requeue)
                answer("ok")
            elif command == "generate":
                answer("ok", engine.generate(*args))
            else:
                raise ValueError(f"unknown engine call {command!r}")
        except Exception as e:  # the driver raises it; the actor serves on
            answer("error", f"{type(e).__name__}: {e}")
