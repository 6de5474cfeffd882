"""The efficacy protocol: does RL turn what a warm start knows into what it reliably does?

``python -m rlpt.efficacy --config=experiments/efficacy.py --workdir=DIR --seeds=0,1,2``
runs, in this order (each run a ``python -m rlpt.train`` process of its own, so an
interrupted protocol resumes where it stopped; finished runs are not repeated):

1. **Tuning, on validation only.** For each PPO learning rate of ``--learning_rates``
   one RL run (the learned-curriculum arm from an SFT run of seed ``--tuning_seed``, kept
   apart from the reporting seeds); the rate with the best mean greedy pass@1 on the
   *validation* half of the held-out partition is used by every reporting run. Test items are never
   scored in this phase.
2. **Arms, per seed.** ``sft``: SFT on the fixed demonstration set to its best
   validation checkpoint, the warm start every other arm of the seed starts from
   (``model.init_from``); ``rl_uniform`` and ``rl_curriculum``: RL from it with uniform
   mixing or the learned curriculum; ``sft_more``: SFT continued from it on the same
   demonstrations (a fresh optimiser state) for ``rl_curriculum``'s RL wall clock.
3. **Test.** Every run's final policy is scored once on the *test* half: greedy pass@1
   and pass@k from ``--n_samples`` samples, plus the out-of-distribution splits.

The results (``DIR/results.json``, ``DIR/results.md``) give mean and standard error over
seeds per arm and domain, and the issue's targets checked on them: RL after SFT beats the
best SFT checkpoint by ``>= 20`` points on at least two domains without losing out of
distribution; RL's greedy pass@1 reaches the warm start's pass@k on at least two domains.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

ARMS = ("sft", "rl_uniform", "rl_curriculum", "sft_more")
# Targets of the protocol (issue: learning efficacy).
GAIN_POINTS = 0.20
DOMAINS_NEEDED = 2


@dataclasses.dataclass(frozen=True)
class Protocol:
    """Where and how the protocol runs; ``config`` is the experiment file (``path[:arg]``
    takes the arm as its argument, ``ARM`` or ``ARM,runlocal``)."""

    config: str
    workdir: str
    seeds: tuple[int, ...] = (0, 1, 2)
    learning_rates: tuple[float, ...] = (2e-4, 4e-4, 8e-4)
    tuning_seed: int = 100
    test_items: int = 200
    n_samples: int = 8
    k: int = 8
    runlocal: bool = False
    python: str = sys.executable

    def __post_init__(self):
        if len(self.seeds) < 1 or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds must be distinct, got {self.seeds}")
        if self.tuning_seed in self.seeds:
            raise ValueError(
                f"--tuning_seed {self.tuning_seed} is one of the reporting --seeds {self.seeds}: "
                "settings would be chosen on a run that reports"
            )
        if not self.learning_rates:
            raise ValueError("--learning_rates needs at least one value")
        if self.n_samples < self.k or self.k < 2:
            raise ValueError(f"need 2 <= k <= n_samples, got k={self.k}, n={self.n_samples}")

    def arm_arg(self, arm: str) -> str:
        return f"{self.config}:{arm}" + (",runlocal" if self.runlocal else "")


def _run_dir(protocol: Protocol, name: str) -> str:
    return os.path.join(protocol.workdir, name)


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _log(message: str) -> None:
    print(f"[efficacy {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def train_run(protocol: Protocol, name: str, arm: str, overrides: Mapping[str, Any]) -> dict:
    """Runs (or resumes, or reuses) one training run; returns its ``summary.json``."""
    workdir = _run_dir(protocol, name)
    summary_path = os.path.join(workdir, "summary.json")
    if os.path.isfile(summary_path):
        return _read_json(summary_path)
    args = [protocol.python, "-m", "rlpt.train", f"--config={protocol.arm_arg(arm)}",
            f"--workdir={workdir}"]  # fmt: skip
    args += [f"--config.{key}={value}" for key, value in sorted(overrides.items())]
    _log(f"train {name}: {' '.join(args[2:])}")
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    return _read_json(summary_path)


def evaluate_on_test(protocol: Protocol, name: str) -> dict:
    """The run's final policy on the test half (greedy pass@1, pass@k, OOD), once."""
    workdir = _run_dir(protocol, name)
    path = os.path.join(workdir, "test_eval.json")
    if os.path.isfile(path):
        return _read_json(path)
    args = [protocol.python, "-m", "rlpt.eval", f"--workdir={workdir}", "--heldout_split=test",
            f"--heldout_items={protocol.test_items}", f"--n_samples={protocol.n_samples}",
            f"--k={protocol.k}"]  # fmt: skip
    _log(f"test {name}")
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)
    return result


