"""The experience pool against hand-worked cases, an independent shadow model and sampling
frequencies computed by hand."""

import json
import math
import pickle
from fractions import Fraction

import numpy as np
import pytest

from rlpt.asyncrl import (
    PRIORITIES,
    Draw,
    ExperiencePool,
    PoolItem,
    PoolUnderfull,
    staleness_histogram,
)

# Upper 0.1% points of the chi-square distribution (standard tables): a correct sampler
# fails one of these checks with probability 1e-3, and the seeds are fixed.
CHI2_999 = {2: 13.816, 3: 16.266, 5: 20.515}

# Group keys of the hand-worked cases.
A, B, C, D = 10, 11, 12, 13
ALL, NONE, HALF, QUARTER = 20, 21, 22, 23
KNOWN, UNKNOWN, ZERO = 30, 31, 32
NEW, OLD, MID = 40, 41, 42


def _item(key, tokens=10, min_version=0, max_version=None, domain=0, success=(0.5, 0.5), **kw):
    max_version = min_version if max_version is None else max_version
    kw.setdefault("added_at", max_version)
    return PoolItem(
        key=key,
        num_tokens=tokens,
        min_version=min_version,
        max_version=max_version,
        domain=domain,
        success=np.array(success, dtype=float),
        **kw,
    )


def _chi2(counts, probs):
    counts = np.asarray(counts, float)
    expected = counts.sum() * np.asarray(probs, float)
    return float(((counts - expected) ** 2 / expected).sum())


# -- capacity --------------------------------------------------------------------------------


def test_capacity_and_has_room():
    pool = ExperiencePool(capacity_tokens=30)
    pool.add(_item(1, tokens=10))
    pool.add(_item(2, tokens=15))
    assert pool.tokens == 25 and len(pool) == 2
    assert pool.has_room(5)
    assert not pool.has_room(6)
    with pytest.raises(ValueError, match="pool full"):
        pool.add(_item(3, tokens=6))
    with pytest.raises(ValueError, match="capacity_tokens"):
        ExperiencePool(capacity_tokens=30).add(_item(4, tokens=31))
    with pytest.raises(ValueError, match="already in the pool"):
        pool.add(_item(1, tokens=1))
    # The refused adds left nothing behind.
    assert pool.tokens == 25 and sorted(pool.keys()) == [1, 2]
    pool.draw(token_budget=100, learner_version=0, max_staleness=4)
    assert pool.tokens == 0 and pool.has_room(30) and not pool.has_room(31)


# -- staleness -------------------------------------------------------------------------------


def test_due_items_come_first_whatever_their_priority():
    # learner_version 5, max_staleness 2: a group with min_version 3 is 2 stale now and would
    # be 3 at version 6, so it is due; min_version 4 and 5 are not.
    pool = ExperiencePool(1000, priority="abs_advantage", alpha=1.0)
    pool.add(_item(A, min_version=4, abs_advantage=100.0, added_at=5))
    pool.add(_item(B, min_version=3, abs_advantage=0.0, added_at=5))
    pool.add(_item(C, min_version=5, abs_advantage=100.0, added_at=5))
    pool.add(_item(D, min_version=3, abs_advantage=0.0, added_at=5))
    draw = pool.draw(token_budget=30, learner_version=5, max_staleness=2)
    assert draw.due == 2
    assert draw.keys[:2] == [B, D]
    assert len(draw) == 3 and draw.keys[2] in (A, C)
    assert not draw.over_budget
    np.testing.assert_array_equal(draw.staleness, [2, 2, 5 - {A: 4, C: 5}[draw.keys[2]]])


def test_due_set_over_budget_is_taken_whole():
    pool = ExperiencePool(1000)
    for k in range(3):
        pool.add(_item(k, tokens=10, min_version=0, added_at=1))
    pool.add(_item(9, tokens=10, min_version=1, added_at=1))
    draw = pool.draw(token_budget=15, learner_version=1, max_staleness=1)
    assert draw.keys == [0, 1, 2] and draw.due == 3
    assert draw.over_budget and draw.num_tokens == 30
    assert pool.keys() == [9]
    assert pool.stats()["over_budget_draws"] == 1.0
    assert pool.stats()["due_draws"] == 3.0


