"""What a finished post-training run leaves besides its metrics: ``summary.json``, the
trained adapter or Hugging Face model, and learning-curve PNGs. Only process 0 calls
these."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from absl import logging

from rlpt.metrics import to_json_value
from rlpt.policy import adapter_name
from rlpt.runfiles import atomic_write_json

SUMMARY_FILE = "summary.json"
# A run of a Hugging Face model leaves its result here as an rlpt interop checkpoint
# (``python -m rlpt.interop.hf export DIR/model OUT [--adapter=NAME]``).
MODEL_DIR = "model"


def write_summary(
    workdir: str, meta: Mapping[str, Any], k: int, levels: Mapping[str, int], curriculum
) -> dict[str, Any]:
    """``summary.json`` (see the conventions) from the run's checkpointed record; written
    by process 0, returned by every process."""
    import jax

    ev = meta["eval"]

    def pick(which, split, key):
        return {d: r.get(key) for d, r in ev.get(which, {}).get(split, {}).items()}

    summary = {
        "eval": {
            "sft": pick("sft", "heldout", "pass@1"),
            "final": pick("final", "heldout", "pass@1"),
            "sft_pass_at_k": pick("sft", "heldout", f"pass@{k}"),
            "final_pass_at_k": pick("final", "heldout", f"pass@{k}"),
            "k": k,
            "ood": {
                "sft": pick("sft", "ood", "pass@1"),
                "final": pick("final", "ood", "pass@1"),
                "sft_pass_at_k": pick("sft", "ood", f"pass@{k}"),
                "final_pass_at_k": pick("final", "ood", f"pass@{k}"),
                "levels": {d: levels[d] + 1 for d in ev.get("final", {}).get("ood", {})},
            },
        },
        "curriculum": {
            "weights": dict(zip(curriculum.names, map(float, curriculum.last_probs))),
            "difficulty": dict(zip(curriculum.names, map(int, curriculum.level))),
        },
        "wall_s": float(meta["elapsed_s"]),
    }
    if ev.get("final", {}).get("train"):
        # The memorisation gap: the same greedy score on training-partition items.
        summary["eval"]["train"] = {
            "sft": pick("sft", "train", "pass@1"),
            "final": pick("final", "train", "pass@1"),
        }
    if any("pass@1_turns" in r for r in ev.get("final", {}).get("heldout", {}).values()):
        # Multi-turn runs (rollout.turns > 1): greedy pass@1 within the turns, beside the
        # first-turn pass@1 above.
        summary["eval"]["turns"] = {
            "sft": pick("sft", "heldout", "pass@1_turns"),
            "final": pick("final", "heldout", "pass@1_turns"),
        }
    if "rl_start_elapsed_s" in meta:
        # What the continued-SFT control gets instead of RL (sft.continued_wall_s).
        summary["rl_wall_s"] = float(meta["elapsed_s"]) - float(meta["rl_start_elapsed_s"])
    if meta.get("sft_best"):
        summary["sft_best"] = dict(meta["sft_best"])
    if meta.get("reward_models"):
        summary["reward_models"] = meta["reward_models"]
    if jax.process_index() == 0:
        atomic_write_json(os.path.join(workdir, SUMMARY_FILE), to_json_value(summary),
                          indent=2, sort_keys=True)  # fmt: skip
    return summary


def save_model_outputs(config, workdir: str, model_cfg, lora, trained, base) -> None:
    """The trained adapter as ``DIR/adapters/NAME``; for a Hugging Face model, also an
    interop checkpoint ``DIR/model`` (base weights plus that adapter) to export."""
    name = adapter_name(config)
    if lora is not None:
        from rlpt.interop.checkpoint import save_adapter

        path = save_adapter(workdir, name, lora, trained)
        logging.info("Saved LoRA adapter %r to %s", name, path)
    hf_path = config.model.hf_path
    if hf_path:
        from rlpt.interop import config_from_hf
        from rlpt.interop.checkpoint import save_adapter, save_checkpoint
        from rlpt.interop.model import read_hf_config

        hf_config = read_hf_config(hf_path)
        _, family = config_from_hf(hf_config, source=os.path.join(hf_path, "config.json"))
        out = os.path.join(workdir, MODEL_DIR)
        weights = base if lora is not None else trained
        save_checkpoint(out, model_cfg, weights, family=family, hf_config=hf_config,
                        tokenizer_dir=hf_path)  # fmt: skip
        if lora is not None:
            save_adapter(out, name, lora, trained)
        logging.info("Saved the post-trained model to %s", out)


def write_plots(workdir: str) -> None:
    """Learning curves as ``DIR/plots/*.png`` (``rlpt.plot``); a plotting failure is
    logged, never fatal to a finished run."""
    from rlpt import plot

    try:
        plot.write_plots(workdir)
    except Exception as e:  # noqa: BLE001 (any plotting error: the run's results stand)
        logging.warning("Could not write plots to %s: %s", workdir, e)
