"""Metric logging to ``workdir/metrics.jsonl``, the run record every trainer writes.

Each line is one JSON object: ``step`` (the run's global step, increasing across
stages), ``stage`` when given, and metric keys named ``STAGE/NAME``. Machine-dependent
figures (wall clock, throughput) go under ``time/`` so that everything else stays
deterministic for a given seed and machine.

The same scalars go to TensorBoard event files in ``workdir/tensorboard`` (written
with tensorboardX, so TensorFlow is not needed; ``tensorboard --logdir=DIR``) and,
when asked for and installed, to Weights & Biases. ``Progress`` is the console
progress bar of long stages and ``StepProfiler`` traces chosen steps with the JAX
profiler.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from absl import logging

from rlpt.runfiles import atomic_write_lines, atomic_write_text

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PROFILE_DIR = "profile"
_ILLEGAL_TAG_CHARS = re.compile(r"[^-/\w.]")


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


def drop_lines_after(path: str | os.PathLike[str], step: int) -> int:
    """Applies the resume rule to a JSONL run file: keeps the lines with ``step <= step``.

    Lines that do not parse (a torn last line left by a kill) or carry no integer step
    are dropped with a warning, and so are lines logged after ``step``. The file is
    replaced atomically: a kill during the rewrite leaves the old file or the new one.
    A missing file is left missing.

    Returns:
      How many lines were dropped.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                line_step = int(json.loads(line).get("step", 0))
            except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
                logging.warning("Dropping unreadable line in %s: %r", path, line[:200])
                dropped += 1
                continue
            if line_step <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    atomic_write_lines(path, kept)
    return dropped


