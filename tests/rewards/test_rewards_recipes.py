"""The reward-model recipe's plumbing: trunk warm start and multi-domain SFT."""

import jax
import numpy as np

from rlpt.models import CausalLM, RewardModel, create_model
from rlpt.rewards.data import correctness_pairs
from rlpt.rewards.recipes import small_config, train_reward_model, train_sft
from rlpt.rewards.train import with_trunk
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


def test_multi_domain_sft_then_rm_training_runs():
    tok = ByteTokenizer()
    config = small_config(d_model=32, n_layers=1, max_seq_len=48)
    arith, steps = get_domain("arithmetic"), get_domain("stepwise_math")
    tasks = arith.tasks("train", 8, 1, seed=0) + steps.tasks("train", 8, 1, seed=0)
    _, policy, metrics = train_sft(config, None, tasks, tok, steps=2, batch_size=4)
    assert np.isfinite(metrics["loss"])
    pairs = correctness_pairs(arith, tasks[:8]) + correctness_pairs(steps, tasks[8:])
    _, _, rm_metrics = train_reward_model(config, pairs, tok, steps=2, batch_size=4, policy=policy)
    assert np.isfinite(rm_metrics["loss"])
