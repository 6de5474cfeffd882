"""A deterministic discrete-event model of synchronous and asynchronous RL timelines.

It predicts wall time and throughput (samples per second) of a post-training run from a few
cost constants, so the speedup of asynchronous RL (AReaL, Fu et al. 2025) over the synchronous
loop can be predicted at pod scale and checked against a measurement on a small machine.

The model, event by event (``simulate``):

* **Work.** ``num_steps * batch_prompts`` prompts, each with ``group_size`` samples, in a
  fixed order; sample ``s`` belongs to prompt (group) ``s // group_size`` and has response
  length ``response_lengths[s]``. Sync and async runs see the same samples.
* **Actor** (``actor_devices`` devices ``d_a``; all devices in sync mode): a continuous-batching
  engine with ``max_slots_per_device * d_a`` decode slots. It does one thing at a time. A
  decode step over ``n`` active slots costs ``decode_step_s + n * decode_token_s / d_a`` and
  gives every active sample one token; a sample of length ``L`` holds its slot for ``L``
  steps and frees it at the end of its last step, when the next waiting sample takes it. When
  slots are free and no sample waits, the actor starts the next prompt: it prefills it
  (``prompt_tokens * prefill_token_s / d_a``, blocking decoding, as the engine's prefill
  chunks do) and the group's samples wait for slots.
* **Admission** (AReaL's rule): prompt ``i`` may start only while
  ``i < (v + eta + 1) * batch_prompts``, with ``v`` the policy version the actor holds (the
  version its tokens are generated under; it is also the sample's version for staleness).
* **Rewards.** A finished sample queues for one of ``sandbox_workers`` sandbox workers (FIFO;
  None is unbounded) and takes ``reward_base_s + reward_per_token_s * L`` seconds (capped at
  ``reward_timeout_s`` when that is set), or ``reward_timeout_s`` with probability
  ``reward_timeout_prob``. A group goes to the experience pool when all its samples have
  rewards. In sync mode rewards start only once the whole batch is generated (rlpt's sync
  trainer judges after generating), unless ``sync_overlap_reward``.
* **Batches.** Group ``g`` of version ``v`` has deadline ``v + eta + 1``: update ``k`` (which
  trains policy version ``k - 1``) may use it only if ``k <= v + eta + 1``. Batch ``k`` takes
  the ``batch_prompts`` finished groups with the earliest deadlines (then earliest arrival).
  Admission alone does not bound staleness when groups finish out of order (a long group can
  be overtaken by many later ones), so the batcher also waits while taking these groups
  would leave, for some update ``d >= k``, more unconsumed started groups of deadline
  ``<= d`` than updates ``k+1..d`` can hold. Groups yet to start need no check: admission
  gives prompt ``i`` a deadline above ``i / batch_prompts``, so with ``S`` started at most
  ``d * batch_prompts - S`` more can have a deadline ``<= d``, and with the ``S - k *
  batch_prompts`` started ones left they always fit. So staleness never exceeds eta, and no
  deadlock arises (the earliest-deadline batch of started groups always passes). A host job
  of ``host_overhead_s`` (batch assembly, Python work) runs once a batch is chosen; batch
  ``k + 1`` may be chosen as soon as update ``k`` starts, so its host job overlaps the
  update (in sync mode nothing is left to overlap).
* **Learner** (the other ``total_devices - actor_devices`` devices ``d_l``; all devices in
  sync mode): update ``k`` costs ``trained_tokens * learner_token_s / d_l +
  learner_overhead_s`` with trained tokens = prompt plus response tokens of the batch, then
  the weights are sent (``weight_sync_s``, the learner waits). The actor takes the new
  version at its next decode-step boundary; requests in flight continue under it (partial
  rollouts). Sync mode is the same machinery with eta = 0 and every phase on all devices,
  which serialises generate, reward, host work, update and weight sync.
* **Shared host cores** (``host_cores``; None means no contention, the accelerator case).
  CPU-bound phases that overlap share the cores by processor sharing: with phases of core
  demands ``c_i`` running at once, every one runs at speed ``min(1, host_cores / sum c_i)``
  (the same slowdown for all). Demands: a decode or prefill ``actor_cpu_demand``, an update
  ``learner_cpu_demand`` (both default to all the cores: XLA's CPU backend uses every core),
  a host job ``host_cpu_demand``, a reward run ``reward_cpu_demand``. A timed-out run is a
  wall-clock deadline: it takes its cores but lasts ``reward_timeout_s`` whatever the speed.
  Weight transfers take no cores. With ``virtual_devices`` (JAX's CPU devices are slices of
  the same cores) device counts do not divide the decode, prefill and learner costs.

Total time ends when the last update's weights have been sent. Not modelled: attention cost
growing with context (fold it into ``decode_token_s`` at a typical context), the engine's
multi-token decode calls (a slot that finishes mid-call idles to its end), preemption when KV
blocks run out, and groups dropped by dynamic sampling.

Checking against a measurement on a small machine:

1. Run the synchronous trainer or benchmark for a few steps with known response lengths;
   turn each step's phase seconds into a ``PhaseTiming`` (its docstring maps rlpt's
   ``time/*`` metrics).
2. Describe that run in a sync ``TimelineConfig``: on a 2-core host with 8 JAX CPU devices,
   ``total_devices=8, virtual_devices=True, host_cores=2``, the engine's slots, the
   sandbox workers; ``calibrate(cfg, timings)`` fits the costs.
3. Measure ``weight_sync_s`` and set it, then ``predict_speedup(dataclasses.replace(fit,
   actor_devices=A), etas)`` with the async run's split ``A``, and compare with the
   measured speedup (same samples, same lengths).

``example_pod_config`` gives a documented pod-scale configuration; ``python -m
rlpt.asyncrl.simulator`` prints its predicted speedups at 8, 64 and 256 devices.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.optimize import nnls

MODES = ("sync", "async")


def _check(ok: bool, field: str, must: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{field} must {must}, got {value!r}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class TimelineConfig:
    """One run to simulate: its sizes, lengths, cost constants and mode.

    Times are seconds. ``decode_token_s``, ``prefill_token_s`` and ``learner_token_s`` are
    device-seconds per token (divided by the role's device count). Invalid values raise a
    ValueError naming the field.
    """

    total_devices: int
    actor_devices: int
    batch_prompts: int
    group_size: int
    num_steps: int
    max_staleness: int = 1
    mode: str = "async"
    # Lengths: explicit (one per sample, num_steps * batch_prompts * group_size), or
    # log-normal with median and sigma (or p99, the 99th percentile), rounded, in [1, cap].
    prompt_tokens: int = 0
    response_lengths: tuple[int, ...] | None = None
    length_median: float = 512.0
    length_sigma: float | None = None
    length_p99: float | None = None
    length_cap: int = 4096
    seed: int = 0
    # Rewards
    reward_base_s: float = 0.0
    reward_per_token_s: float = 0.0
    reward_timeout_prob: float = 0.0
    reward_timeout_s: float = 0.0
    sandbox_workers: int | None = None
    # Decode and prefill
    decode_step_s: float = 0.0
    decode_token_s: float = 0.0
    max_slots_per_device: int = 64
    prefill_token_s: float = 0.0
    # Learner, weights, host work
    learner_token_s: float = 0.0
    learner_overhead_s: float = 0.0
    weight_sync_s: float = 0.0
    host_overhead_s: float = 0.0
    # Shared host cores
    host_cores: float | None = None
    actor_cpu_demand: float | None = None
    learner_cpu_demand: float | None = None
    host_cpu_demand: float = 1.0
    reward_cpu_demand: float = 1.0
    virtual_devices: bool = False
    sync_overlap_reward: bool = False

    def __post_init__(self) -> None:
        for name in (
            "total_devices",
            "batch_prompts",
            "group_size",
            "num_steps",
            "max_slots_per_device",
            "length_cap",
        ):
            v = getattr(self, name)
            _check(_is_int(v) and v >= 1, name, "be an integer >= 1", v)
        _check(self.mode in MODES, "mode", f"be one of {MODES}", self.mode)
        v = self.actor_devices
        if self.mode == "async":
            _check(
                _is_int(v) and 1 <= v < self.total_devices,
                "actor_devices",
                f"be an integer in [1, total_devices - 1] = [1, {self.total_devices - 1}] "
                "in async mode (the rest are learner devices)",
                v,
            )
        else:
            _check(
                _is_int(v) and 1 <= v <= self.total_devices,
                "actor_devices",
                f"be an integer in [1, total_devices] = [1, {self.total_devices}]",
                v,
            )
        for name in ("max_staleness", "prompt_tokens", "seed"):
            v = getattr(self, name)
            _check(_is_int(v) and v >= 0, name, "be an integer >= 0", v)
        for name in (
            "reward_base_s",
            "reward_per_token_s",
            "reward_timeout_s",
            "decode_step_s",
            "decode_token_s",
            "prefill_token_s",
            "learner_token_s",
            "learner_overhead_s",
            "weight_sync_s",
            "host_overhead_s",
        ):
            v = getattr(self, name)
            _check(_is_num(v) and math.isfinite(v) and v >= 0, name, "be a finite number >= 0", v)
        p = self.reward_timeout_prob
        _check(_is_num(p) and 0 <= p <= 1, "reward_timeout_prob", "be in [0, 1]", p)
        if p > 0:
            _check(
                self.reward_timeout_s > 0,
                "reward_timeout_s",
                "be > 0 when reward_timeout_prob > 0",
                self.reward_timeout_s,
            )
        w = self.sandbox_workers
        _check(
            w is None or (_is_int(w) and w >= 1),
            "sandbox_workers",
            "be None (unbounded) or an integer >= 1",
            w,
        )
        c = self.host_cores
        _check(
            c is None or (_is_num(c) and math.isfinite(c) and c > 0),
            "host_cores",
            "be None (no contention) or a number > 0",
            c,
        )
        for name in ("actor_cpu_demand", "learner_cpu_demand"):
            v = getattr(self, name)
            _check(
                v is None or (_is_num(v) and math.isfinite(v) and v > 0),
                name,
                "be None (all host cores) or a number > 0",
                v,
            )
        for name in ("host_cpu_demand", "reward_cpu_demand"):
            v = getattr(self, name)
            _check(_is_num(v) and math.isfinite(v) and v > 0, name, "be a number > 0", v)
        for name in ("virtual_devices", "sync_overlap_reward"):
            v = getattr(self, name)
            _check(isinstance(v, bool), name, "be a bool", v)
        n = self.num_samples
        if self.response_lengths is not None:
            arr = np.asarray(self.response_lengths)
            _check(
                arr.ndim == 1 and arr.size == n,
                "response_lengths",
                f"hold one length per sample (num_steps * batch_prompts * group_size = {n})",
                f"shape {arr.shape}",
            )
            ok = arr.size == 0 or (np.all(np.mod(arr, 1) == 0) and arr.min() >= 1)
            _check(
                bool(ok), "response_lengths", "hold integers >= 1", arr.min() if arr.size else arr
            )
            object.__setattr__(self, "response_lengths", tuple(int(x) for x in arr))
        else:
            m = self.length_median
            _check(_is_num(m) and math.isfinite(m) and m > 0, "length_median", "be a number > 0", m)
            _check(
                self.length_sigma is None or self.length_p99 is None,
                "length_p99",
                "be None when length_sigma is given (give one of them)",
                self.length_p99,
            )
            s = self.length_sigma
            _check(
                s is None or (_is_num(s) and math.isfinite(s) and s >= 0),
                "length_sigma",
                "be a number >= 0",
                s,
            )
            q = self.length_p99
            _check(
                q is None or (_is_num(q) and math.isfinite(q) and q > m),
                "length_p99",
                f"be a number above length_median ({m})",
                q,
            )

    @property
    def num_samples(self) -> int:
        return self.num_steps * self.batch_prompts * self.group_size

    def lengths(self) -> np.ndarray:
        """Response lengths, one per sample, int64 [num_samples]."""
        if self.response_lengths is not None:
            return np.asarray(self.response_lengths, np.int64)
        sigma = self.length_sigma or 0.0
        if self.length_p99 is not None:
            sigma = math.log(
                self.length_p99 / self.length_median
            ) / statistics.NormalDist().inv_cdf(0.99)
        z = np.random.default_rng(_seeds(self.seed)[0]).standard_normal(self.num_samples)
        x = np.rint(self.length_median * np.exp(sigma * z))
        return np.clip(x, 1, self.length_cap).astype(np.int64)

    def timed_out(self) -> np.ndarray:
        """Which samples' reward runs time out, bool [num_samples]."""
        u = np.random.default_rng(_seeds(self.seed)[1]).random(self.num_samples)
        return u < self.reward_timeout_prob

    def reward_seconds(self, lengths: np.ndarray | None = None) -> np.ndarray:
        """Each sample's reward latency at full speed, float64 [num_samples]."""
        lengths = self.lengths() if lengths is None else lengths
        lat = self.reward_base_s + self.reward_per_token_s * lengths.astype(np.float64)
        if self.reward_timeout_s > 0:
            lat = np.minimum(lat, self.reward_timeout_s)
        return np.where(self.timed_out(), self.reward_timeout_s, lat)


def _seeds(seed: int) -> list[np.random.SeedSequence]:
    # Separate streams, so explicit lengths leave the timeout draws unchanged.
    return np.random.SeedSequence(seed).spawn(2)


@dataclasses.dataclass(frozen=True, eq=False)
class TimelineResult:
    """What ``simulate`` predicts. Per-step arrays are [num_steps]; update ``k`` is index
    ``k - 1``. Per-group arrays are [num_steps * batch_prompts], in prompt order."""

    mode: str
    max_staleness: int
    actor_devices: int
    learner_devices: int
    total_s: float
    samples: int
    samples_per_s: float
    response_tokens_per_s: float
    update_start_s: np.ndarray
    update_end_s: np.ndarray
    step_end_s: np.ndarray  # the update's weights sent
    learner_idle_s: np.ndarray  # from the previous step's end to this update's start
    actor_idle_s: np.ndarray  # actor idle time between the previous step's end and this one's
    actor_idle_total_s: float
    staleness_hist: np.ndarray  # consumed samples per staleness 0..max_staleness
    group_version: np.ndarray  # policy version each group was started under
    group_batch: np.ndarray  # the update (1-based) that consumed each group
    group_ready_s: np.ndarray  # when each group's last reward arrived
    partial_fraction: float  # samples whose tokens span a weight update

    def summary(self) -> dict[str, Any]:
        """The headline figures as plain JSON-friendly values."""
        hist = self.staleness_hist
        return {
            "mode": self.mode,
            "max_staleness": self.max_staleness,
            "actor_devices": self.actor_devices,
            "learner_devices": self.learner_devices,
            "total_s": self.total_s,
            "samples_per_s": self.samples_per_s,
            "response_tokens_per_s": self.response_tokens_per_s,
            "learner_idle_s": float(self.learner_idle_s.sum()),
            "actor_idle_s": self.actor_idle_total_s,
            "mean_staleness": float((hist * np.arange(len(hist))).sum() / max(hist.sum(), 1)),
            "staleness_hist": [int(x) for x in hist],
            "partial_fraction": self.partial_fraction,
        }


class _Actor:
    """The actor's current item: a prefill or a chunk of decode steps."""

    __slots__ = ("kind", "seq", "v_start", "steps", "step_cost", "prompt")

    def __init__(self, kind, seq, v_start, steps=0, step_cost=0.0, prompt=-1):
        self.kind, self.seq, self.v_start = kind, seq, v_start
        self.steps, self.step_cost, self.prompt = steps, step_cost, prompt


class _Run:
    """One simulation. Times: ``t`` is wall time; ``V`` is the CPU clock, which advances at
    the common processor-sharing speed, so a CPU-bound activity of ``w`` seconds started at
    ``V0`` ends when ``V`` reaches ``V0 + w`` (one heap serves every such activity)."""

    def __init__(self, cfg: TimelineConfig):
        self.cfg = c = cfg
        sync = c.mode == "sync"
        self.sync = sync
        self.eta = 0 if sync else c.max_staleness
        self.B, self.G, self.K = c.batch_prompts, c.group_size, c.num_steps
        self.n_groups = self.B * self.K
        self.d_a = c.total_devices if sync else c.actor_devices
        self.d_l = c.total_devices if sync else c.total_devices - c.actor_devices
        cost_a = 1 if c.virtual_devices else self.d_a
        cost_l = 1 if c.virtual_devices else self.d_l
        self.slots = c.max_slots_per_device * self.d_a
        self.lengths = c.lengths()
        self.lat = c.reward_seconds(self.lengths)
        self.timed_out = c.timed_out()
        self.prefill_work = c.prompt_tokens * c.prefill_token_s / cost_a
        self.token_cost = c.decode_token_s / cost_a
        group_tokens = self.lengths.reshape(self.n_groups, self.G).sum(1) + self.G * (
            c.prompt_tokens
        )
        self.update_work = group_tokens * c.learner_token_s / cost_l
        self.hold_rewards = sync and not c.sync_overlap_reward
        self.cores = c.host_cores
        all_cores = c.host_cores or 1.0
        self.actor_demand = c.actor_cpu_demand or all_cores
        self.learner_demand = c.learner_cpu_demand or all_cores

        self.t = 0.0
        self.V = 0.0
        self.load = 0.0  # summed core demand of running CPU-bound activities
        self.cpu_heap: list[tuple[float, int, str, int]] = []
        self.wall_heap: list[tuple[float, int, str, int]] = []
        self.dead: set[int] = set()
        self.seq = itertools.count()

        # Actor
        self.v_a = 0  # version the actor generates with
        self.v_arrived = 0  # newest version sent to the actor
        self.started = 0
        self.waiting: deque[int] = deque()
        self.active: list[tuple[int, int]] = []  # heap of (finish step, sample)
        self.step_count = 0
        self.item: _Actor | None = None
        self.idle_since: float | None = 0.0
        self.idle_intervals: list[tuple[float, float]] = []
        self.group_version = np.full(self.n_groups, -1, np.int64)
        self.sample_end_version = np.full(self.n_groups * self.G, -1, np.int64)

        # Rewards
        self.held: list[int] = []
        self.reward_queue: deque[int] = deque()
        self.reward_running = 0
        self.worker_free: list[float] = []  # analytic path: when each worker frees
        self.group_left = np.full(self.n_groups, self.G, np.int64)
        self.group_end = np.zeros(self.n_groups)
        self.group_ready = np.full(self.n_groups, np.nan)

        # Pool and learner
        # Finished, unconsumed groups by version, in arrival order.
        self.pool: list[deque[int]] = [deque() for _ in range(self.K)]
        self.pool_size = 0
        self.pool_dirty = False
        self.deadline_count = np.zeros(self.K + self.eta + 2, np.int64)  # unconsumed, started
        self.group_batch = np.zeros(self.n_groups, np.int64)
        self.formed = 0
        self.host_busy = False
        self.ready: deque[int] = deque()  # batches whose host job is done
        self.updates_started = 0
        self.learner_busy = False
        self.learner_free_since = 0.0
        self.update_start = np.zeros(self.K)
        self.update_end = np.zeros(self.K)
        self.step_end = np.zeros(self.K)
        self.learner_idle = np.zeros(self.K)
        self.done = False

    # Clocks and activities

    def speed(self) -> float:
        if self.cores is None or self.load <= self.cores:
            return 1.0
        return self.cores / self.load

    def start_cpu(self, kind: str, work: float, demand: float, payload: int = -1) -> int:
        s = next(self.seq)
        heapq.heappush(self.cpu_heap, (self.V + work, s, kind, payload))
        if self.cores is not None:
            self.load += demand
        return s

    def start_timer(self, kind: str, duration: float, payload: int = -1) -> None:
        heapq.heappush(self.wall_heap, (self.t + duration, next(self.seq), kind, payload))

    def run(self) -> None:
        self.dispatch()
        while not self.done:
            while self.cpu_heap and self.cpu_heap[0][1] in self.dead:
                self.dead.discard(heapq.heappop(self.cpu_heap)[1])
            s = self.speed()
            if self.cpu_heap:
                v_end = self.cpu_heap[0][0]
                t_cpu = v_end if self.cores is None else self.t + max(0.0, v_end - self.V) / s
            else:
                t_cpu = math.inf
            t_wall = self.wall_heap[0][0] if self.wall_heap else math.inf
            if t_cpu == math.inf and t_wall == math.inf:
                raise RuntimeError(f"timeline stalled at t={self.t} (a bug in the model)")
            if t_wall <= t_cpu:
                _, _, kind, payload = heapq.heappop(self.wall_heap)
                self.V = t_wall if self.cores is None else self.V + (t_wall - self.t) * s
                self.t = t_wall
            else:
                v_end, _, kind, payload = heapq.heappop(self.cpu_heap)
                self.V, self.t = v_end, t_cpu
            getattr(self, f"on_{kind}")(payload)
            self.dispatch()

    def dispatch(self) -> None:
        if self.item is None:
            self.actor_next()
        if self.cores is not None:
            self.rewards_next()
        if self.pool_dirty:
            self.form_batch()
        self.learner_next()

    # Actor

    def can_start(self) -> bool:
        return self.started < min(self.n_groups, (self.v_a + self.eta + 1) * self.B)

    def actor_next(self) -> None:
        if self.v_arrived > self.v_a:
            self.v_a = self.v_arrived
        while self.waiting and len(self.active) < self.slots:
            i = self.waiting.popleft()
            heapq.heappush(self.active, (self.step_count + int(self.lengths[i]), i))
        if len(self.active) < self.slots and self.can_start():
            g = self.started
            self.started += 1
            self.group_version[g] = self.v_a
            self.deadline_count[self.v_a + self.eta + 1] += 1
            seq = self.start_cpu("actor", self.prefill_work, self.actor_demand)
            self.set_item(_Actor("prefill", seq, self.V, prompt=g))
        elif self.active:
            n = len(self.active)
            steps = self.active[0][0] - self.step_count
            cost = self.cfg.decode_step_s + n * self.token_cost
            seq = self.start_cpu("actor", steps * cost, self.actor_demand)
            self.set_item(_Actor("decode", seq, self.V, steps=steps, step_cost=cost))
        else:
            self.set_item(None)
            if self.held:
                held, self.held = self.held, []
                for i in held:
                    self.submit_reward(i)

    def set_item(self, item: _Actor | None) -> None:
        if item is not None and self.idle_since is not None:
            self.idle_intervals.append((self.idle_since, self.t))
            self.idle_since = None
        elif item is None and self.idle_since is None:
            self.idle_since = self.t
        self.item = item

    def on_actor(self, _: int) -> None:
        item = self.item
        if self.cores is not None:
            self.load -= self.actor_demand
        self.item = None
        if item.kind == "prefill":
            g = item.prompt
            self.waiting.extend(range(g * self.G, (g + 1) * self.G))
            return
        self.step_count += item.steps
        while self.active and self.active[0][0] <= self.step_count:
            _, i = heapq.heappop(self.active)
            self.sample_end_version[i] = self.v_a
            if self.hold_rewards:
                self.held.append(i)
            else:
                self.submit_reward(i)

    def cut_decode(self) -> None:
        """New weights arrived: end the current decode chunk at its next step boundary."""
        item = self.item
        if item is None or item.kind != "decode" or item.step_cost <= 0 or item.steps <= 1:
            return
        done = (self.V - item.v_start) / item.step_cost
        j = math.floor(done + 1e-9)
        new = j if (j >= 1 and abs(done - j) <= 1e-9) else j + 1
        if new >= item.steps:
            return
        self.dead.add(item.seq)
        item.steps = new
        item.seq = next(self.seq)
        heapq.heappush(self.cpu_heap, (item.v_start + new * item.step_cost, item.seq, "actor", -1))

    # Rewards

    def submit_reward(self, i: int) -> None:
        if self.cores is not None:
            self.reward_queue.append(i)
            return
        # Without contention a FIFO queue over W workers is solved on arrival: arrivals come
        # in time order, and each run takes the worker that frees first.
        start = self.t
        w = self.cfg.sandbox_workers
        if w is not None:
            if len(self.worker_free) < w:
                heapq.heappush(self.worker_free, self.t + self.lat[i])
            else:
                start = max(self.t, heapq.heappop(self.worker_free))
                heapq.heappush(self.worker_free, start + self.lat[i])
        g = i // self.G
        self.group_end[g] = max(self.group_end[g], start + self.lat[i])
        self.group_left[g] -= 1
        if self.group_left[g] == 0:
            heapq.heappush(self.wall_heap, (self.group_end[g], next(self.seq), "group", g))

    def rewards_next(self) -> None:
        w = self.cfg.sandbox_workers
        while self.reward_queue and (w is None or self.reward_running < w):
            i = self.reward_queue.popleft()
            self.reward_running += 1
            self.load += self.cfg.reward_cpu_demand
            if self.timed_out[i]:
                self.start_timer("reward_timer", self.lat[i], i)
            else:
                self.start_cpu("reward", self.lat[i], 0.0, i)

    def on_reward(self, i: int) -> None:
        self.reward_running -= 1
        self.load -= self.cfg.reward_cpu_demand
        g = i // self.G
        self.group_left[g] -= 1
        if self.group_left[g] == 0:
            self.on_group(g)

    on_reward_timer = on_reward

    def on_group(self, g: int) -> None:
        self.group_ready[g] = self.t
        self.pool[self.group_version[g]].append(g)
        self.pool_size += 1
        self.pool_dirty = True

    # Batches and learner

    def form_batch(self) -> None:
        self.pool_dirty = False
        j = self.formed + 1
        if j > self.K or self.host_busy or j > self.updates_started + 1 or self.pool_size < self.B:
            return
        eta, B = self.eta, self.B
        # The B finished groups of earliest deadline (oldest version), in arrival order.
        take = np.zeros_like(self.deadline_count)
        need = B
        for v, bucket in enumerate(self.pool):
            n = min(need, len(bucket))
            take[v + eta + 1] = n
            need -= n
            if need == 0:
                break
        counts = self.deadline_count - take
        # Started groups that must be consumed by update d must fit in updates j+1..d.
        d = np.arange(j, self.K + 1)
        if np.any(np.cumsum(counts)[d] > (d - j) * B):
            return
        self.deadline_count = counts
        chosen = [
            self.pool[v].popleft() for v in range(len(self.pool)) for _ in range(take[v + eta + 1])
        ]
        self.pool_size -= B
        self.group_batch[chosen] = j
        self.formed = j
        self.host_busy = True
        self.start_cpu("host", self.cfg.host_overhead_s, self.cfg.host_cpu_demand, j)

    def on_host(self, j: int) -> None:
        if self.cores is not None:
            self.load -= self.cfg.host_cpu_demand
        self.host_busy = False
        self.ready.append(j)
        self.pool_dirty = True

    def learner_next(self) -> None:
        if self.learner_busy or not self.ready:
            return
        j = self.ready.popleft()
        self.learner_busy = True
        self.updates_started = j
        self.update_start[j - 1] = self.t
        self.learner_idle[j - 1] = self.t - self.learner_free_since
        groups = np.flatnonzero(self.group_batch == j)
        work = float(self.update_work[groups].sum()) + self.cfg.learner_overhead_s
        self.start_cpu("update", work, self.learner_demand, j)
        self.pool_dirty = True
        if not self.host_busy:
            self.form_batch()

    def on_update(self, j: int) -> None:
        if self.cores is not None:
            self.load -= self.learner_demand
        self.update_end[j - 1] = self.t
        self.start_timer("sync", self.cfg.weight_sync_s, j)

    def on_sync(self, j: int) -> None:
        self.step_end[j - 1] = self.t
        self.learner_busy = False
        self.learner_free_since = self.t
        self.v_arrived = j
        if j == self.K:
            self.done = True
            return
        self.cut_decode()

    def result(self) -> TimelineResult:
        total = self.t
        if self.idle_since is not None:
            self.idle_intervals.append((self.idle_since, total))
        edges = np.concatenate([[0.0], self.step_end])
        idle = np.zeros(self.K)
        for a, b in self.idle_intervals:
            lo, hi = np.maximum(edges[:-1], a), np.minimum(edges[1:], b)
            idle += np.maximum(hi - lo, 0.0)
        staleness = (self.group_batch - 1) - self.group_version
        hist = np.bincount(staleness, minlength=self.eta + 1) * self.G
        versions = np.repeat(self.group_version, self.G)
        n = self.n_groups * self.G
        return TimelineResult(
            mode=self.cfg.mode,
            max_staleness=self.eta,
            actor_devices=self.d_a,
            learner_devices=self.d_l,
            total_s=float(total),
            samples=n,
            samples_per_s=n / total if total > 0 else math.inf,
            response_tokens_per_s=float(self.lengths.sum() / total) if total > 0 else math.inf,
            update_start_s=self.update_start,
            update_end_s=self.update_end,
            step_end_s=self.step_end,
            learner_idle_s=self.learner_idle,
            actor_idle_s=idle,
            actor_idle_total_s=float(sum(b - a for a, b in self.idle_intervals)),
            staleness_hist=hist,
            group_version=self.group_version,
            group_batch=self.group_batch,
            group_ready_s=self.group_ready,
            partial_fraction=float(np.mean(self.sample_end_version > versions)),
        )


def simulate(cfg: TimelineConfig) -> TimelineResult:
    """Runs the timeline of ``cfg`` (its ``mode``) to the last update; deterministic."""
    run = _Run(cfg)
    run.run()
    return run.result()


def _async_at(cfg: TimelineConfig, eta: int, actor_devices: int) -> TimelineResult:
    return simulate(
        dataclasses.replace(cfg, mode="async", max_staleness=eta, actor_devices=actor_devices)
    )


def _best_split(cfg: TimelineConfig, eta: int) -> TimelineResult:
    """The actor device count with the least total time: a coarse grid over the splits, then
    every split between the best point's grid neighbours (refined again while that is wide).
    Time against split is close to unimodal (the slower of two roles that trade devices)."""
    n = cfg.total_devices
    seen: dict[int, TimelineResult] = {}

    def best_of(splits) -> int:
        for a in splits:
            if a not in seen:
                seen[a] = _async_at(cfg, eta, a)
        return min(seen, key=lambda a: (seen[a].total_s, a))

    lo, hi = 1, n - 1
    while True:
        if hi - lo <= 16:
            return seen[best_of(range(lo, hi + 1))]
        grid = sorted({int(round(x)) for x in np.linspace(lo, hi, 9)})
        a = best_of(grid)
        i = grid.index(a)
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]


