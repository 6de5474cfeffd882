"""Asynchronous RL against the synchronous algorithm: same parts, same samples, same seed.

    python benchmarks/async_rl.py            # about 8 minutes on 2 cores

The 8 host CPU devices are split: the rollout engine on 4, the PPO learner (GRPO with
decoupled PPO, truncated importance weights) on the other 4, in both modes. Each step
trains on ``--groups`` groups of ``--group_size`` samples; response lengths are
long-tailed (log-normal, median ``--median_len``, 99th percentile ``--max_len``, the
random policy never stops by itself); every sample's reward is a sandboxed program
(full isolation) whose run time grows with the response (CPU-bound loops of up to
``--max_work_ms``), and ``--timeout_frac`` of them never end and time out at
``--timeout_s``, as broken model-written code does.

Runs, in this order, each with a fresh model from the same seed:
Each run is a fresh process (several runs in one process slowed down one after another);
* an untimed run that fills the persistent compilation cache for the others;
* ``sync``: generate the whole batch, then judge it, then update (``AsyncRunner`` in
  ``mode="sync"``: the synchronous algorithm with the same engine, sandbox and learner);
* ``eta = 0`` asynchronous: must equal sync exactly (``sync_equivalence_max_abs_diff``,
  the largest difference over every logged PPO metric of every step);
* ``eta = 1, 2, 4`` asynchronous: ``speedup_vs_sync`` = samples per second over sync's,
  after ``--warmup`` steps (compilation) that are not timed;
* a checkpoint after ``--steps // 2`` steps of eta = 2, through JSON, and a resumed runner
  in its place: ``lost_or_duplicated_prompts`` counts prompts trained on twice or neither
  trained on nor held (in the pool or in flight) at the end (target 0).

The final JSON line also has the staleness histogram per eta (groups trained on at each
staleness, all timed steps), ``simulator_predicted_speedup`` (``rlpt.asyncrl.simulator``
calibrated on the sync run's measured phases and lengths, for this machine's 8 host
devices on 2 cores, next to the measured ``speedup_vs_sync``) and
``simulator_pod_speedup`` (its predictions for 8, 64 and 256 accelerators under
``example_pod_config``: estimates, not measurements). What it leaves out: the learner and
the actor share the machine's 2 cores, so the overlap is of sandbox waits and host work
with device work, not of two accelerators; a pod's gain is the simulator's to predict
(``rlpt.asyncrl.simulator``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from rlpt.asyncrl import AsyncConfig, AsyncRunner, GroupReward, PPOAsyncLearner, Prompt  # noqa: E402
from rlpt.asyncrl.simulator import (  # noqa: E402
    PhaseTiming,
    TimelineConfig,
    calibrate,
    example_pod_config,
    predict_speedup,
)
from rlpt.models import CausalLM, ModelConfig, create_model  # noqa: E402
from rlpt.parallel import make_mesh  # noqa: E402
from rlpt.rl import PPOConfig, PPOTrainer, init_train_state  # noqa: E402
from rlpt.sampling import Engine, RequestParams  # noqa: E402
from rlpt.sandbox import ExecutionRequest, SandboxPool  # noqa: E402

_STEPS = flags.DEFINE_integer("steps", 12, "Timed learner steps per run.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed first steps (compilation).")
_GROUPS = flags.DEFINE_integer("groups", 4, "Groups (prompts) per learner step.")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 4, "Samples per prompt.")
_MEDIAN_LEN = flags.DEFINE_integer("median_len", 32, "Median response length.")
_MAX_LEN = flags.DEFINE_integer("max_len", 256, "99th percentile and cap of the lengths.")
_MAX_WORK_MS = flags.DEFINE_float("max_work_ms", 60.0, "CPU work of the longest program.")
_TIMEOUT_FRAC = flags.DEFINE_float("timeout_frac", 0.1, "Programs that never end.")
_TIMEOUT_S = flags.DEFINE_float("timeout_s", 0.5, "Sandbox timeout.")
_SANDBOX_WORKERS = flags.DEFINE_integer("sandbox_workers", 3, "Sandbox pool workers.")
_ETAS = flags.DEFINE_list("etas", ["1", "2", "4"], "Staleness bounds to measure.")
_ONLY = flags.DEFINE_string("only", None, "Internal: one run (MODE:ETA or resume) alone.")
_OUT = flags.DEFINE_string("out", None, "Internal: where --only writes its result.")
_CACHE = flags.DEFINE_string("cache", None, "Internal: the shared compilation cache.")

PROMPT_LEN = 16
MODEL = ModelConfig(
    vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384,
    max_seq_len=PROMPT_LEN + 256 + 16, dtype="float32",
)  # fmt: skip


class Prompts:
    """Prompt ``k`` and its response length are functions of ``k`` alone."""

    def __init__(self):
        self.position = 0

    def next(self) -> Prompt:
        k = self.position
        self.position += 1
        rng = np.random.default_rng(10_000 + k)
        sigma = math.log(_MAX_LEN.value / _MEDIAN_LEN.value) / 2.3263  # cap at the 99th pct
        length = int(np.clip(round(_MEDIAN_LEN.value * math.exp(sigma * rng.standard_normal())),
                             1, _MAX_LEN.value))  # fmt: skip
        tokens = tuple(int(t) for t in rng.integers(5, MODEL.vocab_size, PROMPT_LEN))
        return Prompt(k, tokens, max_tokens=length)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = int(state["position"])


def sandbox_reward(sandbox: SandboxPool):
    """A program per sample: a loop whose length follows the response's, or (a fixed
    share, chosen by the sample's first token) one that never ends."""
    loops_per_ms = 20_000  # CPython additions per millisecond, roughly, on this machine

    def reward(prompt: Prompt, completions) -> GroupReward:
        requests = []
        for c in completions:
            first = int(c.tokens[0]) if len(c.tokens) else 0
            if (first * 7919 % 1000) / 1000 < _TIMEOUT_FRAC.value:
                code = "while True:\n    pass\n"
            else:
                work = _MAX_WORK_MS.value * len(c.tokens) / _MAX_LEN.value
                code = f"s = 0\nfor i in range({int(work * loops_per_ms)}):\n    s += i\n"
            requests.append(ExecutionRequest(code=code, timeout_s=_TIMEOUT_S.value))
        results = sandbox.run_batch(requests)
        rewards = np.array([
            float(r.passed) * float(np.mean(c.tokens % 2 == 0)) if len(c.tokens) else 0.0
            for r, c in zip(results, completions)
        ])  # fmt: skip
        return GroupReward(rewards=rewards, success=(rewards > 0.5).astype(np.float32))

    return reward


