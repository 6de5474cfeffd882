"""Training entry point: ``python -m rlpt.train --config=experiments/NAME.py --workdir=DIR``.

``main`` only parses flags, checks them and starts multi-process JAX; the work happens in
:func:`train_and_evaluate`, importable so a notebook or a test can run the same thing.
The config is locked at load, so ``--config.typo=1`` is an error, not a new field; it is
parsed into its typed form (``rlpt.config``) before anything is compiled or written. A bad
flag or config value exits with status 2 and one line on standard error naming the full
dotted path. The final metrics are printed as JSON on the last line of standard output.

Multi-process JAX starts from flags, never from the config:

    --coordinator_address=HOST:PORT --num_processes=N --process_id=I   # explicit
    --distributed                                                      # TPU pod, SLURM job

With ``--config.async_rl.engine=process``, every process but 0 serves a rollout engine on
its devices (several are data-parallel replicas) and process 0 runs the rest of the run
on its own; weights cross
between them device to device through the address ``--transfer_address`` gives each
process (default: this host's address towards the coordinator, port coordinator + 1 +
process id).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import sys
from collections.abc import Mapping
from typing import Any, NoReturn

import jax
import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from rlpt import trainers
from rlpt.config import ConfigError, PostTrainConfig, parse_config, unknown_key_message
from rlpt.metrics import to_json_value
from rlpt.runfiles import RunFileError, atomic_write_json

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to an experiments/NAME.py config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for config.json, metrics, checkpoints.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0, to start multi-process JAX."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0..N-1.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed",
    False,
    "Start multi-process JAX from the environment of a TPU pod or SLURM job "
    "(jax.distributed.initialize() with what the three flags above leave unset).",
)
_TRANSFER_ADDRESS = flags.DEFINE_string(
    "transfer_address",
    None,
    "HOST:PORT where this process sends and receives device arrays across processes "
    "(async_rl.engine=process); default: this host's address towards the coordinator, "
    "port coordinator + 1 + process id.",
)

# How a config field's type reads in an error message.
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def train_and_evaluate(
    config: ml_collections.ConfigDict | Mapping[str, Any] | Any, workdir: str
) -> dict[str, Any]:
    """Parses ``config``, writes ``workdir/config.json`` and runs ``config.trainer``.

    Every config check runs before anything is written or compiled; a bad value raises
    ``rlpt.config.ConfigError`` naming its dotted path.

    Returns:
      The trainer's final metrics.
    """
    typed = parse_config(config)
    train_fn = trainers.get_trainer(typed.trainer)
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        atomic_write_json(os.path.join(workdir, "config.json"), typed.to_dict(), indent=2,
                          sort_keys=True)  # fmt: skip
    logging.info("Running trainer %r in %s", typed.trainer, workdir)
    return train_fn(_trainer_config(typed), workdir)


def _trainer_config(typed: Any) -> Any:
    """What the trainer reads: the typed config itself for post-training; for the gym
    trainer, whose jitted functions take the config as a static ConfigDict, the parsed
    values (derived ones filled in) as a locked ConfigDict."""
    if isinstance(typed, PostTrainConfig):
        return typed
    data = dataclasses.asdict(typed)
    if "model" in data and data["model"].get("hf_path") is None:
        # The trainers read the presence of model.hf_path as "a Hugging Face run".
        del data["model"]["hf_path"]
    config = ml_collections.ConfigDict(data)
    config.lock()
    return config


# -- the command line --------------------------------------------------------------------------


def _fail(message: str) -> NoReturn:
    print(message, file=sys.stderr, flush=True)
    sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with every error as one line and exit status 2."""
    try:
        return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError, ValueError, TypeError, OSError) as e:
        _fail(_flag_error_message(argv, e))


def _flag_error_message(argv: list[str], error: Exception) -> str:
    """Names the override that failed by its full dotted path, or the flag's own error."""
    config = flags.FLAGS["config"].value
    if config is None:  # absl checks the overrides before it keeps the loaded file
        config = _load_config_file(argv)
    overrides = [a.split("=", 1)[0][len("--config.") :] for a in argv if a.startswith("--config.")]
    if isinstance(config, ml_collections.ConfigDict):
        for path in overrides:
            node, parts = config, path.split(".")
            for i, part in enumerate(parts):
                here = ".".join(parts[: i + 1])
                if not isinstance(node, ml_collections.ConfigDict):
                    return f"unknown config key {path}: {'.'.join(parts[:i])} is not a section"
                if part not in node:
                    return unknown_key_message(here, list(node.keys()))
                if i == len(parts) - 1:
                    break
                node = node[part]
        bad = re.match(r"flag --config\.([\w.]+)=(.*?): ", str(error))
        if bad:
            path, value = bad.groups()
            *sections, key = path.split(".")
            node = config
            for part in sections:
                node = node[part]
            kind = node.get_type(key)
            expected = _TYPE_NAMES.get(kind, f"a {getattr(kind, '__name__', kind)}")
            return f"{path} must be {expected}, got {value!r}"
    return _one_line(error)


def _one_line(error: Exception) -> str:
    """The line of ``error`` that says what is wrong (a config file's own error is last)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if len(lines) > 1 and lines[0].startswith("flag --config="):
        return f"{lines[0].split(': ', 1)[0][len('flag ') :]}: {lines[-1]}"
    return lines[0].strip("'\"")


def _load_config() -> Any:
    """The ``--config`` file's ConfigDict (absl loads it on first use)."""
    try:
        config = _CONFIG.value
        config.keys()  # a file that failed to load is an object that raises on first use
        return config
    except Exception as e:  # noqa: BLE001  (a missing or failing config file: one line)
        path = flags.FLAGS["config"].serialize()
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        _fail(f"{path}: {lines[-1] if lines else type(e).__name__}")