def predict_speedup(
    cfg: TimelineConfig, etas: Sequence[int] = (1, 2, 4), *, best_split: bool = False
) -> dict[str, Any]:
    """Async at each eta against sync on the same total devices and the same samples.

    Async uses ``cfg.actor_devices`` actor devices, or with ``best_split`` the split with
    the least time (searched per eta). Returns ``{"sync": summary, "async": {eta: summary},
    "speedup_vs_sync": {eta: sync total_s / async total_s}}``, etas as strings.
    """
    _check(
        cfg.total_devices >= 2,
        "total_devices",
        "be >= 2 to split actor and learner",
        cfg.total_devices,
    )
    for eta in etas:
        _check(_is_int(eta) and eta >= 0, "etas", "hold integers >= 0", tuple(etas))
    sync = simulate(dataclasses.replace(cfg, mode="sync"))
    out: dict[str, Any] = {"sync": sync.summary(), "async": {}, "speedup_vs_sync": {}}
    for eta in etas:
        res = _best_split(cfg, eta) if best_split else _async_at(cfg, eta, cfg.actor_devices)
        out["async"][str(eta)] = res.summary()
        out["speedup_vs_sync"][str(eta)] = sync.total_s / res.total_s
    return out


def example_pod_config(total_devices: int, **overrides: Any) -> TimelineConfig:
    """A plausible pod-scale run, for predictions; every figure is an estimate, not a
    measurement.

    An 8B dense model with grouped-query attention (Llama-3-8B shapes: 16 GB of bf16
    weights, 128 KB of KV per token) on H100-class devices (989 TFLOP/s bf16, 3.35 TB/s),
    each actor device a full replica:

    * decode step: 12 ms fixed (reading the weights, launches: the latency an inference
      server shows at small batch) plus 0.1 ms per active sequence (its KV at about 2k
      context, about 256 MB, read at memory bandwidth, and 16 GFLOP of matmuls);
    * prefill: 16 GFLOP per prompt token at 40% of peak, 4e-5 s;
    * learner: about 64 GFLOP per trained token (forward and backward, plus the forward
      passes for old and reference log-probabilities) at 40% of peak, 1.6e-4 s; 2 s per
      update of fixed work; 3 s to send 16 GB of weights to the actors; 1 s of host work
      per batch;
    * work: 16 steps of 8 prompts per device (weak scaling), 8 samples each, 512 prompt
      tokens, responses log-normal with median 1024 and p99 6144 tokens, capped at 8192;
      64 slots per actor device;
    * rewards: program runs in sandboxes, 8 workers per device, 0.3 s each, 3% time out
      at 5 s;
    * half the devices generate, half train (about where the roles balance).

    ``overrides`` replace any field.
    """
    _check(_is_int(total_devices) and total_devices >= 2, "total_devices", "be >= 2", total_devices)
    fields: dict[str, Any] = dict(
        total_devices=total_devices,
        actor_devices=total_devices // 2,
        batch_prompts=8 * total_devices,
        group_size=8,
        num_steps=16,
        max_staleness=2,
        prompt_tokens=512,
        length_median=1024.0,
        length_p99=6144.0,
        length_cap=8192,
        reward_base_s=0.3,
        reward_timeout_prob=0.03,
        reward_timeout_s=5.0,
        sandbox_workers=8 * total_devices,
        decode_step_s=0.012,
        decode_token_s=1e-4,
        max_slots_per_device=64,
        prefill_token_s=4e-5,
        learner_token_s=1.6e-4,
        learner_overhead_s=2.0,
        weight_sync_s=3.0,
        host_overhead_s=1.0,
    )
    fields.update(overrides)
    return TimelineConfig(**fields)


