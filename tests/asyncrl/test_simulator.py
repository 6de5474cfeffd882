"""The RL timeline simulator against hand-worked timelines, bounds and invariants.

Float64 sums of a few dozen terms: agreement to 1e-9 relative is far above rounding error.
"""

import dataclasses

import numpy as np
import pytest

from rlpt.asyncrl.simulator import (
    PhaseTiming,
    TimelineConfig,
    calibrate,
    example_pod_config,
    predict_speedup,
    simulate,
)

REL = 1e-9


def tiny(**kw) -> TimelineConfig:
    """Two prompts of two samples per step on two devices, lengths 2,3,4,5 then 1,1,6,2."""
    fields = dict(
        total_devices=2,
        actor_devices=1,
        batch_prompts=2,
        group_size=2,
        num_steps=2,
        mode="sync",
        prompt_tokens=4,
        response_lengths=(2, 3, 4, 5, 1, 1, 6, 2),
        max_slots_per_device=2,
    )
    fields.update(kw)
    return TimelineConfig(**fields)


# Sync: phases in sequence


def test_sync_without_overheads_is_the_sum_of_its_phases():
    cfg = tiny(decode_token_s=0.2, learner_token_s=0.05)
    # Step 1 decodes 2+3+4+5 = 14 tokens at 0.2 / 2 devices each, then trains 2*2*4 prompt
    # plus 14 response tokens at 0.05 / 2; step 2 decodes 10 tokens and trains 16 + 10.
    step1 = 14 * 0.1 + 30 * 0.025
    step2 = 10 * 0.1 + 26 * 0.025
    res = simulate(cfg)
    assert res.total_s == pytest.approx(step1 + step2, rel=REL)
    assert res.samples_per_s == pytest.approx(8 / (step1 + step2), rel=REL)
    np.testing.assert_allclose(res.step_end_s, [step1, step1 + step2], rtol=REL)


def test_sync_with_every_overhead_is_the_sum_of_its_phases():
    cfg = tiny(
        decode_step_s=0.5,
        decode_token_s=0.2,
        prefill_token_s=0.1,
        learner_token_s=0.05,
        learner_overhead_s=1.5,
        weight_sync_s=0.7,
        host_overhead_s=0.3,
    )
    prefill = 2 * 4 * 0.1 / 2
    # Lengths 2,3,4,5: 5 decode steps with 4,4,3,2,1 active slots.
    gen1 = prefill + 5 * 0.5 + (4 + 4 + 3 + 2 + 1) * 0.2 / 2
    upd1 = 30 * 0.05 / 2 + 1.5
    # Lengths 1,1,6,2: 6 decode steps with 4,2,1,1,1,1 active slots.
    gen2 = prefill + 6 * 0.5 + (4 + 2 + 1 + 1 + 1 + 1) * 0.2 / 2
    upd2 = 26 * 0.05 / 2 + 1.5
    end1 = gen1 + 0.3 + upd1 + 0.7
    end2 = end1 + gen2 + 0.3 + upd2 + 0.7
    res = simulate(cfg)
    assert res.total_s == pytest.approx(end2, rel=REL)
    np.testing.assert_allclose(res.update_start_s, [gen1 + 0.3, end1 + gen2 + 0.3], rtol=REL)
    np.testing.assert_allclose(res.update_end_s, [gen1 + 0.3 + upd1, end2 - 0.7], rtol=REL)
    np.testing.assert_allclose(res.learner_idle_s, [gen1 + 0.3, gen2 + 0.3], rtol=REL)
    # The devices generate only during gen; the rest of each step they wait.
    np.testing.assert_allclose(res.actor_idle_s, [end1 - gen1, end2 - end1 - gen2], rtol=REL)
    np.testing.assert_array_equal(res.staleness_hist, [8])