def _load_config_file(argv: list[str]) -> ml_collections.ConfigDict | None:
    """The ``--config`` file's ConfigDict as loaded before any override, or None."""
    paths = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    if not paths:
        return None
    try:
        return flags.FLAGS["config"].parser.parse(paths[-1])
    except Exception:  # noqa: BLE001  (the file's own error is reported instead)
        return None


def _distributed_options() -> dict[str, Any] | None:
    """Keyword arguments of ``jax.distributed.initialize``, or None for one process."""
    given = {
        "coordinator_address": _COORDINATOR.value,
        "num_processes": _NUM_PROCESSES.value,
        "process_id": _PROCESS_ID.value,
    }
    explicit = {k: v for k, v in given.items() if v is not None}
    if not explicit and not _DISTRIBUTED.value:
        return None
    if not _DISTRIBUTED.value:
        missing = [f"--{k}" for k, v in given.items() if v is None]
        if missing:
            raise ConfigError(
                f"{', '.join(missing)} must be set with "
                f"{', '.join(f'--{k}' for k in explicit)} (or pass --distributed to read the "
                "rest from a TPU pod's or SLURM job's environment)"
            )
    address = explicit.get("coordinator_address")
    if address is not None and not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", address):
        raise ConfigError(f"--coordinator_address must be HOST:PORT, got {address!r}")
    n, i = explicit.get("num_processes"), explicit.get("process_id")
    if n is not None and n < 1:
        raise ConfigError(f"--num_processes must be >= 1, got {n}")
    if i is not None and (i < 0 or (n is not None and i >= n)):
        raise ConfigError(f"--process_id must be in [0, {n if n is not None else 'N'}), got {i}")
    return explicit


def _check_workdir(workdir: str) -> None:
    """A workdir that is a file, or under a file or an unwritable directory, is refused."""
    if "://" in workdir:  # a remote file system (gs://...): nothing to check from here
        return
    path = os.path.abspath(workdir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--workdir {workdir} is a file, not a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"--workdir {workdir} cannot be made: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--workdir {workdir} is not writable: {parent}")


def _check_against_processes(config: PostTrainConfig) -> None:
    """Checks that need the device and process counts (known once JAX has started)."""
    from rlpt.parallel.multihost import trainer_devices

    config.mesh.shape(len(trainer_devices()))


def _engine_process(config: Any, distributed: dict[str, Any] | None) -> bool:
    """Whether the rollout engine runs in a process of its own (async_rl.engine=process);
    checks that the flags start the two processes it needs."""
    if not isinstance(config, PostTrainConfig) or config.async_rl.engine != "process":
        return False
    if distributed is None:
        raise ConfigError(
            "async_rl.engine 'process' runs as two JAX processes: pass --coordinator_address, "
            "--num_processes=2 and --process_id (or --distributed)"
        )
    n = distributed.get("num_processes")
    if n is not None and n < 2:
        raise ConfigError(
            f"async_rl.engine 'process' runs as --num_processes >= 2 (the driver and one "
            f"process per engine), got {n}"
        )
    return True


def _transfer_address(distributed: dict[str, Any]) -> str:
    """This process's HOST:PORT for cross-process device transfers (see --transfer_address)."""
    given = _TRANSFER_ADDRESS.value
    if given:
        if not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", given):
            raise ConfigError(f"--transfer_address must be HOST:PORT, got {given!r}")
        return given
    address, pid = distributed.get("coordinator_address"), distributed.get("process_id")
    if address is None or pid is None:
        raise ConfigError(
            "async_rl.engine 'process' with --distributed needs --transfer_address=HOST:PORT "
            "(where this process exchanges weights with the other)"
        )
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    # The address this host uses towards the coordinator: reachable by the other process.
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))
        own = s.getsockname()[0]
    own = f"[{own}]" if ":" in own else own
    return f"{own}:{int(port) + 1 + int(pid)}"


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        _fail(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        distributed = _distributed_options()
        config = parse_config(_load_config())
        _check_workdir(_WORKDIR.value)
        engine_process = _engine_process(config, distributed)
        if engine_process:
            from rlpt.asyncrl.remote import enable_cross_host_transfers

            enable_cross_host_transfers(_transfer_address(distributed))
    except ConfigError as e:
        _fail(str(e))
    if distributed is not None:
        # Cross-process collectives of the CPU backend (host devices in tests, host-side
        # arrays on accelerators) need an implementation; gloo ships with jaxlib.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(**distributed)
        logging.info("JAX process %d of %d", jax.process_index(), jax.process_count())
    if engine_process:
        if jax.process_count() < 2:
            _fail("async_rl.engine 'process' needs 2 JAX processes or more, got 1")
        if jax.process_index() != 0:
            from rlpt.asyncrl.remote import serve_engine

            calls = serve_engine()  # until the driver's run closes the engine
            logging.info("rollout engine served %d calls", calls)
            return
        from rlpt.parallel.multihost import set_trainer_process

        set_trainer_process(0)
    if isinstance(config, PostTrainConfig):
        try:  # the mesh sizes against the devices there are, before anything compiles
            _check_against_processes(config)
        except ConfigError as e:
            _fail(str(e))
    try:
        result = train_and_evaluate(config, _WORKDIR.value)
    except RunFileError as e:  # a damaged run file or workdir: one line naming it
        _fail(str(e))
    finally:
        if engine_process:  # the engines' processes end with the run, also a failed one
            from rlpt.asyncrl.remote import ProcessEngine, actor_processes

            for process in actor_processes():
                ProcessEngine.release(process)
    print(json.dumps(to_json_value(result)), flush=True)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main, flags_parser=_parse_flags)
