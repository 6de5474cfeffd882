"""Held-out accuracy against samples for several arms of runs, mean and standard error over seeds.

    python benchmarks/learning_curves.py sync=runs/sync_s0,runs/sync_s1,runs/sync_s2 \
        eta2=runs/eta2_s0,runs/eta2_s1 ...

Each argument is ``ARM=DIR[,DIR...]``: run directories of one arm, one per seed. Reads
each run's ``metrics.jsonl`` (greedy held-out ``eval/DOMAIN/pass@1`` lines, the SFT one
included as 0 samples) and ``config.json`` (``rollout.batch_size`` samples per PPO step),
and prints a table of the mean over domains at each evaluation (mean over seeds +- the
standard error) and, as the last line, a JSON object with the per-arm curves and the final
point's per-domain means, and each later arm's final accuracy minus the first arm's,
paired by seed (the directories' order). Points are matched by PPO step, so every run of an arm must
evaluate at the same steps; a run that stopped early contributes its evaluations so far.

``--target=DOMAIN:VALUE[,DOMAIN:VALUE...]`` (the curriculum check): per run, the samples
at the first evaluation where every named domain has reached its value (``null`` if it
never did), per arm their mean, each later arm's ratio to the first arm's paired by seed,
and each arm's mean sampling weight per domain (``curriculum/DOMAIN/weight``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import defaultdict


def _eval_scores(d: dict) -> dict[str, float]:
    """The greedy held-out ``eval/DOMAIN/pass@1`` values of one metrics line."""
    return {
        k.split("/")[1]: v
        for k, v in d.items()
        if k.startswith("eval/") and k.endswith("/pass@1") and k.count("/") == 2
    }


def _metrics(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _run_curve(workdir: str) -> tuple[dict[int, dict[str, float]], int]:
    """({samples: {domain: pass@1}}, samples per PPO step) of one run.

    Samples are those generated: a PPO step that drew several rounds of prompts to fill
    its update with varying groups (``ppo/rollout_rounds``) counts every round. The SFT
    stage's evaluation is the point at 0 samples; a run with no SFT stage that started
    from ``model.init_from`` takes its warm-start run's last SFT evaluation instead.
    """
    with open(os.path.join(workdir, "config.json")) as f:
        config = json.load(f)
    per_step = int(config["rollout"]["batch_size"])
    lines = _metrics(workdir)
    points: dict[int, dict[str, float]] = {}
    warm = config.get("model", {}).get("init_from") or ""
    if warm and not any(d.get("stage") == "sft" for d in lines):
        sft_evals = [s for s in map(_eval_scores, _metrics(warm)) if s]
        if sft_evals:
            points[0] = sft_evals[-1]
    generated = 0
    for d in lines:
        # One line per PPO step carries its rollout metrics (an evaluation shares it).
        if d.get("stage") == "ppo" and "ppo/loss" in d:
            generated += per_step * int(d.get("ppo/rollout_rounds", 1))
        scores = _eval_scores(d)
        if not scores:
            continue
        if d.get("stage") == "ppo":
            points[generated] = scores
        elif d.get("stage") == "sft":
            points[0] = scores
    return points, per_step


def _mean_se(values: list[float]) -> tuple[float, float | None]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def _paired_summary(values: list[float]) -> dict:
    mean, se = _mean_se(values)
    return {"mean": round(mean, 4), "se": None if se is None else round(se, 4),
            "pairs": len(values)}  # fmt: skip


def _samples_to_target(run: dict[int, dict[str, float]], target: dict[str, float]):
    for samples in sorted(run):
        if all(run[samples].get(d, -1.0) >= v for d, v in target.items()):
            return samples
    return None


def _mean_weights(workdir: str) -> dict[str, float]:
    """Mean over PPO steps of each domain's curriculum sampling weight."""
    weights: dict[str, list[float]] = defaultdict(list)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            d = json.loads(line) if line.strip() else {}
            for k, v in d.items():
                if k.startswith("curriculum/") and k.endswith("/weight"):
                    weights[k.split("/")[1]].append(v)
    return {d: round(sum(v) / len(v), 4) for d, v in weights.items()}


def main(argv: list[str]) -> None:
    target = None
    for arg in [a for a in argv if a.startswith("--target=")]:
        target = {d: float(v) for d, v in (p.split(":") for p in arg.split("=", 1)[1].split(","))}
    argv = [a for a in argv if not a.startswith("--target=")]
    if not argv:
        raise SystemExit(__doc__)
    report = {}
    to_target: dict[str, list] = {}
    finals: dict[str, list[float]] = {}
    for spec in argv:
        if "=" not in spec:
            raise SystemExit(f"expected ARM=DIR[,DIR...], got {spec!r}")
        arm, dirs = spec.split("=", 1)
        dir_list = [d for d in dirs.split(",") if d]
        runs = [_run_curve(d)[0] for d in dir_list]
        by_samples: dict[int, list[float]] = defaultdict(list)
        final_domains: dict[str, list[float]] = defaultdict(list)
        for run in runs:
            for samples, scores in run.items():
                by_samples[samples].append(sum(scores.values()) / len(scores))
            last = run[max(run)]
            for domain, value in last.items():
                final_domains[domain].append(value)
        curve = {}
        for samples in sorted(by_samples):
            mean, se = _mean_se(by_samples[samples])
            n = len(by_samples[samples])
            se_text = "  n/a" if se is None else f"{se:.3f}"
            curve[str(samples)] = {
                "mean": round(mean, 4), "se": None if se is None else round(se, 4), "seeds": n
            }  # fmt: skip
            print(f"{arm:12s} {samples:7d}  {mean:.3f} +- {se_text}  (n={n})")
        finals[arm] = [sum(run[max(run)].values()) / len(run[max(run)]) for run in runs]
        report[arm] = {
            "curve": curve,
            "final_by_domain": {d: round(_mean_se(v)[0], 4) for d, v in final_domains.items()},
            "runs": len(runs),
        }
        if target is not None:
            to_target[arm] = [_samples_to_target(run, target) for run in runs]
            reached = [s for s in to_target[arm] if s is not None]
            report[arm]["samples_to_target"] = to_target[arm]
            report[arm]["samples_to_target_mean"] = _mean_se(reached)[0] if reached else None
            report[arm]["curriculum_weights"] = [_mean_weights(d) for d in dir_list]
    # Arms share each seed's warm start (the SFT stage is the same for a seed), so the
    # difference at the last evaluation is paired by seed: the first arm is the reference.
    arms = list(finals)
    for arm in arms[1:]:
        pairs = [b - a for a, b in zip(finals[arms[0]], finals[arm])]
        if pairs:
            report[arm][f"final_minus_{arms[0]}"] = _paired_summary(pairs)
        if target is not None:
            ratios = [b / a for a, b in zip(to_target[arms[0]], to_target[arm]) if a and b]
            if ratios:
                report[arm][f"samples_ratio_vs_{arms[0]}"] = _paired_summary(ratios)
    if target is not None:
        report["target"] = target
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
