"""The post_train trainer end to end on the demo's runlocal config (tiny model, every stage).

One uninterrupted reference run feeds the schema checks and is the oracle for the
resume test: a run stopped after a few steps and rerun must log exactly the same
metrics outside ``time/``. The config includes the sandboxed ``program_synthesis``.
"""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rlpt import eval as eval_lib
from rlpt import policy as policy_lib
from rlpt import train
from rlpt.config import parse_config
from rlpt.rl import PPOTrainer
from rlpt.roles import RewardRole
from rlpt.trainers import post_train
from tests.trainers.experiment_configs import experiment_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _demo_config(**overrides):
    config = experiment_config("demo", **overrides)
    config.lock()
    return config


def _read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _deterministic(records):
    """Metric lines without resume markers and machine-dependent keys."""
    out = []
    for r in records:
        if "event" in r:
            continue
        out.append({k: v for k, v in r.items() if not k.startswith("time/")})
    return out


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("post_train") / "reference")
    # Step 2 is traced with the JAX profiler: a control field, so resuming the
    # reference's config without it is still the same run.
    summary = train.train_and_evaluate(_demo_config(**{"profile.steps": (2,)}), workdir)
    return workdir, summary


def test_metrics_follow_the_conventions(reference_run):
    workdir, _ = reference_run
    records = _read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), "one line per step, increasing"
    stages = [r["stage"] for r in records]
    assert stages[0] == "sft" and stages[-1] == "ppo"
    assert stages.index("ppo") > max(i for i, s in enumerate(stages) if s == "sft")
    for r in records:
        for key in r:
            assert key in ("step", "stage") or "/" in key, key
    sft_lines = [r for r in records if r["stage"] == "sft"]
    assert all("sft/loss" in r for r in sft_lines)
    ppo_lines = [r for r in records if r["stage"] == "ppo"]
    for r in ppo_lines:
        for key in ("ppo/kl", "ppo/entropy", "ppo/sandbox_failures", "ppo/nonfinite_rewards",
                    "time/step_s", "time/generate_s", "time/score_s", "time/update_s",
                    "time/mfu"):  # fmt: skip
            assert key in r, key
        assert 0.0 < r["time/mfu"] < 1.0
        for domain in ("arithmetic", "stepwise_math", "program_synthesis"):
            assert f"curriculum/{domain}/weight" in r
            assert f"curriculum/{domain}/difficulty" in r
    # The warm start's evaluation closes SFT; the final one closes PPO; k = 2 in runlocal.
    for line in (sft_lines[-1], ppo_lines[-1]):
        for domain in ("arithmetic", "stepwise_math", "program_synthesis"):
            assert 0.0 <= line[f"eval/{domain}/pass@1"] <= 1.0
            assert 0.0 <= line[f"eval/{domain}/pass@2"] <= 1.0
            assert f"eval/{domain}/ood/pass@1" in line


def test_tensorboard_profile_and_plots_are_written(reference_run):
    import glob

    workdir, _ = reference_run
    assert glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))
    traces = glob.glob(os.path.join(workdir, "profile", "**", "*.xplane.pb"), recursive=True)
    assert len(traces) == 1
    # The run ends by drawing its learning curves.
    for name in ("accuracy", "kl", "curriculum_weights"):
        assert os.path.getsize(os.path.join(workdir, "plots", f"{name}.png")) > 0


def test_summary_has_the_conventional_shape(reference_run):
    workdir, summary = reference_run
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        on_disk = json.load(f)
    assert on_disk == json.loads(json.dumps(summary))
    assert set(on_disk) == {"eval", "curriculum", "wall_s", "rl_wall_s"}
    domains = {"arithmetic", "stepwise_math", "program_synthesis"}
    e = on_disk["eval"]
    assert {"sft", "final", "sft_pass_at_k", "final_pass_at_k", "k", "ood"} <= set(e)
    assert e["k"] == 2
    for key in ("sft", "final", "sft_pass_at_k", "final_pass_at_k"):
        assert set(e[key]) == domains
    # runlocal scores training items too: the memorisation gap beside the held-out score.
    assert set(e["train"]["sft"]) == set(e["train"]["final"]) == domains
    assert all(0.0 <= v <= 1.0 for v in e["train"]["final"].values())
    assert set(on_disk["curriculum"]["weights"]) == domains
    assert sum(on_disk["curriculum"]["weights"].values()) == pytest.approx(1.0)
    assert set(on_disk["curriculum"]["difficulty"]) == domains
    assert 0 < on_disk["rl_wall_s"] < on_disk["wall_s"]


