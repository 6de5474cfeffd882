"""The PPO update: exactness properties, sharding equivalence, guards and a learning check."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlpt.models import CausalLM, ValueModel, create_model, get_preset
from rlpt.parallel import make_mesh
from rlpt.rl import PPOConfig, PPOTrainer, init_train_state, new_rollout_batch
from rlpt.rl.ppo import accumulated_gradients, response_log_probs, score_rollout
from rlpt.sampling import Sampler, SamplingParams

CFG = get_preset("tiny")
B, P, T = 8, 6, 7


def _models(mesh=None):
    policy_graph, policy = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0), mesh)
    value_graph, value = create_model(lambda r: ValueModel(CFG, rngs=r), jax.random.key(1), mesh)
    _, ref = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0), mesh)
    return policy_graph, policy, value_graph, value, ref


def _batch(seed=0, nan_reward=False):
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(1, P + 1, size=B)
    prompt_mask = np.arange(P)[None, :] >= (P - prompt_len)[:, None]
    prompt = np.where(prompt_mask, rng.integers(5, 200, size=(B, P)), 0)
    resp_len = rng.integers(1, T + 1, size=B)
    resp_mask = (np.arange(T)[None, :] < resp_len[:, None]).astype(np.float32)
    response = np.where(resp_mask > 0, rng.integers(5, 200, size=(B, T)), 0)
    rewards = rng.normal(size=B).astype(np.float32)
    if nan_reward:
        rewards[3] = np.nan
    return new_rollout_batch(
        prompt, prompt_mask, response, resp_mask, sequence_rewards=rewards,
        truncated=resp_len == T,
    )  # fmt: skip


BASE = PPOConfig(
    epochs=2, num_minibatches=2, learning_rate=1e-3, value_learning_rate=1e-3, kl_coef=0.1,
    ent_coef=0.01, gamma=0.99,
)  # fmt: skip


def _run(cfg, mesh=None, batch=None, steps=1):
    policy_graph, policy, value_graph, value, ref = _models(mesh)
    trainer = PPOTrainer(cfg, policy_graph, value_graph if cfg.uses_critic else None, mesh=mesh)
    state = trainer.shard_state(
        init_train_state(cfg, policy, value if cfg.uses_critic else None, jax.random.key(5))
    )
    metrics = []
    for _ in range(steps):
        b = trainer.shard_batch(_batch() if batch is None else batch)
        b = trainer.score(state, ref, b)
        b = trainer.advantages(state, b)
        state, m = trainer.update(state, b)
        metrics.append(jax.device_get(m))
    return state, metrics, b


@pytest.fixture(scope="module")
def single_device_run():
    return _run(BASE)


def test_first_minibatch_ratio_is_exactly_one(single_device_run):
    _, metrics, _ = single_device_run
    assert metrics[0]["first_ratio_max_dev"] < 1e-5
    assert np.isfinite(metrics[0]["loss"]) and metrics[0]["skipped"] == 0


def test_update_changes_parameters_and_reports_metrics(single_device_run):
    state, metrics, _ = single_device_run
    _, policy, _, value, _ = _models()
    moved = [
        float(jnp.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(state.policy), jax.tree.leaves(policy))
    ]
    assert max(moved) > 0
    assert int(state.step) == BASE.epochs * BASE.num_minibatches
    for key in ("policy_loss", "value_loss", "entropy", "kl", "clip_frac", "approx_kl", "lr"):
        assert key in metrics[0]


def test_sharded_update_matches_single_device(single_device_run, devices):
    state, metrics, _ = single_device_run
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded_state, sharded_metrics, _ = _run(BASE, mesh)
    for a, b in zip(jax.tree.leaves(sharded_state.policy), jax.tree.leaves(state.policy)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
    for a, b in zip(jax.tree.leaves(sharded_state.value), jax.tree.leaves(state.value)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
    for key, value in metrics[0].items():
        np.testing.assert_allclose(sharded_metrics[0][key], value, atol=1e-4, rtol=1e-4)
    # Parameters (and their Adam moments) end up split as the rules say.
    wq = sharded_state.policy["trunk"]["blocks"][0]["attn"]["wq"][...]
    assert wq.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
    assert len({str(s.index) for s in wq.addressable_shards}) == 4


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_accumulated_gradients_equal_whole_minibatch_gradients(single_device_run, aggregation):
    """Compared before the optimiser: Adam's per-element normalisation would amplify
    float32 noise in gradients that cancel to zero (whitened advantages sum to 0)."""
    _, _, scored = single_device_run
    # Some rows marked for imitation: that term must accumulate exactly too.
    scored = scored.replace(imitation_weight=jnp.asarray(np.arange(B) % 3 == 0, jnp.float32))
    policy_graph, policy, value_graph, value, _ = _models()
    params = (policy, value)

    def grads(accum):
        cfg = dataclasses.replace(
            BASE, aggregation=aggregation, grad_accum=accum, imitation_coef=0.5
        )
        fn = lambda p, b: accumulated_gradients(cfg, policy_graph, value_graph, p, 0.1, b)
        return jax.jit(fn)(params, scored)

    (g1, m1), (g4, m4) = grads(1), grads(4)
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-5)
    scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g1))
    for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * scale)
    assert float(jnp.abs(jax.tree.leaves(g1)[0]).max()) > 0


def test_non_finite_step_is_skipped_and_counted():
    cfg = dataclasses.replace(BASE, epochs=1, num_minibatches=1)
    state, metrics, _ = _run(cfg, batch=_batch(nan_reward=True))
    _, policy, _, value, _ = _models()
    for a, b in zip(jax.tree.leaves(state.policy), jax.tree.leaves(policy)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(state.skipped) == 1 and metrics[0]["skipped"] == 1


def test_critic_free_grpo_builds_no_value_model():
    cfg = dataclasses.replace(BASE, estimator="grpo", num_groups=4)
    batch = _batch()
    batch = batch.replace(group_id=jnp.arange(B, dtype=jnp.int32) // 2)
    state, metrics, scored = _run(cfg, batch=batch)
    assert state.value is None and state.value_opt is None
    assert "value_loss" not in metrics[0]
    adv = np.asarray(scored.advantages)[:, 0]
    # Two rows per group: their advantages are equal and opposite.
    np.testing.assert_allclose(adv[0::2], -adv[1::2], atol=1e-5)


def test_overlong_rows_can_be_masked_out_of_the_loss():
    cfg = dataclasses.replace(BASE, overlong="mask")
    _, _, scored = _run(cfg)
    truncated = np.asarray(scored.truncated)
    assert truncated.any()
    np.testing.assert_array_equal(np.asarray(scored.loss_weight), (~truncated).astype(np.float32))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_weight_zero_rows_leave_the_loss_as_if_absent(aggregation):
    """Rows a run drops (weight 0: sandbox failure, non-finite reward) must not dilute the
    others: the loss and gradients equal those of the batch without those rows."""
    cfg = PPOConfig(
        estimator="grpo", num_groups=4, kl_placement="loss", kl_coef=0.1, ent_coef=0.01,
        aggregation=aggregation,
    )  # fmt: skip
    policy_graph, policy, _, _, ref = _models()
    trainer = PPOTrainer(cfg, policy_graph)
    state = init_train_state(cfg, policy, None, jax.random.key(0))
    full = _batch(seed=4).replace(group_id=jnp.arange(B) // 2)
    dropped = np.arange(B) >= B - 2  # the last group
    weighted = full.replace(loss_weight=jnp.asarray((~dropped).astype(np.float32)))
    kept = jax.tree.map(lambda x: x[~dropped] if x.ndim else x, full)

    def loss_and_grads(batch):
        batch = trainer.advantages(state, trainer.score(state, ref, batch))
        grads, metrics = accumulated_gradients(cfg, policy_graph, None, (policy, None), 0.1, batch)
        return metrics["loss"], jax.tree.leaves(grads[0])

    (loss_w, g_w), (loss_k, g_k) = loss_and_grads(weighted), loss_and_grads(kept)
    np.testing.assert_allclose(loss_w, loss_k, rtol=1e-5)
    scale = max(float(jnp.abs(g).max()) for g in g_k)
    for a, b in zip(g_w, g_k):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * scale)


def test_imitation_term_adds_the_nll_of_the_marked_rows():
    """The loss gains exactly coef times the marked rows' negative log-likelihood over the
    batch's token count, and no unmarked row changes the gradient."""
    cfg = PPOConfig(estimator="grpo", num_groups=4, kl_placement="loss", kl_coef=0.1)
    policy_graph, policy, _, _, ref = _models()
    trainer = PPOTrainer(cfg, policy_graph)
    state = init_train_state(cfg, policy, None, jax.random.key(0))
    marked = np.array([1, 0, 0, 1, 0, 1, 0, 0], np.float32)
    batch = _batch(seed=6).replace(group_id=jnp.arange(B) // 2)
    batch = trainer.advantages(state, trainer.score(state, ref, batch))
    batch = batch.replace(imitation_weight=jnp.asarray(marked))

    def loss_and_grads(coef, b):
        c = dataclasses.replace(cfg, imitation_coef=coef)
        grads, metrics = accumulated_gradients(c, policy_graph, None, (policy, None), 0.1, b)
        return metrics, jax.tree.leaves(grads[0])

    (m0, g0), (m2, g2) = loss_and_grads(0.0, batch), loss_and_grads(2.0, batch)
    # Scoring used these parameters, so old_logp is the current log-likelihood.
    logp = np.asarray(batch.old_logp, np.float64)
    mask = np.asarray(batch.response_mask, np.float64)
    nll = -sum(logp[b, t] for b in range(B) for t in range(T) if mask[b, t] and marked[b])
    np.testing.assert_allclose(m2["imitation_loss"], nll / mask.sum(), rtol=1e-5)
    np.testing.assert_allclose(m2["loss"] - m0["loss"], 2.0 * nll / mask.sum(), rtol=1e-4)
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(g2, g0)) > 0
    (m_none, g_none) = loss_and_grads(2.0, batch.replace(imitation_weight=jnp.zeros(B)))
    np.testing.assert_allclose(m_none["loss"], m0["loss"], rtol=1e-6)
    for a, b in zip(g_none, g0):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_imitation_alone_raises_the_likelihood_of_the_marked_rows():
    """Equal rewards in every group: the clipped surrogate has zero advantage, so only the
    imitation term moves the policy: every marked completion becomes likelier."""
    cfg = PPOConfig(
        estimator="grpo", num_groups=4, kl_placement="none", learning_rate=3e-3,
        epochs=2, imitation_coef=1.0,
    )  # fmt: skip
    policy_graph, policy, _, _, ref = _models()
    trainer = PPOTrainer(cfg, policy_graph)
    state = init_train_state(cfg, policy, None, jax.random.key(0))
    marked = np.array([1, 0, 1, 0, 1, 0, 1, 0], np.float32)
    batch = _batch(seed=7).replace(
        group_id=jnp.arange(B) // 2, rewards=jnp.zeros((B, T)),
        imitation_weight=jnp.asarray(marked),
    )  # fmt: skip
    before = trainer.advantages(state, trainer.score(state, ref, batch))
    np.testing.assert_array_equal(np.asarray(before.advantages), 0.0)
    state, _ = trainer.update(state, before)
    after = trainer.score(state, ref, batch)
    mask = np.asarray(batch.response_mask)
    gain = ((np.asarray(after.old_logp) - np.asarray(before.old_logp)) * mask).sum(1) / mask.sum(1)
    assert (gain[marked > 0] > 0).all(), gain