def build(eta: int, mode: str, sandbox: SandboxPool, seed: int = 0):
    devices = jax.devices()
    actor_mesh, learner_mesh = make_mesh(devices=devices[:4]), make_mesh(devices=devices[4:])
    graph, params = create_model(lambda r: CausalLM(MODEL, rngs=r), jax.random.key(seed))
    ppo = PPOConfig(
        estimator="grpo", num_groups=_GROUPS.value, learning_rate=1e-4, kl_coef=0.0,
        behaviour_correction="truncate",
    )  # fmt: skip
    learner = PPOAsyncLearner(
        PPOTrainer(ppo, graph, mesh=learner_mesh),
        init_train_state(ppo, params, None, jax.random.key(seed + 1)),
        jax.tree.map(lambda x: x.copy(), params), prompt_width=PROMPT_LEN,
        max_new_tokens=_MAX_LEN.value, width_multiple=_MAX_LEN.value,  # one update shape
    )  # fmt: skip
    engine = Engine(
        graph, params, MODEL, eos_id=-1, num_slots=4 * _GROUP_SIZE.value * 2, mesh=actor_mesh,
        decode_steps=8,
    )  # fmt: skip
    engine.warm_up()  # every engine program compiled (or loaded) before any timing
    consumed: list[int] = []

    def learn(draw, version):
        consumed.extend(draw.keys)
        return learner(draw, version)

    cfg = AsyncConfig(
        max_staleness=eta, batch_groups=_GROUPS.value, group_size=_GROUP_SIZE.value, mode=mode,
        reward_threads=4,
    )  # fmt: skip
    runner = AsyncRunner(
        cfg, engine, Prompts(), sandbox_reward(sandbox), learn,
        RequestParams(max_tokens=_MAX_LEN.value), seed=seed,
    )  # fmt: skip
    return runner, learner, consumed


def timed_run(eta: int, mode: str, sandbox: SandboxPool) -> dict:
    runner, _, _ = build(eta, mode, sandbox)
    stamps: list[float] = []
    metrics = runner.run(
        _WARMUP.value + _STEPS.value, on_step=lambda v, m: stamps.append(time.perf_counter())
    )
    timed = metrics[_WARMUP.value :]
    seconds = stamps[-1] - stamps[_WARMUP.value - 1]
    samples = _STEPS.value * _GROUPS.value * _GROUP_SIZE.value
    hist = np.sum([m["async/staleness_hist"] for m in timed], axis=0)
    return {
        "samples_per_s": samples / seconds,
        "seconds": seconds,
        "metrics": metrics,
        "staleness_hist": hist.tolist(),
        "learner_wait_s": float(np.mean([m["async/learner_wait_s"] for m in timed])),
    }


def resume_check(sandbox: SandboxPool) -> int:
    """Prompts trained on twice, or neither trained on nor held, across a checkpoint taken
    mid-run (through JSON) and a new runner resumed from it in the old one's place."""
    runner, learner, consumed = build(2, "async", sandbox)
    half = max(1, _STEPS.value // 2)
    runner.run(half)
    state = json.loads(json.dumps(runner.state_dict()))
    resumed, resumed_learner, consumed_after = build(2, "async", sandbox)
    resumed_learner.state = learner.state
    resumed.load_state_dict(state, learner.state.policy)
    resumed.run(half)
    final = resumed.state_dict()
    held = [p["key"] for p in final["inflight"]] + [i["key"] for i in final["pool"]["items"]]
    everything = consumed + consumed_after
    duplicated = len(everything) - len(set(everything))
    return duplicated + len(set(range(final["started"])) - set(everything) - set(held))


def run_one(what: str, out: str) -> None:
    """One measurement, alone in this process (``--only``), written to ``out``."""
    with SandboxPool(workers=_SANDBOX_WORKERS.value, timeout_s=_TIMEOUT_S.value) as sandbox:
        if what == "resume":
            result = {"lost_or_duplicated": resume_check(sandbox)}
        else:
            mode, eta = what.split(":")
            result = timed_run(int(eta), mode, sandbox)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)


