"""Run checkpoints: array pytrees plus a JSON record, saved asynchronously with orbax.

A checkpoint at step ``N`` holds named pytree items (for post-training: the PPO or
SFT ``TrainState`` with policy, value and optimiser states, KL controller and key;
the frozen reference policy) and one JSON item ``meta`` (step, stage, the loader's
curriculum state, counters, the config the run was started with). Items may differ
between steps (an SFT checkpoint has no reference policy); ``meta["items"]`` lists
what a step holds, so ``restore`` asks for exactly those.

Saving is asynchronous (``enable_async_checkpointing``): the arrays are copied off
the device and written in the background while training goes on; ``wait`` blocks
until the last save is on disk. ``meta`` is serialised when ``save`` is called, so the
caller may change its dict at once. Orbax writes into a temporary directory and
renames it at the end, so a run killed mid-save leaves the previous checkpoint intact
and the torn one is ignored.

A checkpoint can still be damaged after it was committed (a disk that filled up, a
file truncated by a copy): ``restore_latest`` then falls back to the newest step that
restores, saying which step it skipped and why.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from rlpt.parallel.multihost import trainer_processes
from rlpt.runfiles import RunFileError, move_aside

CHECKPOINT_DIR = "checkpoints"
_META = "meta"


class Checkpointer:
    """``save(step, items, meta)`` every ``every`` steps, keeping the last ``keep``.

    Args:
      directory: where checkpoints live (``WORKDIR/checkpoints``); created if missing.
      keep: how many recent checkpoints to keep on disk.
      async_save: write in the background (``wait`` before reading them back).
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, keep: int = 2, async_save: bool = True
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        extra = {"create": True}
        trainers = trainer_processes()
        # The trainer runs in one process of several (the rest serve it a role).
        self._alone = len(trainers) < jax.process_count()
        if self._alone:
            # Processes that serve a role and never save (a remote rollout engine) stay out
            # of the checkpoint's barriers; orbax then leaves making the directory to us.
            extra["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
                primary_host=min(trainers), active_processes=trainers
            )
            extra["create"] = False
            os.makedirs(self.directory, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, **extra
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        # Filled by ``restore_latest``: each step it skipped, with its one-line error.
        self.skipped_steps: dict[int, str] = {}

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, items: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        """Starts saving ``items`` (pytrees of arrays) and ``meta`` (JSON) as step ``step``."""
        if _META in items:
            raise ValueError(f"item name {_META!r} is reserved for the JSON record")
        try:
            # A copy made now: the async save writes it later, while the caller goes on
            # changing its own dict (a shallow copy would share the nested ones).
            meta = json.loads(json.dumps({**meta, "items": sorted(items)}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"checkpoint {step}: meta is not JSON ({e})") from None
        if int(step) in self._manager.all_steps():
            # A step saved again (its record gained a final evaluation) replaces the old one.
            self._manager.wait_until_finished()
            self._manager.delete(int(step))
        if self._alone:
            # Orbax writes device arrays held by one process of several only as host
            # arrays; restoring places them on the targets' devices again.
            items = {name: jax.tree.map(_host_copy, tree) for name, tree in items.items()}
        args = {name: ocp.args.StandardSave(tree) for name, tree in items.items()}
        args[_META] = ocp.args.JsonSave(meta)
        self._manager.save(int(step), args=ocp.args.Composite(**args), force=True)

    def read_meta(self, step: int | None = None) -> dict[str, Any] | None:
        """The JSON record of ``step`` (default: the latest), or None without checkpoints."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()})
        )
        return dict(restored[_META])

    def restore(
        self, step: int, targets: Mapping[str, Any], *, only: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restores ``(items, meta)`` of ``step``.

        ``targets`` maps each item name to a pytree of the same structure (arrays or
        ``jax.ShapeDtypeStruct`` with shardings): restoring places every leaf as its
        target is placed, so a run may resume on a different mesh. A checkpoint
        item without a target is an error (a resume must not silently drop state)
        unless ``only``, which restores just the targeted items (to read a policy).
        """
        meta = self.read_meta(step)
        return self._restore_items(step, meta, targets, only=only), meta

    def restore_latest(
        self,
        targets_fn: Callable[[dict[str, Any]], Mapping[str, Any]],
        *,
        only: bool = False,
        set_aside_damaged: bool = False,
    ) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        """Restores the newest step that restores: ``(step, items, meta)``, or None.

        Tries the kept steps newest first. For each, reads its JSON record ``meta`` and
        calls ``targets_fn(meta)`` for the restore targets (as ``restore``'s ``targets``:
        templates may depend on ``meta["items"]``, the items that step holds). A step
        whose record or arrays cannot be read (a truncated or missing file) is skipped
        with one logged line naming it and its error, and the next older one is tried;
        ``skipped_steps`` then maps each skipped step to that error.
        ``set_aside_damaged`` also renames a skipped step's directory to
        ``STEP.damaged-N`` (orbax ignores it from then on; nothing is deleted), so the
        run's next saves and retention do not trip over it again.

        Errors of the caller (``targets_fn`` raising, items without a target) are
        raised at once, not taken for damage.

        Returns:
          None when the directory holds no checkpoint.

        Raises:
          RunFileError: checkpoints exist but none restores; the one-line message names
            the directory and each step's error.
        """
        self.skipped_steps = {}
        for step in sorted(self.all_steps(), reverse=True):
            try:
                meta = self.read_meta(step)
                items = meta["items"]
                if not isinstance(items, list):
                    raise ValueError(f"meta['items'] is {items!r}, not a list of item names")
            except Exception as e:  # noqa: BLE001 - any failure to read is damage
                self._skip(step, e, set_aside_damaged)
                continue
            targets = targets_fn(meta)
            self._check_targets(step, meta, targets, only=only)
            try:
                restored = self._restore_items(step, meta, targets, only=only)
            except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many types
                self._skip(step, e, set_aside_damaged)
                continue
            return step, restored, meta
        if self.skipped_steps:
            errors = "; ".join(f"step {s}: {e}" for s, e in self.skipped_steps.items())
            raise RunFileError(f"{self.directory}: no checkpoint restores ({errors})")
        return None

    def _skip(self, step: int, error: Exception, set_aside: bool) -> None:
        lines = str(error).strip().splitlines() or [""]
        message = f"{type(error).__name__}: {lines[0][:300]}"
        self.skipped_steps[step] = message
        where = ""
        if set_aside and jax.process_index() == 0:
            where = "; moved aside to " + move_aside(
                os.path.join(self.directory, str(step)), "damaged"
            )
            self._manager.reload()
        logging.warning(
            "Checkpoint step %d in %s does not restore, trying an older one (%s)%s",
            step, self.directory, message, where,
        )  # fmt: skip

    def _check_targets(
        self, step: int, meta: Mapping[str, Any], targets: Mapping[str, Any], *, only: bool
    ) -> None:
        missing = sorted(set(meta["items"]) - set(targets))
        if missing and not only:
            raise ValueError(
                f"checkpoint {step} holds items {missing} that no target was given for"
            )
        absent = sorted(set(targets) - set(meta["items"]))
        if absent:
            raise ValueError(f"checkpoint {step} holds no items {absent}")

    def _restore_items(
        self, step: int, meta: Mapping[str, Any], targets: Mapping[str, Any], *, only: bool
    ) -> dict[str, Any]:
        self._check_targets(step, meta, targets, only=only)
        names = [name for name in meta["items"] if name in targets]
        args = {name: ocp.args.StandardRestore(_abstract(targets[name])) for name in names}
        restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        return {name: restored[name] for name in names}

    def wait(self) -> None:
        """Blocks until every started save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _host_copy(x: Any) -> Any:
    return np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) else x


def _abstract(tree: Any) -> Any:
    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(leaf, tree)


def latest_checkpoint_meta(workdir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The JSON record of a run's newest checkpoint whose record reads, or None.

    Read only: a step whose record is damaged is skipped with a logged line, not moved.
    """
    directory = os.path.join(os.fspath(workdir), CHECKPOINT_DIR)
    if not os.path.isdir(directory):
        return None
    ckpt = Checkpointer(directory, async_save=False)
    try:
        for step in sorted(ckpt.all_steps(), reverse=True):
            try:
                return ckpt.read_meta(step)
            except Exception as e:  # noqa: BLE001 - any failure to read is damage
                ckpt._skip(step, e, set_aside=False)
        return None
    finally:
        ckpt.close()


__all__ = ["CHECKPOINT_DIR", "Checkpointer", "latest_checkpoint_meta"]
