"""rlpt.checkpoint: round trips of a PPO TrainState with its JSON record, retention, replacing,
falling back past damaged checkpoints."""

import json
import logging
import os
import time
import types

import jax
import numpy as np
import pytest

from rlpt.checkpoint import CHECKPOINT_DIR, Checkpointer, latest_checkpoint_meta
from rlpt.models import CausalLM, create_model, get_preset
from rlpt.rl import PPOConfig, init_train_state
from rlpt.runfiles import RunFileError


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


def test_meta_changed_right_after_an_async_save_is_saved_as_it_was(tmp_path, monkeypatch):
    # A slow disk: orbax's background writer serialises the record 50 ms late, so a
    # save that shared the caller's nested dicts would write them as changed since.
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler

    def slow_dumps(obj, **kwargs):
        time.sleep(0.05)
        return json.dumps(obj, **kwargs)

    monkeypatch.setattr(handler, "json", types.SimpleNamespace(dumps=slow_dumps, loads=json.loads))
    a = {"w": np.arange(1000.0, dtype=np.float32)}
    meta = {"loader": {"position": 0, "weights": []}, "eval": {"sft": {}}}
    with Checkpointer(tmp_path / "ck", keep=4, async_save=True) as ck:
        for step in (1, 2, 3, 4):
            # What the trainer does to its record while the last save is in flight.
            meta["loader"]["position"] = step
            meta["loader"]["weights"].append(step)
            meta["eval"]["sft"] = {"math": step / 10}
            ck.save(step, {"a": a}, meta)
        ck.wait()
        for step in (1, 2, 3, 4):
            assert ck.read_meta(step) == {
                "loader": {"position": step, "weights": list(range(1, step + 1))},
                "eval": {"sft": {"math": step / 10}},
                "items": ["a"],
            }


def test_meta_that_is_not_json_fails_at_save(tmp_path):
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(ValueError, match="checkpoint 3"):
        ck.save(3, {"a": {"w": np.zeros(2)}}, {"bad": object()})


def _arrays(step):
    return {"w": step * np.arange(600, dtype=np.float32), "b": np.full(3, step, np.int32)}


def _template():
    return {"w": np.zeros(600, np.float32), "b": np.zeros(3, np.int32)}


def _truncate_largest_file(directory):
    files = [os.path.join(r, f) for r, _, names in os.walk(directory) for f in names]
    largest = max(files, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.truncate(os.path.getsize(largest) // 3)
    return largest


def test_restore_latest_falls_back_past_a_truncated_array_file(tmp_path, caplog):
    directory = tmp_path / CHECKPOINT_DIR
    with Checkpointer(directory, keep=3, async_save=False) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"a": _arrays(step)}, {"step": step})
        _truncate_largest_file(directory / "3" / "a")
        seen = []

        def targets(meta):
            seen.append(meta["step"])
            return {"a": _template()}

        with caplog.at_level(logging.WARNING):
            step, items, meta = ck.restore_latest(targets)
    assert step == 2 and meta["step"] == 2 and seen == [3, 2]
    np.testing.assert_array_equal(items["a"]["w"], _arrays(2)["w"])
    np.testing.assert_array_equal(items["a"]["b"], [2, 2, 2])
    assert list(ck.skipped_steps) == [3]
    (line,) = [r.getMessage() for r in caplog.records if "does not restore" in r.getMessage()]
    assert f"Checkpoint step 3 in {directory} does not restore" in line
    assert "ValueError" in ck.skipped_steps[3] and "\n" not in line
    # Read only: the damaged step stays where it was.
    assert sorted(os.listdir(directory)) == ["1", "2", "3"]


def test_restore_latest_builds_targets_from_the_step_it_tries_and_sets_damage_aside(tmp_path):
    directory = tmp_path / CHECKPOINT_DIR
    with Checkpointer(directory, keep=3, async_save=False) as ck:
        ck.save(1, {"sft": _arrays(1)}, {"stage": "sft"})
        ck.save(2, {"ppo": _arrays(2), "ref": _arrays(20)}, {"stage": "ppo"})
        ck.save(3, {"ppo": _arrays(3), "ref": _arrays(30)}, {"stage": "ppo"})
        os.remove(directory / "3" / "meta" / "metadata")  # an unreadable record
        _truncate_largest_file(directory / "2" / "ref")
        asked = []

        def targets(meta):
            asked.append(meta["items"])
            return {name: _template() for name in meta["items"]}

        step, items, meta = ck.restore_latest(targets, set_aside_damaged=True)
        assert (step, meta["stage"], asked) == (1, "sft", [["ppo", "ref"], ["sft"]])
        np.testing.assert_array_equal(items["sft"]["w"], _arrays(1)["w"])
        assert sorted(ck.skipped_steps) == [2, 3]
        assert "FileNotFoundError" in ck.skipped_steps[3]
        assert sorted(os.listdir(directory)) == ["1", "2.damaged-1", "3.damaged-1"]
        # The run goes on from step 1: its next saves neither collide with nor keep
        # the damaged steps.
        assert ck.all_steps() == [1] and ck.latest_step() == 1
        ck.save(2, {"sft": _arrays(4)}, {"stage": "sft"})
        assert ck.restore_latest(targets)[0] == 2


def test_restore_latest_without_checkpoints_is_none_and_with_only_damaged_ones_an_error(tmp_path):
    directory = tmp_path / CHECKPOINT_DIR
    with Checkpointer(directory, keep=2, async_save=False) as ck:
        assert ck.restore_latest(lambda meta: {"a": _template()}) is None
        for step in (5, 6):
            ck.save(step, {"a": _arrays(step)}, {})
            _truncate_largest_file(directory / str(step) / "a")
        with pytest.raises(RunFileError, match=f"^{directory}: no checkpoint restores") as info:
            ck.restore_latest(lambda meta: {"a": _template()})
    message = str(info.value)
    assert "step 6: ValueError" in message and "step 5: ValueError" in message
    assert "\n" not in message


def test_restore_latest_raises_errors_of_the_caller_at_once(tmp_path):
    with Checkpointer(tmp_path / CHECKPOINT_DIR, keep=2, async_save=False) as ck:
        ck.save(1, {"a": _arrays(1)}, {})
        ck.save(2, {"a": _arrays(2), "b": _arrays(2)}, {})
        with pytest.raises(ValueError, match=r"checkpoint 2 holds items \['b'\] that no target"):
            ck.restore_latest(lambda meta: {"a": _template()})
        assert ck.skipped_steps == {}
        items = ck.restore_latest(lambda meta: {"a": _template()}, only=True)[1]
        np.testing.assert_array_equal(items["a"]["w"], _arrays(2)["w"])


def test_latest_checkpoint_meta_skips_an_unreadable_record(tmp_path):
    directory = tmp_path / CHECKPOINT_DIR
    with Checkpointer(directory, keep=2, async_save=False) as ck:
        ck.save(1, {"a": _arrays(1)}, {"stage": "sft"})
        ck.save(2, {"a": _arrays(2)}, {"stage": "ppo"})
    with open(directory / "2" / "meta" / "metadata", "w") as f:
        f.write('{"stage": "pp')
    assert latest_checkpoint_meta(tmp_path)["stage"] == "sft"
