"""Environment tokens (multi-turn feedback) are context, never actions.

Rows hold holes in the trained mask where the environment's tokens sit. Every loss,
KL, entropy and advantage with those tokens masked must equal the same quantity
computed by plain numpy loops over the model's tokens alone, with the environment's
tokens deleted; and the policy must still attend over them (they change the scores of
the model tokens after them), packed or not.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlpt.models import CausalLM, create_model, get_preset
from rlpt.rl import (
    PPOConfig,
    PPOTrainer,
    aggregate,
    compute_advantages,
    init_kl_controller,
    init_train_state,
    kl_loss,
    new_rollout_batch,
    policy_loss,
)
from rlpt.rl.ppo import accumulated_gradients

# 1 model token, 0 environment token, "." past the row: four rows, two groups of two.
LAYOUT = ("1100111...", "111.......", "1000110...", "1101111111")
B, T, P = len(LAYOUT), len(LAYOUT[0]), 3


def _masks():
    trained = np.array([[c == "1" for c in row] for row in LAYOUT], np.float32)
    present = np.array([[c != "." for c in row] for row in LAYOUT], np.float32)
    return trained, present


def _batch(seed):
    """A multi-turn batch with random scores; junk where the masks say nothing counts."""
    rng = np.random.default_rng(seed)
    trained, present = _masks()
    prompt = rng.integers(5, 200, size=(B, P))
    response = rng.integers(5, 200, size=(B, T))
    rewards = rng.normal(size=B).astype(np.float32)
    batch = new_rollout_batch(
        prompt, np.ones((B, P), bool), response, trained, present_mask=present,
        sequence_rewards=rewards, group_id=np.array([0, 0, 1, 1]),
    )  # fmt: skip
    # As score_rollout leaves them: zero off the trained tokens.
    old, ref, values = (rng.normal(-1.5, 0.5, size=(B, T)).astype(np.float32) * trained
                        for _ in range(3))  # fmt: skip
    batch = batch.replace(old_logp=jnp.asarray(old), ref_logp=jnp.asarray(ref),
                          values=jnp.asarray(values))  # fmt: skip
    logp = old + rng.normal(0, 0.3, size=(B, T)).astype(np.float32)  # the new policy, junk too
    entropy = rng.uniform(0.5, 3.0, size=(B, T)).astype(np.float32)
    return batch, rewards, logp, entropy


def _model_tokens(x):
    """Row ``b`` of ``x`` [B, T] with the environment's tokens and the padding deleted."""
    trained, _ = _masks()
    return [np.asarray(x[b], np.float64)[trained[b] > 0] for b in range(B)]


def _k3(logp, ref):
    log_r = ref - logp
    return np.exp(log_r) - 1.0 - log_r


