"""What a stage of a post-training run receives: a small context, never the whole run.

``StageContext`` carries the step counter (backed by the checkpointed record
``meta``), named PRNG keys, the metrics sink, ``save``, the clocks and the stop
request. ``RunEvaluation`` is the evaluator role bound to the run's evaluation sets
and its ``samples.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import jax
from absl import logging

from rlpt.eval import Evaluator, flatten_results, format_table
from rlpt.metrics import Progress, StepProfiler, to_json_value

SAMPLES_FILE = "samples.jsonl"


@dataclasses.dataclass
class StageContext:
    """The part of a run a stage may touch."""

    meta: MutableMapping[str, Any]  # the checkpointed record: step, stage_step, ...
    keys: Mapping[str, jax.Array]  # named PRNG keys; derive per-step keys with fold_in
    writer: Callable[[int, Mapping[str, Any], str], None]  # (step, metrics, stage)
    save: Callable[[], None]
    elapsed: Callable[[], float]  # run wall time, interruptions excluded
    profiler: StepProfiler
    checkpoint_every: int = 1
    progress_enabled: bool | None = None
    stop_after_step: int | None = None

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def stage_step(self) -> int:
        return int(self.meta["stage_step"])

    def advance(self) -> int:
        """Counts one step of the current stage; returns the new global step."""
        self.meta["step"] += 1
        self.meta["stage_step"] += 1
        return self.step

    def write(self, metrics: Mapping[str, Any], stage: str) -> None:
        """One metrics line at the current global step."""
        self.writer(self.step, metrics, stage)

    def progress(self, total: int | None, desc: str) -> Progress:
        return Progress(total, desc, initial=self.stage_step, enabled=self.progress_enabled)

    def checkpoint_due(self, step: int) -> bool:
        return step % self.checkpoint_every == 0

    def should_stop(self, last: bool) -> bool:
        """Whether ``stop_after_step`` asks the run to stop after the current step."""
        stop = self.stop_after_step
        return stop is not None and self.step >= stop and not last


class RunEvaluation:
    """Held-out, OOD (and training-item) evaluation of the policy during a run."""

    def __init__(
        self,
        evaluator: Evaluator,
        eval_sets: Mapping[str, Any],
        eval_config,
        key: jax.Array,
        workdir: str,
        *,
        writes: bool = True,
    ):
        self.evaluator = evaluator
        self.eval_sets = eval_sets
        self.config = eval_config
        self.key = key
        self.samples_path = os.path.join(workdir, SAMPLES_FILE)
        self.writes = writes  # only one process of a multi-process run writes files

    def full(self, params, step: int, which: str, record: MutableMapping) -> dict[str, Any]:
        """Every split with pass@k; the results are kept in ``record[which]``."""
        e = self.config
        t0 = time.perf_counter()
        results, samples = self.evaluator.evaluate(
            params, self.eval_sets, jax.random.fold_in(self.key, step), n_samples=e.n_samples,
            k=e.k, log_samples=e.log_samples,
        )  # fmt: skip
        record[which] = results
        logging.info("Evaluation (%s) at step %d:\n%s", which, step, format_table(results, e.k))
        self._write_samples(samples, step, which)
        out = flatten_results(results, e.k)
        out["time/eval_s"] = time.perf_counter() - t0
        return out

    def periodic(self, params, step: int) -> dict[str, Any]:
        """Greedy pass@1 on (a subset of) the held-out split."""
        e = self.config
        t0 = time.perf_counter()
        held = {"heldout": self.eval_sets["heldout"]}
        results, samples = self.evaluator.evaluate(
            params, held, jax.random.fold_in(self.key, step), n_samples=0, k=e.k,
            max_items=e.periodic_items or None, log_samples=e.log_samples,
        )  # fmt: skip
        self._write_samples(samples, step, "periodic")
        out = flatten_results(results, e.k)
        out["time/eval_s"] = time.perf_counter() - t0
        return out

    def after_rl_step(
        self, policy_params, step: int, stage_step: int, total: int, record: MutableMapping
    ) -> dict[str, Any]:
        """What an RL stage's step ``stage_step`` of ``total`` evaluates: the full evaluation
        on the last step, the periodic one every ``eval.every`` steps, else nothing.
        ``policy_params`` is called only when an evaluation is due."""
        if stage_step == total:
            return self.full(policy_params(), step, "final", record)
        if self.config.every and stage_step % self.config.every == 0:
            return self.periodic(policy_params(), step)
        return {}

    def _write_samples(self, samples, step: int, which: str) -> None:
        if not self.writes:
            return
        with open(self.samples_path, "a", encoding="utf-8") as f:
            for s in samples:
                record = {"step": step, "eval": which, **s}
                f.write(json.dumps(to_json_value(record)) + "\n")