def test_samples_are_logged_at_every_evaluation(reference_run):
    workdir, _ = reference_run
    samples = _read_jsonl(os.path.join(workdir, "samples.jsonl"))
    assert {s["eval"] for s in samples} == {"sft", "periodic", "final"}
    for s in samples:
        assert {"step", "domain", "prompt", "completion", "reward", "outcome"} <= set(s)


def test_interrupted_run_resumes_to_identical_metrics(reference_run, tmp_path):
    ref_dir, _ = reference_run
    workdir = str(tmp_path / "resumed")
    # SFT is 3 steps in runlocal; stop inside PPO, between checkpoints (every 2 steps),
    # so the rerun restores step 4 and replays step 5.
    out = train.train_and_evaluate(_demo_config(stop_after_step=5), workdir)
    assert out == {"stopped_at_step": 5}
    train.train_and_evaluate(_demo_config(), workdir)
    records = _read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert [r for r in records if "event" in r] == [
        {"step": 4, "event": "resumed", "resumed_from_step": 4}
    ]
    reference = _read_jsonl(os.path.join(ref_dir, "metrics.jsonl"))
    assert _deterministic(records) == _deterministic(reference)
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        resumed_summary = json.load(f)
    with open(os.path.join(ref_dir, "summary.json"), encoding="utf-8") as f:
        reference_summary = json.load(f)
    for key in ("wall_s", "rl_wall_s"):
        resumed_summary.pop(key), reference_summary.pop(key)
    assert resumed_summary == reference_summary


def test_a_stop_on_a_stage_boundary_stops_there_and_resumes_into_the_next_stage(
    reference_run, tmp_path
):
    ref_dir, _ = reference_run
    workdir = str(tmp_path / "boundary")
    # SFT is 3 steps in runlocal: stopping after step 3 must not take a PPO step.
    out = train.train_and_evaluate(_demo_config(stop_after_step=3), workdir)
    assert out == {"stopped_at_step": 3}
    records = _read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert {r["stage"] for r in records} == {"sft"} and records[-1]["step"] == 3
    train.train_and_evaluate(_demo_config(), workdir)
    records = _read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert [r for r in records if "event" in r] == [
        {"step": 3, "event": "resumed", "resumed_from_step": 3}
    ]
    reference = _read_jsonl(os.path.join(ref_dir, "metrics.jsonl"))
    assert _deterministic(records) == _deterministic(reference)


def test_a_workdir_holding_another_config_is_refused_unless_overwritten(tmp_path):
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(_demo_config(stop_after_step=1), workdir)
    with pytest.raises(ValueError, match="different config.*overwrite"):
        train.train_and_evaluate(_demo_config(seed=1, stop_after_step=1), workdir)
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["seed"] == 0  # the run's own config is put back
    out = train.train_and_evaluate(_demo_config(seed=1, stop_after_step=1, overwrite=True), workdir)
    assert out == {"stopped_at_step": 1}
    records = _read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1]


def test_learned_reward_weight_without_its_stage_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="rewards.reward_model .* no 'rm' stage"):
        train.train_and_evaluate(_demo_config(**{"rewards.reward_model": 1.0}), str(tmp_path))


