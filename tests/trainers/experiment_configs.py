"""An experiment file's config with dotted overrides, for the trainer tests."""

import importlib.util
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def experiment_config(name: str, arg: str = "runlocal", **overrides):
    """``experiments/NAME.py``'s ``get_config(arg)`` with ``{"a.b": value}`` overrides."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(REPO_ROOT, "experiments", f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg)
    for key, value in overrides.items():
        node = config
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return config