@dataclasses.dataclass(frozen=True)
class PhaseTiming:
    """One measured step of a synchronous run, for ``calibrate``.

    From rlpt's sync trainer (``metrics.jsonl``): ``generate_s`` is ``time/generate_s``,
    ``reward_s`` is ``time/verify_s``, ``update_s`` is ``time/score_s + time/update_s`` and
    ``host_s`` what ``time/step_s`` holds beyond those. ``response_lengths`` are the step's
    lengths in sample order (prompt by prompt). ``reward_sample_s`` (each sandbox run's
    ``duration_s``) and ``reward_timed_out`` (its status was a timeout), where given, fit the
    reward constants directly.
    """

    response_lengths: tuple[int, ...]
    generate_s: float
    update_s: float
    reward_s: float = 0.0
    host_s: float = 0.0
    reward_sample_s: tuple[float, ...] | None = None
    reward_timed_out: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.response_lengths)
        _check(
            n >= 1 and all(_is_int(x) and x >= 1 for x in self.response_lengths),
            "response_lengths",
            "be a non-empty sequence of integers >= 1",
            self.response_lengths,
        )
        for name in ("generate_s", "update_s", "reward_s", "host_s"):
            v = getattr(self, name)
            _check(_is_num(v) and math.isfinite(v) and v >= 0, name, "be a finite number >= 0", v)
        for name in ("reward_sample_s", "reward_timed_out"):
            v = getattr(self, name)
            _check(v is None or len(v) == n, name, f"be None or hold one value per sample ({n})", v)