def test_sampled_pass_at_one_is_refused_before_the_run_claims_the_workdir(tmp_path):
    # With samples, k=1 would report the sampled estimate as the greedy pass@1.
    with pytest.raises(ValueError, match="eval.k must be >= 2 when eval.n_samples > 0, got 1"):
        train.train_and_evaluate(_demo_config(**{"eval.k": 1}), str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run" / "run_config.json")


def test_a_rollout_temperature_of_zero_is_refused_before_the_run_claims_the_workdir(tmp_path):
    with pytest.raises(ValueError, match="rollout.temperature must be a number > 0, got 0.0"):
        train.train_and_evaluate(_demo_config(**{"rollout.temperature": 0.0}), str(tmp_path / "r"))
    assert not os.path.exists(tmp_path / "r" / "run_config.json")


def test_eval_cli_evaluates_the_latest_checkpoint(reference_run):
    workdir, summary = reference_run
    proc = subprocess.run(
        [sys.executable, "-m", "rlpt.eval", f"--workdir={workdir}"],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["stage"] == "ppo" and result["k"] == 2
    assert set(result["results"]["heldout"]) == set(summary["eval"]["final"])
    assert "pass@1" in proc.stderr  # the table
    # Repeated prompts are counted: items are drawn from the held-out partition.
    config = parse_config(_demo_config())
    sets = eval_lib.make_eval_data(config, policy_lib.make_domains(config))
    for name, tasks in sets["heldout"].items():
        got = result["results"]["heldout"][name]
        assert got["items"] == len(tasks)
        assert got["distinct_items"] == len({t.prompt for t in tasks})
    assert os.path.exists(os.path.join(workdir, f"eval_step_{result['step']}.json"))

    # Flags given with --workdir replace the run's eval config; a --hf-only flag is an error.
    proc = subprocess.run(
        [sys.executable, "-m", "rlpt.eval", f"--workdir={workdir}", "--seed=7",
         "--heldout_items=6", "--ood_items=0"],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    redrawn = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["items"] for r in redrawn["results"]["heldout"].values()} == {6}
    assert not redrawn["results"].get("ood")
    saved = f"eval_step_{redrawn['step']}_heldout_items6_ood_items0_seed7.json"
    assert os.path.exists(os.path.join(workdir, saved))
    proc = subprocess.run(
        [sys.executable, "-m", "rlpt.eval", f"--workdir={workdir}", "--max_level=3"],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0 and "--max_level: only with --hf" in proc.stderr


def test_eval_overrides_redraw_items_without_touching_the_run(reference_run, monkeypatch):
    workdir, _ = reference_run
    with open(os.path.join(workdir, "run_config.json")) as f:
        run_config = f.read()
    draws = []
    real = eval_lib.make_eval_sets

    def spy(*args, **kwargs):
        draws.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(eval_lib, "make_eval_sets", spy)
    out = eval_lib.evaluate_checkpoint(
        workdir, eval_overrides={"seed": 7, "heldout_items": 6, "ood_items": 0, "train_items": 4,
                                 "heldout_split": "test"},
    )  # fmt: skip
    assert (draws[-1]["seed"], draws[-1]["heldout_items"], draws[-1]["ood_items"]) == (7, 6, 0)
    # The reported result draws from the test half of the held-out partition only.
    assert draws[-1]["heldout_split"] == "test"
    assert {r["items"] for r in out["results"]["heldout"].values()} == {6}
    # Training items are scored greedily only, with the per-level breakdown every split has.
    train_results = out["results"]["train"]
    assert {r["items"] for r in train_results.values()} == {4}
    for name, r in train_results.items():
        assert f"pass@{out['k']}" not in r and "sample_pass@1" not in r
        assert sum(v["items"] for v in r["by_level"].values()) == 4
        assert out[f"eval/{name}/train/pass@1"] == r["pass@1"]
        held = out["results"]["heldout"][name]
        if not held["sandbox_failures"]:  # then every item counts at its level
            levels = held["by_level"].values()
            assert held["pass@1"] == pytest.approx(
                sum(v["pass@1"] * v["items"] for v in levels) / held["items"]
            )
    eval_lib.evaluate_checkpoint(workdir)
    assert draws[-1]["seed"] != 7  # the run's own config is untouched
    with open(os.path.join(workdir, "run_config.json")) as f:
        assert f.read() == run_config
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['domains'\]"):
        eval_lib.evaluate_checkpoint(workdir, eval_overrides={"domains": ("arithmetic",)})
    with pytest.raises(ValueError, match=r"eval.n_samples \(1\) must be >= eval.k \(2\)"):
        eval_lib.evaluate_checkpoint(workdir, eval_overrides={"n_samples": 1, "k": 2})
    with pytest.raises(ValueError, match="eval.k must be >= 2 when eval.n_samples > 0"):
        eval_lib.evaluate_checkpoint(workdir, eval_overrides={"n_samples": 2, "k": 1})


def test_group_filtering_needs_a_group_estimator(tmp_path):
    config = _demo_config(**{"rollout.filter_groups": True, "ppo.estimator": "gae"})
    with pytest.raises(ValueError, match="rollout.filter_groups.*'gae'"):
        train.train_and_evaluate(config, str(tmp_path))
    assert not os.path.exists(tmp_path / "run_config.json")  # refused before claiming it


def test_group_filtering_fills_the_update_with_varying_groups(tmp_path, monkeypatch):
    # runlocal: 8 rows per update in groups of 4, so two groups are needed. The verifier's
    # rewards are replaced per round: round 0 has no varying group, round 1 one (rewards
    # 11..14), round 2 two (21..24 and 31..34); the update must hold 11..14 and 21..24.
    planted = [
        np.zeros(8),
        np.array([11, 12, 13, 14, 0, 0, 0, 0]),
        np.array([21, 22, 23, 24, 31, 32, 33, 34]),
    ]
    calls = []

    real_judge = RewardRole.judge

    def fake_judge(self, traj):
        traj = real_judge(self, traj)
        r = planted[len(calls) % 3].astype(np.float32)
        calls.append(len(traj))
        ones = np.ones(len(traj), np.float32)
        success = (r % 2 == 1).astype(np.float32)  # the odd rewards count as correct
        verdicts = dataclasses.replace(traj.verdicts, rewards=r, weight=ones, success=success,
                                       valid=ones)  # fmt: skip
        return dataclasses.replace(traj, verdicts=verdicts)

    updated = []
    real_update = PPOTrainer.update

    def spy_update(self, state, batch):
        updated.append((
            np.asarray(batch.rewards).sum(axis=1).round(), np.asarray(batch.group_id),
            np.asarray(batch.imitation_weight),
        ))  # fmt: skip
        return real_update(self, state, batch)

    monkeypatch.setattr(RewardRole, "judge", fake_judge)
    monkeypatch.setattr(PPOTrainer, "update", spy_update)
    config = _demo_config(
        **{"rollout.filter_groups": True, "rollout.filter_max_rounds": 3, "ppo_steps": 2,
           "rewards.format": 0.0, "ppo.imitation_coef": 0.5}
    )  # fmt: skip
    train.train_and_evaluate(config, str(tmp_path))
    assert calls == [8] * 6  # three rounds in each of the two steps
    for rewards, group_ids, imitated in updated:
        assert rewards.tolist() == [11, 12, 13, 14, 21, 22, 23, 24]
        assert group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
        # The self-imitation term trains on the verified-correct rows of the update.
        assert imitated.tolist() == [1, 0, 1, 0, 1, 0, 1, 0]
    ppo = [r for r in _read_jsonl(tmp_path / "metrics.jsonl") if r.get("stage") == "ppo"]
    assert all(r["ppo/imitation_loss"] > 0 for r in ppo)
    assert [r["ppo/rollout_rounds"] for r in ppo] == [3, 3]
    assert [r["ppo/varying_groups_frac"] for r in ppo] == [0.5, 0.5]  # 3 of 6 generated
    assert [r["ppo/update_varying_groups_frac"] for r in ppo] == [1.0, 1.0]


def test_continued_sft_control_logs_a_heldout_learning_curve(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "demo_controls", os.path.join(REPO_ROOT, "experiments/demo_controls.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("sft_more,runlocal")
    config.lock()
    every, full = config.sft.eval_every, f"eval/arithmetic/pass@{config.eval.k}"
    summary = train.train_and_evaluate(config, str(tmp_path))
    records = _read_jsonl(tmp_path / "metrics.jsonl")
    # Full evaluations (with pass@k) end the warm start and the control; periodic ones
    # (greedy only) fall every `every` steps of each SFT stage.
    warm_end, last = [r["step"] for r in records if full in r]
    assert last == records[-1]["step"]
    periodic = [r for r in records if "eval/arithmetic/pass@1" in r and full not in r]
    continued = [r["step"] - warm_end for r in periodic if r["step"] > warm_end]
    assert continued and all(s % every == 0 for s in continued)
    assert all("sft/heldout_loss" in r for r in periodic)
    assert set(summary["eval"]["final"]) == set(config.domains)


GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden",
                      "demo_runlocal_seed0.json")  # fmt: skip


def added_since_recording(golden: dict) -> dict[str, tuple[float, float]]:
    """Metrics logged since the recording, with the range each must lie in (the golden
    file says which and why)."""
    ranges = golden.get("added_since_recording", {})
    return {k: tuple(v) for k, v in ranges.items() if not k.startswith("_")}


def test_runlocal_demo_reproduces_the_recorded_metrics(reference_run):
    """Behaviour kept across refactors: every deterministic metric of every step of the
    seed-0 runlocal demo equals the recorded figures (recorded again when the rollout engine
    became the sampler: its per-request seeds draw other tokens than the static sampler's
    batch key; before that, the recording had held since before the trainer was split into
    roles). Float32 reductions may reorder when the batch and parameters are sharded over
    8 devices (sums of up to a few thousand terms, relative error below 1e-5 each), so
    floats compare to rtol 1e-4; counts, stages and keys compare exactly."""
    workdir, _ = reference_run
    with open(GOLDEN, encoding="utf-8") as f:
        recording = json.load(f)
    golden, added = recording["records"], added_since_recording(recording)
    got = _deterministic(_read_jsonl(os.path.join(workdir, "metrics.jsonl")))
    assert [r["step"] for r in got] == [r["step"] for r in golden]
    for want, have in zip(golden, got):
        for key, (low, high) in added.items():
            if key.split("/")[0] == want["stage"]:
                assert low <= have.pop(key) <= high, f"step {want['step']} {key}"
        assert sorted(have) == sorted(want), f"step {want['step']}: keys differ"
        for key, value in want.items():
            if isinstance(value, float):
                np.testing.assert_allclose(have[key], value, rtol=1e-4, atol=1e-6,
                                           err_msg=f"step {want['step']} {key}")  # fmt: skip
            else:
                assert have[key] == value, f"step {want['step']} {key}"


def test_a_domain_reads_its_prompts_from_the_configured_source(tmp_path):
    path = tmp_path / "arith.jsonl"
    path.write_text("".join(
        json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i), "id": f"j{i}"}) + "\n"
        for i in range(5)
    ))  # fmt: skip
    config = _demo_config(**{
        "domains": ("arithmetic",),
        "data.sources": {"arithmetic": {"kind": "jsonl", "path": str(path)}},
    })  # fmt: skip
    run = post_train.PostTrainRun(config, str(tmp_path / "run"))
    try:
        prompts = {t.prompt for t in run.loader.next().tasks}
    finally:
        run.close()
    assert prompts and prompts <= {f"{i}+{i}=" for i in range(5)}
    missing = _demo_config(
        **{"data.sources": {"arithmetic": {"kind": "jsonl", "path": str(tmp_path / "no")}}}
    )
    with pytest.raises(ValueError, match="data.sources.arithmetic.path .* does not exist"):
        post_train.PostTrainRun(missing, str(tmp_path / "other"))


def test_multi_turn_rollouts_train_and_report_success_within_the_turns(tmp_path):
    """``rollout.turns=2`` on the runlocal demo (no warm start, two PPO steps): wrong answers
    are retried with the verifier's feedback (program_synthesis through the sandbox), the
    update trains on the model's tokens only, and steps and the final evaluation report
    success at the first turn and within the turns."""
    config = _demo_config(**{
        "rollout.turns": 2, "ppo_steps": 2, "stages": ("ppo",), "eval.train_items": 0,
    })  # fmt: skip
    summary = train.train_and_evaluate(config, str(tmp_path))
    records = _read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    ppo = [r for r in records if r["stage"] == "ppo"]
    assert [r["step"] for r in ppo] == [1, 2]
    for r in ppo:
        first, within = r["ppo/first_turn_success"], r["ppo/success_within_turns"]
        # A row solved at the first turn stops there, so it is solved within the turns.
        assert 0.0 <= first <= within <= 1.0 and within == r["ppo/success"]
        assert 1.0 <= r["ppo/mean_turns"] <= 2.0
        # Trained tokens per row: two completions of max_new_tokens (16) at most; the
        # feedback between them is context, not counted.
        assert 1.0 <= r["ppo/response_len"] <= 2 * 16
        assert np.isfinite(r["ppo/loss"])
    domains = ("arithmetic", "stepwise_math", "program_synthesis")
    for domain in domains:
        for split in ("", "ood/"):
            assert 0.0 <= ppo[-1][f"eval/{domain}/{split}pass@1_turns"] <= 1.0
            assert 1.0 <= ppo[-1][f"eval/{domain}/{split}mean_turns"] <= 2.0
    assert set(summary["eval"]["turns"]["final"]) == set(domains)


def test_multi_turn_rows_that_do_not_fit_the_model_are_refused_before_the_workdir(tmp_path):
    # runlocal: bucket 64 + 20 completions of 16 + 19 feedbacks of 64 > 256 (tiny).
    with pytest.raises(ValueError, match=r"must fit model.max_seq_len \(256\), got 1600"):
        train.train_and_evaluate(_demo_config(**{"rollout.turns": 20}), str(tmp_path / "r"))
    assert not os.path.exists(tmp_path / "r" / "run_config.json")
