"""Learning curves from a run's metrics.jsonl, as PNG files.

    python -m rlpt.plot DIR

Writes ``DIR/plots/NAME.png`` for each group of metrics the run logged:
rewards, per-domain held-out accuracy, KL, entropy, losses, curriculum weights
and difficulty levels, episode returns. The last line of standard output is
JSON listing the files written.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict

from absl import app, logging

from rlpt.runfiles import atomic_file

# (file name, title, pattern of metric keys); a key may appear in several plots.
PLOTS = (
    ("rewards", "Rewards", r"(^|/)reward|episode_return"),
    ("accuracy", "Held-out accuracy", r"^eval/.*pass@"),
    ("kl", "KL to the reference", r"^ppo/(kl|rollout_kl|kl_coef)$"),
    ("entropy", "Policy entropy", r"/entropy$"),
    ("losses", "Losses", r"(^|/)[a-z_]*loss$"),
    ("curriculum_weights", "Curriculum weights", r"^curriculum/.*/weight$"),
    ("curriculum_difficulty", "Curriculum difficulty", r"^curriculum/.*/difficulty$"),
)


def read_metrics(workdir: str) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value), ...]} of every numeric metric (skips event lines and NaNs).

    A torn last line (a run killed mid-write, or one still writing) is skipped with a
    warning; a damaged line before it is an error naming the file and line.
    """
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics.jsonl in {workdir!r}")
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for line_number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if line_number == len(lines) and not raw.endswith("\n"):
                logging.warning("Skipping the torn last line of %s: %r", path, line[:200])
                continue
            raise ValueError(f"{path}:{line_number}: not JSON ({e})") from e
        step = record.get("step")
        for key, value in record.items():
            if key in ("step", "stage", "event") or isinstance(value, bool):
                continue
            if isinstance(value, int | float) and math.isfinite(value):
                series[key].append((step, float(value)))
    return dict(series)


def write_plots(workdir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to files
    import matplotlib.pyplot as plt

    series = read_metrics(workdir)
    out_dir = os.path.join(workdir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, title, pattern in PLOTS:
        keys = sorted(k for k in series if re.search(pattern, k) and not k.startswith("time/"))
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in keys:
            steps, values = zip(*series[key])
            ax.plot(steps, values, label=key, marker="." if len(steps) < 30 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        # A plot read while the run goes on must be whole: written aside, then renamed.
        with atomic_file(path, "wb") as f:
            fig.savefig(f, format="png", dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv):
    if len(argv) != 2:
        raise app.UsageError("usage: python -m rlpt.plot DIR")
    print(json.dumps({"plots": write_plots(argv[1])}))


if __name__ == "__main__":
    app.run(main)