def validation_score(summary: Mapping[str, Any]) -> float:
    """Mean greedy pass@1 over domains of a run's final evaluation (on validation)."""
    final = summary["eval"]["final"]
    values = [v for v in final.values() if v is not None]
    if not values:
        raise ValueError("the run has no final evaluation to choose by")
    return float(np.mean(values))


def _from_warm_start(protocol: Protocol, sft_run: str, stages: tuple[str, ...]) -> dict:
    """Overrides that start an arm from a finished SFT run's kept parameters."""
    return {"model.init_from": _run_dir(protocol, sft_run), "stages": repr(stages)}


def tune(protocol: Protocol) -> dict[str, Any]:
    """The learning rate with the best validation score; the scores of every candidate."""
    scores = {}
    seed = {"seed": protocol.tuning_seed}
    train_run(protocol, "tune/sft", "sft", seed)
    for lr in protocol.learning_rates:
        summary = train_run(
            protocol, f"tune/lr{lr:g}", "rl_curriculum",
            {**seed, "ppo.learning_rate": lr, **_from_warm_start(protocol, "tune/sft", ("ppo",))},
        )  # fmt: skip
        scores[f"{lr:g}"] = validation_score(summary)
    best = max(protocol.learning_rates, key=lambda lr: scores[f"{lr:g}"])
    return {"learning_rate": best, "validation_pass@1": scores}


def run_seed(protocol: Protocol, seed: int, learning_rate: float) -> dict[str, dict]:
    """Every arm of one seed, trained and tested; ``{arm: test result}``."""
    base = {"seed": seed, "ppo.learning_rate": learning_rate}
    warm = f"seed{seed}/sft"
    train_run(protocol, warm, "sft", base)
    # Every other arm starts from that run's kept parameters: one warm start per seed.
    rl_start = {**base, **_from_warm_start(protocol, warm, ("ppo",))}
    train_run(protocol, f"seed{seed}/rl_uniform", "rl_uniform", rl_start)
    rl = train_run(protocol, f"seed{seed}/rl_curriculum", "rl_curriculum", rl_start)
    train_run(
        protocol, f"seed{seed}/sft_more", "sft_more",
        {**base, **_from_warm_start(protocol, warm, ("sft_continued",)),
         "sft.continued_wall_s": round(float(rl["rl_wall_s"]), 1)},
    )  # fmt: skip
    return {arm: evaluate_on_test(protocol, f"seed{seed}/{arm}") for arm in ARMS}


def _mean_se(values: Sequence[float]) -> dict[str, float]:
    x = np.asarray([v for v in values if v is not None and not math.isnan(v)], np.float64)
    if x.size == 0:
        return {"mean": float("nan"), "se": float("nan"), "n": 0}
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else float("nan")
    return {"mean": float(x.mean()), "se": se, "n": int(x.size)}


def aggregate(per_seed: Mapping[int, Mapping[str, Mapping[str, Any]]], k: int) -> dict[str, Any]:
    """Mean and standard error over seeds of each arm's test scores, and the targets.

    Differences between arms are paired by seed (the arms of a seed share its warm start),
    so their standard error is that of the per-seed differences.
    """
    seeds = sorted(per_seed)
    first = per_seed[seeds[0]]["sft"]["results"]
    domains = sorted(first["heldout"])
    ood_splits = sorted(s for s in first if s not in ("heldout", "train"))

    def score(seed, arm, split, domain, key):
        entry = per_seed[seed][arm]["results"].get(split, {}).get(domain)
        return None if entry is None else entry.get(key)

    table: dict[str, Any] = {}
    for arm in ARMS:
        table[arm] = {}
        for domain in domains:
            row = {
                "pass@1": _mean_se([score(s, arm, "heldout", domain, "pass@1") for s in seeds]),
                f"pass@{k}": _mean_se(
                    [score(s, arm, "heldout", domain, f"pass@{k}") for s in seeds]
                ),
            }
            for split in ood_splits:
                row[f"{split}/pass@1"] = _mean_se(
                    [score(s, arm, split, domain, "pass@1") for s in seeds]
                )
            table[arm][domain] = row

    def paired(arm_a, key_a, arm_b, key_b, domain, split="heldout"):
        diffs = []
        for s in seeds:
            a, b = score(s, arm_a, split, domain, key_a), score(s, arm_b, split, domain, key_b)
            if a is not None and b is not None:
                diffs.append(a - b)
        return _mean_se(diffs)

    targets: dict[str, Any] = {}
    for arm in ("rl_uniform", "rl_curriculum"):
        gain = {d: paired(arm, "pass@1", "sft", "pass@1", d) for d in domains}
        reach = {d: paired(arm, "pass@1", "sft", f"pass@{k}", d) for d in domains}
        ood = {
            split: {d: paired(arm, "pass@1", "sft", "pass@1", d, split) for d in domains}
            for split in ood_splits
        }
        gained = [d for d in domains if gain[d]["mean"] >= GAIN_POINTS]
        # Only where the warm start had something to make reliable: its pass@k above its
        # greedy pass@1 (a warm start at 0 everywhere is "reached" by any policy).
        headroom = {d: paired("sft", f"pass@{k}", "sft", "pass@1", d)["mean"] for d in domains}
        reached = [d for d in domains if reach[d]["mean"] >= 0.0 and headroom[d] > 0]
        # "Does not lose out of distribution": no OOD mean drop beyond its standard error.
        lost = [
            f"{split}/{d}" for split in ood_splits for d in domains
            if ood[split][d]["n"] and ood[split][d]["mean"] + (ood[split][d]["se"] or 0) < 0
        ]  # fmt: skip
        targets[arm] = {
            "gain_over_best_sft": gain,
            f"greedy_minus_warm_start_pass@{k}": reach,
            "ood_change": ood,
            "domains_gaining_20_points": gained,
            f"domains_reaching_warm_start_pass@{k}": reached,
            "ood_losses": lost,
            "gain_target_met": len(gained) >= DOMAINS_NEEDED and not lost,
            "reach_target_met": len(reached) >= DOMAINS_NEEDED,
        }
    return {"seeds": seeds, "k": k, "domains": domains, "arms": table, "targets": targets}


