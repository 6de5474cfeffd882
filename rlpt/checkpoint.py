"""Run checkpoints: array pytrees plus a JSON record, saved asynchronously with orbax.

A checkpoint at step ``N`` holds named pytree items (for post-training: the PPO or
SFT ``TrainState`` with policy, value and optimiser states, KL controller and key;
the frozen reference policy) and one JSON item ``meta`` (step, stage, the loader's
curriculum state, counters, the config the run was started with). Items may differ
between steps (an SFT checkpoint has no reference policy); ``meta["items"]`` lists
what a step holds, so ``restore`` asks for exactly those.

Saving is asynchronous (``enable_async_checkpointing``): the arrays are copied off
the device and written in the background while training goes on; ``wait`` blocks
until the last save is on disk. Orbax writes into a temporary directory and renames
it at the end, so a run killed mid-save leaves the previous checkpoint intact and the
torn one is ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

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
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, items: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        """Starts saving ``items`` (pytrees of arrays) and ``meta`` (JSON) as step ``step``."""
        if _META in items:
            raise ValueError(f"item name {_META!r} is reserved for the JSON record")
        meta = {**meta, "items": sorted(items)}
        if int(step) in self._manager.all_steps():
            # A step saved again (its record gained a final evaluation) replaces the old one.
            self._manager.wait_until_finished()
            self._manager.delete(int(step))
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
        missing = sorted(set(meta["items"]) - set(targets))
        if missing and not only:
            raise ValueError(
                f"checkpoint {step} holds items {missing} that no target was given for"
            )
        absent = sorted(set(targets) - set(meta["items"]))
        if absent:
            raise ValueError(f"checkpoint {step} holds no items {absent}")
        names = [name for name in meta["items"] if name in targets]
        args = {name: ocp.args.StandardRestore(_abstract(targets[name])) for name in names}
        restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        return {name: restored[name] for name in names}, meta

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


def _abstract(tree: Any) -> Any:
    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(leaf, tree)


def latest_checkpoint_meta(workdir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The JSON record of a run's latest checkpoint, or None (reads without a manager lock)."""
    directory = os.path.join(os.fspath(workdir), CHECKPOINT_DIR)
    if not os.path.isdir(directory):
        return None
    ckpt = Checkpointer(directory, async_save=False)
    try:
        return ckpt.read_meta()
    finally:
        ckpt.close()


__all__ = ["CHECKPOINT_DIR", "Checkpointer", "latest_checkpoint_meta"]
