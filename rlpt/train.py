"""Training entry point: ``python -m rlpt.train --config=experiments/NAME.py --workdir=DIR``.

``main`` only parses flags (and starts multi-host JAX when the config asks); the work
happens in :func:`train_and_evaluate`, importable so a notebook or a test can run the
same thing. The config is locked at load: ``--config.typo=1`` is an error, not a new
field. The final metrics are printed as JSON on the last line of standard output.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from rlpt import trainers
from rlpt.metrics import to_json_value
from rlpt.runfiles import atomic_write_text

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to an experiments/NAME.py config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for config.json, metrics, checkpoints.")

_REQUIRED_FIELDS = ("trainer", "seed")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Checks ``config``, writes ``workdir/config.json`` and runs ``config.trainer``.

    The trainer name is validated before anything is written or compiled, so a typo
    fails at once with the allowed values.

    Returns:
      The trainer's final metrics.
    """
    missing = [name for name in _REQUIRED_FIELDS if name not in config]
    if missing:
        raise ValueError(f"config lacks required field(s) {missing}")
    train_fn = trainers.get_trainer(config.trainer)
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        atomic_write_text(
            os.path.join(workdir, "config.json"),
            config.to_json_best_effort(indent=2, sort_keys=True) + "\n",
        )
    logging.info("Running trainer %r in %s", config.trainer, workdir)
    return train_fn(config, workdir)


def _maybe_initialize_distributed(config: ml_collections.ConfigDict) -> None:
    """Starts multi-host JAX if ``config.distributed`` is set.

    ``True`` lets JAX detect the cluster (Cloud TPU, SLURM, ...); a mapping is passed
    as keyword arguments to ``jax.distributed.initialize`` (``coordinator_address``,
    ``num_processes``, ``process_id``, ...).
    """
    distributed = config.get("distributed")
    if not distributed:
        return
    if isinstance(distributed, Mapping | ml_collections.ConfigDict):
        kwargs = distributed.to_dict() if hasattr(distributed, "to_dict") else dict(distributed)
        jax.distributed.initialize(**kwargs)
    else:
        jax.distributed.initialize()
    logging.info("JAX process %d of %d", jax.process_index(), jax.process_count())


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    _maybe_initialize_distributed(config)
    result = train_and_evaluate(config, _WORKDIR.value)
    print(json.dumps(to_json_value(result)), flush=True)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