def test_imitation_coef_must_not_be_negative():
    with pytest.raises(ValueError, match="ppo.imitation_coef"):
        PPOConfig(imitation_coef=-0.1)


def test_adaptive_kl_controller_moves_the_coefficient():
    cfg = dataclasses.replace(BASE, kl_adaptive=True, kl_target=1e-6, kl_horizon=100.0)
    _, metrics, _ = _run(cfg, steps=2)
    # First rollout: policy == reference, KL 0 is under target, so the coefficient shrinks;
    # after an update the policy has drifted past the tiny target, so it grows again.
    assert metrics[0]["rollout_kl"] < 1e-6 and metrics[0]["kl_coef"] < BASE.kl_coef
    assert metrics[1]["rollout_kl"] > 1e-6 and metrics[1]["kl_coef"] > metrics[0]["kl_coef"]


def test_impossible_batch_layouts_fail_before_compiling(devices):
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    policy_graph, *_ = _models()
    batch = _batch()
    with pytest.raises(ValueError, match="num_minibatches=3"):
        PPOTrainer(dataclasses.replace(BASE, num_minibatches=3), policy_graph).update(None, batch)
    with pytest.raises(ValueError, match="grad_accum=3"):
        PPOTrainer(dataclasses.replace(BASE, grad_accum=3), policy_graph).update(None, batch)
    with pytest.raises(ValueError, match="data-parallel"):
        cfg = dataclasses.replace(BASE, num_minibatches=4)  # microbatches of 2 rows, 4 devices
        PPOTrainer(cfg, policy_graph, mesh=mesh).update(None, batch)
    with pytest.raises(ValueError, match="ppo.estimator"):
        PPOConfig(estimator="ppo2")


