"""Chunked reasoning in the post_train trainer: config checks and a tiny SFT + PPO run."""

import json
import math
import os

import pytest

from rlpt import chunked_eval
from rlpt.config import ConfigError, parse_config
from rlpt.trainers import post_train
from tests.trainers.experiment_configs import experiment_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**overrides):
    return experiment_config("long_reasoning", **overrides)


C = "rollout.chunked_reasoning"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({f"{C}.chunk_tokens": 0}, f"{C}.chunk_tokens must be >= 1, got 0"),
        ({f"{C}.carry_tokens": 16}, f"{C}.carry_tokens must be < {C}.chunk_tokens (16)"),
        ({f"{C}.carry_tokens": -1}, f"{C}.carry_tokens must be >= 0"),
        ({f"{C}.max_chunks": 0}, f"{C}.max_chunks must be >= 1"),
        ({f"{C}.budgets": (2, 5)}, f"{C}.budgets[1] must be in [1, {C}.max_chunks = 4]"),
        ({f"{C}.budget_steps": ()}, f"{C}.budget_steps must be 1 PPO steps"),
        ({f"{C}.budgets": (1, 2, 4), f"{C}.budget_steps": (3, 2)},
         f"{C}.budget_steps must be strictly increasing"),
        ({"ppo.estimator": "gae"}, f"{C}.enabled needs ppo.estimator one of"),
    ],
)  # fmt: skip
def test_bad_chunked_reasoning_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)").replace("]", r"\]")):  # fmt: skip
        parse_config(_config(**overrides))


def test_budget_schedule():
    overrides = {f"{C}.max_chunks": 8, f"{C}.budgets": (2, 4, 8), f"{C}.budget_steps": (10, 20)}
    c = parse_config(_config(**overrides)).rollout.chunked_reasoning
    assert [c.budget(s) for s in (0, 9, 10, 19, 20, 500)] == [2, 2, 4, 4, 8, 8]
    fixed = {f"{C}.budgets": (), f"{C}.budget_steps": ()}
    assert parse_config(_config(**fixed)).rollout.chunked_reasoning.budget(7) == 4


def test_a_window_larger_than_the_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=f"{C}.chunk_tokens"):
        post_train.PostTrainRun(_config(**{f"{C}.chunk_tokens": 40, f"{C}.carry_tokens": 8}),
                                str(tmp_path))  # fmt: skip


def test_ppo_with_chunked_reasoning_runs_and_no_pass_exceeds_one_window(tmp_path):
    # Only the final held-out evaluation is asserted on: no sampled or out-of-domain sets.
    config = _config(**{"rollout.sampler": "static", "eval.n_samples": 0, "eval.k": 1,
                        "eval.heldout_items": 2, "eval.ood_items": 0, "eval.train_items": 0,
                        "logging.plots": False})  # fmt: skip
    summary = post_train.train_and_evaluate(config, str(tmp_path))
    assert "state_tracking" in summary["eval"]["sft"]
    assert "state_tracking" in summary["eval"]["final"]
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    # SFT trained on chunk rows: level-1 demonstrations (about 20 tokens) fit one window,
    # so it ran and logged a finite loss.
    sft = [r for r in lines if r.get("stage") == "sft" and "sft/loss" in r]
    assert sft and all(math.isfinite(r["sft/loss"]) for r in sft)
    ppo = [r for r in lines if r.get("stage") == "ppo"]
    assert [r["ppo/max_chunks"] for r in ppo] == [2, 4]  # the length curriculum
    window = 48 + 16  # largest prompt bucket + one chunk = model.max_seq_len
    for r in ppo:
        assert r["ppo/window_max"] <= window
        assert 1 <= r["ppo/chunks_per_trace"] <= r["ppo/max_chunks"]
        assert r["ppo/trace_len_max"] <= 16 * r["ppo/max_chunks"]
    # The budget of the last step lets a trace grow past one window.
    assert 16 * ppo[-1]["ppo/max_chunks"] >= 64
    # The per-level evaluation of the checkpoint: greedy chunked traces, one window each.
    result = chunked_eval.evaluate_chunked(str(tmp_path), levels=[1], chunk_sizes=[16], items=2)
    level1 = result["results"]["state_tracking/C16"]["1"]
    assert result["carry_tokens"] == 8 and level1["items"] == 2
    assert 0.0 <= level1["pass@1"] <= 1.0 and 0.0 <= level1["counter_ok_frac"] <= 1.0
    assert level1["window_max"] <= window
    assert level1["trace_len_max"] <= 16 * level1["max_chunks"]
