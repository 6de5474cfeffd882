"""The rm and prm stages of a post-training run and their rewards inside PPO.

One run on the runlocal config with both stages and both learned weights is the
oracle for an interrupted one: reward-model parameters, normalisation statistics
and the monitor are checkpointed, so the resumed run's metrics are identical.
"""

import json
import os
import types

import jax.numpy as jnp
import numpy as np
import pytest

from rlpt import train
from rlpt.metrics import StepProfiler
from rlpt.rewards.composite import RewardConfig
from rlpt.rewards.learned import LearnedRewards
from rlpt.rewards.monitor import RewardMonitor
from rlpt.rl import new_rollout_batch
from rlpt.tasks.base import (
    ANSWER,
    STEP,
    AnswerDomain,
    Problem,
    VerifyResult,
    extract_answer,
    split_steps,
)
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
    # Three steps of a tiny model only log the figures here; that they rise with training
    # is test_rm_and_prm_stages_beat_their_untrained_start_on_heldout_items.
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


class _TensDomain(AnswerDomain):
    """Count on by tens from a start: every right step and the answer end in 0.

    A slip (``corrupt_step``) shifts one step by 1 to 3 and carries it on, so the last digit
    before each separator tells right from wrong. A tiny model learns that from a few dozen
    pairs and it holds on unseen starts; held-out arithmetic correctness, which the demo's
    domains ask, a tiny run does not reach (3 rm steps left held-out accuracy at 0.625).
    """

    name = "tens"

    def _sample(self, rng, difficulty):
        start = 10 * rng.randint(1, 99)
        return Problem(f"count on from {start}:", str(start + 30), {"start": start})

    @staticmethod
    def _values(task):
        return [task.data["start"] + 10 * (i + 1) for i in range(3)]

    def demonstration(self, task):
        values = self._values(task)
        return STEP.join(map(str, values)) + ANSWER + str(values[-1])

    def verify_one(self, task, completion):
        ok = extract_answer(completion) == task.answer
        return VerifyResult(float(ok), "correct" if ok else "wrong")

    def check_steps(self, task, completion):
        values = self._values(task)
        steps = split_steps(completion)
        return [i < len(values) and s == str(values[i]) for i, s in enumerate(steps)]

    def corrupt_step(self, task, completion, rng):
        values = self._values(task)
        i = rng.randint(0, len(values) - 1)
        shift = rng.choice((1, 2, 3)) * rng.choice((-1, 1))
        values = values[:i] + [v + shift for v in values[i:]]
        return STEP.join(map(str, values)) + ANSWER + str(values[-1])


class _CountingPolicy:
    """Stands in for the policy's ``Sampler``: it continues the count rightly from wherever
    the prompt and step prefix leave it, so its Math-Shepherd labels are the steps' truth (a
    step is right exactly when the count carried on from it reaches the answer)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def generate(self, params, prompts, key, *, max_new_tokens, sampling):
        del params, key, sampling
        tokens = np.full((len(prompts), max_new_tokens), self.tok.pad_id, np.int32)
        lengths = np.zeros(len(prompts), np.int32)
        for row, ids in enumerate(prompts):
            head, _, body = self.tok.decode(ids).partition(":")
            done = [int(s) for s in body.split(STEP) if s]
            value = done[-1] if done else int(head.split()[-1])
            values = [value + 10 * (i + 1) for i in range(max(3 - len(done), 0))]
            text = STEP.join(map(str, values)) + ANSWER + str(values[-1] if values else value)
            out = self.tok.encode(text, add_eos=True)[:max_new_tokens]
            tokens[row, : len(out)], lengths[row] = out, len(out)
        return types.SimpleNamespace(tokens=tokens, lengths=lengths)


def test_rm_and_prm_stages_beat_their_untrained_start_on_heldout_items(monkeypatch, tmp_path):
    """Each stage's held-out figure, against the same evaluation of its model before training."""
    import jax

    from rlpt.models import CausalLM, create_model, get_preset
    from rlpt.tokenizers import ByteTokenizer
    from rlpt.trainers import learned_rewards
    from rlpt.trainers.context import StageContext

    config = _demo_config(**{
        "reward_model.domains": ("tens",), "reward_model.pairs_per_level": 48,
        "reward_model.heldout_pairs": 32, "reward_model.steps": 30,
        "reward_model.batch_size": 16, "reward_model.refresh_every": 0,
        "process_reward.domain": "tens", "process_reward.label_tasks": 16,
        "process_reward.heldout_tasks": 24, "process_reward.steps": 30,
        "process_reward.batch_size": 16, "process_reward.learning_rate": 1e-3,
    })  # fmt: skip
    tok = ByteTokenizer()
    model_cfg = get_preset("tiny").replace(max_seq_len=64)  # rows are under 40 tokens
    graph, policy = create_model(lambda r: CausalLM(model_cfg, rngs=r), jax.random.key(0))
    learned = LearnedRewards.from_config(config, tok)
    run = learned_rewards.RewardStageInputs(
        config=config, policy_params=policy, model_cfg=model_cfg, tokenizer=tok,
        domains={"tens": _TensDomain()}, levels={"tens": 1}, sampler=_CountingPolicy(tok),
        learned=learned,
    )  # fmt: skip
    lines = []
    ctx = StageContext(
        meta={"step": 0, "stage_step": 0}, keys={"init": jax.random.key(1)},
        writer=lambda step, metrics, stage: lines.append(dict(metrics)), save=lambda: None,
        elapsed=lambda: 0.0, profiler=StepProfiler((), str(tmp_path)),
    )  # fmt: skip

    # The untrained start: the stage's own held-out evaluation on the parameters its
    # optimiser starts from (the policy's trunk under a fresh head).
    start = {}
    stage_train = learned_rewards._train

    def train_from_start(ctx, log_every, stage, trainer, state, batches, steps, final):
        start.update(final(state.params))
        return stage_train(ctx, log_every, stage, trainer, state, batches, steps, final)

    monkeypatch.setattr(learned_rewards, "_train", train_from_start)
    learned_rewards.rm_stage(ctx, run)
    learned_rewards.prm_stage(ctx, run)
    end = {k: v for line in lines for k, v in line.items() if "heldout" in k}
    rm_key, prm_key = "rm/heldout_tens_pairwise_accuracy", "prm/heldout_step_roc_auc"
    assert set(end) == {rm_key, prm_key}
    # Seed 0: pairwise accuracy 0.34 to 1.0, step ROC-AUC 0.42 to 0.99.
    for key in (rm_key, prm_key):
        assert end[key] >= start[key] + 0.3, (key, start[key], end[key])