def test_ppo_raises_the_probability_of_rewarded_tokens():
    """Reward 1 when the first response token is even: PPO must make even tokens likelier."""
    cfg = PPOConfig(
        epochs=4, num_minibatches=1, estimator="rloo", learning_rate=3e-3, kl_coef=0.0,
        num_groups=4,
    )  # fmt: skip
    policy_graph, policy, _, _, ref = _models()
    trainer = PPOTrainer(cfg, policy_graph)
    state = init_train_state(cfg, policy, None, jax.random.key(0))
    sampler = Sampler(policy_graph, CFG, eos_id=2, pad_id=0)
    prompts = [[1, 10 + i] for i in range(4) for _ in range(4)]
    rates = []
    for it in range(12):
        out = sampler.generate(
            state.policy, prompts, jax.random.key(100 + it), max_new_tokens=2,
            sampling=SamplingParams(),
        )  # fmt: skip
        reward = (out.tokens[:, 0] % 2 == 0).astype(np.float32)
        rates.append(reward.mean())
        tokens, mask = sampler.prepare(prompts, 2)
        batch = new_rollout_batch(
            tokens, mask, out.tokens, out.mask, sequence_rewards=reward,
            group_id=np.arange(16) // 4,
        )  # fmt: skip
        batch = trainer.advantages(state, trainer.score(state, ref, batch))
        state, _ = trainer.update(state, batch)
    assert np.mean(rates[-3:]) > np.mean(rates[:3]) + 0.25, rates


