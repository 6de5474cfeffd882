"""MetricWriter: the metrics.jsonl format and the resume rule of the conventions."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest

from rlpt.metrics import METRICS_FILE, MetricWriter, to_json_value


def _read(workdir):
    with open(workdir / METRICS_FILE, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_lines_hold_step_stage_and_namespaced_keys(tmp_path):
    with MetricWriter(tmp_path, enabled=True) as writer:
        writer.write(1, {"ppo/kl": 0.5, "time/step_s": 0.1}, stage="ppo")
        writer.write(2, {"loss": 1.5}, stage="sft")
        writer.write(3, {"train/episode_return": 20.0})
    assert _read(tmp_path) == [
        {"step": 1, "stage": "ppo", "ppo/kl": 0.5, "time/step_s": 0.1},
        {"step": 2, "stage": "sft", "sft/loss": 1.5},
        {"step": 3, "train/episode_return": 20.0},
    ]


def test_bare_key_without_stage_is_an_error(tmp_path):
    with MetricWriter(tmp_path, enabled=True) as writer, pytest.raises(ValueError, match="loss"):
        writer.write(1, {"loss": 1.0})


def test_each_write_is_flushed(tmp_path):
    writer = MetricWriter(tmp_path, enabled=True)
    writer.write(7, {"sft/loss": 2.0})
    # Read while the writer is still open: a crash right now must not lose the line.
    assert _read(tmp_path) == [{"step": 7, "sft/loss": 2.0}]
    writer.close()


def test_jax_and_numpy_values_become_json_numbers(tmp_path):
    with MetricWriter(tmp_path, enabled=True) as writer:
        writer.write(
            np.int64(4),
            {
                "a/jax_f32": jnp.float32(0.25),
                "a/jax_int": jnp.asarray(3, jnp.int32),
                "a/np_f64": np.float64(1.5),
                "a/np_bool": np.bool_(True),
                "a/vector": jnp.arange(2.0),
                "a/nan": float("nan"),
            },
        )
    (line,) = _read(tmp_path)
    assert line == {
        "step": 4,
        "a/jax_f32": 0.25,
        "a/jax_int": 3,
        "a/np_f64": 1.5,
        "a/np_bool": True,
        "a/vector": [0.0, 1.0],
        "a/nan": "nan",
    }
    assert type(line["a/jax_int"]) is int


def test_to_json_value_handles_nested_mappings():
    assert to_json_value({"x": (np.float32(2.0), {"y": math.inf})}) == {"x": [2.0, {"y": "inf"}]}


def test_appends_to_an_existing_file(tmp_path):
    with MetricWriter(tmp_path, enabled=True) as writer:
        writer.write(1, {"sft/loss": 1.0})
    with MetricWriter(tmp_path, enabled=True) as writer:
        writer.write(2, {"sft/loss": 0.5})
    assert [line["step"] for line in _read(tmp_path)] == [1, 2]


def test_resume_drops_later_lines_and_writes_the_resumed_line(tmp_path):
    with MetricWriter(tmp_path, enabled=True) as writer:
        for step in (10, 20, 30, 40):
            writer.write(step, {"ppo/kl": step / 10})
    with open(tmp_path / METRICS_FILE, "a", encoding="utf-8") as f:
        f.write('{"step": 50, "ppo/k')  # a line torn by the crash
    with MetricWriter(tmp_path, enabled=True) as writer:
        with absltest.mock.patch("rlpt.metrics.logging.info") as log_info:
            writer.resume(20)
        writer.write(30, {"ppo/kl": 3.5})
    assert _read(tmp_path) == [
        {"step": 10, "ppo/kl": 1.0},
        {"step": 20, "ppo/kl": 2.0},
        {"step": 20, "event": "resumed", "resumed_from_step": 20},
        {"step": 30, "ppo/kl": 3.5},
    ]
    (message, *args), _ = log_info.call_args
    assert "Resumed from step" in message and args[0] == 20


def test_resume_on_an_empty_run(tmp_path):
    with MetricWriter(tmp_path, enabled=True) as writer:
        writer.resume(0)
    assert _read(tmp_path) == [{"step": 0, "event": "resumed", "resumed_from_step": 0}]


def test_disabled_writer_writes_nothing(tmp_path):
    with MetricWriter(tmp_path / "run", enabled=False) as writer:
        writer.write(1, {"sft/loss": 1.0})
        writer.resume(1)
    assert not (tmp_path / "run").exists()


def test_default_writes_on_process_zero(tmp_path):
    with MetricWriter(tmp_path) as writer:
        assert writer.enabled
