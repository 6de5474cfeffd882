"""The rm and prm stages of a post-training run and their rewards inside PPO.

One run on the runlocal config with both stages and both learned weights is the
oracle for an interrupted one: reward-model parameters, normalisation statistics
and the monitor are checkpointed, so the resumed run's metrics are identical.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from rlpt import train
from rlpt.rewards.composite import RewardConfig
from rlpt.rewards.learned import LearnedRewards
from rlpt.rewards.monitor import RewardMonitor
from rlpt.rl import new_rollout_batch
from tests.trainers.test_post_train import _demo_config, _deterministic, _read_jsonl

LEARNED = {
    "stages": ("sft", "rm", "prm", "ppo"),
    "rewards.reward_model": 0.5,
    "rewards.process": 0.5,
    # A critic, so the process rewards reach the advantages token by token.
    "ppo.estimator": "gae",
    "rollout.filter_groups": False,  # a group filter needs a group estimator
    # The reward model follows the policy; its optimiser state and traces are checkpointed.
    "reward_model.refresh_every": 2,
    "reward_model.refresh_batch_size": 4,
    "process_reward.likelihood": True,
    # The training-partition split is covered by the post_train tests; here it only costs time.
    "eval.train_items": 0,
}


@pytest.fixture(scope="module")
def learned_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("learned") / "run")
    summary = train.train_and_evaluate(_demo_config(**LEARNED), workdir)
    return workdir, summary


def test_rm_and_prm_stages_log_their_training_and_heldout_figures(learned_run):
    workdir, summary = learned_run
    records = _read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    stages = [r["stage"] for r in records]
    # Stages in order, one global step across them.
    first = {s: stages.index(s) for s in ("sft", "rm", "prm", "ppo")}
    assert first["sft"] < first["rm"] < first["prm"] < first["ppo"]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps))
    rm_last = [r for r in records if r["stage"] == "rm"][-1]
    for domain in ("arithmetic", "stepwise_math"):
        acc = rm_last[f"rm/heldout_{domain}_pairwise_accuracy"]
        assert 0.0 <= acc <= 1.0
    assert "rm/loss" in rm_last
    prm_last = [r for r in records if r["stage"] == "prm"][-1]
    assert 0.0 <= prm_last["prm/heldout_step_roc_auc"] <= 1.0
    # Level-1 solutions have one step, labelled by their verified answer alone; the
    # continuation sampling itself is tested in tests/rewards/test_rewards_process.py.
    assert prm_last["prm/train_solutions"] > 0 and prm_last["prm/label_samples"] >= 0
    assert set(summary["reward_models"]) == {"rm", "prm"}
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        assert json.load(f)["reward_models"]["prm"]["heldout_step_roc_auc"] == pytest.approx(
            prm_last["prm/heldout_step_roc_auc"]
        )


def test_ppo_logs_each_learned_term_and_the_monitor(learned_run):
    workdir, _ = learned_run
    ppo = [r for r in _read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r["stage"] == "ppo"]
    assert ppo
    for r in ppo:
        for key in ("reward/outcome", "reward/reward_model", "reward/process", "reward/total"):
            assert key in r and np.isfinite(r[key]), key
        assert any(k.startswith("monitor/") and k.endswith("/agreement") for k in r)
        assert r["rm/refresh_buffer"] > 0
    # Every second global step the reward model refreshes from the newest traces.
    refreshes = [r for r in ppo if "rm/refresh_pairs" in r]
    assert refreshes and all(r["step"] % 2 == 0 for r in refreshes)
    assert len(refreshes) == sum(1 for r in ppo if r["step"] % 2 == 0)


def test_interrupted_learned_reward_run_resumes_identically(learned_run, tmp_path):
    workdir, _ = learned_run
    reference = _read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    first_ppo = next(r["step"] for r in reference if r["stage"] == "ppo")
    other = str(tmp_path / "resumed")
    stopped = train.train_and_evaluate(
        _demo_config(**LEARNED, stop_after_step=first_ppo + 1), other
    )
    assert stopped == {"stopped_at_step": first_ppo + 1}
    train.train_and_evaluate(_demo_config(**LEARNED), other)
    resumed = _read_jsonl(os.path.join(other, "metrics.jsonl"))
    assert any(r.get("resumed_from_step") for r in resumed)
    assert _deterministic(resumed) == _deterministic(reference)


def test_reward_model_term_sits_on_the_last_token_only(monkeypatch):
    """apply() adds w * clip(normalised score) on each row's last token and keeps the rest."""
    import rlpt.rewards.learned as lr

    scores = np.asarray([2.0, -1.0, 0.5], np.float32)
    monkeypatch.setattr(lr, "_rm_scores", lambda graph, params, batch: jnp.asarray(scores))
    cfg = RewardConfig(outcome=1.0, reward_model=0.5, normalize=False, clip=1.0)
    learned = LearnedRewards(cfg, RewardMonitor(), step_id=1, answer_id=2, rm_params={})
    response = np.asarray([[5, 6, 7, 0], [5, 6, 0, 0], [5, 6, 7, 8]])
    mask = np.asarray([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], np.float32)
    outcome = np.asarray([1.0, 0.0, 1.0], np.float32)
    batch = new_rollout_batch(
        np.ones((3, 2), np.int32), np.ones((3, 2), bool), response, mask,
        sequence_rewards=outcome,
    )  # fmt: skip
    new, metrics, confidence = learned.apply(
        batch, ["a", "a", "b"], np.asarray([1.0, 0.0, 1.0]), np.ones(3)
    )
    expected = np.zeros((3, 4), np.float32)
    for row, last in enumerate((2, 1, 3)):  # hand-placed last tokens
        expected[row, last] = outcome[row] + 0.5 * min(max(scores[row], -1.0), 1.0)
    np.testing.assert_allclose(np.asarray(new.rewards), expected, atol=1e-6)
    assert metrics["reward/reward_model"] == pytest.approx(0.5 * (1.0 - 1.0 + 0.5) / 3)
    # The score's sign agrees with the verifier on all three rows.
    assert metrics["monitor/a/agreement"] == 1.0 and confidence == {"a": 1.0, "b": 1.0}


