"""Metric logging to ``workdir/metrics.jsonl``, the run record every trainer writes.

Each line is one JSON object: ``step`` (the run's global step, increasing across
stages), ``stage`` when given, and metric keys named ``STAGE/NAME``. Machine-dependent
figures (wall clock, throughput) go under ``time/`` so that everything else stays
deterministic for a given seed and machine. See ``/work/shared/CONVENTIONS.md``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from absl import logging

METRICS_FILE = "metrics.jsonl"


def to_json_value(value: Any) -> Any:
    """Converts a metric value (python, numpy or jax scalar, or small array) to JSON.

    Non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"``: the JSON
    standard has no such numbers and strict readers reject Python's ``NaN`` token.
    """
    if isinstance(value, bool | str) or value is None:
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): to_json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json_value(v) for v in value]
    # numpy and jax arrays (jax arrays implement __array__, which copies to host).
    arr = np.asarray(value)
    if arr.ndim == 0:
        item = arr.item()
        return to_json_value(item)
    return to_json_value(arr.tolist())


class MetricWriter:
    """Appends metric lines to ``workdir/metrics.jsonl``, flushing after every write.

    Args:
      workdir: the run directory; created if missing.
      enabled: whether this process writes. ``None`` means "only JAX process 0", so a
        multi-host run writes each line once; the other processes get a no-op writer.
    """

    def __init__(self, workdir: str | os.PathLike[str], *, enabled: bool | None = None):
        if enabled is None:
            import jax

            enabled = jax.process_index() == 0
        self.enabled = enabled
        self.path = os.path.join(os.fspath(workdir), METRICS_FILE)
        self._file = None
        if self.enabled:
            os.makedirs(os.fspath(workdir), exist_ok=True)
            # Held open across writes (closed by close()), so no context manager.
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def write(
        self, step: int, metrics: Mapping[str, Any], *, stage: str | None = None
    ) -> dict[str, Any]:
        """Writes one line and returns the JSON object written.

        Keys must be ``STAGE/NAME``; a bare ``NAME`` is prefixed with ``stage`` when one
        is given (``write(3, {"loss": x}, stage="sft")`` logs ``sft/loss``), and is an
        error otherwise, so that no unnamespaced key reaches the file.
        """
        record: dict[str, Any] = {"step": int(step)}
        if stage is not None:
            record["stage"] = stage
        for key, value in metrics.items():
            if "/" not in key:
                if stage is None:
                    raise ValueError(f"metric key {key!r} is not STAGE/NAME and no stage given")
                key = f"{stage}/{key}"
            record[key] = to_json_value(value)
        self._write_record(record)
        return record

    def resume(self, step: int) -> None:
        """Applies the resume rule after restoring a checkpoint taken at ``step``.

        Lines with a step after ``step`` are dropped (so the file never holds a step
        twice once training replays them), and so is a torn last line left by a crash;
        then ``{"step": N, "event": "resumed", "resumed_from_step": N}`` is written and
        the same is logged to the console.
        """
        step = int(step)
        if not self.enabled:
            logging.info("Resumed from step %d.", step)
            return
        self._file.close()
        kept = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    logging.warning("Dropping unreadable line in %s: %r", self.path, line[:200])
                    continue
                if int(record.get("step", 0)) <= step:
                    kept.append(json.dumps(record) + "\n")
        # Replace, never truncate in place: a crash mid-rewrite must not lose the history.
        tmp_path = self.path + ".tmp"
        with open(tmp_path, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._write_record({"step": step, "event": "resumed", "resumed_from_step": step})
        logging.info("Resumed from step %d; metrics after it dropped from %s.", step, self.path)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write_record(self, record: Mapping[str, Any]) -> None:
        if self._file is None:
            if self.enabled:
                raise ValueError(f"MetricWriter for {self.path} is closed")
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
