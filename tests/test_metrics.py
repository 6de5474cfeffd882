"""MetricWriter: the metrics.jsonl format and the resume rule of the conventions."""

import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest

from rlpt.metrics import (
    METRICS_FILE,
    TENSORBOARD_DIR,
    MetricWriter,
    Progress,
    StepProfiler,
    drop_lines_after,
    matmul_peak_flops,
    rl_step_model_flops,
    to_json_value,
)


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


def test_resume_rewrites_the_file_atomically(tmp_path, monkeypatch):
    with MetricWriter(tmp_path, enabled=True) as writer:
        for step in (1, 2, 3):
            writer.write(step, {"ppo/kl": step})
    before = (tmp_path / METRICS_FILE).read_text()

    def killed(src, dst):
        raise KeyboardInterrupt("killed before the rename")

    # A kill between writing the new file and renaming it over the old one.
    monkeypatch.setattr("rlpt.runfiles.os.replace", killed)
    writer = MetricWriter(tmp_path, enabled=True, tensorboard=False)
    with pytest.raises(KeyboardInterrupt):
        writer.resume(1)
    writer.close()
    assert (tmp_path / METRICS_FILE).read_text() == before
    assert sorted(os.listdir(tmp_path)) == [METRICS_FILE, TENSORBOARD_DIR]


def test_drop_lines_after_applies_the_resume_rule_to_samples(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text(
        '{"step": 4, "eval": "periodic", "text": "a"}\n'
        '{"step": 8, "eval": "periodic", "text": "b"}\n'
        '["not", "a", "record"]\n'
        '{"step": 6, "text": "c"}\n'
        '{"step": 12, "eval": "per'
    )
    assert drop_lines_after(path, 6) == 3
    assert path.read_text() == (
        '{"step": 4, "eval": "periodic", "text": "a"}\n{"step": 6, "text": "c"}\n'
    )
    assert drop_lines_after(tmp_path / "absent.jsonl", 6) == 0
    assert not (tmp_path / "absent.jsonl").exists()


def test_disabled_writer_writes_nothing(tmp_path):
    with MetricWriter(tmp_path / "run", enabled=False) as writer:
        writer.write(1, {"sft/loss": 1.0})
        writer.resume(1)
    assert not (tmp_path / "run").exists()


def test_default_writes_on_process_zero(tmp_path):
    with MetricWriter(tmp_path) as writer:
        assert writer.enabled


def _tensorboard_scalars(workdir):
    """Every scalar in the event files, decoded from TFRecord framing by hand."""
    import glob
    import struct

    from tensorboardX.proto import event_pb2

    scalars = []
    for path in sorted(glob.glob(str(workdir / TENSORBOARD_DIR / "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            # TFRecord: uint64 length, uint32 crc, payload, uint32 crc.
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            payload = data[pos + 12 : pos + 12 + length]
            pos += 12 + length + 4
            event = event_pb2.Event()
            event.ParseFromString(payload)
            if event.HasField("file_version"):
                continue
            for value in event.summary.value:
                scalars.append((event.step, value.tag, value.simple_value))
            if event.HasField("session_log"):
                scalars.append((event.step, "session_log", float(event.session_log.status)))
    return scalars


def test_tensorboard_holds_the_same_scalars_as_the_jsonl(tmp_path):
    with MetricWriter(tmp_path, enabled=True) as writer:
        writer.write(
            1, {"ppo/kl": 0.5, "time/step_s": 0.25, "ppo/note": "x", "e/pass@1": 1}, stage="ppo"
        )
        writer.write(2, {"ppo/kl": float("nan"), "ppo/success": 0.75}, stage="ppo")
    got = sorted(_tensorboard_scalars(tmp_path))
    # Strings and non-finite values are not scalars; everything else is.
    assert got == [
        (1, "e/pass_1", 1.0), (1, "ppo/kl", 0.5), (1, "time/step_s", 0.25),
        (2, "ppo/success", 0.75),
    ]  # fmt: skip


def test_tensorboard_off_writes_no_event_files(tmp_path):
    with MetricWriter(tmp_path, enabled=True, tensorboard=False) as writer:
        writer.write(1, {"a/b": 1.0})
    assert not (tmp_path / TENSORBOARD_DIR).exists()


def test_resume_purges_later_tensorboard_steps(tmp_path):
    with MetricWriter(tmp_path, enabled=True) as writer:
        for step in (1, 2, 3):
            writer.write(step, {"a/x": float(step)})
    with MetricWriter(tmp_path, enabled=True) as writer:
        writer.resume(1)
        writer.write(2, {"a/x": 20.0})
    events = _tensorboard_scalars(tmp_path)
    # The resumed writer marks steps after 1 as discarded (a SessionLog.START at
    # purge step 2), which TensorBoard uses to drop the stale 2 and 3.
    start = tensorboardX_session_start()
    assert (2, "session_log", float(start)) in events
    assert events[-1] == (2, "a/x", 20.0)


def tensorboardX_session_start():
    from tensorboardX.proto import event_pb2

    return event_pb2.SessionLog.START


def test_wandb_missing_only_warns(tmp_path, monkeypatch):
    import builtins
    import sys

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb here")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with MetricWriter(tmp_path, enabled=True, wandb_project="p") as writer:
        writer.write(1, {"a/x": 1.0})
    assert _read(tmp_path) == [{"step": 1, "a/x": 1.0}]


def test_progress_shows_rate_and_metrics(capsys):
    progress = Progress(4, "sft", enabled=True)
    for i in range(4):
        progress.update({"sft/loss": 1.0 / (i + 1)})
    progress.close()
    err = capsys.readouterr().err
    assert "sft" in err and "4/4" in err and "loss=0.25" in err and "step/s" in err


def test_progress_disabled_prints_nothing(capsys):
    progress = Progress(4, "sft", enabled=False)
    progress.update({"sft/loss": 1.0})
    progress.close()
    assert capsys.readouterr().err == ""


def test_step_profiler_traces_only_the_chosen_steps(tmp_path):
    import glob

    profiler = StepProfiler((2,), str(tmp_path / "prof"))
    for step in (1, 2, 3):
        profiler.start(step)
        result = jnp.arange(8.0).sum() * step
        profiler.stop(step, result)
    profiler.close()
    traces = glob.glob(str(tmp_path / "prof" / "**" / "*.xplane.pb"), recursive=True)
    assert len(traces) == 1
    assert not StepProfiler((), str(tmp_path / "none")).steps


def test_rl_step_model_flops_by_hand():
    # 10 params, batch 2, prompt 3, response 4, 5 generated tokens, 1 epoch, no critic:
    # generate 2*10*(2*3 + 5) = 220; score (policy + reference) 2 * 2*10*14 = 560;
    # update 6*10*14 = 840.
    assert rl_step_model_flops(10, 2, 3, 4, 5) == 220 + 560 + 840
    # A critic adds one scoring forward and a second trained model; epochs multiply updates.
    assert rl_step_model_flops(10, 2, 3, 4, 5, epochs=2, critic=True) == (
        220 + 3 * 280 + 2 * 2 * 840
    )


def test_matmul_peak_is_a_positive_rate():
    assert matmul_peak_flops(sizes=(64,)) > 0.0
