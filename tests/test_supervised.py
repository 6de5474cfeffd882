"""The supervised trainer on SFT: the loss against numpy, the schedule by hand, and a
sharded step against the single-device one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlpt import sft
from rlpt.models import CausalLM, create_model, get_preset
from rlpt.parallel import make_mesh
from rlpt.supervised import TrainConfig
from rlpt.tokenizers import ByteTokenizer

CFG = get_preset("tiny")  # d_model 32
TOK = ByteTokenizer()
L = 24


@pytest.fixture(scope="module")
def lm():
    return create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0))


def _batch(n=8):
    rows = [sft.encode_example(TOK, f"{i}*3=", f"<answer>{3 * i}", L) for i in range(n)]
    return {"tokens": np.stack([r[0] for r in rows]), "loss_mask": np.stack([r[1] for r in rows])}


def _numpy_nll(logits, tokens, loss_mask):
    """Mean -log p(next token) over the completion targets, in float64 numpy."""
    logits = np.asarray(logits, np.float64)[:, :-1]
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    total = count = 0.0
    for b in range(tokens.shape[0]):
        for t in range(1, tokens.shape[1]):
            if loss_mask[b, t]:
                total -= logp[b, t - 1, tokens[b, t]]
                count += 1
    return total / count


def test_sft_loss_matches_numpy_and_left_padding(lm):
    graph, params = lm
    batch = _batch()
    tokens = batch["tokens"]
    positions = np.broadcast_to(np.arange(L), tokens.shape)
    logits, _ = nnx.merge(graph, params)(jnp.asarray(tokens), positions, jnp.ones(tokens.shape))
    loss, metrics = sft.sft_objective(graph, params, batch)
    # float32 softmax and sums over ~100 targets against float64: 1e-5 relative.
    np.testing.assert_allclose(float(loss), _numpy_nll(logits, tokens, batch["loss_mask"]), 1e-5)
    assert 0.0 <= float(metrics["token_accuracy"]) <= 1.0
    # The same rows left-padded, with their mask: the same loss.
    lengths = (tokens != TOK.pad_id).sum(1)
    shift = lambda x, fill: np.stack(
        [np.concatenate([np.full(L - n, fill, x.dtype), r[:n]]) for r, n in zip(x, lengths)]
    )
    left = {
        "tokens": shift(tokens, TOK.pad_id), "loss_mask": shift(batch["loss_mask"], 0),
        "mask": shift(np.ones_like(tokens), 0),
    }  # fmt: skip
    np.testing.assert_allclose(float(sft.sft_objective(graph, params, left)[0]), float(loss), 1e-5)


def test_sft_schedule_warms_up_from_a_fraction_by_hand():
    # 3 warmup steps at peak 0.3: lr(s) = 0.3/3 + (0.3 - 0.3/3) s / 3, then 0.3.
    cfg = sft.train_config(0.3, warmup_steps=3)
    got = [cfg.learning_rate_at(s) for s in range(6)]
    np.testing.assert_allclose(got, [0.1, 0.1 + 0.2 / 3, 0.1 + 0.4 / 3, 0.3, 0.3, 0.3], 1e-6)
    # No warmup asked: one step of "warmup" from 0.3 / 1, i.e. constant.
    assert sft.train_config(0.3, 0).learning_rate_at(0) == pytest.approx(0.3, rel=1e-6)
    with pytest.raises(ValueError, match="decay_steps"):
        TrainConfig(warmup_steps=5, decay_steps=3)


def test_sharded_sft_step_matches_the_single_device_step(lm, devices):
    graph, params = lm
    mesh = make_mesh(data=4, fsdp=2)
    batch = _batch(8)
    cfg = sft.train_config(1e-2, warmup_steps=1)
    runs = {}
    for name, m in (("single", None), ("sharded", mesh)):
        trainer = sft.sft_trainer(cfg, graph, mesh=m)
        # The step donates its state: each run starts from its own copy.
        state = trainer.init(jax.tree.map(jnp.copy, params))
        state, metrics = trainer.step(state, batch)
        runs[name] = (state, jax.device_get(metrics))
    (single, m1), (sharded, m2) = runs["single"], runs["sharded"]
    # The sharded program sums the loss and the gradients in another order (partial sums
    # per device, then across devices): float32 rounding, a few ulps of the ~1e-7 epsilon
    # per term, far under 1e-5 relative.
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-5)
    np.testing.assert_allclose(m2["grad_norm"], m1["grad_norm"], rtol=1e-5)
    # Adam's first moment after one step is 0.1 * g: the gradients. A float32 sum's error
    # scales with the magnitude of its terms, not of its result, hence the leaf-wide atol.
    mu = lambda s: dict(jax.tree_util.tree_leaves_with_path(s.opt_state[1][0].mu))
    grads_1, grads_2 = mu(single), mu(sharded)
    params_1 = dict(jax.tree_util.tree_leaves_with_path(single.params))
    for path, p2 in jax.tree_util.tree_leaves_with_path(sharded.params):
        g1, g2 = np.asarray(grads_1[path]) * 10, np.asarray(grads_2[path]) * 10
        np.testing.assert_allclose(g2, g1, rtol=1e-5, atol=1e-5 * np.abs(g1).max())
        # Adam's first step moves a weight by lr * g / (|g| + 1e-8): for |g| >= 1e-5 that is
        # lr * sign(g) to 1e-3, so a 1e-5 relative change of g moves it by < 1e-7 * lr. Where
        # |g| is near Adam's epsilon the step turns rounding of g into a large change of the
        # step (seen: 6e-5 at |g| = 8e-9); the gradient check above covers those entries.
        big = np.abs(g1) >= 1e-5
        np.testing.assert_allclose(
            np.asarray(p2)[big], np.asarray(params_1[path])[big], rtol=1e-5, atol=1e-7
        )
    assert int(sharded.step) == 1 and int(sharded.skipped) == 0
    # The weights really are split: the embed axis of wq over fsdp (2 distinct shards,
    # each replicated over data), and the optimiser's moments alike.
    wq = sharded.params["trunk"]["blocks"][0]["attn"]["wq"][...]
    assert wq.sharding.spec[0] == "fsdp"
    assert len({str(s.index) for s in wq.addressable_shards}) == 2
    mu = sharded.opt_state[1][0].mu["trunk"]["blocks"][0]["attn"]["wq"][...]
    assert mu.sharding == wq.sharding


def test_a_batch_that_does_not_split_over_the_mesh_is_an_error(lm, devices):
    graph, _ = lm
    trainer = sft.sft_trainer(sft.train_config(1e-3, 1), graph, mesh=make_mesh(data=4, fsdp=2))
    with pytest.raises(ValueError, match="tokens.*6 rows.*8 data-parallel"):
        trainer.shard_batch(_batch(6))