def _cell(entry: Mapping[str, float]) -> str:
    if not entry["n"]:
        return "-"
    se = "" if math.isnan(entry["se"]) else f" ± {entry['se']:.3f}"
    return f"{entry['mean']:.3f}{se}"


def format_markdown(results: Mapping[str, Any], command: str) -> str:
    """The results table as markdown, with the command that reproduces it."""
    k = results["k"]
    lines = [
        "# Efficacy protocol: results on the test split",
        "",
        f"Reproduce: `{command}`",
        "",
        f"Seeds {results['seeds']}; mean ± standard error over seeds. PPO learning rate "
        f"{results['tuning']['learning_rate']:g}, chosen on validation "
        f"(validation pass@1 by rate: {results['tuning']['validation_pass@1']}).",
        "",
    ]
    columns = list(next(iter(next(iter(results["arms"].values())).values())))
    lines.append("| arm | domain | " + " | ".join(columns) + " |")
    lines.append("|---|---|" + "---|" * len(columns))
    for arm, by_domain in results["arms"].items():
        for domain, row in by_domain.items():
            lines.append(
                f"| {arm} | {domain} | " + " | ".join(_cell(row[c]) for c in columns) + " |"
            )
    lines += ["", "## Targets", ""]
    for arm, t in results["targets"].items():
        gains = ", ".join(f"{d} {_cell(v)}" for d, v in t["gain_over_best_sft"].items())
        reach = ", ".join(
            f"{d} {_cell(v)}" for d, v in t[f"greedy_minus_warm_start_pass@{k}"].items()
        )
        lines += [
            f"- **{arm}**: gain over the best SFT checkpoint (paired by seed): {gains}; "
            f">= 20 points on {t['domains_gaining_20_points'] or 'no domain'}; OOD losses: "
            f"{t['ood_losses'] or 'none'}; target {'met' if t['gain_target_met'] else 'NOT met'}.",
            f"  Greedy pass@1 minus the warm start's pass@{k}: {reach}; target "
            f"{'met' if t['reach_target_met'] else 'NOT met'}.",
        ]
    lines += _diagnostics_markdown(results.get("diagnostics", {}))
    return "\n".join(lines) + "\n"


