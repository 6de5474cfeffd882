"""The loader: determinism, bucketed shapes, groups, sharding and exact resume."""

import json

import numpy as np
import pytest

from rlpt.data import CurriculumLoader, Feedback, ProceduralSource, make_curriculum
from rlpt.tokenizers import ByteTokenizer

NAMES = ("arithmetic", "stepwise_math")
LEARNED = {
    "strategy": "bandit",
    "signal": "progress",
    "floor": 0.05,
    "loss_weighting": "lagging",
    "difficulty": {"window": 8, "upper": 0.6, "lower": 0.3},
}


def _loader(curriculum=None, *, seed=0, batch_size=8, group_size=2, **kwargs):
    sources = {n: ProceduralSource(n, seed=seed) for n in NAMES}
    cur = make_curriculum(
        curriculum or LEARNED,
        list(sources),
        max_levels=[s.max_difficulty for s in sources.values()],
        sizes=[s.size for s in sources.values()],
    )
    kwargs.setdefault("shard_index", 0)
    kwargs.setdefault("shard_count", 1)
    kwargs.setdefault("buckets", (32, 64, 128, 256, 512))
    return CurriculumLoader(
        sources,
        cur,
        ByteTokenizer(),
        batch_size=batch_size,
        group_size=group_size,
        seed=seed,
        **kwargs,
    )


def _feedback(batch):
    # A deterministic stand-in for training: success depends on the prompt text,
    # so levels move and the learned weights change.
    success = np.array([len(t.prompt) % 3 != 0 for t in batch.tasks], float)
    adv = np.abs(success - 0.5)
    return Feedback(batch.domain_index, success, abs_advantage=adv, difficulty=batch.difficulty)


def _fingerprint(batch):
    return (
        batch.tokens.tolist(),
        batch.mask.tolist(),
        batch.loss_weight.tolist(),
        batch.domain_index.tolist(),
        batch.difficulty.tolist(),
        [t.id for t in batch.tasks],
    )


def _run(loader, steps):
    out = []
    for _ in range(steps):
        batch = next(loader)
        out.append(_fingerprint(batch))
        loader.update(_feedback(batch))
    return out


def test_deterministic_for_a_seed_and_different_across_seeds():
    a, b, c = _run(_loader(), 3), _run(_loader(), 3), _run(_loader(seed=1), 3)
    assert a == b
    assert a != c


def test_batch_shapes_padding_and_groups():
    tok = ByteTokenizer()
    loader = _loader(batch_size=8, group_size=4)
    batch = next(loader)
    assert batch.tokens.dtype == np.int32 and batch.tokens.shape[0] == 8
    longest = max(len(tok.encode(t.prompt, add_bos=True)) for t in batch.tasks)
    assert batch.tokens.shape[1] == _smallest_fit(longest, (32, 64, 128, 256, 512))
    assert batch.mask[:, -1].all()  # left-padded: every prompt ends at the last column
    for row, task in enumerate(batch.tasks):
        ids = batch.tokens[row][batch.mask[row]]
        assert ids[0] == tok.bos_id and tok.decode(ids) == task.prompt
        assert (batch.tokens[row][~batch.mask[row]] == tok.pad_id).all()
    assert batch.group_id.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert batch.tasks[0] is batch.tasks[3] and batch.domain_index[0] == batch.domain_index[3]
    assert batch.loss_weight.shape == (8,) and batch.loss_weight.dtype == np.float32
    metrics = loader.metrics()
    for name in NAMES:
        for key in ("weight", "difficulty", "success"):
            assert f"curriculum/{name}/{key}" in metrics


def _smallest_fit(length, buckets):
    return min(b for b in buckets if b >= length)


def test_each_batch_is_padded_to_the_smallest_bucket_that_fits():
    # Buckets fine enough that these short prompts land in different ones.
    tok, buckets = ByteTokenizer(), (8, 12, 16, 20, 24, 32, 64, 512)
    loader = _loader(batch_size=4, group_size=1, buckets=buckets)
    widths = set()
    for _ in range(6):
        batch = next(loader)
        longest = max(len(tok.encode(t.prompt, add_bos=True)) for t in batch.tasks)
        assert batch.tokens.shape[1] == _smallest_fit(longest, buckets), longest
        widths.add(batch.tokens.shape[1])
        loader.update(_feedback(batch))
    assert len(widths) > 1  # more than one bucket was exercised


def test_shards_read_disjoint_items():
    ids = []
    for index in range(2):
        loader = _loader({"strategy": "fixed", "fixed_weights": {"arithmetic": 1.0}, "floor": 0.0},
                         shard_index=index, shard_count=2, batch_size=8, group_size=1)  # fmt: skip
        ids.append({t.id for t in next(loader).tasks})
    assert len(ids[0]) == 8 and not ids[0] & ids[1]