def test_response_log_probs_by_hand_at_a_temperature():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3  # [B, L, V]
    tokens = rng.integers(0, 7, size=(2, 5))
    temperature, prompt_len = 0.6, 2
    logp, _ = response_log_probs(jnp.asarray(logits), jnp.asarray(tokens), prompt_len, temperature)
    for b in range(2):
        for t in range(5 - prompt_len):
            z = logits[b, prompt_len - 1 + t].astype(np.float64) / temperature
            expected = z[tokens[b, prompt_len + t]] - z.max() - np.log(np.exp(z - z.max()).sum())
            assert abs(float(logp[b, t]) - expected) < 1e-4


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_old_log_probs_are_those_of_the_sampling_distribution(temperature):
    """Scoring at the rollout temperature reproduces the sampler's own log-probabilities
    (a cached token-by-token decode against one full forward pass); at temperature 1 it
    does not, which is the off-policy gap scoring at the wrong temperature would leave."""
    policy_graph, policy, _, _, ref = _models()
    sampler = Sampler(policy_graph, CFG, eos_id=2, pad_id=0)
    prompts = [[1, 10 + i, 20 + i] for i in range(B)]
    sampling = SamplingParams(temperature=temperature)
    out = sampler.generate(policy, prompts, jax.random.key(7), max_new_tokens=T, sampling=sampling)
    tokens, mask = sampler.prepare(prompts, T)
    batch = new_rollout_batch(tokens, mask, out.tokens, out.mask, group_id=np.arange(B) // 4)

    def old_logp(t):
        cfg = PPOConfig(estimator="grpo", num_groups=2, sampling_temperature=t)
        return np.asarray(PPOTrainer(cfg, policy_graph).score(
            init_train_state(cfg, policy, None, jax.random.key(0)), ref, batch
        ).old_logp)  # fmt: skip

    np.testing.assert_allclose(old_logp(temperature), out.logprobs * out.mask, atol=2e-4)
    assert np.abs(old_logp(1.0) - out.logprobs * out.mask).max() > 0.05


def test_sampling_temperature_must_be_positive():
    with pytest.raises(ValueError, match="sampling_temperature"):
        PPOConfig(sampling_temperature=0.0)


def test_learning_rate_schedules_by_hand():
    from rlpt.rl import learning_rate_schedule

    cfg = PPOConfig(schedule="warmup_linear", warmup_steps=10, total_steps=110, end_lr_fraction=0.1)
    lr = learning_rate_schedule(cfg, 1.0)
    # Linear warmup 0 -> 1 over 10 steps, then linear decay 1 -> 0.1 over the next 100.
    np.testing.assert_allclose([lr(0), lr(5), lr(10), lr(60), lr(110)], [0, 0.5, 1, 0.55, 0.1])
    cosine = learning_rate_schedule(dataclasses.replace(cfg, schedule="warmup_cosine"), 1.0)
    # Half-way through the cosine: end + (peak - end) * (1 + cos(pi / 2)) / 2 = 0.55.
    np.testing.assert_allclose([cosine(10), cosine(60), cosine(110)], [1, 0.55, 0.1], atol=1e-6)
    constant = learning_rate_schedule(PPOConfig(), 3e-4)
    assert float(constant(0)) == float(constant(10_000)) == 3e-4


def test_adaptive_learning_rate_follows_the_measured_kl():
    from rlpt.rl.ppo import _adapt_lr

    cfg = PPOConfig(adaptive_lr="kl", adaptive_lr_target=0.02, adaptive_lr_bounds=(0.5, 2.0))
    one = jnp.ones(())
    # Over twice the target: divide by the factor; under half: multiply; in between: keep.
    assert float(_adapt_lr(cfg, one, {"approx_kl": 0.05})) == pytest.approx(1 / 1.5)
    assert float(_adapt_lr(cfg, one, {"approx_kl": 0.001})) == pytest.approx(1.5)
    assert float(_adapt_lr(cfg, one, {"approx_kl": 0.02})) == 1.0
    # Bounded.
    assert float(_adapt_lr(cfg, 1.9 * one, {"approx_kl": 0.0})) == 2.0
    clip = dataclasses.replace(cfg, adaptive_lr="clip_frac", adaptive_lr_target=0.2)
    assert float(_adapt_lr(clip, one, {"clip_frac": 0.5, "approx_kl": 0.0})) < 1.0


def test_step_advantages_credit_each_step_from_its_group():
    from rlpt.rl.advantages import process_group_advantages
    from rlpt.rl.kl import init_kl_controller
    from rlpt.rl.ppo import compute_advantages

    step = 7  # token id marking a step's end
    # Two groups of two: in each, a right first step (reward 1 at the step token) and a
    # wrong one (0), then outcomes at the last token.
    response = np.array(
        [[5, step, 6, 6], [5, step, 6, 0], [5, 5, step, 6], [5, step, 6, 6]], np.int32
    )
    mask = (response > 0).astype(np.float32)
    batch = new_rollout_batch(
        np.full((4, 2), 9), np.ones((4, 2), bool), response, mask,
        sequence_rewards=np.array([1.0, 0.0, 0.0, 1.0], np.float32), step_token_id=step,
        group_id=np.array([0, 0, 1, 1]),
    )  # fmt: skip
    process = np.asarray(batch.step_mask) * np.array([[1.0], [0.0], [0.0], [1.0]])
    batch = batch.replace(rewards=batch.rewards + process)
    cfg = PPOConfig(estimator="grpo", step_advantages=True, kl_placement="loss", num_groups=2)
    got = np.asarray(compute_advantages(cfg, init_kl_controller(0.0), batch).advantages)
    last = np.zeros((4, 4), np.float32)
    last[np.arange(4), mask.sum(1).astype(int) - 1] = 1.0
    positions = np.maximum(np.asarray(batch.step_mask), last)
    want = process_group_advantages(batch.rewards, positions, mask, batch.group_id, num_groups=2)
    np.testing.assert_allclose(got, np.asarray(want), atol=1e-6)
    # Group 0, hand-worked: entries [1, 1, 0, 0] -> ±1; sample 0 earns 2 before its step.
    np.testing.assert_allclose(got[0], [2.0, 2.0, 1.0, 1.0], atol=1e-5)
    np.testing.assert_allclose(got[1], [-2.0, -2.0, -1.0, 0.0], atol=1e-5)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"estimator": "gae", "step_advantages": True}, "estimator 'grpo' or 'dr_grpo'"),
        ({"estimator": "grpo", "step_advantages": True}, "kl_placement"),
    ],
)
def test_step_advantages_config_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        PPOConfig(**fields)