def test_continuous_batching_refills_freed_slots_from_the_next_prompt():
    # Two slots for lengths 2,3,4,5: s0 and s1 start; s0 frees its slot after step 2 and the
    # second prompt is prefilled for it (s2), s1 frees after step 3 (s3 takes it). Slots
    # hold 2,2,2,2,2,2,1,1 sequences over 8 steps; each prefill blocks decoding.
    cfg = tiny(
        num_steps=1,
        response_lengths=(2, 3, 4, 5),
        max_slots_per_device=1,
        decode_step_s=0.5,
        decode_token_s=0.2,
        prefill_token_s=0.1,
    )
    gen = 2 * (4 * 0.1 / 2) + 8 * 0.5 + (6 * 2 + 2 * 1) * 0.2 / 2
    assert simulate(cfg).total_s == pytest.approx(gen, rel=REL)


# Sync: reward latency


def reward_case(**kw) -> TimelineConfig:
    # One device, one step, 1 s per active slot per decode step: lengths 2,3,4,5 finish at
    # 8, 11, 13 and 14 s. Learner costs are the same in every variant.
    return tiny(
        total_devices=1,
        num_steps=1,
        prompt_tokens=0,
        response_lengths=(2, 3, 4, 5),
        max_slots_per_device=4,
        decode_token_s=1.0,
        learner_token_s=0.1,
        learner_overhead_s=0.4,
        **kw,
    )


def test_reward_latency_adds_exactly_its_makespan_in_strict_sync():
    base = simulate(reward_case()).total_s
    # Latencies 1 + 0.5 L = 2, 2.5, 3, 3.5 on two workers, all submitted at 14 s:
    # 2 and 2.5 run first, 3 follows at +2, 3.5 at +2.5; the last ends at +6.
    slow = simulate(reward_case(reward_base_s=1.0, reward_per_token_s=0.5, sandbox_workers=2))
    assert slow.total_s - base == pytest.approx(6.0, rel=REL)
    # Every run times out at 0.5 s: two rounds on two workers.
    out = simulate(reward_case(reward_timeout_prob=1.0, reward_timeout_s=0.5, sandbox_workers=2))
    assert out.total_s - base == pytest.approx(1.0, rel=REL)


def test_reward_latency_adds_only_its_tail_when_rewards_overlap_generation():
    base = simulate(reward_case(sync_overlap_reward=True)).total_s
    # Runs start as samples finish (8, 11, 13, 14 s): 8-10, 11-13.5, then 13-16 on the
    # worker free since 10, and 14-17.5 on the one free since 13.5. Generation ends at 14,
    # so 3.5 s are not overlapped.
    slow = simulate(
        reward_case(
            reward_base_s=1.0, reward_per_token_s=0.5, sandbox_workers=2, sync_overlap_reward=True
        )
    )
    assert slow.total_s - base == pytest.approx(3.5, rel=REL)


def test_runs_sharing_one_core_take_their_summed_work():
    # One core, two workers of one core each: the runs (2, 2.5, 3, 3.5 s of work) share it,
    # each at half speed while two run. 2 ends at +4 (2.5 has 0.5 left), 2.5 at +5 (3 has
    # 2.5 left), 3 at +10 (3.5 has 1 left), 3.5 alone at +11: the summed work.
    kw = dict(host_cores=1.0, reward_base_s=1.0, reward_per_token_s=0.5, sandbox_workers=2)
    base = simulate(reward_case(host_cores=1.0)).total_s
    assert simulate(reward_case(**kw)).total_s - base == pytest.approx(11.0, rel=REL)
    # A timed-out run holds a core but ends at its wall-clock deadline.
    kw = dict(host_cores=1.0, reward_timeout_prob=1.0, reward_timeout_s=0.5, sandbox_workers=2)
    assert simulate(reward_case(**kw)).total_s - base == pytest.approx(1.0, rel=REL)


