"""Trainer registry: ``config.trainer`` names which ``train_and_evaluate`` runs a config.

Entries are import paths, resolved only when chosen, so that checking a name costs
nothing (no gymnasium or model imports, no compilation) and a trainer's optional
dependencies load only for the runs that use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import ml_collections

TrainFn = Callable[[ml_collections.ConfigDict, str], dict[str, Any]]

# name -> "module:function". Add new trainers here (for example ``post_train``).
TRAINERS: dict[str, str] = {
    "ppo_gym": "rlpt.trainers.ppo_gym:train_and_evaluate",
    "post_train": "rlpt.trainers.post_train:train_and_evaluate",
}


def check_trainer(name: str) -> None:
    """Raises ValueError naming the allowed values if ``name`` is not registered."""
    if name not in TRAINERS:
        raise ValueError(f"unknown trainer {name!r}; allowed values: {sorted(TRAINERS)}")


def get_trainer(name: str) -> TrainFn:
    """Returns the ``train_and_evaluate(config, workdir)`` function registered as ``name``."""
    check_trainer(name)
    module_name, fn_name = TRAINERS[name].split(":")
    return getattr(importlib.import_module(module_name), fn_name)


__all__ = ["TRAINERS", "TrainFn", "check_trainer", "get_trainer"]