@functools.cache
def _trainer(cfg):
    # One trainer per config, so a config used twice traces and compiles its steps once.
    policy_graph, _, value_graph, _, _ = _models()
    return PPOTrainer(cfg, policy_graph, value_graph if cfg.uses_critic else None)


def _scored_twice(cfg, batch):
    """Score and update ``batch`` once under ``cfg`` from the same initial state."""
    _, policy, _, value, ref = _models()
    trainer = _trainer(cfg)
    state = trainer.shard_state(init_train_state(cfg, policy, value, jax.random.key(5)))
    scored = trainer.advantages(state, trainer.score(state, ref, batch))
    new_state, metrics = trainer.update(state, scored)
    return trainer, scored, jax.device_get(new_state.policy), jax.device_get(metrics)


def test_behaviour_log_probs_stand_in_for_the_recomputed_ones():
    """old_logprobs='behaviour' takes the sampler's log-probs as the ratio's anchor: given
    exactly the recomputed ones it scores and updates as recompute does; a correction
    whose weights are all 1 changes nothing; the mismatch metric is k3 by hand."""
    trainer, recomputed, params, metrics = _scored_twice(BASE, _batch())
    behaviour = np.asarray(recomputed.old_logp)
    batch = _batch().replace(behaviour_logp=jnp.asarray(behaviour))
    for cfg in (
        dataclasses.replace(BASE, old_logprobs="behaviour"),
        dataclasses.replace(BASE, behaviour_correction="truncate"),
        dataclasses.replace(BASE, old_logprobs="behaviour", behaviour_correction="mask"),
    ):
        _, scored, other_params, other_metrics = _scored_twice(cfg, batch)
        np.testing.assert_array_equal(scored.old_logp, behaviour)
        jax.tree.map(np.testing.assert_array_equal, other_params, params)
        assert other_metrics["policy_loss"] == metrics["policy_loss"]
        if cfg.behaviour_correction != "none":
            assert other_metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-6)
            assert other_metrics["is_capped_frac"] == 0.0
    mask = np.asarray(recomputed.response_mask)
    shifted = recomputed.replace(behaviour_logp=jnp.asarray((behaviour + 0.1) * mask))
    mismatch = jax.device_get(trainer.mismatch(shifted))
    w = math.exp(-0.1)
    assert mismatch["mismatch_kl"] == pytest.approx((w - 1) - math.log(w), rel=1e-4)
    assert mismatch["mismatch_logp_max_abs"] == pytest.approx(0.1, rel=1e-4)