def test_stale_or_future_items_and_backward_versions_raise_without_changing_the_pool():
    pool = ExperiencePool(1000)
    pool.add(_item(1, min_version=0, added_at=3))
    with pytest.raises(ValueError, match="stale"):
        pool.draw(token_budget=100, learner_version=3, max_staleness=2)
    assert pool.keys() == [1] and pool.uses(1) == 0
    pool.add(_item(2, min_version=4, added_at=4))
    with pytest.raises(ValueError, match="max_version"):
        pool.draw(token_budget=100, learner_version=3, max_staleness=5)
    assert sorted(pool.keys()) == [1, 2]
    pool.draw(token_budget=10, learner_version=4, max_staleness=5)
    with pytest.raises(ValueError, match="learner_version"):
        pool.draw(token_budget=10, learner_version=3, max_staleness=5)


def test_reused_items_expire_but_unused_ones_are_forced():
    # max_staleness 1, max_reuse 3. Version 0: A (min 0) is the only group and is drawn.
    # Version 1: B (min 0) is unused and would be 2 stale at version 2, so it is due and
    # fills the budget; A is used, so it is not forced. After the draw both would be stale
    # at version 2: both are removed as expired reused groups.
    pool = ExperiencePool(1000, max_reuse=3)
    pool.add(_item(A, min_version=0))
    assert pool.draw(10, learner_version=0, max_staleness=1).keys == [A]
    assert pool.uses(A) == 1
    pool.add(_item(B, min_version=0, added_at=1))
    draw = pool.draw(10, learner_version=1, max_staleness=1)
    assert draw.keys == [B] and draw.due == 1
    assert len(pool) == 0
    assert pool.stats()["expired_reused"] == 2.0


def test_reuse_until_spent():
    pool = ExperiencePool(1000, max_reuse=2)
    pool.add(_item(A, min_version=0))
    assert pool.draw(10, 0, max_staleness=5).keys == [A]
    assert pool.draw(10, 1, max_staleness=5).keys == [A]
    assert len(pool) == 0 and pool.stats()["drawn"] == 2.0
    assert pool.stats()["expired_reused"] == 0.0


def test_staleness_histogram():
    np.testing.assert_array_equal(staleness_histogram([0, 2, 2, 1, 2], 3), [1, 1, 3, 0])
    draw = Draw([], np.ones(3), np.array([1, 1, 0]), 0, False)
    np.testing.assert_array_equal(staleness_histogram(draw, 1), [1, 2])
    with pytest.raises(ValueError, match="staleness"):
        staleness_histogram([4], 3)


@pytest.mark.parametrize("max_reuse", [1, 2])
@pytest.mark.parametrize("priority", PRIORITIES)
def test_randomized_run_never_exceeds_the_bound_nor_loses_a_group(priority, max_reuse):
    """Actors add groups of random ages under admission control, the learner draws once per
    version; a shadow model tracks uses and predicts the due set independently."""
    rng = np.random.default_rng(7)
    max_s, budget, capacity = 3, 40, 150
    pool = ExperiencePool(capacity, priority=priority, alpha=1.0, max_reuse=max_reuse, seed=3)
    shadow = {}  # key -> [item, uses, insertion index]
    drawn = {}
    next_key = 0
    expired = 0
    refused = 0
    version = 0
    while version < 120 or shadow:
        for _ in range(rng.integers(0, 6) if version < 120 else 0):
            tokens = int(rng.integers(5, 31))
            if not pool.has_room(tokens):
                refused += 1
                continue
            lo = int(rng.integers(max(0, version - max_s), version + 1))
            item = _item(
                next_key,
                tokens=tokens,
                min_version=lo,
                max_version=int(rng.integers(lo, version + 1)),
                domain=int(rng.integers(0, 3)),
                success=rng.integers(0, 2, size=4),
                abs_advantage=None if rng.random() < 0.2 else float(rng.random()),
                added_at=version,
            )
            pool.add(item)
            shadow[next_key] = [item, 0, next_key]
            next_key += 1
        assert pool.tokens == sum(e[0].num_tokens for e in shadow.values()) <= capacity
        if shadow:
            due = sorted(
                (
                    e
                    for e in shadow.values()
                    if e[1] == 0 and version + 1 - e[0].min_version > max_s
                ),
                key=lambda e: (e[0].min_version, e[2]),
            )
            draw = pool.draw(budget, version, max_s)
            assert draw.keys[: draw.due] == [e[0].key for e in due]
            assert len(set(draw.keys)) == len(draw) >= 1
            expected_s = [version - it.min_version for it in draw.items]
            np.testing.assert_array_equal(draw.staleness, expected_s)
            assert max(expected_s) <= max_s
            due_tokens = sum(e[0].num_tokens for e in due)
            if draw.num_tokens > budget:
                assert draw.over_budget
                assert due_tokens > budget or len(draw) == 1
                if due_tokens > budget:
                    assert len(draw) == draw.due
            else:
                assert not draw.over_budget
            assert np.all(draw.weights > 0) and draw.weights.max() == 1.0
            for k in draw.keys:
                drawn[k] = drawn.get(k, 0) + 1
                shadow[k][1] += 1
                if shadow[k][1] == max_reuse:
                    del shadow[k]
            for k in [k for k, e in shadow.items() if version + 1 - e[0].min_version > max_s]:
                assert shadow[k][1] >= 1
                del shadow[k]
                expired += 1
            assert sorted(pool.keys()) == sorted(shadow)
        version += 1
    assert sorted(drawn) == list(range(next_key)) and next_key > 150
    assert refused > 0  # admission control was exercised
    if max_reuse == 1:
        assert set(drawn.values()) == {1}
        assert expired == 0
    else:
        assert set(drawn.values()) <= {1, 2}
        assert expired == sum(1 for n in drawn.values() if n == 1)
    assert pool.stats()["expired_reused"] == expired
    assert pool.stats()["drawn"] == sum(drawn.values())