def test_rewards_land_on_the_last_model_token_and_masks_stay_apart():
    batch, rewards, _, _ = _batch(0)
    trained, present = _masks()
    # Last model token of each row, read off LAYOUT: columns 6, 2, 5, 9.
    for b, col in enumerate((6, 2, 5, 9)):
        row = np.zeros(T, np.float32)
        row[col] = rewards[b]
        np.testing.assert_array_equal(np.asarray(batch.rewards[b]), row)
    np.testing.assert_array_equal(np.asarray(batch.response_mask), trained)
    np.testing.assert_array_equal(np.asarray(batch.input_mask[:, P:]), present > 0)
    # Positions count every present token, environment tokens included.
    np.testing.assert_array_equal(
        np.asarray(batch.positions[0]), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0]
    )
    with pytest.raises(ValueError, match="must be present"):
        new_rollout_batch(np.ones((1, 1)), np.ones((1, 1), bool), np.ones((1, 2)),
                          np.array([[1.0, 1.0]]), present_mask=np.array([[1.0, 0.0]]))  # fmt: skip


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_grpo_losses_equal_a_loop_over_model_tokens(aggregation):
    batch, rewards, logp, entropy = _batch(1)
    cfg = PPOConfig(estimator="grpo", num_groups=2, kl_placement="loss", aggregation=aggregation,
                    clip_low=0.2, clip_high=0.28)  # fmt: skip
    out = compute_advantages(cfg, init_kl_controller(0.1), batch)
    mask = out.response_mask
    pg, _ = policy_loss(jnp.asarray(logp), out.old_logp, out.advantages, mask, clip_low=0.2,
                        clip_high=0.28, aggregation=aggregation)  # fmt: skip
    kl = kl_loss(jnp.asarray(logp), out.ref_logp, mask, kind="k3", aggregation=aggregation)
    ent = aggregate(jnp.asarray(entropy), mask, mode=aggregation)

    # The oracle: group-normalised sequence rewards, then per-token sums over model tokens.
    group = np.array([0, 0, 1, 1])
    adv = np.zeros(B)
    for g in (0, 1):
        r = rewards[group == g].astype(np.float64)
        adv[group == g] = (r - r.mean()) / (r.std() + 1e-6)
    new, old, ref, ent_rows = (_model_tokens(x) for x in (logp, out.old_logp, out.ref_logp,
                                                           entropy))  # fmt: skip
    per_row = {"pg": [], "kl": [], "ent": []}
    for b in range(B):
        ratio = np.exp(new[b] - old[b])
        surrogate = np.minimum(ratio * adv[b], np.clip(ratio, 0.8, 1.28) * adv[b])
        per_row["pg"].append(-surrogate)
        per_row["kl"].append(_k3(new[b], ref[b]))
        per_row["ent"].append(ent_rows[b])
    for name, value in (("pg", pg), ("kl", kl), ("ent", ent)):
        rows = per_row[name]
        if aggregation == "token_mean":
            want = sum(r.sum() for r in rows) / sum(len(r) for r in rows)
        else:
            want = np.mean([r.mean() for r in rows])
        # float32 (ratios, the group std) against a float64 oracle of the same inputs; the
        # surrogate is a cancelling sum of terms of order 1, hence the absolute tolerance.
        np.testing.assert_allclose(float(value), want, rtol=2e-5, atol=1e-5, err_msg=name)
    # Advantages: the row's on its model tokens, zero on the environment's.
    trained, _ = _masks()
    np.testing.assert_allclose(np.asarray(out.advantages), adv[:, None] * trained, rtol=2e-5,
                               atol=1e-6)  # fmt: skip


def test_gae_with_kl_rewards_equals_a_loop_over_model_tokens():
    batch, rewards, _, _ = _batch(2)
    gamma, lam, coef = 0.9, 0.8, 0.1
    cfg = PPOConfig(estimator="gae", gamma=gamma, lam=lam, kl_placement="reward",
                    whiten_advantages=True)  # fmt: skip
    out = compute_advantages(cfg, init_kl_controller(coef), batch)
    old, ref, values = (_model_tokens(x) for x in (batch.old_logp, batch.ref_logp, batch.values))
    adv_rows = []
    for b in range(B):
        n = len(old[b])
        r = -coef * _k3(old[b], ref[b])
        r[-1] += rewards[b]
        adv, next_value, next_adv = np.zeros(n), 0.0, 0.0
        for t in reversed(range(n)):
            delta = r[t] + gamma * next_value - values[b][t]
            adv[t] = next_adv = delta + gamma * lam * next_adv
            next_value = values[b][t]
        adv_rows.append(adv)
    flat = np.concatenate(adv_rows)
    whitened = (flat - flat.mean()) / np.sqrt(flat.var() + 1e-8)
    got = np.concatenate(_model_tokens(out.advantages))
    np.testing.assert_allclose(got, whitened, rtol=1e-5, atol=1e-5)
    trained, _ = _masks()
    assert np.all(np.asarray(out.advantages)[trained == 0] == 0.0)


CFG = get_preset("tiny").replace(max_seq_len=32)


@pytest.fixture(scope="module")
def models():
    graph, policy = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0))
    _, ref = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(5))
    return graph, policy, ref