# -- the implicit PRM (PRIME) as the prm stage -----------------------------------------------

IMPLICIT = {
    "stages": ("sft", "prm", "ppo"),
    "process_reward.kind": "implicit",
    "rewards.process": 0.5,
    "ppo.estimator": "gae",
    "rollout.filter_groups": False,
    "ppo_steps": 2,
    "eval.train_items": 0,
}


def test_implicit_prm_stage_trains_and_its_rewards_reach_ppo(tmp_path):
    workdir = str(tmp_path / "implicit")
    # Updated online too (PRIME): one step of pi_phi on each PPO batch.
    config = _demo_config(**IMPLICIT, **{"process_reward.online_learning_rate": 1e-3})
    summary = train.train_and_evaluate(config, workdir)
    records = _read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    prm = [r for r in records if r["stage"] == "prm"]
    assert prm and all(np.isfinite(r["prm/loss"]) for r in prm)
    last = prm[-1]
    for key in ("prm/accuracy", "prm/reward_correct", "prm/reward_wrong"):
        assert key in last, key
    assert last["prm/train_solutions"] > 0
    # "nan" (metrics.jsonl's spelling) when the held-out samples are all right or all
    # wrong, as a tiny runlocal policy's usually are.
    auc = last["prm/heldout_outcome_roc_auc"]
    assert auc == "nan" or 0.0 <= auc <= 1.0
    assert "heldout_outcome_roc_auc" in summary["reward_models"]["prm"]
    ppo = [r for r in records if r["stage"] == "ppo"]
    assert len(ppo) == 2
    # pi_phi has moved from its reference, so the step rewards are not all zero.
    assert any(r["reward/process"] != 0.0 for r in ppo)
    assert all(np.isfinite(r["reward/process"]) for r in ppo)
    assert all(np.isfinite(r["prm/online_loss"]) and "prm/online_accuracy" in r for r in ppo)


def test_implicit_prm_checkpoint_restores_pi_phi_and_its_reference():
    import jax

    from rlpt.models import CausalLM, create_model, get_preset
    from rlpt.rewards.implicit import ImplicitPRM
    from rlpt.rewards.learned import IMPLICIT_KEY, IMPLICIT_REF_KEY
    from rlpt.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    cfg = get_preset("tiny").replace(max_seq_len=16)
    graph, ref = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(0))
    _, phi = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(1))
    config = _demo_config(**IMPLICIT)

    def learned():
        out = LearnedRewards.from_config(config, tok)
        out.set_policy(graph, jax.eval_shape(lambda: ref))
        return out

    saved = learned()
    saved.set_implicit_prm(ImplicitPRM(graph, phi, ref, beta=0.05))
    assert saved.active
    items = saved.items()
    assert items[IMPLICIT_KEY] is phi and items[IMPLICIT_REF_KEY] is ref
    fresh = learned()
    template = fresh.templates(list(items), cfg, tok.step_id)
    assert jax.tree.structure(template[IMPLICIT_KEY]) == jax.tree.structure(phi)
    fresh.set_items(items)
    assert fresh.implicit.params is phi and fresh.implicit.ref_params is ref
    assert fresh.implicit.beta == 0.05 and fresh.implicit.graphdef is graph

    # Both score a rollout alike: step rewards at step ends, summing to the outcome logit.
    prompt = np.asarray([tok.encode("1+1=", add_bos=True)] * 2, np.int32)
    response = np.asarray([tok.encode("2<step><answer>2", add_eos=True)] * 2, np.int32)
    batch = new_rollout_batch(
        prompt, np.ones_like(prompt, bool), response, np.ones(response.shape, np.float32),
        sequence_rewards=np.asarray([1.0, 0.0], np.float32),
    )  # fmt: skip
    a, _, _ = saved.apply(batch, ["d", "d"], np.asarray([1.0, 0.0]), np.ones(2))
    b, _, _ = fresh.apply(batch, ["d", "d"], np.asarray([1.0, 0.0]), np.ones(2))
    np.testing.assert_array_equal(np.asarray(a.rewards), np.asarray(b.rewards))