# -- budgets ---------------------------------------------------------------------------------


def test_token_budget_respected_and_at_least_one_item():
    pool = ExperiencePool(1000, seed=1)
    for k in range(6):
        pool.add(_item(k, tokens=10))
    draw = pool.draw(token_budget=35, learner_version=0, max_staleness=5)
    assert len(draw) == 3 and draw.num_tokens == 30 and not draw.over_budget
    draw = pool.draw(token_budget=5, learner_version=0, max_staleness=5)
    assert len(draw) == 1 and draw.over_budget
    assert len(pool) == 2

    rng = np.random.default_rng(0)
    for trial in range(20):
        pool = ExperiencePool(1000, priority="learnability", seed=trial)
        sizes = rng.integers(1, 20, size=8)
        for k, t in enumerate(sizes):
            pool.add(_item(k, tokens=int(t), success=rng.integers(0, 2, size=3)))
        budget = int(rng.integers(int(sizes.max()), 60))
        draw = pool.draw(budget, learner_version=0, max_staleness=5)
        assert len(draw) >= 1 and draw.num_tokens <= budget and not draw.over_budget


def test_min_max_items_and_multiple_of():
    def fresh(n, min_version=0, version=0):
        pool = ExperiencePool(1000, seed=2)
        for k in range(n):
            pool.add(_item(k, tokens=10, min_version=min_version, added_at=version))
        return pool

    # Budget fits 5; multiple_of 2 puts the fifth pick back.
    pool = fresh(7)
    draw = pool.draw(50, 0, max_staleness=5, multiple_of=2)
    assert len(draw) == 4 and len(pool) == 3 and not draw.over_budget
    assert sorted(pool.keys() + draw.keys) == list(range(7))
    # Three due groups with multiple_of 2: one more is taken, past the budget.
    pool = fresh(3, min_version=0, version=2)
    for k in (10, 11):
        pool.add(_item(k, tokens=10, min_version=2, added_at=2))
    draw = pool.draw(30, 2, max_staleness=2, multiple_of=2)
    assert len(draw) == 4 and draw.due == 3 and draw.over_budget
    assert draw.keys[:3] == [0, 1, 2]
    # Nothing to round up with: the draw raises and leaves the pool as it was.
    pool = fresh(3, min_version=0, version=2)
    with pytest.raises(PoolUnderfull):
        pool.draw(30, 2, max_staleness=2, multiple_of=2)
    assert pool.keys() == [0, 1, 2] and pool.tokens == 30 and pool.stats()["draws"] == 0
    # min_items goes past the budget; max_items stops before it.
    pool = fresh(6)
    draw = pool.draw(10, 0, max_staleness=5, min_items=3)
    assert len(draw) == 3 and draw.over_budget
    draw = pool.draw(1000, 0, max_staleness=5, max_items=2)
    assert len(draw) == 2 and not draw.over_budget
    with pytest.raises(PoolUnderfull):
        pool.draw(1000, 0, max_staleness=5, min_items=2)
    with pytest.raises(PoolUnderfull):
        ExperiencePool(10).draw(10, 0, max_staleness=1)


