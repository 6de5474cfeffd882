"""Actors and learner on separate halves of the host devices: the staleness bound, the
synchronous algorithm at eta = 0, and no prompt lost or seen twice across a resume."""

import json

import jax
import numpy as np
import pytest

from rlpt.asyncrl import AsyncConfig, AsyncRunner, GroupReward, PPOAsyncLearner, Prompt
from rlpt.models import CausalLM, create_model, get_preset
from rlpt.parallel import make_mesh
from rlpt.rl import PPOConfig, PPOTrainer, init_train_state
from rlpt.sampling import Engine, RequestParams

CFG = get_preset("tiny")
PROMPT_LEN, MAX_TOKENS = 4, 48


class CountingPrompts:
    """Prompt ``k`` is a fixed function of ``k``; the state is the next key."""

    def __init__(self):
        self.position = 0

    def next(self) -> Prompt:
        k = self.position
        self.position += 1
        rng = np.random.default_rng(k)
        # Every fifth prompt is long, the rest short: groups finish out of order.
        length = MAX_TOKENS if k % 5 == 0 else 1 + int(rng.integers(0, 2))
        return Prompt(k, tuple(int(t) for t in rng.integers(5, 200, PROMPT_LEN)), max_tokens=length)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = int(state["position"])


def even_reward(prompt, completions):
    rewards = np.array([np.mean(c.tokens % 2 == 0) if len(c.tokens) else 0.0 for c in completions])
    return GroupReward(rewards=rewards, success=(rewards > 0.5).astype(np.float32))


VARIED: dict[int, bool] = {}  # prompt key -> did its group's rewards vary


def majority_even_reward(prompt, completions):
    """1 when most of a completion's tokens are even: groups are often all 0 or all 1."""
    success = np.array([float(np.mean(c.tokens % 2 == 0) > 0.5) if len(c.tokens) else 0.0
                        for c in completions])  # fmt: skip
    VARIED[prompt.key] = bool(np.ptp(success) > 0)
    return GroupReward(rewards=success, success=success)


def _runner(eta, mode="async", batch_groups=2, group_size=2, state=None, **cfg_overrides):
    devices = jax.devices()
    actor_mesh, learner_mesh = make_mesh(devices=devices[:4]), make_mesh(devices=devices[4:])
    graph, params = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0))
    ppo = PPOConfig(
        estimator="grpo", num_groups=batch_groups, learning_rate=1e-2, kl_coef=0.0,
        behaviour_correction="truncate",
    )  # fmt: skip
    trainer = PPOTrainer(ppo, graph, mesh=learner_mesh)
    ref = jax.tree.map(lambda x: x.copy(), params)
    learner = PPOAsyncLearner(
        trainer, init_train_state(ppo, params, None, jax.random.key(1)), ref,
        prompt_width=PROMPT_LEN, max_new_tokens=MAX_TOKENS,
    )  # fmt: skip
    engine = Engine(graph, params, CFG, eos_id=2, num_slots=8, mesh=actor_mesh, decode_steps=1)
    consumed = []

    def learn(draw, version):
        consumed.extend(draw.keys)
        return learner(draw, version)

    cfg = AsyncConfig(max_staleness=eta, batch_groups=batch_groups, group_size=group_size,
                      mode=mode, reward_threads=2, **cfg_overrides)  # fmt: skip
    reward = majority_even_reward if cfg.filter_groups else even_reward
    runner = AsyncRunner(
        cfg, engine, CountingPrompts(), reward, learn, RequestParams(max_tokens=MAX_TOKENS),
        seed=3,
    )  # fmt: skip
    if state is not None:
        runner.load_state_dict(state, learner.state.policy)
    return runner, learner, consumed


def _held_keys(state):
    return [p["key"] for p in state["inflight"]] + [i["key"] for i in state["pool"]["items"]]


