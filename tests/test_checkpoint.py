"""rlpt.checkpoint: round trips of a PPO TrainState with its JSON record, retention, replacing."""

import jax
import numpy as np
import pytest

from rlpt.checkpoint import CHECKPOINT_DIR, Checkpointer, latest_checkpoint_meta
from rlpt.models import CausalLM, create_model, get_preset
from rlpt.rl import PPOConfig, init_train_state


@pytest.fixture(scope="module")
def ppo_state():
    cfg = get_preset("tiny")
    _, params = create_model(lambda rngs: CausalLM(cfg, rngs=rngs), jax.random.key(0))
    ppo = PPOConfig(estimator="grpo")
    return params, init_train_state(ppo, params, None, jax.random.key_data(jax.random.key(1)))


def _equal(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


def test_round_trip_of_train_state_reference_and_record(tmp_path, ppo_state):
    params, state = ppo_state
    with Checkpointer(tmp_path / CHECKPOINT_DIR, keep=2) as ck:
        ck.save(7, {"ppo": state, "ref": params}, {"stage": "ppo", "loader": {"step": 3}})
        ck.wait()
        assert ck.latest_step() == 7
        items, meta = ck.restore(7, {"ppo": state, "ref": params})
    assert meta["stage"] == "ppo" and meta["loader"] == {"step": 3}
    assert meta["items"] == ["ppo", "ref"]
    assert type(items["ppo"]) is type(state)
    assert _equal(items["ppo"], state) and _equal(items["ref"], params)
    assert latest_checkpoint_meta(tmp_path)["stage"] == "ppo"


def test_keeps_the_last_k_and_items_may_change_between_steps(tmp_path, ppo_state):
    params, state = ppo_state
    with Checkpointer(tmp_path / "ck", keep=2) as ck:
        ck.save(1, {"sft": params}, {"stage": "sft"})
        ck.save(2, {"sft": params}, {"stage": "sft"})
        ck.save(3, {"ppo": state}, {"stage": "ppo"})
        ck.wait()
        assert ck.all_steps() == [2, 3]
        assert ck.read_meta(2)["items"] == ["sft"]
        items, _ = ck.restore(2, {"sft": params})
        assert _equal(items["sft"], params)
        with pytest.raises(ValueError, match="ppo"):
            ck.restore(3, {"sft": params})


def test_saving_a_step_again_replaces_it(tmp_path, ppo_state):
    params, _ = ppo_state
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(4, {"sft": params}, {"note": "first"})
        ck.save(4, {"sft": params}, {"note": "second"})
        ck.wait()
        assert ck.read_meta(4)["note"] == "second"


def test_restore_refuses_untargeted_items_unless_only_the_targeted_are_asked(tmp_path):
    a = {"w": np.arange(3.0, dtype=np.float32)}
    b = {"v": np.ones(2, np.float32)}
    with Checkpointer(tmp_path / CHECKPOINT_DIR, async_save=False) as ckpt:
        ckpt.save(1, {"a": a, "b": b}, {"step": 1})
        with pytest.raises(ValueError, match=r"holds items \['b'\] that no target"):
            ckpt.restore(1, {"a": a})
        items, meta = ckpt.restore(1, {"a": {"w": np.zeros(3, np.float32)}}, only=True)
        assert set(items) == {"a"} and meta["step"] == 1
        np.testing.assert_array_equal(items["a"]["w"], [0.0, 1.0, 2.0])
        with pytest.raises(ValueError, match=r"holds no items \['c'\]"):
            ckpt.restore(1, {"c": a}, only=True)