def main(argv):
    del argv
    if _ONLY.value:
        jax.config.update("jax_compilation_cache_dir", _CACHE.value)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        run_one(_ONLY.value, _OUT.value)
        return
    results = {}
    # Each run in a fresh process: runs in one process slowed down one after another (a
    # fifth run in a row measured half the speed it had as the first), and a fresh process
    # gives every configuration the same start. They share one compilation through the
    # persistent cache, which an untimed first run fills.
    cache = tempfile.mkdtemp(prefix="rlpt-async-bench-")

    def measure(what: str) -> dict:
        out = os.path.join(cache, what.replace(":", "_") + ".json")
        flags_ = [f"--{name}={flags.FLAGS[name].value}" for name in (
            "steps", "warmup", "groups", "group_size", "median_len", "max_len", "max_work_ms",
            "timeout_frac", "timeout_s", "sandbox_workers")]  # fmt: skip
        subprocess.run(
            [sys.executable, __file__, f"--only={what}", f"--out={out}", f"--cache={cache}",
             *flags_], check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        with open(out, encoding="utf-8") as f:
            return json.load(f)

    measure("async:2")
    sync = measure("sync:0")
    eta0 = measure("async:0")
    diffs = [
        abs(a[k] - b[k])
        for a, b in zip(sync["metrics"], eta0["metrics"])
        for k in a
        if k.startswith("ppo/")
    ]
    runs = {int(e): measure(f"async:{int(e)}") for e in _ETAS.value}
    lost = measure("resume")["lost_or_duplicated"]
    # The timeline simulator, calibrated on the sync run's measured phases, predicts the
    # async speedups on this machine (8 host devices on 2 cores) and at pod scale.
    timings = [
        PhaseTiming(
            response_lengths=tuple(max(1, n) for n in m["async/response_lengths"]),
            generate_s=m["time/generate_s"],
            reward_s=m["time/reward_s"],
            update_s=m["time/update_s"],
        )  # fmt: skip
        for m in sync["metrics"][_WARMUP.value :]
    ]
    here = TimelineConfig(
        total_devices=8, actor_devices=4, batch_prompts=_GROUPS.value,
        group_size=_GROUP_SIZE.value, num_steps=_STEPS.value, max_staleness=1,
        prompt_tokens=PROMPT_LEN,
        response_lengths=tuple(n for t in timings for n in t.response_lengths),
        sandbox_workers=_SANDBOX_WORKERS.value, max_slots_per_device=2 * _GROUP_SIZE.value,
        virtual_devices=True, host_cores=2,
    )  # fmt: skip
    predicted = predict_speedup(calibrate(here, timings), etas=[int(e) for e in _ETAS.value])
    pods = {
        str(n): {e: round(v, 2) for e, v in predict_speedup(
            example_pod_config(n), etas=[int(e) for e in _ETAS.value], best_split=True
        )["speedup_vs_sync"].items()}
        for n in (8, 64, 256)
    }  # fmt: skip
    for eta, run in runs.items():
        results[f"speedup_vs_sync_eta{eta}"] = round(
            run["samples_per_s"] / sync["samples_per_s"], 3
        )
    print(json.dumps({
        "groups": _GROUPS.value, "group_size": _GROUP_SIZE.value, "steps": _STEPS.value,
        "median_len": _MEDIAN_LEN.value, "max_len": _MAX_LEN.value,
        "timeout_frac": _TIMEOUT_FRAC.value, "sandbox_workers": _SANDBOX_WORKERS.value,
        "sync_samples_per_s": round(sync["samples_per_s"], 2),
        **{f"async_eta{e}_samples_per_s": round(r["samples_per_s"], 2) for e, r in runs.items()},
        "speedup_vs_sync": {str(e): results[f"speedup_vs_sync_eta{e}"] for e in runs},
        "simulator_predicted_speedup": {
            e: round(v, 3) for e, v in predicted["speedup_vs_sync"].items()
        },
        "simulator_pod_speedup": pods,
        "sync_equivalence_max_abs_diff": max(diffs),
        "lost_or_duplicated_prompts": lost,
        "staleness_hist": {str(e): r["staleness_hist"] for e, r in runs.items()},
        "learner_wait_s": {"sync": round(sync["learner_wait_s"], 3),
                           **{str(e): round(r["learner_wait_s"], 3) for e, r in runs.items()}},
        "backend": jax.default_backend(),
    }))  # fmt: skip


if __name__ == "__main__":
    app.run(main)