def test_refresh_trains_on_rollout_verdicts_and_checkpoints_its_state():
    import types

    import jax
    import ml_collections

    from rlpt.models import RewardModel, create_model, get_preset
    from rlpt.rewards.learned import RM_STATE_KEY, reward_model_trainer
    from rlpt.tokenizers import ByteTokenizer

    cfg = get_preset("tiny").replace(max_seq_len=32)
    tok = ByteTokenizer()
    rm_cfg = ml_collections.ConfigDict({
        "learning_rate": 1e-3, "warmup_steps": 0, "margin": 0.0, "refresh_every": 2,
        "refresh_steps": 3, "refresh_batch_size": 4, "refresh_buffer": 10,
    })  # fmt: skip
    learned = LearnedRewards(
        RewardConfig(reward_model=1.0), RewardMonitor(), tok.step_id, tok.answer_id,
        rm_config=rm_cfg, tokenizer=tok,
    )  # fmt: skip
    assert learned.refreshing
    graph, params = create_model(lambda r: RewardModel(cfg, rngs=r), jax.random.key(0))
    trainer = reward_model_trainer(rm_cfg, graph)
    learned.set_rm(graph, params)
    learned.start_refresh(trainer, trainer.init(params), cfg.max_seq_len)
    before = jax.tree.map(np.asarray, learned.rm_params)

    # Four prompts, each answered once right and once wrong.
    tasks = [types.SimpleNamespace(id=f"t{i}", domain="d", prompt=f"q{i}")
             for i in range(4) for _ in (0, 1)]  # fmt: skip
    texts = [f"{i}<answer>{2 * i + k}" for i in range(4) for k in (0, 1)]
    results = [types.SimpleNamespace(valid=True, outcome=("correct", "wrong")[k])
               for _ in range(4) for k in (0, 1)]  # fmt: skip
    metrics = learned.observe(1, tasks, texts, results, jax.random.key(1))
    assert metrics == {"rm/refresh_buffer": 8.0}  # not due: only buffered
    results[7] = types.SimpleNamespace(valid=False, outcome="")  # a sandbox failure
    metrics = learned.observe(2, tasks, texts, results, jax.random.key(2))
    # The buffer keeps the newest ten traces: all of the second rollout and the first's
    # two answers to q3, whose wrong one stands in for the failure (no verdict): four pairs.
    assert metrics["rm/refresh_buffer"] == 10.0 and metrics["rm/refresh_pairs"] == 4.0
    assert int(learned.rm_state.step) == 3
    after = jax.tree.map(np.asarray, learned.rm_params)
    assert any(not np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(before), jax.tree.leaves(after)))  # fmt: skip

    # What a checkpoint holds restores into the template another run builds.
    items, traces = learned.items(), learned.trace_state()
    assert RM_STATE_KEY in items and len(traces) == 10
    fresh = LearnedRewards(
        RewardConfig(reward_model=1.0), RewardMonitor(), tok.step_id, tok.answer_id,
        rm_config=rm_cfg, tokenizer=tok,
    )  # fmt: skip
    template = fresh.templates(list(items), cfg, tok.step_id)
    assert jax.tree.structure(template[RM_STATE_KEY]) == jax.tree.structure(items[RM_STATE_KEY])
    fresh.set_items(items)
    fresh.set_trace_state(json.loads(json.dumps(traces)))
    assert fresh.trace_state() == traces and fresh.rm_params is fresh.rm_state.params