def test_implicit_prm_online_scores_then_steps_and_checkpoints_its_optimiser():
    """PRIME's order: a batch is scored by pi_phi as it was, then pi_phi takes one step on
    that batch's outcome labels; the step's loss is the objective on the same rows encoded
    apart (right-padded), and a checkpoint round trip (pi_phi, its optimiser state and the
    reference) continues exactly."""
    import jax

    from rlpt.models import CausalLM, create_model, get_preset
    from rlpt.rewards.implicit import (
        ImplicitPRM,
        encode_implicit_examples,
        implicit_prm_objective,
        reference_log_probs,
    )
    from rlpt.rewards.learned import IMPLICIT_KEY, IMPLICIT_REF_KEY, IMPLICIT_STATE_KEY
    from rlpt.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    cfg = get_preset("tiny").replace(max_seq_len=32)
    graph, ref = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(0))
    _, phi = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(1))
    online = _demo_config(**IMPLICIT, **{"process_reward.online_learning_rate": 1e-2})

    def learned(config):
        out = LearnedRewards.from_config(config, tok)
        out.set_policy(graph, jax.eval_shape(lambda: ref))
        return out

    fixed = learned(_demo_config(**IMPLICIT))
    fixed.set_implicit_prm(ImplicitPRM(graph, jax.tree.map(jnp.copy, phi), ref, beta=0.05))
    moving = learned(online)
    moving.set_implicit_prm(ImplicitPRM(graph, jax.tree.map(jnp.copy, phi), ref, beta=0.05))
    assert fixed.implicit_state is None and moving.implicit_state is not None

    prompts = [tok.encode("1+1=", add_bos=True), tok.encode("2+2=", add_bos=True)]
    responses = [
        tok.encode("2<step><answer>2", add_eos=True),
        tok.encode("5<answer>5", add_eos=True),
    ]
    width = max(map(len, responses))
    r_tok = np.full((2, width), tok.pad_id, np.int32)
    r_mask = np.zeros((2, width), np.float32)
    for i, r in enumerate(responses):
        r_tok[i, : len(r)], r_mask[i, : len(r)] = r, 1.0
    batch = new_rollout_batch(
        np.asarray(prompts, np.int32), np.ones((2, len(prompts[0])), bool), r_tok, r_mask,
        sequence_rewards=np.asarray([1.0, 0.0], np.float32),
    )  # fmt: skip
    success, valid = np.asarray([1.0, 0.0]), np.ones(2)
    a, _, _ = fixed.apply(batch, ["d", "d"], success, valid)
    b, metrics, _ = moving.apply(batch, ["d", "d"], success, valid)
    # Scored before the step: the same rewards as a pi_phi that never moves.
    np.testing.assert_array_equal(np.asarray(a.rewards), np.asarray(b.rewards))
    rows = encode_implicit_examples(
        [(p, r, float(s)) for p, r, s in zip(prompts, responses, success)], pad_id=tok.pad_id,
        pad_to=len(prompts[0]) + width,
    )  # fmt: skip
    rows["ref_logp"] = reference_log_probs(graph, ref, rows["tokens"], rows["mask"])
    loss, _ = implicit_prm_objective(graph, phi, rows, beta=0.05)
    assert metrics["prm/online_loss"] == pytest.approx(float(loss), rel=1e-4, abs=1e-6)
    moved = max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(moving.implicit.params), jax.tree.leaves(phi))
    )
    assert moved > 0.0

    items = moving.items()
    assert IMPLICIT_STATE_KEY in items and IMPLICIT_KEY not in items
    assert items[IMPLICIT_REF_KEY] is ref
    fresh = learned(online)
    template = fresh.templates(list(items), cfg, tok.step_id)
    assert jax.tree.structure(template[IMPLICIT_STATE_KEY]) == jax.tree.structure(
        items[IMPLICIT_STATE_KEY]
    )
    restored = jax.tree.map(jnp.copy, items[IMPLICIT_STATE_KEY])
    fresh.set_items({**items, IMPLICIT_STATE_KEY: restored})
    c, m1, _ = moving.apply(batch, ["d", "d"], success, valid)
    d, m2, _ = fresh.apply(batch, ["d", "d"], success, valid)
    np.testing.assert_array_equal(np.asarray(c.rewards), np.asarray(d.rewards))
    assert m1["prm/online_loss"] == m2["prm/online_loss"]
