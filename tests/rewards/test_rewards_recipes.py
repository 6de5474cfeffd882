"""The reward-model recipe: trunk warm start, multi-domain SFT and RM training that learn."""

import jax
import numpy as np
import pytest

from rlpt.models import CausalLM, RewardModel, create_model
from rlpt.rewards.data import correctness_pairs
from rlpt.rewards.preferences import encode_pairs
from rlpt.rewards.recipes import sft_examples, small_config, train_reward_model, train_sft
from rlpt.rewards.train import TrainConfig, rm_trainer, with_trunk
from rlpt.sft import sft_trainer
from rlpt.tasks import get_domain
from rlpt.tokenizers import ByteTokenizer


def test_reward_model_starts_from_the_policy_trunk_and_a_fresh_head():
    config = small_config(d_model=32, n_layers=1, max_seq_len=32)
    _, policy = create_model(lambda r: CausalLM(config, rngs=r), jax.random.key(1))
    _, rm = create_model(lambda r: RewardModel(config, rngs=r), jax.random.key(2))
    head = np.asarray(rm["head_w"][...])
    rm = with_trunk(rm, policy)
    for a, b in zip(jax.tree.leaves(rm["trunk"]), jax.tree.leaves(policy["trunk"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(rm["head_w"][...]), head)


def test_multi_domain_sft_then_rm_training_learns_both_domains():
    tok = ByteTokenizer()
    config = small_config(d_model=32, n_layers=1, max_seq_len=48)
    arith, steps = get_domain("arithmetic"), get_domain("stepwise_math")
    tasks = arith.tasks("train", 8, 1, seed=0) + steps.tasks("train", 8, 1, seed=0)
    graph, policy, _ = train_sft(config, None, tasks, tok, steps=30, batch_size=4)
    # The untrained policy train_sft starts from (its seed, 0).
    _, untrained = create_model(lambda r: CausalLM(config, rngs=r), jax.random.key(0))
    sft = sft_trainer(TrainConfig(), graph)
    for dom, part in ((arith, tasks[:8]), (steps, tasks[8:])):
        data = sft_examples(tok, part, [dom.demonstration(t) for t in part], 48)
        before = float(sft.evaluate(untrained, data)["loss"])
        after = float(sft.evaluate(policy, data)["loss"])
        # Measured: about 0.65x for each domain after 30 steps.
        assert after < 0.8 * before, (dom.name, before, after)

    pairs = correctness_pairs(arith, tasks[:8]) + correctness_pairs(steps, tasks[8:])
    rm_graph, rm, _ = train_reward_model(config, pairs, tok, steps=60, batch_size=4, policy=policy)
    # Against the same start: the policy's trunk under a fresh head (seed 0), a loss of
    # about log 2 since its scores barely differ.
    _, start = create_model(lambda r: RewardModel(config, rngs=r), jax.random.key(0))
    start = with_trunk(start, policy)
    arrays, _ = encode_pairs(pairs, tok, 48, pad_to=48)
    batch = {
        "chosen": arrays.chosen, "chosen_mask": arrays.chosen_mask,
        "rejected": arrays.rejected, "rejected_mask": arrays.rejected_mask,
        "margin": arrays.margin, "weight": np.ones(len(pairs), np.float32),
    }  # fmt: skip
    rm_eval = rm_trainer(TrainConfig(), rm_graph)
    before = float(rm_eval.evaluate(start, batch)["loss"])
    after = float(rm_eval.evaluate(rm, batch)["loss"])
    # Measured: from 0.69 to about 0.16 (0.24x) after 60 steps.
    assert after < 0.5 * before, (before, after)


def test_sft_stopped_early_on_a_longer_schedule_equals_that_run_at_the_same_step():
    """``decay_steps`` sets the schedule, ``steps`` where it stops: a 3-step run on a
    6-step schedule is the 6-step run's state after its third step (``on_step``)."""
    tok = ByteTokenizer()
    config = small_config(d_model=32, n_layers=1, max_seq_len=48)
    arith = get_domain("arithmetic")
    tasks = arith.tasks("train", 8, 1, seed=0)
    seen = {}

    def keep(n, params):
        seen[n] = jax.tree.map(np.array, params)  # a copy: the next step donates them

    train_sft(config, arith, tasks, tok, steps=6, batch_size=4, decay_steps=6, on_step=keep)
    assert sorted(seen) == [1, 2, 3, 4, 5, 6]
    _, stopped, _ = train_sft(config, arith, tasks, tok, steps=3, batch_size=4, decay_steps=6)
    for a, b in zip(jax.tree.leaves(stopped), jax.tree.leaves(seen[3])):
        np.testing.assert_array_equal(np.asarray(a), b)
    # Its own 3-step schedule (a shorter warmup and decay) ends elsewhere.
    _, short, _ = train_sft(config, arith, tasks, tok, steps=3, batch_size=4)
    assert any(
        not np.array_equal(np.asarray(a), b)
        for a, b in zip(jax.tree.leaves(short), jax.tree.leaves(seen[3]))
    )
    with pytest.raises(ValueError, match="decay_steps"):
        train_sft(config, arith, tasks, tok, steps=3, batch_size=4, decay_steps=2)