def _list_schedule(durations: np.ndarray, machines: int) -> tuple[np.ndarray, np.ndarray]:
    """FIFO list scheduling, all jobs released at 0: each job in order takes the machine
    that frees first (the lowest index among ties). Returns (each job's end, its machine)."""
    free = [(0.0, m) for m in range(min(machines, len(durations)))]
    end = np.zeros(len(durations))
    machine = np.zeros(len(durations), np.int64)
    for i, d in enumerate(durations):
        t, m = heapq.heappop(free)
        end[i], machine[i] = t + d, m
        heapq.heappush(free, (end[i], m))
    return end, machine


def _critical_runs(lengths: np.ndarray, base: float, per_token: float, workers: int) -> np.ndarray:
    """Which runs lie on the worker that finishes last, under FIFO scheduling."""
    end, machine = _list_schedule(base + per_token * lengths.astype(np.float64), workers)
    return machine == machine[int(np.argmax(end))]


def calibrate(cfg: TimelineConfig, steps: Sequence[PhaseTiming]) -> TimelineConfig:
    """Fits the cost constants to measured synchronous steps; returns ``cfg`` with them.

    ``cfg`` describes the measured run's layout (``total_devices``, ``batch_prompts``,
    ``group_size``, ``prompt_tokens``, ``max_slots_per_device``, ``sandbox_workers``,
    ``virtual_devices``, ``host_cores``); each phase ran alone on all devices. With ``d`` the
    device count the costs divide by (1 with ``virtual_devices``), non-negative least squares
    (``scipy.optimize.nnls``) over the steps fits:

    * ``generate_s = decode_step_s * n_steps + decode_token_s * tokens / d +
      prefill_token_s * prompt_tokens * batch_prompts / d``, where ``n_steps`` is the step's
      number of decode steps under continuous batching (FIFO over the slots, computed from
      its lengths) and ``tokens`` the sum of its lengths;
    * ``update_s = learner_token_s * trained_tokens / d + learner_overhead_s``;
    * ``host_overhead_s`` = mean ``host_s``;
    * rewards: with per-sample durations, ``duration = reward_base_s + reward_per_token_s *
      length`` over the runs that did not time out, and ``reward_timeout_prob`` = the share
      that did; without them, each step's ``reward_s`` as the FIFO makespan over
      ``sandbox_workers`` (timeouts ignored): the last-finishing worker's runs ``J`` give
      ``|J| * reward_base_s + reward_per_token_s * sum_J length``, refitted until ``J`` stops
      changing. With ``host_cores``, reward times are first scaled by the slowdown of the
      workers sharing the cores (``min(1, host_cores / (workers * reward_cpu_demand))``; the
      phase's tail, with fewer runs left, is slowed less than this).

    The constants are identifiable only when the regressors vary: steps whose lengths
    differ (a long tail gives different ``n_steps`` and ``tokens``) separate the per-step
    from the per-token decode cost; with a fixed prompt count the prefill term is the decode
    fit's intercept. A constant that the data cannot tell apart from another may come out 0.
    """
    _check(len(steps) >= 1, "steps", "hold at least one PhaseTiming", steps)
    c = cfg
    n = c.batch_prompts * c.group_size
    for k, st in enumerate(steps):
        _check(
            len(st.response_lengths) == n,
            f"steps[{k}].response_lengths",
            f"hold batch_prompts * group_size = {n} lengths",
            len(st.response_lengths),
        )
    d = 1 if c.virtual_devices else c.total_devices
    slots = c.max_slots_per_device * c.total_devices
    lengths = [np.asarray(st.response_lengths, np.int64) for st in steps]

    # Decode and prefill.
    cols = [
        [float(_list_schedule(x.astype(np.float64), slots)[0].max()) for x in lengths],
        [float(x.sum()) / d for x in lengths],
    ]
    if c.prompt_tokens > 0:
        cols.append([c.prompt_tokens * c.batch_prompts / d] * len(steps))
    coef, _ = nnls(np.array(cols).T, np.array([st.generate_s for st in steps]))
    fitted: dict[str, Any] = dict(decode_step_s=float(coef[0]), decode_token_s=float(coef[1]))
    fitted["prefill_token_s"] = float(coef[2]) if c.prompt_tokens > 0 else c.prefill_token_s

    # Learner.
    trained = [float(x.sum() + n * c.prompt_tokens) / d for x in lengths]
    coef, _ = nnls(np.array([trained, [1.0] * len(steps)]).T, np.array([s.update_s for s in steps]))
    fitted.update(learner_token_s=float(coef[0]), learner_overhead_s=float(coef[1]))
    fitted["host_overhead_s"] = float(np.mean([s.host_s for s in steps]))

    # Rewards.
    workers = min(c.sandbox_workers or n, n)
    slow = 1.0
    if c.host_cores is not None:
        slow = min(1.0, c.host_cores / (workers * c.reward_cpu_demand))
    if all(s.reward_sample_s is not None for s in steps):
        dur = np.concatenate([np.asarray(s.reward_sample_s, np.float64) for s in steps])
        out = np.zeros(len(dur), bool)
        if all(s.reward_timed_out is not None for s in steps):
            out = np.concatenate([np.asarray(s.reward_timed_out, bool) for s in steps])
            fitted["reward_timeout_prob"] = float(out.mean())
        ok = ~out
        if ok.any():
            x = np.concatenate(lengths)[ok].astype(np.float64)
            coef, _ = nnls(np.stack([np.ones_like(x), x], 1), dur[ok] * slow)
            fitted.update(reward_base_s=float(coef[0]), reward_per_token_s=float(coef[1]))
    else:
        # The measured run judged samples in finishing order; under FIFO slots that is the
        # order of their end steps (then sample order).
        orders = [
            np.argsort(_list_schedule(x.astype(np.float64), slots)[0], kind="stable")
            for x in lengths
        ]
        target = np.array([s.reward_s for s in steps]) * slow
        base, per_token, chains = 1.0, 0.0, None
        for _ in range(50):
            crit = [
                _critical_runs(x[o], base, per_token, workers)
                for x, o in zip(lengths, orders, strict=True)
            ]
            key = [tuple(np.flatnonzero(m)) for m in crit]
            if key == chains:
                break
            chains = key
            rows = [
                [float(m.sum()), float(x[o][m].sum())]
                for x, o, m in zip(lengths, orders, crit, strict=True)
            ]
            (base, per_token), _ = nnls(np.array(rows), target)
            if base == 0 and per_token == 0:
                break
        fitted.update(reward_base_s=float(base), reward_per_token_s=float(per_token))
    return dataclasses.replace(cfg, **fitted)


def main() -> None:
    """Prints the predicted speedups of ``example_pod_config`` at 8, 64 and 256 devices, each
    at its best split, as one JSON object on the last line (a few minutes on one core)."""
    out = {}
    for n in (8, 64, 256):
        pred = predict_speedup(example_pod_config(n), etas=(1, 2, 4), best_split=True)
        out[str(n)] = {
            "speedup_vs_sync": pred["speedup_vs_sync"],
            "actor_devices": {e: a["actor_devices"] for e, a in pred["async"].items()},
            "sync_samples_per_s": pred["sync"]["samples_per_s"],
            "async_samples_per_s": {e: a["samples_per_s"] for e, a in pred["async"].items()},
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