def test_eta_zero_is_the_synchronous_algorithm():
    """Same seed: every metric of every step and the final parameters are equal."""
    sync, sync_learner, sync_keys = _runner(0, mode="sync")
    sync_metrics = sync.run(3)
    asyn, asyn_learner, asyn_keys = _runner(0)
    asyn_metrics = asyn.run(3)
    assert sorted(sync_keys) == sorted(asyn_keys) == list(range(6))
    for a, b in zip(sync_metrics, asyn_metrics):
        for k, v in a.items():
            if k.startswith("ppo/"):
                assert b[k] == v, k
        assert b["async/staleness_hist"] == [2]
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(sync_learner.state.policy), jax.device_get(asyn_learner.state.policy),
    )  # fmt: skip


@pytest.mark.parametrize("eta", [1, 2])
def test_staleness_is_bounded_and_no_prompt_is_lost_across_a_resume(eta):
    runner, _, consumed = _runner(eta)
    metrics = runner.run(4)
    for m in metrics:
        hist = m["async/staleness_hist"]
        assert len(hist) == eta + 1 and sum(hist) == m["async/groups"]
    state = json.loads(json.dumps(runner.state_dict()))  # what a checkpoint holds
    held = _held_keys(state)
    assert len(set(consumed)) == len(consumed)
    assert sorted(consumed + held) == list(range(state["started"]))
    # A new process from the checkpoint: the held prompts come back, nothing else repeats.
    resumed, _, consumed_after = _runner(eta, state=state)
    resumed.run(3)
    final = resumed.state_dict()
    everything = consumed + consumed_after
    assert len(set(everything)) == len(everything)
    assert sorted(everything + _held_keys(final)) == list(range(final["started"]))
    assert set(held) <= set(consumed_after + _held_keys(final))


def test_dynamic_sampling_at_eta_zero_is_the_synchronous_rounds():
    """filter_groups: uniform groups are left out and other prompts start in their place,
    at most (filter_max_rounds - 1) x batch_groups of them per version; at eta = 0 the same
    prompts are trained, filtered and kept as in the synchronous mode's rounds."""
    runs = {}
    for mode in ("sync", "async"):
        runner, learner, keys = _runner(0, mode=mode, filter_groups=True, filter_max_rounds=3)
        filtered = []

        def take(version, metrics, runner=runner, filtered=filtered):
            filtered.append(sorted(g.prompt.key for g in runner.take_filtered()))

        metrics = runner.run(3, on_step=take)
        runs[mode] = (metrics, learner, keys, filtered, runner.state_dict())
    (sm, sl, sk, sf, ss), (am, al, ak, af, as_) = runs["sync"], runs["async"]
    # The same prompts trained and filtered, step by step.
    assert [m["async/prompt_keys"] for m in sm] == [m["async/prompt_keys"] for m in am]
    assert sorted(sk) == sorted(ak) and sf == af
    assert sum(map(len, sf)) > 0, "no group was uniform: the test shows nothing"
    assert all(len(f) <= 2 * 2 for f in sf)  # the per-version bound
    assert any(not VARIED[k] for m in sm for k in m["async/prompt_keys"]), "bound never bit"
    assert not any(VARIED[k] for f in sf for k in f)
    for step_filtered, step_metrics in zip(sf, sm):
        # Every trained group varies unless the bound was reached at its version: more
        # than (3 - 1) x 2 prompts admitted for it (at eta = 0, those it trains or filters).
        trained = step_metrics["async/prompt_keys"]
        assert all(VARIED[k] for k in trained) or len(trained) + len(step_filtered) > 4
    assert ss["filtered"] == as_["filtered"] == sum(map(len, sf))
    assert sorted(sk + [k for f in sf for k in f]) == list(range(ss["started"]))
    for a, b in zip(sm, am):
        for k, v in a.items():
            if k.startswith("ppo/"):
                assert b[k] == v, k
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(sl.state.policy), jax.device_get(al.state.policy),
    )  # fmt: skip


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="async_rl.max_staleness"):
        AsyncConfig(max_staleness=-1)
    with pytest.raises(ValueError, match="async_rl.mode"):
        AsyncConfig(mode="overlap")
    with pytest.raises(ValueError, match="async_rl.batch_groups"):
        AsyncConfig(batch_groups=0)
