"""Curriculum benchmark: a learning simulator with no neural network, plus loader speed.

Usage: ``python benchmarks/curriculum.py`` (no arguments; a minute or two on CPU).

The simulator's learning curves (fixed before the curriculum was tuned):

- Every domain has ``L = 5`` difficulty levels and a latent skill ``s``. A
  prompt at level ``l`` succeeds with probability ``sigmoid(3 (s - l))``.
- Each sample at level ``l`` raises the skill by ``rate * 4 p (1 - p)`` with
  ``p`` that success probability: learning is fastest where success is near
  one half, and nil on tasks far too easy or too hard.
- A domain is mastered when ``s >= L + 0.5`` (success about 0.82 at the top level).
- Main scenario, 8 domains: 3 already mastered (``s = 7``); 4 learnable from
  ``s = 0.5`` at rates 1/150, 1/300, 1/600 and 1/1000 per sample; and one
  unlearnable noise domain that succeeds with probability 0.5 whatever the
  level and never changes.
- Equal scenario: 6 learnable domains, all at rate 1/500 from ``s = 0.5``.
- Each step draws 16 prompts and 8 samples per prompt (GRPO groups); the
  advantage of a sample is its reward minus its group's mean. Both runs use the
  same difficulty curriculum (window 64, thresholds 0.2 / 0.8) and seeds; only
  the domain mixing differs.

Printed (last line, JSON): ``samples_ratio_vs_uniform`` (samples the learned
curriculum needs until every learnable domain is mastered, over uniform's;
mean over seeds), ``samples_ratio_equal_domains``, ``noise_domain_share`` (the
noise domain's mean sampling probability under the learned curriculum, with
its floor alongside; ``noise_domain_share_abs_advantage_signal`` is the same
under the |advantage| signal, which the noise domain traps),
``mixer_overhead_ms_200_domains`` (median per-batch time
of weights, draws and update with 200 domains), and
``loader_batches_per_s`` (the real loader over the built-in domains, tokenised).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlpt.data import (  # noqa: E402
    Curriculum,
    CurriculumConfig,
    CurriculumLoader,
    DifficultyConfig,
    Feedback,
    ProceduralSource,
    make_curriculum,
)

LEVELS = 5
PROMPTS, GROUP = 16, 8
MAX_STEPS = 4000
SEEDS = (0, 1, 2, 3, 4)
# The library defaults (temperature 0.2, exploration 0.1, EMA rates 0.01 / 0.005 per
# sample) were chosen on this simulator after its curves were fixed.
LEARNED = dict(strategy="bandit", signal="progress", floor=0.02)


def _log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def simulate(
    rates: list[float],
    skills: list[float],
    noise: list[bool],
    config: CurriculumConfig,
    seed: int,
) -> tuple[int, np.ndarray]:
    """Samples until every learnable domain is mastered, and mean sampling probabilities."""
    k = len(rates)
    rates_a, skill = np.asarray(rates), np.asarray(skills, np.float64)
    noise_a = np.asarray(noise)
    learnable = (rates_a > 0) & ~noise_a & (skill < LEVELS + 0.5)
    cur = Curriculum([f"d{i}" for i in range(k)], config, max_levels=[LEVELS] * k)
    rng = np.random.default_rng(seed)
    prob_sum = np.zeros(k)
    for step in range(MAX_STEPS):
        d, probs = cur.sample(PROMPTS, rng)
        prob_sum += probs
        cur.record_draws(d)
        rows = np.repeat(d, GROUP)
        level = cur.level[rows]
        p = 1.0 / (1.0 + np.exp(-3.0 * (skill[rows] - level)))
        p = np.where(noise_a[rows], 0.5, p)
        success = (rng.random(rows.size) < p).astype(np.float64)
        adv = success - np.repeat(success.reshape(PROMPTS, GROUP).mean(1), GROUP)
        np.add.at(skill, rows, rates_a[rows] * 4.0 * p * (1.0 - p))
        cur.update(Feedback(rows, success, abs_advantage=np.abs(adv), difficulty=level))
        if (skill[learnable] >= LEVELS + 0.5).all():
            return (step + 1) * PROMPTS * GROUP, prob_sum / (step + 1)
    return MAX_STEPS * PROMPTS * GROUP, prob_sum / MAX_STEPS


def scenario(rates, skills, noise) -> tuple[float, float, float]:
    diff = DifficultyConfig(start=1, upper=0.8, lower=0.2, window=64)
    learned = CurriculumConfig(**LEARNED, difficulty=diff)
    uniform = CurriculumConfig(strategy="uniform", floor=0.0, difficulty=diff)
    n_learned, n_uniform, shares = [], [], []
    for seed in SEEDS:
        n, probs = simulate(rates, skills, noise, learned, seed)
        n_learned.append(n)
        shares.append(probs)
        n_uniform.append(simulate(rates, skills, noise, uniform, seed)[0])
    _log(f"  learned {n_learned}  uniform {n_uniform}")
    noise_share = float(np.mean([s[np.asarray(noise)].mean() for s in shares])) if any(noise) else 0
    return float(np.mean(n_learned) / np.mean(n_uniform)), noise_share, float(np.mean(n_uniform))


def mixer_overhead_ms(k: int = 200, reps: int = 300) -> float:
    cfg = make_curriculum(
        {**LEARNED, "floor": 0.001}, [f"d{i}" for i in range(k)], max_levels=[LEVELS] * k
    )
    cfg_exp3 = make_curriculum(
        {**LEARNED, "floor": 0.001, "strategy": "exp3"}, cfg.names, max_levels=[LEVELS] * k
    )
    rng = np.random.default_rng(0)
    times = []
    for cur in (cfg, cfg_exp3):
        for rep in range(reps + 20):
            success = rng.random(PROMPTS * GROUP) < 0.5
            t = time.perf_counter()
            d, _ = cur.sample(PROMPTS, rng)
            cur.record_draws(d)
            rows = np.repeat(d, GROUP)
            cur.update(
                Feedback(rows, success, abs_advantage=success * 0.5, difficulty=cur.level[rows])
            )
            if rep >= 20:
                times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def loader_speed(batches: int = 30) -> dict[str, float]:
    names = ["arithmetic", "stepwise_math", "program_synthesis"]
    sources = {n: ProceduralSource(n) for n in names}
    cur = make_curriculum(
        LEARNED,
        names,
        max_levels=[s.max_difficulty for s in sources.values()],
        sizes=[s.size for s in sources.values()],
    )
    loader = CurriculumLoader(
        sources, cur, batch_size=PROMPTS * GROUP, group_size=GROUP, shard_index=0, shard_count=1
    )
    rng = np.random.default_rng(0)
    times = []
    for i in range(batches + 5):
        t = time.perf_counter()
        batch = next(loader)
        if i >= 5:
            times.append(time.perf_counter() - t)
        success = rng.random(len(batch.tasks)) < 0.5
        loader.update(Feedback(batch.domain_index, success, difficulty=batch.difficulty))
    loader.close()
    median = float(np.median(times))
    return {
        "loader_batches_per_s": 1.0 / median,
        "loader_prompts_per_s": PROMPTS / median,
    }


def main() -> None:
    t0 = time.time()
    _log("main scenario: 3 mastered, 4 learnable, 1 noise")
    rates = [0.0, 0.0, 0.0, 1 / 150, 1 / 300, 1 / 600, 1 / 1000, 0.0]
    skills = [7.0, 7.0, 7.0, 0.5, 0.5, 0.5, 0.5, 0.5]
    noise = [False] * 7 + [True]
    ratio, noise_share, uniform_samples = scenario(rates, skills, noise)
    _log("main scenario with the |advantage| signal (the noise trap)")
    LEARNED["signal"] = "abs_advantage"
    _, noise_share_abs_adv, _ = scenario(rates, skills, noise)
    LEARNED["signal"] = "progress"
    _log("equal scenario: 6 equally learnable domains")
    ratio_eq, _, _ = scenario([1 / 500] * 6, [0.5] * 6, [False] * 6)
    _log("mixer overhead, 200 domains")
    overhead = mixer_overhead_ms()
    _log("loader speed")
    speed = loader_speed()
    result = {
        "samples_ratio_vs_uniform": round(ratio, 4),
        "samples_ratio_equal_domains": round(ratio_eq, 4),
        "noise_domain_share": round(noise_share, 4),
        "noise_domain_floor": LEARNED["floor"],
        "noise_domain_share_abs_advantage_signal": round(noise_share_abs_adv, 4),
        "uniform_samples_to_mastery": uniform_samples,
        "mixer_overhead_ms_200_domains": round(overhead, 4),
        **{k: round(v, 2) for k, v in speed.items()},
        "wall_s": round(time.time() - t0, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
