"""The efficacy protocol's driver: order of runs, choice on validation, aggregation."""

import json
import math
import os
import stat
import sys

import pytest

from rlpt import efficacy

# A stand-in for the Python interpreter: it records each command and writes what
# `rlpt.train` and `rlpt.eval` would, with scores fixed by the arguments.
_FAKE = r"""#!PYTHON
import json, os, sys
args = sys.argv[1:]
with open(os.environ["EFFICACY_LOG"], "a") as f:
    f.write(json.dumps(args) + "\n")
flags = dict(a[2:].split("=", 1) for a in args if a.startswith("--"))
workdir = flags["workdir"]
os.makedirs(workdir, exist_ok=True)
if args[1] == "rlpt.train":
    lr = float(flags.get("config.ppo.learning_rate", 0))
    # Validation score peaks at lr 4e-4.
    score = {2e-4: 0.3, 4e-4: 0.5, 8e-4: 0.4}.get(lr, 0.0)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump({"eval": {"final": {"a": score, "b": score}}, "rl_wall_s": 123.4}, f)
else:
    arm = os.path.basename(workdir)
    seed = int(os.path.basename(os.path.dirname(workdir))[len("seed"):])
    base = {"sft": 0.2, "rl_uniform": 0.45, "rl_curriculum": 0.5, "sft_more": 0.25}[arm]
    def entry(p1):
        return {"pass@1": p1, "pass@8": min(1.0, p1 + 0.3)}
    results = {
        "heldout": {"a": entry(base + 0.01 * seed), "b": entry(base / 2)},
        "ood": {"a": entry(0.1), "b": entry(0.1 if arm == "sft" else 0.0)},
    }
    print("log line")
    print(json.dumps({"results": results, "k": 8}))
"""


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    path = tmp_path / "fake_python"
    path.write_text(_FAKE.replace("PYTHON", sys.executable, 1))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("EFFICACY_LOG", str(log))
    return str(path), log


def _calls(log):
    with open(log) as f:
        return [json.loads(line) for line in f]


def test_protocol_tunes_on_validation_runs_every_arm_and_tests_once(fake_python, tmp_path):
    python, log = fake_python
    protocol = efficacy.Protocol(config="experiments/efficacy.py", workdir=str(tmp_path / "p"),
                                 seeds=(0, 1), python=python)  # fmt: skip
    results = efficacy.run_protocol(protocol, command="cmd")
    calls = _calls(log)
    train = [c for c in calls if c[1] == "rlpt.train"]
    evals = [c for c in calls if c[1] == "rlpt.eval"]
    # A warm start and three tuning runs from it at the tuning seed, then four arms per
    # seed, every arm after the first from that seed's warm start.
    arms = [c[2].rsplit(":", 1)[1] for c in train]
    assert arms[:4] == ["sft"] + ["rl_curriculum"] * 3
    assert all("--config.seed=100" in c for c in train[:4])
    tune_start = f"--config.model.init_from={tmp_path / 'p' / 'tune' / 'sft'}"
    assert all(tune_start in c and "--config.stages=('ppo',)" in c for c in train[1:4])
    assert results["tuning"]["learning_rate"] == 4e-4
    for c in train[4:]:
        assert "--config.ppo.learning_rate=0.0004" in c
    assert arms[4:] == ["sft", "rl_uniform", "rl_curriculum", "sft_more"] * 2
    for seed, runs in ((0, train[4:8]), (1, train[8:12])):
        start = f"--config.model.init_from={tmp_path / 'p' / f'seed{seed}' / 'sft'}"
        assert not any(a.startswith("--config.model.init_from") for a in runs[0])
        assert all(start in c for c in runs[1:])
        assert "--config.stages=('sft_continued',)" in runs[3]
    # The continued-SFT control gets the RL arm's measured wall clock.
    assert all("--config.sft.continued_wall_s=123.4" in c for c in train[4:] if "sft_more" in c[2])
    # Test is scored once per reporting run, never for the tuning runs.
    assert len(evals) == 8 and all("--heldout_split=test" in c for c in evals)
    assert not any("/tune/" in a for c in evals for a in c)
    # A second call reuses every finished run and evaluation.
    efficacy.run_protocol(protocol)
    assert len(_calls(log)) == len(calls)
    assert os.path.isfile(tmp_path / "p" / "results.md")