# -- priorities and weights ------------------------------------------------------------------


def test_priority_values_by_hand():
    pool = ExperiencePool(1000, priority="learnability", priority_floor=0.05)
    pool.add(_item(ALL, success=[1, 1, 1, 1]))
    pool.add(_item(NONE, success=[0, 0, 0, 0]))
    pool.add(_item(HALF, success=[1, 0, 1, 0]))
    pool.add(_item(QUARTER, success=[1, 0, 0, 0]))
    assert pool.priorities(0) == pytest.approx(
        {ALL: 0.05, NONE: 0.05, HALF: 0.25, QUARTER: 0.1875}, abs=1e-15
    )
    pool = ExperiencePool(1000, priority="abs_advantage", abs_advantage_default=0.7)
    pool.add(_item(KNOWN, abs_advantage=0.3))
    pool.add(_item(UNKNOWN))
    pool.add(_item(ZERO, abs_advantage=0.0))
    assert pool.priorities(0) == pytest.approx({KNOWN: 0.3, UNKNOWN: 0.7, ZERO: 1e-3}, abs=1e-15)
    pool = ExperiencePool(1000, priority="freshness")
    pool.add(_item(NEW, min_version=5, added_at=5))
    pool.add(_item(OLD, min_version=3, added_at=5))
    pool.add(_item(MID, min_version=4, added_at=5))
    assert pool.priorities(5) == pytest.approx(
        {NEW: 1.0, OLD: math.exp(-2), MID: math.exp(-1)}, rel=1e-15
    )


def _first_pick_counts(pool, keys, draws, version=0):
    counts = dict.fromkeys(keys, 0)
    for _ in range(draws):
        counts[pool.draw(10, version, max_staleness=10**6).keys[0]] += 1
    return [counts[k] for k in keys]


@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_learnability_sampling_frequencies_with_floor(alpha):
    # Priorities 0.05 (floor), 0.05 (floor), 0.25, 0.1875; P ∝ priority^alpha.
    pool = ExperiencePool(
        1000, priority="learnability", alpha=alpha, priority_floor=0.05, max_reuse=10**9, seed=11
    )
    for key, s in [(ALL, [1, 1, 1, 1]), (NONE, [0] * 4), (HALF, [1, 0, 1, 0])]:
        pool.add(_item(key, success=s))
    pool.add(_item(QUARTER, success=[1, 0, 0, 0]))
    raw = np.array([0.05, 0.05, 0.25, 0.1875]) ** alpha
    counts = _first_pick_counts(pool, [ALL, NONE, HALF, QUARTER], 6000)
    assert min(counts) > 0
    assert _chi2(counts, raw / raw.sum()) < CHI2_999[3]


def test_ordered_pairs_follow_sampling_without_replacement():
    # abs_advantage 1, 2, 5 with alpha 1: P = 1/8, 2/8, 5/8, and the second pick is drawn
    # from the rest renormalised: P(i then j) = P_i P_j / (1 - P_i).
    pool = ExperiencePool(1000, priority="abs_advantage", max_reuse=10**9, seed=5)
    for key, adv in zip((A, B, C), [1.0, 2.0, 5.0]):
        pool.add(_item(key, abs_advantage=adv))
    pairs = [(A, B), (A, C), (B, A), (B, C), (C, A), (C, B)]
    expected = [
        Fraction(1, 28),
        Fraction(5, 56),
        Fraction(1, 24),
        Fraction(5, 24),
        Fraction(5, 24),
        Fraction(5, 12),
    ]
    assert sum(expected) == 1
    counts = dict.fromkeys(pairs, 0)
    for _ in range(6000):
        counts[tuple(pool.draw(20, 0, max_staleness=10**6).keys)] += 1
    assert _chi2([counts[p] for p in pairs], [float(e) for e in expected]) < CHI2_999[5]


