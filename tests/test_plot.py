"""PNG learning curves from metrics.jsonl."""

import json
import subprocess
import sys

import pytest

from rlpt.plot import read_metrics, write_plots


def _write(tmp_path, records):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_plots_each_logged_group(tmp_path):
    records = [
        {"step": s, "stage": "ppo", "ppo/kl": 0.01 * s, "ppo/entropy": 1.0 / (s + 1),
         "eval/arithmetic/pass@1": 0.1 * s, "curriculum/arithmetic/weight": 0.5,
         "curriculum/arithmetic/difficulty": 1 + s // 2, "time/step_s": 0.1}
        for s in range(5)
    ]  # fmt: skip
    records.insert(2, {"step": 1, "event": "resumed", "resumed_from_step": 1})
    _write(tmp_path, records)
    written = write_plots(str(tmp_path))
    names = sorted(p.rsplit("/", 1)[1] for p in written)
    assert names == [
        "accuracy.png", "curriculum_difficulty.png", "curriculum_weights.png", "entropy.png",
        "kl.png",
    ]  # fmt: skip
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert read_metrics(str(tmp_path))["ppo/kl"][3] == (3, pytest.approx(0.03))


def test_cli_and_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "sft/loss": 2.0}\nnot json\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(str(tmp_path))
    # A run killed mid-line: the torn last line is skipped, the lines before it plotted.
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "sft/loss": 2.0}\n{"step": 1, "sft/lo')
    assert read_metrics(str(tmp_path)) == {"sft/loss": [(0, 2.0)]}
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "sft/loss": 2.0}\n')
    out = subprocess.run(
        [sys.executable, "-m", "rlpt.plot", str(tmp_path)], capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    assert json.loads(out.stdout.strip().splitlines()[-1])["plots"][0].endswith("losses.png")
