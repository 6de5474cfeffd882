"""``benchmarks/learning_curves.py``: samples counted as generated, warm starts, targets."""

import importlib.util
import json
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    path = os.path.join(REPO_ROOT, "benchmarks", "learning_curves.py")
    spec = importlib.util.spec_from_file_location("benchmarks_learning_curves", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_run(path, lines, batch_size=8, init_from=""):
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"rollout": {"batch_size": batch_size}, "model": {"init_from": init_from}}, f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    return str(path)


def _ppo(step, rounds, **scores):
    line = {"stage": "ppo", "step": step, "ppo/loss": 0.0, "ppo/rollout_rounds": rounds}
    line.update({f"eval/{d}/pass@1": v for d, v in scores.items()})
    return line


def test_samples_count_every_round_and_the_warm_start_is_the_first_point(tmp_path, capsys):
    lc = _load()
    warm = _write_run(
        tmp_path / "warm",
        [{"stage": "sft", "step": 5, "eval/a/pass@1": 0.1, "eval/b/pass@1": 0.2}],
    )
    # Rounds 2, 1, 3, 1 at 8 samples a round: 16, 24, 48, 56 samples generated.
    uniform = _write_run(
        tmp_path / "uniform",
        [_ppo(0, 2), _ppo(1, 1, a=0.3, b=0.2), _ppo(2, 3), _ppo(3, 1, a=0.5, b=0.4)],
        init_from=warm,
    )
    learned = _write_run(
        tmp_path / "learned",
        [_ppo(0, 1), _ppo(1, 2, a=0.5, b=0.45), _ppo(2, 1), _ppo(3, 1, a=0.6, b=0.5)],
        init_from=warm,
    )
    curve, generated = lc._run_curve(uniform)
    # Points line up by step (8 samples a step); the samples generated are every round's.
    assert curve == {0: {"a": 0.1, "b": 0.2}, 16: {"a": 0.3, "b": 0.2}, 32: {"a": 0.5, "b": 0.4}}
    assert generated == {0: 0, 16: 24, 32: 56}
    lc.main([f"uniform={uniform}", f"learned={learned}", "--target=a:0.45,b:0.4"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # uniform reaches both targets at 56 samples, learned at 8 + 16 = 24.
    assert report["uniform"]["samples_to_target"] == [56]
    assert report["learned"]["samples_to_target"] == [24]
    assert abs(report["learned"]["samples_ratio_vs_uniform"]["mean"] - round(24 / 56, 4)) < 1e-9
    # Each domain alone: a reaches 0.45 at step 3 (uniform, 56) and step 1 (learned, 24);
    # b reaches 0.4 at step 3 (uniform, 56) and step 1 (learned, 24) as well.
    assert report["uniform"]["samples_to_target_by_domain"] == {"a": [56], "b": [56]}
    assert report["learned"]["samples_to_target_by_domain"] == {"a": [24], "b": [24]}


def test_per_domain_targets_are_counted_separately(tmp_path, capsys):
    lc = _load()
    # uniform: a reaches 0.5 at step 1 (16 samples generated), b never reaches 0.5.
    uniform = _write_run(
        tmp_path / "uniform",
        [_ppo(0, 1), _ppo(1, 1, a=0.5, b=0.1), _ppo(2, 1), _ppo(3, 1, a=0.2, b=0.3)],
    )
    # learned: a at step 3 (32 samples), b at step 1 (16).
    learned = _write_run(
        tmp_path / "learned",
        [_ppo(0, 1), _ppo(1, 1, a=0.1, b=0.6), _ppo(2, 1), _ppo(3, 1, a=0.7, b=0.2)],
    )
    lc.main([f"uniform={uniform}", f"learned={learned}", "--target=a:0.5,b:0.5"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["uniform"]["samples_to_target_by_domain"] == {"a": [16], "b": [None]}
    assert report["learned"]["samples_to_target_by_domain"] == {"a": [32], "b": [16]}
    # Neither run had both at once; a's ratio is 32 / 16, b's has no pair to compare.
    assert report["uniform"]["samples_to_target"] == [None]
    assert report["learned"]["samples_to_target"] == [None]
    ratios = report["learned"]["samples_ratio_vs_uniform_by_domain"]
    assert ratios["a"]["mean"] == 2.0 and ratios["b"] is None


def test_a_run_with_its_own_sft_stage_ignores_init_from(tmp_path):
    lc = _load()
    run = _write_run(
        tmp_path / "run",
        [{"stage": "sft", "step": 3, "eval/a/pass@1": 0.25}, {"stage": "ppo", "step": 4,
          "ppo/loss": 0.0, "eval/a/pass@1": 0.5}],
    )  # fmt: skip
    assert lc._run_curve(run) == ({0: {"a": 0.25}, 8: {"a": 0.5}}, {0: 0, 8: 8})


def test_a_resumed_run_counts_each_step_once(tmp_path):
    lc = _load()
    # Steps 0-1 logged, then the run resumed from step 0's checkpoint and logged 1-2 again.
    lines = [_ppo(0, 2), _ppo(1, 1), _ppo(1, 3), _ppo(2, 1, a=0.5)]
    run = _write_run(tmp_path / "run", lines)
    assert lc._run_curve(run) == ({24: {"a": 0.5}}, {0: 0, 24: 8 * (2 + 3 + 1)})
