"""Import, post-train with PPO (full and LoRA), export, reload in transformers: same logits.

LoRA: only the adapters are trained (the train state holds nothing else), the
base is one frozen copy shared with the reference policy, and the export folds
the adapters into the Hugging Face weights.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlpt.interop import load_hf_model, save_hf_model
from rlpt.models.lora import LoRAConfig, combine_lora, create_lora, merge_lora, zero_lora
from rlpt.rl import PPOConfig, PPOTrainer, init_train_state, new_rollout_batch
from rlpt.sampling import left_pad

PROMPTS = [[2, 17, 45, 9], [2, 8, 100], [2, 250, 251, 252, 11], [2, 60]]
PPO = PPOConfig(
    estimator="grpo", num_groups=2, epochs=1, num_minibatches=1, learning_rate=1e-2,
    kl_coef=0.01, max_grad_norm=10.0,
)  # fmt: skip
LORA = LoRAConfig(rank=4, alpha=8.0, targets=("wq", "wv", "wo", "w_up", "w_down"))
STEPS = 2


def _rollout(step: int):
    """A fixed rollout batch (as tests/rl does): left-padded prompts, random responses and
    rewards that differ within each group of two. Sampling itself is covered elsewhere."""
    rng = np.random.default_rng(step)
    prompt_tokens, prompt_mask = left_pad(PROMPTS, 8, 1)
    response = rng.integers(4, 280, size=(len(PROMPTS), 6))
    response_mask = (np.arange(6)[None, :] < np.array([6, 4, 5, 3])[:, None]).astype(np.float32)
    return new_rollout_batch(
        prompt_tokens, prompt_mask, np.where(response_mask > 0, response, 1), response_mask,
        sequence_rewards=rng.normal(size=len(PROMPTS)), group_id=np.array([0, 0, 1, 1]),
    )  # fmt: skip


def _ppo(graphdef, policy, ref, frozen=None):
    """``STEPS`` PPO steps; the final train state."""
    trainer = PPOTrainer(PPO, graphdef, frozen=frozen)
    # Committed to a device up front, as the update's outputs are: the second step then
    # reuses the first step's compiled program.
    state = jax.device_put(init_train_state(PPO, policy, None, jax.random.key(1)), jax.devices()[0])
    for step in range(STEPS):
        batch = trainer.score(state, ref, _rollout(step))
        batch = trainer.advantages(state, batch)
        state, metrics = trainer.update(state, batch)
        assert float(metrics["skipped"]) == 0
    return state


@pytest.fixture(scope="module")
def llama(hf_models):
    path, _ = hf_models["llama"]
    return path, load_hf_model(path)


def _export_and_compare(tmp_path, hf_helpers, model, path, state_to_export, graphdef, state):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "export")
    save_hf_model(
        out, model.config, state_to_export, family=model.family, hf_config=model.hf_config,
        tokenizer_dir=path, max_shard_bytes=200_000,
    )  # fmt: skip
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens, mask = hf_helpers.padded_batch(PROMPTS)
    expected = hf_helpers.rlpt_logits(graphdef, state, tokens, mask)
    got = hf_helpers.hf_logits(reloaded, tokens, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], expected[real], atol=1e-4, rtol=0)
    return out


def test_full_ppo_round_trip(llama, hf_helpers, tmp_path):
    path, model = llama
    policy = jax.tree.map(jnp.copy, model.state)  # the update donates its state
    state = _ppo(model.graphdef, policy, model.state)
    moved = [
        float(jnp.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(state.policy), jax.tree.leaves(model.state))
    ]
    assert max(moved) > 1e-4
    out = _export_and_compare(
        tmp_path, hf_helpers, model, path, state.policy, model.graphdef, state.policy
    )
    import os

    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))  # several shards
    assert os.path.exists(os.path.join(out, "tokenizer.json"))


def test_lora_ppo_trains_only_adapters_and_exports_merged(llama, hf_helpers, tmp_path):
    path, model = llama
    base = model.state
    base_before = jax.tree.map(np.asarray, base)
    graphdef, lora_state = create_lora(model.config, LORA, jax.random.key(3))
    state = _ppo(graphdef, lora_state, zero_lora(lora_state), frozen=base)

    # The train state (parameters and Adam moments) holds adapters only.
    paths = [p for p, _ in nnx.to_flat_state(state.policy)]
    assert paths and all(any(str(k).startswith("lora_") for k in p) for p in paths)
    n_lora = sum(x.size for x in jax.tree.leaves(state.policy))
    n_opt = sum(x.size for x in jax.tree.leaves(state.policy_opt))
    assert n_opt <= 2 * n_lora + 8 and n_lora < sum(x.size for x in jax.tree.leaves(base)) / 5
    # The adapters moved; the shared base did not.
    b = [v.get_value() for p, v in nnx.to_flat_state(state.policy) if p[-1] == "b"]
    assert max(float(jnp.abs(x).max()) for x in b) > 1e-4
    for before, after in zip(jax.tree.leaves(base_before), jax.tree.leaves(base)):
        np.testing.assert_array_equal(before, np.asarray(after))
    # Zeroed adapters compute the base model exactly: the reference needs no second copy.
    tokens, mask = hf_helpers.padded_batch(PROMPTS)
    np.testing.assert_allclose(
        hf_helpers.rlpt_logits(graphdef, combine_lora(zero_lora(state.policy), base), tokens, mask),
        hf_helpers.rlpt_logits(model.graphdef, base, tokens, mask),
        atol=1e-6,
    )
    merged = merge_lora(LORA, state.policy, base)
    _export_and_compare(
        tmp_path, hf_helpers, model, path, merged, graphdef, combine_lora(state.policy, base)
    )