def test_importance_weights_by_hand():
    # abs_advantage 1, 2, 5 and alpha 1: P = 1/8, 2/8, 5/8 over N = 3 eligible groups, so
    # (N P)^-1 = 8/3, 8/6, 8/15; the due group D gets 1. Divided by the max, 8/3.
    pool = ExperiencePool(1000, priority="abs_advantage", beta=1.0)
    for key, adv in zip((A, B, C), [1.0, 2.0, 5.0]):
        pool.add(_item(key, min_version=4, abs_advantage=adv, added_at=4))
    pool.add(_item(D, min_version=2, abs_advantage=9.0, added_at=4))
    draw = pool.draw(40, learner_version=4, max_staleness=2)
    assert draw.keys[0] == D and draw.due == 1
    got = dict(zip(draw.keys, draw.weights.tolist()))
    assert got == pytest.approx({A: 1.0, B: 0.5, C: 0.2, D: 3 / 8}, rel=1e-12)

    pool = ExperiencePool(1000, priority="abs_advantage", beta=0.5)
    for key, adv in zip((A, B, C), [1.0, 2.0, 5.0]):
        pool.add(_item(key, abs_advantage=adv))
    draw = pool.draw(30, learner_version=0, max_staleness=2)
    got = dict(zip(draw.keys, draw.weights.tolist()))
    assert got == pytest.approx({A: 1.0, B: 0.5**0.5, C: 0.2**0.5}, rel=1e-12)


def test_uniform_weights_are_exactly_one():
    pool = ExperiencePool(1000, priority="uniform", beta=1.0, seed=4)
    for k in range(5):
        pool.add(_item(k, tokens=3 + k, min_version=k % 3, added_at=2))
    draw = pool.draw(20, learner_version=2, max_staleness=2)
    assert draw.due == 2 and len(draw) >= 3
    assert draw.weights.dtype == np.float64 and np.all(draw.weights == 1.0)


# -- curriculum feed and counters -------------------------------------------------------------


def test_domain_stats_feedback_and_counters():
    pool = ExperiencePool(1000)
    pool.add(_item(1, domain=0, success=[1, 0, 0, 0], abs_advantage=0.5))
    pool.add(_item(2, domain=2, success=[1, 1], abs_advantage=0.1))
    pool.add(_item(3, domain=0, success=[1, 1, 1, 0], abs_advantage=0.2))
    assert pool.domain_stats() == {0: (2, pytest.approx(0.5)), 2: (1, 1.0)}

    draw = pool.draw(30, learner_version=1, max_staleness=3)
    order = draw.keys
    sizes = {1: 4, 2: 2, 3: 4}
    domains = {1: 0, 2: 2, 3: 0}
    success = {1: [1, 0, 0, 0], 2: [1, 1], 3: [1, 1, 1, 0]}
    adv = {1: 0.5, 2: 0.1, 3: 0.2}
    fb = draw.feedback()
    np.testing.assert_array_equal(
        fb["domain_index"], [d for k in order for d in [domains[k]] * sizes[k]]
    )
    np.testing.assert_array_equal(fb["success"], [s for k in order for s in success[k]])
    np.testing.assert_allclose(fb["abs_advantage"], [a for k in order for a in [adv[k]] * sizes[k]])
    np.testing.assert_array_equal(draw.domain_index, [domains[k] for k in order])
    np.testing.assert_allclose(draw.group_success, [np.mean(success[k]) for k in order])

    stats = pool.stats()
    assert stats == {
        "items": 0.0,
        "tokens": 0.0,
        "added": 3.0,
        "draws": 1.0,
        "drawn": 3.0,
        "due_draws": 0.0,
        "over_budget_draws": 0.0,
        "expired_reused": 0.0,
        "mean_staleness": 1.0,
    }
    pool.add(_item(4, success=[0]))
    assert pool.draw(10, 1, max_staleness=3).feedback()["abs_advantage"] is None


# -- checkpointing ---------------------------------------------------------------------------


