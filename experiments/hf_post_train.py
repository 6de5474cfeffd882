"""Post-train a Hugging Face Llama / Qwen2 checkpoint with the demo's pipeline.

Launch (the directory holds config.json, *.safetensors and tokenizer.json):

    python -m rlpt.train --config=experiments/hf_post_train.py \
        --config.model.hf_path=/path/to/hf_model --workdir=/tmp/rlpt_hf

Smoke run (a few steps of every stage):

    python -m rlpt.train --config=experiments/hf_post_train.py:runlocal \
        --config.model.hf_path=/path/to/hf_model --workdir=/tmp/rlpt_hf_smoke

The checkpoint's weights start the SFT warm start and its own tokenizer.json
(with `<step>` and `<answer>` added where missing) encodes the prompts; every
stage after that is the demo's (``experiments/demo.py``). Export the result
with ``python -m rlpt.interop.hf export``.
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections


def _demo_module():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo.py")
    spec = importlib.util.spec_from_file_location("rlpt_experiments_demo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The demo config with ``model.hf_path``; ``arg="runlocal"`` shrinks it to a smoke run."""
    demo = _demo_module()
    config = demo.get_config(None)
    # Required: the run refuses to start while it is empty.
    config.model.hf_path = ""
    # A pretrained model needs gentler steps than one trained from scratch.
    config.sft.learning_rate = 1e-4
    config.ppo.learning_rate = 1e-5
    if arg == "runlocal":
        demo.shrink_for_runlocal(config)
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; expected 'runlocal' or nothing")
    return config