def test_truncated_weights_shrink_the_policy_gradient_of_stale_tokens():
    """With every token's behaviour probability far below the proximal one (w = e^3),
    truncation at 2 scales the clipped surrogate by exactly 2 on every token; masking
    drops it, leaving only the critic, entropy and KL terms (which need no weights)."""
    no_kl = dataclasses.replace(BASE, kl_coef=0.0, ent_coef=0.0, epochs=1, num_minibatches=1)
    _, scored, _, _ = _scored_twice(no_kl, _batch())
    stale = _batch().replace(behaviour_logp=scored.old_logp - 3.0 * scored.response_mask)
    _, _, _, plain = _scored_twice(no_kl, stale)
    _, _, _, truncated = _scored_twice(
        dataclasses.replace(no_kl, behaviour_correction="truncate"), stale
    )
    _, _, masked_params, masked = _scored_twice(
        dataclasses.replace(no_kl, behaviour_correction="mask"), stale
    )
    assert truncated["policy_loss"] == pytest.approx(2.0 * plain["policy_loss"], rel=1e-5)
    assert truncated["is_capped_frac"] == 1.0
    assert masked["policy_loss"] == 0.0
    _, initial_policy, _, _, _ = _models()
    jax.tree.map(np.testing.assert_array_equal, masked_params, jax.device_get(initial_policy))