def _diagnostics_markdown(diagnostics: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Training-prompt success at the start and end of each RL arm, mean over seeds."""
    rows = []
    for arm, by_seed in diagnostics.items():
        runs = [d for d in by_seed.values() if d]
        if not runs:
            continue
        domains = sorted({dom for d in runs for dom in d["first"]["success"]})
        for dom in domains:
            cells = []
            for part in ("first", "last"):
                values = [d[part]["success"].get(dom) for d in runs]
                cells.append(_cell(_mean_se(values)))
            rows.append(f"| {arm} | {dom} | {cells[0]} | {cells[1]} |")
        kl = [_cell(_mean_se([d[p]["kl"] for d in runs])) for p in ("first", "last")]
        ent = [_cell(_mean_se([d[p]["entropy"] for d in runs])) for p in ("first", "last")]
        rows.append(f"| {arm} | KL to reference | {kl[0]} | {kl[1]} |")
        rows.append(f"| {arm} | policy entropy | {ent[0]} | {ent[1]} |")
    if not rows:
        return []
    return [
        "", "## What RL did on its training prompts", "",
        "Sampled success on the prompts each PPO step trained on (rollout temperature), "
        "mean over the first and the last fifth of the steps; mean ± standard error over "
        "seeds.", "",
        "| arm | domain | first fifth | last fifth |", "|---|---|---|---|", *rows,
    ]  # fmt: skip


def rl_diagnostics(workdir: str, fraction: float = 0.2) -> dict[str, Any]:
    """What an RL run did on its training prompts, from its ``metrics.jsonl``: per domain,
    the mean sampled success over the first and the last ``fraction`` of its PPO steps,
    and the mean KL to the reference and policy entropy over those steps. ``{}`` for a
    run without a metrics file (nothing to diagnose)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        steps = [r for r in map(json.loads, f) if r.get("stage") == "ppo"]
    if not steps:
        return {}
    n = max(1, int(round(len(steps) * fraction)))

    def mean(rows, key):
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        values = [v for v in values if math.isfinite(v)]
        return float(np.mean(values)) if values else None

    out: dict[str, Any] = {"ppo_steps": len(steps)}
    for name, rows in (("first", steps[:n]), ("last", steps[-n:])):
        keys = {k for r in rows for k in r}
        domains = sorted(
            k.split("/")[1] for k in keys
            if k.startswith("ppo/") and k.endswith("/success") and k.count("/") == 2
        )  # fmt: skip
        out[name] = {
            "success": {d: mean(rows, f"ppo/{d}/success") for d in domains},
            "kl": mean(rows, "ppo/kl"),
            "entropy": mean(rows, "ppo/entropy"),
        }
    return out


def run_protocol(protocol: Protocol, command: str = "") -> dict[str, Any]:
    """Tuning, every arm of every seed, the test evaluations and the results files."""
    os.makedirs(protocol.workdir, exist_ok=True)
    tuning = tune(protocol)
    _log(f"chosen on validation: learning rate {tuning['learning_rate']:g} {tuning}")
    per_seed = {s: run_seed(protocol, s, tuning["learning_rate"]) for s in protocol.seeds}
    results = {**aggregate(per_seed, protocol.k), "tuning": tuning}
    results["diagnostics"] = {
        arm: {str(s): rl_diagnostics(_run_dir(protocol, f"seed{s}/{arm}")) for s in protocol.seeds}
        for arm in ("rl_uniform", "rl_curriculum")
    }
    with open(os.path.join(protocol.workdir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, sort_keys=True)
    with open(os.path.join(protocol.workdir, "results.md"), "w", encoding="utf-8") as f:
        f.write(format_markdown(results, command))
    return results


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    protocol = Protocol(
        config=_CONFIG.value, workdir=_WORKDIR.value,
        seeds=tuple(int(s) for s in _SEEDS.value),
        learning_rates=tuple(float(v) for v in _LRS.value), tuning_seed=_TUNING_SEED.value,
        test_items=_TEST_ITEMS.value, n_samples=_N_SAMPLES.value, k=_K.value,
        runlocal=_RUNLOCAL.value,
    )  # fmt: skip
    results = run_protocol(protocol, command="python -m rlpt.efficacy " + " ".join(argv_flags()))
    print(json.dumps({"targets": {a: {k: v for k, v in t.items() if k.endswith("met")}
                                  for a, t in results["targets"].items()}}))  # fmt: skip


def argv_flags() -> list[str]:
    return [a for a in sys.argv[1:] if a.startswith("--")]


if __name__ == "__main__":
    from absl import app, flags

    _CONFIG = flags.DEFINE_string("config", "experiments/efficacy.py", "The experiment file.")
    _WORKDIR = flags.DEFINE_string("workdir", None, "Directory for every run and the results.")
    _SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Reporting seeds.")
    _LRS = flags.DEFINE_list("learning_rates", ["2e-4", "4e-4", "8e-4"],
                             "PPO learning rates tried on validation.")  # fmt: skip
    _TUNING_SEED = flags.DEFINE_integer("tuning_seed", 100, "Seed of the tuning runs.")
    _TEST_ITEMS = flags.DEFINE_integer("test_items", 200, "Test items per domain.")
    _N_SAMPLES = flags.DEFINE_integer("n_samples", 8, "Samples per test item for pass@k.")
    _K = flags.DEFINE_integer("k", 8, "k of pass@k.")
    _RUNLOCAL = flags.DEFINE_bool("runlocal", False, "Tiny runs of every arm: a smoke test.")
    flags.mark_flag_as_required("workdir")
    app.run(main)
