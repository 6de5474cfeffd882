"""The rollout worker and the PPO learner, each built alone from a tiny model.

A prompt batch goes through the rollout (trajectories tagged with the policy version),
a stub verdict, the learner's batch layout and one PPO update on a mesh of the 8 host
devices. Checked against what must hold whatever the numbers: the learner trains on
exactly the sampled ids, the behaviour log-probs are those of the sampled ids under the
sampling distribution (the learner's own scoring of the same ids, before any update),
the state's step advances, and the reference stays where it was.
"""

import dataclasses

import jax
import numpy as np

from rlpt.data.loader import PromptBatch
from rlpt.models import CausalLM, create_model, get_preset
from rlpt.parallel import make_mesh
from rlpt.rl import PPOConfig
from rlpt.roles import PPOLearner, RolloutWorker, Verdicts
from rlpt.sampling import Sampler, SamplingParams
from rlpt.tokenizers import ByteTokenizer


def test_rollout_then_one_learner_step(devices):
    cfg = get_preset("tiny").replace(max_seq_len=48)
    tok = ByteTokenizer()
    mesh = make_mesh(data=4, fsdp=2)
    graph, params = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(0))
    sampler = Sampler(graph, cfg, eos_id=tok.eos_id, pad_id=tok.pad_id, buckets=(16,), mesh=mesh)
    worker = RolloutWorker(sampler, tok, domain_names=("d",), max_new_tokens=8,
                           sampling=SamplingParams(temperature=1.0))  # fmt: skip
    prompts = [tok.encode(f"{i}+{i}=", add_bos=True) for i in range(4) for _ in range(2)]
    tokens = np.full((8, 16), tok.pad_id, np.int32)
    mask = np.zeros((8, 16), bool)
    for row, ids in enumerate(prompts):
        tokens[row, 16 - len(ids) :], mask[row, 16 - len(ids) :] = ids, True
    batch = PromptBatch(
        tokens=tokens, mask=mask, loss_weight=np.ones(8, np.float32),
        domain_index=np.zeros(8, np.int32), difficulty=np.ones(8, np.int32),
        group_id=np.repeat(np.arange(4), 2).astype(np.int32), tasks=[None] * 8, step=0,
    )  # fmt: skip

    ppo = PPOConfig(estimator="grpo", num_groups=4, kl_placement="loss", sampling_temperature=1.0,
                    learning_rate=1e-2, total_steps=1)  # fmt: skip
    learner = PPOLearner(ppo, graph, cfg, value_key=jax.random.key(1), mesh=mesh)
    learner.start(params, jax.random.key_data(jax.random.key(2)))
    version = int(learner.state.step)
    traj = worker.generate(learner.policy_params(), batch, jax.random.key(3), version=version)
    assert traj.policy_version.tolist() == [version] * 8
    rewards = np.arange(8, dtype=np.float32) % 2  # one right, one wrong answer per group
    ones = np.ones(8, np.float32)
    traj = dataclasses.replace(traj, verdicts=Verdicts(
        results=[None] * 8, rewards=rewards, weight=ones, success=rewards, valid=ones,
    ))  # fmt: skip
    rollout_batch, layout = learner.make_batch(
        traj, batch.group_id, prompt_buckets=(16,), pad_id=tok.pad_id, step_id=tok.step_id,
        max_new_tokens=8,
    )  # fmt: skip
    assert layout["prompt_len"] == 16
    # Token in, token out: the learner's response columns are the sampled ids.
    width = layout["width"]
    np.testing.assert_array_equal(np.asarray(rollout_batch.tokens)[:, 16:], traj.tokens[:, :width])

    scored = learner.score(rollout_batch)
    old_logp = np.asarray(jax.device_get(scored.old_logp))
    resp = traj.mask[:, :width] > 0
    # fp32 on CPU: the sampler's log-probs of its own ids equal the learner's scoring.
    np.testing.assert_allclose(old_logp[resp], traj.logprobs[:, :width][resp], atol=1e-5)

    ref_before = jax.tree.map(np.asarray, learner.ref_params)
    metrics = learner.update(learner.advantages(scored))
    assert int(learner.state.step) == version + 1 and np.isfinite(float(metrics["loss"]))
    after = jax.tree.leaves(learner.state.policy)
    moved = [not np.allclose(a, b) for a, b in zip(jax.tree.leaves(ref_before), after)]
    assert any(moved)  # the policy moved; the reference did not
    for a, b in zip(jax.tree.leaves(ref_before), jax.tree.leaves(learner.ref_params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    # The state lives on the mesh the learner was given.
    leaf = jax.tree.leaves(learner.state.policy)[0]
    assert leaf.sharding.mesh.devices.size == 8