@pytest.mark.parametrize(
    "fields, message",
    [({"old_logprobs": "sampler"}, "old_logprobs"),
     ({"behaviour_correction": "clip"}, "behaviour_correction"),
     ({"is_cap": 1.0}, "is_cap")],
)  # fmt: skip
def test_behaviour_settings_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        PPOConfig(**fields)


def test_chunked_vocabulary_scores_and_updates_like_the_dense_head(single_device_run):
    """vocab_chunk only changes how the vocabulary statistics are computed: scoring, the
    losses (entropy bonus and KL in the loss included) and the gradients stay the same."""
    _, _, scored = single_device_run
    scored = scored.replace(imitation_weight=jnp.asarray(np.arange(B) % 3 == 0, jnp.float32))
    cfg = dataclasses.replace(
        BASE, ent_coef=0.1, kl_placement="loss", imitation_coef=0.5, grad_accum=2,
        sampling_temperature=0.8,
    )  # fmt: skip
    value_graph, value = create_model(lambda r: ValueModel(CFG, rngs=r), jax.random.key(1))

    def run(vocab_chunk):
        # 3 tokens a chunk: the 7 response tokens make two full chunks and a ragged one.
        model_cfg = get_preset("tiny", vocab_chunk=vocab_chunk)
        graph, policy = create_model(lambda r: CausalLM(model_cfg, rngs=r), jax.random.key(0))
        _, ref = create_model(lambda r: CausalLM(model_cfg, rngs=r), jax.random.key(9))
        rescored = jax.jit(
            lambda p, r, v, b: score_rollout(graph, value_graph, p, r, v, b, temperature=0.8)
        )(policy, ref, value, scored)
        grads_fn = lambda p, b: accumulated_gradients(cfg, graph, value_graph, p, 0.1, b)
        return rescored, jax.jit(grads_fn)((policy, value), scored)

    dense_scored, (dense_grads, dense_metrics) = run(0)
    chunked_scored, (chunked_grads, chunked_metrics) = run(3)
    for name in ("old_logp", "ref_logp", "values"):
        np.testing.assert_allclose(
            getattr(chunked_scored, name), getattr(dense_scored, name), atol=1e-5
        )
    for key, value in dense_metrics.items():
        np.testing.assert_allclose(chunked_metrics[key], value, atol=1e-5, rtol=1e-5)
    assert float(dense_metrics["entropy"]) > 1.0
    scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(dense_grads))
    for a, b in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(dense_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * scale)