def test_exact_resume_with_a_learned_strategy_after_updates():
    reference = _loader()
    _run(reference, 6)
    state = json.loads(json.dumps(reference.get_state()))
    expected = _run(reference, 4)
    # The run above must have moved the curriculum, or the test checks nothing.
    assert reference.curriculum.level.max() > 1
    assert not np.allclose(reference.curriculum.last_probs, 0.5)

    restored = _loader()
    restored.set_state(state)
    assert _run(restored, 4) == expected


REVIEW = {"strategy": "uniform", "difficulty": {"start": 3, "review": 0.5, "window": 1000}}


def test_review_prompts_come_from_lower_levels_and_new_items():
    loader = _loader(REVIEW, batch_size=200, group_size=1)
    batch = next(loader)
    review = batch.difficulty < 3
    # Half the prompts in expectation (binomial, 200 draws: 0.35-0.65 is about 4 sd).
    assert 0.35 < review.mean() < 0.65
    assert set(batch.difficulty[review].tolist()) == {1, 2}
    for task, level in zip(batch.tasks, batch.difficulty):
        assert task.difficulty == level
    # A review item is none of the items the main stream serves at that level.
    main = _loader({"strategy": "uniform", "difficulty": {"start": 1}}, batch_size=200,
                   group_size=1)  # fmt: skip
    main_ids = {t.id for _ in range(3) for t in next(main).tasks}
    assert not {t.id for t, lv in zip(batch.tasks, batch.difficulty) if lv == 1} & main_ids
    # Without review every prompt is at the domain's level.
    plain = next(_loader({"strategy": "uniform", "difficulty": {"start": 3}}, batch_size=200,
                         group_size=1))  # fmt: skip
    assert set(plain.difficulty.tolist()) == {3}


def test_exact_resume_with_review_prompts():
    reference = _loader(REVIEW)
    _run(reference, 3)
    state = json.loads(json.dumps(reference.get_state()))
    expected = _run(reference, 3)
    restored = _loader(REVIEW)
    restored.set_state(state)
    assert _run(restored, 3) == expected


def test_resume_through_grain_checkpoint_handler(tmp_path):
    import grain

    loader = _loader()
    _run(loader, 3)
    grain.checkpoint.CheckpointHandler().save(
        tmp_path, args=grain.checkpoint.CheckpointSave(loader)
    )
    expected = _run(loader, 2)
    restored = _loader()
    grain.checkpoint.CheckpointHandler().restore(
        tmp_path, args=grain.checkpoint.CheckpointRestore(restored)
    )
    assert _run(restored, 2) == expected


def test_set_state_rejects_a_foreign_state():
    state = _loader().get_state()
    state["streams"] = {"other": None}
    with pytest.raises(ValueError, match="domains"):
        _loader().set_state(state)


def test_exact_resume_with_grain_worker_processes():
    # Kept small: each mp_prefetch iterator spawns a worker that imports jax.
    # The level changes after the first batch, so the worker pipeline is rebuilt
    # at the new level from its saved position before the checkpoint.
    curriculum = {
        "strategy": "fixed",
        "fixed_weights": {"arithmetic": 1.0},
        "floor": 0.0,
        "difficulty": {"window": 4, "upper": 0.5, "lower": 0.1},
    }
    workers = {"arithmetic": 1}
    in_process = _run(_loader(curriculum, batch_size=4, group_size=1), 4)
    assert in_process[0][4] != in_process[1][4]  # difficulty column moved
    with _loader(curriculum, batch_size=4, group_size=1, workers=workers) as loader:
        assert _run(loader, 2) == in_process[:2]
        state = json.loads(json.dumps(loader.get_state()))
    with _loader(curriculum, batch_size=4, group_size=1, workers=workers) as restored:
        restored.set_state(state)
        assert _run(restored, 2) == in_process[2:]


def test_rejects_bad_batch_geometry():
    with pytest.raises(ValueError, match="multiple of group_size"):
        _loader(batch_size=6, group_size=4)


def test_loader_from_config():
    import ml_collections

    config = ml_collections.ConfigDict(
        {"domains": ["arithmetic"], "curriculum": {"strategy": "uniform"}}
    )
    loader = CurriculumLoader.from_config(
        config, batch_size=2, shard_index=0, shard_count=1, buckets=(64, 256)
    )
    assert len(next(loader).tasks) == 2


def test_state_saves_with_orbax_json(tmp_path):
    import orbax.checkpoint as ocp

    loader = _loader()
    _run(loader, 3)
    checkpointer = ocp.Checkpointer(ocp.JsonCheckpointHandler())
    checkpointer.save(tmp_path / "data", args=ocp.args.JsonSave(loader.get_state()))
    expected = _run(loader, 2)
    restored = _loader()
    restored.set_state(checkpointer.restore(tmp_path / "data", args=ocp.args.JsonRestore()))
    assert _run(restored, 2) == expected