def test_contended_path_matches_the_closed_form_when_cores_are_plentiful():
    cfg = example_pod_config(8, num_steps=3, batch_prompts=16, length_cap=2048)
    free = simulate(cfg)
    roomy = simulate(
        dataclasses.replace(cfg, host_cores=1e9, actor_cpu_demand=1.0, learner_cpu_demand=1.0)
    )
    assert roomy.total_s == pytest.approx(free.total_s, rel=REL)
    np.testing.assert_array_equal(roomy.group_batch, free.group_batch)


# Async: staleness


def test_async_with_zero_staleness_uses_only_fresh_samples():
    cfg = TimelineConfig(
        total_devices=4,
        actor_devices=3,
        batch_prompts=3,
        group_size=2,
        num_steps=6,
        max_staleness=0,
        length_median=40,
        length_p99=400,
        decode_step_s=0.01,
        decode_token_s=0.001,
        learner_token_s=0.001,
        reward_base_s=0.05,
        reward_timeout_prob=0.2,
        reward_timeout_s=0.5,
        sandbox_workers=2,
    )
    res = simulate(cfg)
    np.testing.assert_array_equal(res.staleness_hist, [cfg.num_samples])
    np.testing.assert_array_equal(res.group_batch - 1, res.group_version)


@pytest.mark.parametrize("seed", range(40))
def test_random_configs_keep_every_invariant(seed):
    rng = np.random.default_rng(seed)
    total = int(rng.integers(2, 9))
    B, G, K = (int(x) for x in rng.integers(1, [6, 4, 9]))
    eta = int(rng.integers(0, 4))
    cfg = TimelineConfig(
        total_devices=total,
        actor_devices=int(rng.integers(1, total)),
        batch_prompts=B,
        group_size=G,
        num_steps=K,
        max_staleness=eta,
        mode=str(rng.choice(["sync", "async", "async"])),
        prompt_tokens=int(rng.integers(0, 50)),
        length_median=float(rng.uniform(5, 50)),
        length_sigma=float(rng.uniform(0, 1.5)),
        length_cap=int(rng.integers(50, 400)),
        seed=seed,
        reward_base_s=float(rng.uniform(0, 0.5)),
        reward_per_token_s=float(rng.uniform(0, 0.01)),
        reward_timeout_prob=float(rng.uniform(0, 0.3)),
        reward_timeout_s=1.0,
        sandbox_workers=[None, 1, 3][seed % 3],
        decode_step_s=float(rng.uniform(0, 0.02)),
        decode_token_s=float(rng.uniform(0, 0.01)),
        max_slots_per_device=int(rng.integers(1, 8)),
        prefill_token_s=float(rng.uniform(0, 0.001)),
        learner_token_s=float(rng.uniform(0, 0.01)),
        learner_overhead_s=float(rng.uniform(0, 0.5)),
        weight_sync_s=float(rng.uniform(0, 0.5)),
        host_overhead_s=float(rng.uniform(0, 0.3)),
        host_cores=[None, 1.0, 2.0][(seed // 3) % 3],
        sync_overlap_reward=bool(seed % 2),
    )
    eta = 0 if cfg.mode == "sync" else eta
    res = simulate(cfg)
    n_groups = B * K
    batch, version = res.group_batch, res.group_version
    # Every group is consumed once, B per update.
    np.testing.assert_array_equal(np.bincount(batch, minlength=K + 1), [0] + [B] * K)
    # Update k trains version k - 1 on groups of version at least k - 1 - eta.
    staleness = batch - 1 - version
    assert staleness.min() >= 0 and staleness.max() <= eta
    np.testing.assert_array_equal(res.staleness_hist, np.bincount(staleness, minlength=eta + 1) * G)
    # Admission: prompt i started under version v only if i < (v + eta + 1) B.
    assert np.all(np.arange(n_groups) < (version + eta + 1) * B)
    # A group is finished before the update that uses it starts, and updates follow each other.
    assert np.all(res.group_ready_s <= res.update_start_s[batch - 1])
    assert np.all(res.update_start_s[1:] >= res.step_end_s[:-1])
    assert np.all(res.update_end_s >= res.update_start_s)
    assert res.total_s == res.step_end_s[-1]
    # Idle time never exceeds the time it is counted over.
    assert np.all(res.learner_idle_s >= 0) and np.all(res.actor_idle_s >= -1e-12)
    assert res.actor_idle_s.sum() == pytest.approx(res.actor_idle_total_s, rel=1e-9, abs=1e-12)
    assert res.actor_idle_total_s <= res.total_s * (1 + 1e-12)


def test_simulation_is_deterministic():
    cfg = example_pod_config(8, num_steps=3, batch_prompts=16)
    a, b = simulate(cfg), simulate(dataclasses.replace(cfg))
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y, f.name
    # A different seed draws different lengths and so a different timeline.
    assert simulate(dataclasses.replace(cfg, seed=1)).total_s != a.total_s


# Async: overlap bounds


def overlap_case(**kw) -> TimelineConfig:
    # Generation costs tokens only (no per-step overhead, no prefill, no rewards), so the
    # actor's busy time is exactly its tokens times 1e-3 / 2 devices, however they batch.
    lengths = np.maximum(1, np.rint(np.random.default_rng(7).lognormal(np.log(60), 0.8, 320)))
    fields = dict(
        total_devices=4,
        actor_devices=2,
        batch_prompts=4,
        group_size=4,
        num_steps=20,
        response_lengths=tuple(int(x) for x in lengths),
        decode_token_s=1e-3,
        max_slots_per_device=64,
        learner_token_s=6e-4,
        learner_overhead_s=0.003,
        weight_sync_s=0.002,
    )
    fields.update(kw)
    return TimelineConfig(**fields)


def per_step(cfg: TimelineConfig) -> tuple[np.ndarray, np.ndarray]:
    """Hand-computed generate and learn-plus-send seconds of each step on the split."""
    tokens = np.asarray(cfg.response_lengths, float).reshape(cfg.num_steps, -1).sum(1)
    gen = tokens * cfg.decode_token_s / cfg.actor_devices
    learn = tokens * cfg.learner_token_s / (cfg.total_devices - cfg.actor_devices)
    return gen, learn + cfg.learner_overhead_s + cfg.weight_sync_s


def test_async_approaches_the_slower_role_not_the_sum():
    cfg = overlap_case(max_staleness=2)
    gen, learn = per_step(cfg)
    assert gen.sum() > 1.5 * learn.sum()  # generation dominates
    # Without staleness the roles alternate: exactly the sum.
    serial = simulate(dataclasses.replace(cfg, max_staleness=0)).total_s
    assert serial == pytest.approx(gen.sum() + learn.sum(), rel=REL)
    # With staleness 2 the actor never waits; only the last update follows it.
    res = simulate(cfg)
    bound = max(gen.sum(), learn.sum())
    assert bound <= res.total_s <= bound + 2 * (gen.max() + learn.max())
    assert res.total_s < 0.8 * serial
    assert res.actor_idle_total_s <= 2 * (gen.max() + learn.max())


def test_async_learner_bound_runs_updates_back_to_back():
    cfg = overlap_case(max_staleness=2, learner_token_s=3e-3)
    gen, learn = per_step(cfg)
    assert learn.sum() > 2 * gen.sum()
    res = simulate(cfg)
    # The first batch, generated alongside up to two more, is ready by 3 steps' generation;
    # after that the learner never waits.
    assert learn.sum() <= res.total_s <= learn.sum() + 3 * gen.max()
    assert res.learner_idle_s[1:].sum() == pytest.approx(0.0, abs=1e-12)


# Speedup predictions


def test_predicted_speedups_are_ratios_of_simulated_times():
    cfg = overlap_case(num_steps=6, response_lengths=None, length_median=60, length_sigma=0.8)
    pred = predict_speedup(cfg, etas=(0, 2))
    sync = simulate(dataclasses.replace(cfg, mode="sync")).total_s
    for eta in (0, 2):
        t = simulate(dataclasses.replace(cfg, max_staleness=eta)).total_s
        assert pred["speedup_vs_sync"][str(eta)] == pytest.approx(sync / t, rel=REL)
        assert pred["async"][str(eta)]["actor_devices"] == 2
    assert pred["sync"]["total_s"] == pytest.approx(sync, rel=REL)


def test_best_split_is_the_fastest_of_every_split():
    cfg = overlap_case(
        total_devices=7, num_steps=5, response_lengths=None, length_median=60, length_sigma=0.8
    )
    pred = predict_speedup(cfg, etas=(1,), best_split=True)
    times = {a: simulate(dataclasses.replace(cfg, actor_devices=a, max_staleness=1)).total_s
             for a in range(1, 7)}  # fmt: skip
    best = min(times, key=times.get)
    assert pred["async"]["1"]["actor_devices"] == best
    assert pred["async"]["1"]["total_s"] == pytest.approx(times[best], rel=REL)


# Calibration


def test_calibrate_recovers_constants_from_phase_timings():
    cfg = TimelineConfig(
        total_devices=2,
        actor_devices=2,
        batch_prompts=2,
        group_size=2,
        num_steps=1,
        mode="sync",
        prompt_tokens=8,
        max_slots_per_device=2,
        reward_timeout_s=2.0,
    )
    o, c, p, lt, lo, rb, rt = 0.01, 0.002, 0.0005, 0.003, 0.2, 0.05, 0.001
    steps = []
    all_lengths = [(3, 9, 4, 1), (20, 2, 5, 5), (7, 7, 7, 30), (1, 1, 2, 11)]
    for k, lengths in enumerate(all_lengths):
        L = np.array(lengths)
        out = np.array([False, k == 1, False, k == 3])
        dur = np.where(out, 2.0, rb + rt * L)
        # Four slots hold the whole step, so it decodes max(L) steps.
        steps.append(
            PhaseTiming(
                response_lengths=lengths,
                generate_s=o * L.max() + c * L.sum() / 2 + p * 8 * 2 / 2,
                update_s=lt * (L.sum() + 4 * 8) / 2 + lo,
                host_s=0.1 + 0.02 * k,
                reward_sample_s=tuple(dur),
                reward_timed_out=tuple(out),
            )
        )
    fit = calibrate(cfg, steps)
    got = [fit.decode_step_s, fit.decode_token_s, fit.prefill_token_s, fit.learner_token_s]
    np.testing.assert_allclose(got, [o, c, p, lt], rtol=1e-6)
    np.testing.assert_allclose(
        [fit.learner_overhead_s, fit.reward_base_s, fit.reward_per_token_s], [lo, rb, rt], rtol=1e-6
    )
    assert fit.host_overhead_s == pytest.approx(0.13, rel=REL)
    assert fit.reward_timeout_prob == pytest.approx(2 / 16, rel=REL)
    # Fitted constants replay a measured step's generate and update phases.
    L = np.array(all_lengths[2])
    replay = dataclasses.replace(
        fit,
        response_lengths=tuple(L),
        host_overhead_s=0.0,
        reward_base_s=0.0,
        reward_per_token_s=0.0,
        reward_timeout_prob=0.0,
    )
    assert simulate(replay).total_s == pytest.approx(
        steps[2].generate_s + steps[2].update_s, rel=1e-6
    )


@pytest.mark.parametrize("workers", [1, 4])
def test_calibrate_fits_rewards_from_step_makespans(workers):
    cfg = TimelineConfig(
        total_devices=1,
        actor_devices=1,
        batch_prompts=2,
        group_size=2,
        num_steps=1,
        mode="sync",
        sandbox_workers=workers,
    )
    rb, rt = 0.3, 0.02
    steps = []
    for lengths in [(3, 9, 4, 1), (20, 2, 5, 5), (7, 7, 7, 30)]:
        lat = rb + rt * np.array(lengths)
        # One worker runs them all in turn; four run them side by side.
        makespan = lat.sum() if workers == 1 else lat.max()
        steps.append(PhaseTiming(lengths, generate_s=1.0, update_s=1.0, reward_s=makespan))
    fit = calibrate(cfg, steps)
    np.testing.assert_allclose([fit.reward_base_s, fit.reward_per_token_s], [rb, rt], rtol=1e-6)


# Bad input


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("total_devices", 0),
        ("actor_devices", 4),
        ("actor_devices", 0),
        ("batch_prompts", 1.5),
        ("group_size", 0),
        ("num_steps", -1),
        ("max_staleness", -1),
        ("mode", "overlap"),
        ("response_lengths", (1, 2, 3)),
        ("length_median", 0.0),
        ("length_p99", 10.0),
        ("reward_timeout_prob", 1.5),
        ("sandbox_workers", 0),
        ("decode_token_s", -1.0),
        ("weight_sync_s", float("nan")),
        ("max_slots_per_device", 0),
        ("host_cores", 0.0),
        ("learner_cpu_demand", -2.0),
        ("virtual_devices", 1),
    ],
)
def test_bad_config_names_the_field(field, value):
    kw = dict(total_devices=4, actor_devices=2, batch_prompts=2, group_size=2, num_steps=2)
    kw["length_median"] = 100.0
    kw[field] = value
    with pytest.raises(ValueError, match=field):
        TimelineConfig(**kw)