def _run(pool, rng, start_key, versions):
    """Adds and draws driven by ``rng``; returns everything the draws produced, payloads
    included, so a restored pool must also have kept the payloads intact."""
    out = []
    key = start_key
    for version in versions:
        for _ in range(int(rng.integers(0, 8))):
            tokens = int(rng.integers(2, 12))
            if pool.has_room(tokens):
                lo = int(rng.integers(max(0, version - 1), version + 1))
                payload = {"ids": rng.integers(0, 100, size=(2, 5)).astype(np.int32), "n": key}
                pool.add(
                    _item(
                        key,
                        tokens=tokens,
                        min_version=lo,
                        added_at=version,
                        success=rng.integers(0, 2, size=2),
                        abs_advantage=float(rng.random()),
                        payload=payload,
                    )
                )
                key += 1
        if len(pool):
            d = pool.draw(20, version, max_staleness=4)
            payloads = [
                (it.payload["ids"].dtype.str, it.payload["ids"].tolist(), it.payload["n"])
                for it in d.items
            ]
            out.append(
                (d.keys, d.weights.tolist(), d.staleness.tolist(), d.due, d.over_budget, payloads)
            )
    return out, key


def _config():
    return {
        "capacity_tokens": 120,
        "priority": "abs_advantage",
        "alpha": 1.5,
        "beta": 0.6,
        "max_reuse": 2,
        "seed": 9,
    }


def _encode(payload):
    ids = payload["ids"]
    return {"ids": ids.tolist(), "dtype": ids.dtype.str, "n": payload["n"]}


def _decode(data):
    return {"ids": np.array(data["ids"], dtype=data["dtype"]), "n": data["n"]}


@pytest.mark.parametrize("via", ["pickle", "json", "load_state_dict"])
def test_state_dict_round_trip_reproduces_later_draws(via):
    pool = ExperiencePool(**_config())
    _, key = _run(pool, np.random.default_rng(0), 0, range(6))
    assert len(pool) > 0 and any(pool.uses(k) > 0 for k in pool)
    if via == "pickle":
        restored = ExperiencePool.from_state_dict(pickle.loads(pickle.dumps(pool.state_dict())))
    elif via == "json":
        text = json.dumps(pool.state_dict(encode_payload=_encode))
        restored = ExperiencePool.from_state_dict(json.loads(text), decode_payload=_decode)
    else:
        # A pool built from the config with another seed: the state must bring the RNG.
        restored = ExperiencePool(**{**_config(), "seed": 1})
        restored.load_state_dict(pool.state_dict())
    assert restored.stats() == pool.stats()
    assert restored.keys() == pool.keys()
    assert [restored.uses(k) for k in restored] == [pool.uses(k) for k in pool]

    a, _ = _run(pool, np.random.default_rng(123), key, range(6, 16))
    b, _ = _run(restored, np.random.default_rng(123), key, range(6, 16))
    assert len(a) >= 8 and a == b
    assert restored.stats() == pool.stats()


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"capacity_tokens": 0}, "capacity_tokens"),
        ({"capacity_tokens": 1.5}, "capacity_tokens"),
        ({"priority": "greedy"}, "priority"),
        ({"alpha": -1.0}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"beta": 1.5}, "beta"),
        ({"max_reuse": 0}, "max_reuse"),
        ({"seed": -1}, "seed"),
        ({"abs_advantage_default": -0.1}, "abs_advantage_default"),
        ({"priority_floor": 0.0}, "priority_floor"),
    ],
)
def test_bad_pool_arguments_name_the_argument(kwargs, name):
    args = {"capacity_tokens": 100, **kwargs}
    with pytest.raises(ValueError, match=name):
        ExperiencePool(**args)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"token_budget": 0}, "token_budget"),
        ({"learner_version": -1}, "learner_version"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"min_items": 0}, "min_items"),
        ({"max_items": 3, "multiple_of": 2}, "max_items"),
        ({"max_items": 1, "min_items": 2}, "max_items"),
        ({"multiple_of": 0}, "multiple_of"),
    ],
)
def test_bad_draw_arguments_name_the_argument(kwargs, name):
    pool = ExperiencePool(100)
    pool.add(_item(1))
    args = {"token_budget": 10, "learner_version": 0, "max_staleness": 1, **kwargs}
    with pytest.raises(ValueError, match=name):
        pool.draw(**args)
    assert pool.keys() == [1]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"tokens": 0}, "num_tokens"),
        ({"min_version": -1}, "min_version"),
        ({"min_version": 3, "max_version": 2}, "max_version"),
        ({"success": [[1.0]]}, "success"),
        ({"success": [1.5]}, "success"),
        ({"abs_advantage": -1.0}, "abs_advantage"),
        ({"domain": -1}, "domain"),
    ],
)
def test_bad_items_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        _item(1, **kwargs)