def _numpy_log_probs(graph, params, batch, temperature):
    """Log-probs [B, T] and entropies [B, T] of the response tokens from a plain forward
    pass over whole rows (every present token attended)."""
    from flax import nnx

    logits, _ = nnx.merge(graph, params)(batch.tokens, batch.positions, batch.input_mask)
    logits = np.asarray(logits, np.float64)[:, P - 1 : -1] / temperature  # [B, T, V]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    log_probs = logits - logz[..., None]
    targets = np.asarray(batch.tokens)[:, P:]
    picked = np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    entropy = -(np.exp(log_probs) * log_probs).sum(-1)
    return picked, entropy


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_the_policy_attends_over_environment_tokens_and_trains_on_model_tokens(models, pack):
    graph, policy, ref = models
    temperature = 1.3
    cfg = PPOConfig(estimator="grpo", num_groups=2, kl_placement="loss", kl_coef=0.1,
                    sampling_temperature=temperature, pack_sequences=pack)  # fmt: skip
    trainer = PPOTrainer(cfg, graph)
    state = init_train_state(cfg, policy, None, jax.random.key_data(jax.random.key(0)))
    batch, rewards, _, _ = _batch(3)
    scored = trainer.score(state, ref, batch)
    want_old, entropy = _numpy_log_probs(graph, policy, batch, temperature)
    want_ref, _ = _numpy_log_probs(graph, ref, batch, temperature)
    trained, _ = _masks()
    # fp32 forward passes against a float64 softmax of the same logits.
    np.testing.assert_allclose(np.asarray(scored.old_logp), want_old * trained, atol=2e-5)
    np.testing.assert_allclose(np.asarray(scored.ref_logp), want_ref * trained, atol=2e-5)

    # The feedback is visible context: change one environment token (row 0, column 2) and
    # the model tokens after it score differently; those before it do not.
    tokens = np.asarray(batch.tokens).copy()
    tokens[0, P + 2] = (tokens[0, P + 2] + 1) % 200 + 5
    other = trainer.score(state, ref, batch.replace(tokens=jnp.asarray(tokens)))
    before = np.asarray(scored.old_logp[0])
    after = np.asarray(other.old_logp[0])
    np.testing.assert_allclose(after[:2], before[:2], atol=1e-6)
    assert np.all(np.abs(after[4:7] - before[4:7]) > 1e-6)

    # One loss over the batch: clipped surrogate (ratio 1: the policy scored the batch),
    # k3 KL to the reference and entropy, all over model tokens only.
    advantaged = trainer.advantages(state, scored)
    plan = trainer.plan(state, advantaged)
    packed = None
    if plan is not None:
        # The packed layout is of the first epoch's row order: take the rows in that order.
        perm = plan.permutations[0]
        advantaged = jax.tree.map(lambda x: jnp.take(x, perm, axis=0), advantaged)
        packed = jax.tree.map(lambda x: x[0, 0], plan.rows)
    _, metrics = jax.jit(functools.partial(accumulated_gradients, cfg, graph, None))(
        (policy, None), jnp.float32(0.1), advantaged, None, packed
    )
    group = np.array([0, 0, 1, 1])
    adv = np.zeros(B)
    for g in (0, 1):
        r = rewards[group == g].astype(np.float64)
        adv[group == g] = (r - r.mean()) / (r.std() + 1e-6)
    old_rows, ref_rows, ent_rows = (_model_tokens(x) for x in (want_old, want_ref, entropy))
    n = sum(len(r) for r in old_rows)
    want_pg = -sum(adv[b] * len(old_rows[b]) for b in range(B)) / n
    want_kl = sum(_k3(old_rows[b], ref_rows[b]).sum() for b in range(B)) / n
    want_ent = sum(r.sum() for r in ent_rows) / n
    np.testing.assert_allclose(float(metrics["policy_loss"]), want_pg, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["kl"]), want_kl, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(metrics["entropy"]), want_ent, rtol=1e-5)
    want_loss = want_pg + 0.1 * want_kl
    np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-4, atol=1e-6)