class MetricWriter:
    """Appends metric lines to ``workdir/metrics.jsonl``, flushing after every write.

    Args:
      workdir: the run directory; created if missing.
      enabled: whether this process writes. ``None`` means "only JAX process 0", so a
        multi-host run writes each line once; the other processes get a no-op writer.
      tensorboard: also write every finite scalar to ``workdir/tensorboard``.
      wandb_project: also log to this Weights & Biases project (empty: off). Skipped
        with a warning when ``wandb`` is not installed.
      run_config: the config recorded with a Weights & Biases run.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        enabled: bool | None = None,
        tensorboard: bool = True,
        wandb_project: str = "",
        run_config: Mapping[str, Any] | None = None,
    ):
        if enabled is None:
            import jax

            enabled = jax.process_index() == 0
        self.enabled = enabled
        self.workdir = os.fspath(workdir)
        self.path = os.path.join(self.workdir, METRICS_FILE)
        self._file = None
        self._tb = None
        self._tensorboard = tensorboard and enabled
        self._wandb = None
        if self.enabled:
            os.makedirs(self.workdir, exist_ok=True)
            # Held open across writes (closed by close()), so no context manager.
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            if wandb_project:
                self._wandb = _start_wandb(wandb_project, self.workdir, run_config)
        if self._tensorboard:
            self._open_tensorboard(purge_step=None)

    def _open_tensorboard(self, purge_step: int | None) -> None:
        from tensorboardX import SummaryWriter

        # purge_step: TensorBoard hides events at or after it that an earlier,
        # interrupted writer left behind, so a resumed run's curves do not fork.
        self._tb = SummaryWriter(
            os.path.join(self.workdir, TENSORBOARD_DIR), purge_step=purge_step, flush_secs=10
        )

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
        self._write_scalars(record)
        return record

    def _write_scalars(self, record: Mapping[str, Any]) -> None:
        if self._tb is None and self._wandb is None:
            return
        step = record["step"]
        scalars = {
            k: float(v)
            for k, v in record.items()
            if k not in ("step", "stage") and isinstance(v, int | float)
            and not isinstance(v, bool) and math.isfinite(v)
        }  # fmt: skip
        if self._tb is not None:
            for key, value in scalars.items():
                # TensorBoard tags allow [A-Za-z0-9_./-] only ("pass@1" -> "pass_1").
                self._tb.add_scalar(_ILLEGAL_TAG_CHARS.sub("_", key), value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

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
        drop_lines_after(self.path, step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        if self._tb is not None:
            self._tb.close()
            self._open_tensorboard(purge_step=step + 1)
        self._write_record({"step": step, "event": "resumed", "resumed_from_step": step})
        logging.info("Resumed from step %d; metrics after it dropped from %s.", step, self.path)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

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


def _start_wandb(project: str, workdir: str, run_config: Mapping[str, Any] | None):
    try:
        import wandb
    except ImportError:
        logging.warning("wandb_project=%r but wandb is not installed; not logging to it", project)
        return None
    # One W&B run per workdir: a resumed run continues the same W&B run.
    id_path = os.path.join(workdir, "wandb_run_id")
    if os.path.exists(id_path):
        with open(id_path, encoding="utf-8") as f:
            run_id = f.read().strip()
    else:
        run_id = wandb.util.generate_id()
        atomic_write_text(id_path, run_id)
    return wandb.init(
        project=project, dir=workdir, id=run_id, resume="allow",
        config=dict(run_config or {}),
    )  # fmt: skip


class Progress:
    """A console progress bar (tqdm) with rate, ETA and a few key metrics.

    ``enabled=None`` shows it only on a terminal, so log files stay clean.
    """

    def __init__(self, total: int | None, desc: str, *, initial: int = 0, enabled=None):
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True,
            disable=None if enabled is None else not enabled,
        )  # fmt: skip

    def update(self, metrics: Mapping[str, Any] | None = None, n: int = 1) -> None:
        if metrics:
            self._bar.set_postfix(
                {k.split("/")[-1]: f"{float(v):.3g}" for k, v in metrics.items()},
                refresh=False,
            )  # fmt: skip
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


class StepProfiler:
    """JAX profiler traces of chosen global steps, into ``logdir`` (TensorBoard's
    profile plugin or Perfetto read them).

    Call ``start(step)`` before a step's work and ``stop(step, result)`` after it;
    ``stop`` waits for ``result``'s arrays so the trace holds the whole step.
    """

    def __init__(self, steps, logdir: str):
        self.steps = {int(s) for s in steps or ()}
        self.logdir = logdir
        self._active = False

    def start(self, step: int) -> None:
        if step in self.steps and not self._active:
            import jax

            os.makedirs(self.logdir, exist_ok=True)
            jax.profiler.start_trace(self.logdir)
            self._active = True

    def stop(self, step: int, result: Any = None) -> None:
        if self._active and step in self.steps:
            import jax

            jax.block_until_ready(result)
            jax.profiler.stop_trace()
            self._active = False
            logging.info("Profiled step %d into %s", step, self.logdir)

    def close(self) -> None:
        if self._active:
            import jax

            jax.profiler.stop_trace()
            self._active = False


def matmul_peak_flops(dtype: str = "float32", sizes=(512, 1024)) -> float:
    """The best jitted square-matmul rate of the default device, in FLOP/s.

    The denominator of ``time/mfu``: on a CPU there is no datasheet peak, so this
    measured rate stands in for it (on accelerators it is close to the datasheet's).
    For ``bfloat16`` the inputs are bfloat16 with float32 accumulation, the way
    rlpt's layers compute.
    """
    import time

    import jax
    import jax.numpy as jnp

    dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    best = 0.0
    for n in sizes:
        key_a, key_b = jax.random.split(jax.random.key(n))
        a = jax.random.normal(key_a, (n, n), jnp.float32).astype(dtype)
        b = jax.random.normal(key_b, (n, n), jnp.float32).astype(dtype)
        jax.block_until_ready(dot(a, b))
        times = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(dot(a, b))
            times.append(time.perf_counter() - start)
        best = max(best, 2 * n**3 / min(times))
    return best


def rl_step_model_flops(
    n_params: int, batch: int, prompt_len: int, response_len: int, generated: int, *,
    epochs: int = 1, critic: bool = False, scored_tokens: int | None = None,
) -> float:  # fmt: skip
    """Model FLOPs of one RL step (the 2N-per-token forward, 6N-per-token training rule).

    Generation: a forward over prompts and every generated token. Scoring: the
    policy and the reference (and the critic) forward over the padded batch, or
    over ``scored_tokens`` (the real tokens, when sequences are packed). Update:
    forward and backward of the policy (and critic) per epoch. Attention's
    quadratic term is left out: at these lengths it is small beside the matmuls.
    """
    tokens = batch * (prompt_len + response_len) if scored_tokens is None else scored_tokens
    models = 2 if critic else 1
    gen = 2 * n_params * (batch * prompt_len + generated)
    score = 2 * n_params * tokens * (2 + (1 if critic else 0))
    update = 6 * n_params * tokens * epochs * models
    return float(gen + score + update)