def test_aggregate_pairs_arms_by_seed(fake_python, tmp_path):
    python, _ = fake_python
    protocol = efficacy.Protocol(config="experiments/efficacy.py", workdir=str(tmp_path / "p"),
                                 seeds=(0, 1, 2), python=python)  # fmt: skip
    results = efficacy.run_protocol(protocol)
    a = results["arms"]["rl_curriculum"]["a"]["pass@1"]
    # Seeds 0, 1, 2 give 0.50, 0.51, 0.52: mean 0.51, sd 0.01, se 0.01 / sqrt(3).
    assert a["mean"] == pytest.approx(0.51) and a["se"] == pytest.approx(0.01 / math.sqrt(3))
    t = results["targets"]["rl_curriculum"]
    # Domain a gains 0.30 over SFT in every seed (se 0); b gains 0.15: one domain of two.
    assert t["gain_over_best_sft"]["a"]["mean"] == pytest.approx(0.30)
    assert t["gain_over_best_sft"]["a"]["se"] == pytest.approx(0.0)
    assert t["domains_gaining_20_points"] == ["a"]
    # OOD on b drops 0.1 in every seed: a loss, so the target fails on two counts.
    assert t["ood_losses"] == ["ood/b"]
    assert t["gain_target_met"] is False
    # Greedy a (0.50 + 0.01 s) against SFT's pass@8 (0.50 + 0.01 s): reached (0.0);
    # b: 0.25 against 0.40: not.
    assert t["domains_reaching_warm_start_pass@8"] == ["a"]
    assert t["reach_target_met"] is False


def test_a_warm_start_with_nothing_to_reach_reaches_nothing():
    """Greedy 0 against a warm start's pass@k of 0 is no capability made reliable."""
    zero = {"pass@1": 0.0, "pass@8": 0.0}
    per_seed = {s: {arm: {"results": {"heldout": {"a": zero, "b": zero}}}
                    for arm in efficacy.ARMS} for s in (0, 1)}  # fmt: skip
    t = efficacy.aggregate(per_seed, 8)["targets"]["rl_curriculum"]
    assert t["domains_reaching_warm_start_pass@8"] == [] and t["reach_target_met"] is False


def test_settings_are_never_chosen_on_a_reporting_seed():
    with pytest.raises(ValueError, match="tuning_seed 0 is one of the reporting"):
        efficacy.Protocol(config="c", workdir="w", seeds=(0, 1), tuning_seed=0)
    with pytest.raises(ValueError, match="k <= n_samples"):
        efficacy.Protocol(config="c", workdir="w", n_samples=4, k=8)


def test_rl_diagnostics_average_the_first_and_last_fifth_of_ppo_steps(tmp_path):
    lines = [{"step": 1, "stage": "sft", "sft/loss": 1.0}]
    for i in range(10):  # ten PPO steps: a fifth is two
        lines.append({
            "step": 2 + i, "stage": "ppo", "ppo/a/success": i / 10, "ppo/b/success": 0.0,
            "ppo/kl": float(i), "ppo/entropy": 1.0 - i / 20, "ppo/success": 9.0,
        })  # fmt: skip
    lines[-1]["ppo/b/success"] = float("nan")  # a step without that domain's samples
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)
    d = efficacy.rl_diagnostics(str(tmp_path))
    assert d["ppo_steps"] == 10
    assert d["first"]["success"] == {"a": pytest.approx(0.05), "b": 0.0}
    assert d["last"]["success"] == {"a": pytest.approx(0.85), "b": 0.0}
    assert d["first"]["kl"] == pytest.approx(0.5) and d["last"]["kl"] == pytest.approx(8.5)
    assert d["last"]["entropy"] == pytest.approx(1.0 - 8.5 / 20)
    assert efficacy.rl_diagnostics(str(tmp_path / "absent")) == {}
    table = efficacy._diagnostics_markdown({"rl_uniform": {"0": d, "1": d, "2": {}}})
    assert "| rl_uniform | a | 0.050 ± 0.000 | 0.850 ± 0.000 |" in table
    assert efficacy._diagnostics_markdown({"rl_uniform": {"0": {}}}) == []