def test_bad_config_names_the_dependent_field():
    with pytest.raises(ValueError, match="reward_timeout_s"):
        TimelineConfig(
            total_devices=2,
            actor_devices=1,
            batch_prompts=1,
            group_size=1,
            num_steps=1,
            reward_timeout_prob=0.1,
        )
    with pytest.raises(ValueError, match="length_p99"):
        TimelineConfig(
            total_devices=2,
            actor_devices=1,
            batch_prompts=1,
            group_size=1,
            num_steps=1,
            length_sigma=0.5,
            length_p99=900.0,
        )
    with pytest.raises(ValueError, match=r"steps\[0\].response_lengths"):
        calibrate(tiny(num_steps=1, response_lengths=None), [PhaseTiming((1, 2), 1.0, 1.0)])


def test_partial_rollout_takes_new_weights_at_the_next_decode_step():
    # One actor device with two slots, 1 s per decode step, staleness 1, one sample per
    # prompt. Prompts 0 and 1 start under version 0 (lengths 2 and 10); prompt 0 ends at
    # 2 s; update 1 runs 2-2.5 and its weights arrive at 2.7, which the actor takes at the
    # step boundary at 3 s and starts prompt 2 (length 3, ends at 6 s) beside prompt 1. Prompt
    # 2 is ready first, but update 2 must take prompt 1 (version 0, the last update allowed
    # to use it) and waits for it until 10 s; update 3 takes prompt 2.
    cfg = TimelineConfig(
        total_devices=2,
        actor_devices=1,
        batch_prompts=1,
        group_size=1,
        num_steps=3,
        max_staleness=1,
        response_lengths=(2, 10, 3),
        max_slots_per_device=2,
        decode_step_s=1.0,
        learner_overhead_s=0.5,
        weight_sync_s=0.2,
    )
    res = simulate(cfg)
    np.testing.assert_array_equal(res.group_version, [0, 0, 1])
    np.testing.assert_array_equal(res.group_batch, [1, 2, 3])
    np.testing.assert_allclose(res.group_ready_s, [2.0, 10.0, 6.0], rtol=REL)
    np.testing.assert_allclose(res.update_start_s, [2.0, 10.0, 10.7], rtol=REL)
    assert res.total_s == pytest.approx(11.4, rel=REL)
    # Prompt 1 started under version 0 and finished under version 1.
    assert res.partial_fraction == pytest.approx(1 / 3, rel=REL)
    # Staleness: update 1 on version 0 (0), update 2 on version 0 (1), update 3 on 1 (1).
    np.testing.assert_array_equal(res.staleness_hist, [1, 2])
