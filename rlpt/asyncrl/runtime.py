"""Actors and a learner around an experience pool: generation, rewards and updates overlap.

One actor thread drives the rollout engine: it admits prompts, steps the engine, and
hands each finished group (a prompt's G samples) to a pool of reward threads, which
judge it while decoding goes on (sandboxed programs run in their own processes, so
the waits overlap) and push the scored group into the ``ExperiencePool``. The learner
(the caller's thread) draws batches from the pool, updates, and publishes new weights
with a version number; the actor swaps them in between engine steps, and requests in
flight continue under the new weights (``in_flight="continue"``, partial rollouts: each
token carries the version that sampled it) or start again (``"requeue"``).

Staleness is bounded by admission, never by discarding (AReaL's rule, Fu et al. 2025,
arXiv:2505.24298): prompt number ``s`` (0-based) may start only while
``s < (learner_version + eta + 1) * batch_groups``, and the pool draws every group
before it would exceed ``eta`` versions. ``eta = 0`` admits a batch only after the
weights that will train on it are published, so every token of it comes from those
weights: the synchronous algorithm, step for step.

Dynamic sampling (DAPO; ``filter_groups``): a judged group whose rewards do not vary carries
no gradient under a group-relative advantage; it is left out of the pool and frees its
admission slot, so another prompt starts in its place (the rule counts prompts that are
trained or in flight). Nothing is discarded unseen: the caller takes the filtered groups
(``take_filtered``) for its curriculum statistics. Against an endless search when every
group is uniform, only the first ``(filter_max_rounds - 1) * batch_groups`` prompts
admitted at each engine version may be filtered; later ones are kept whatever their
rewards. Which prompt may be filtered depends only on its place in the prompt stream, so
``eta = 0`` still reproduces the synchronous mode, which draws its batch in rounds by the
same rule.

``mode="sync"`` runs the same parts strictly in turn (generate the whole batch, then
judge it, then update): the synchronous baseline with identical prompts, seeds and
learner, so the two modes can be compared and checked against each other.

Checkpoint: ``state_dict()`` (taken between learner steps) holds the pool's groups,
the prompts in flight (started, not yet in the pool: regenerated on resume) and the
prompt source's position, so a killed and resumed run loses no prompt and sees none
twice.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from rlpt.asyncrl.pool import PRIORITIES, Draw, ExperiencePool, PoolItem, staleness_histogram
from rlpt.rl.advantages import group_varies
from rlpt.sampling.engine import Completion, Engine, Request, RequestParams

MODES = ("async", "sync")


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
    """The ``async`` section: staleness, batching and the pool."""

    max_staleness: int = 1  # eta: a batch's tokens are at most this many versions old
    batch_groups: int = 8  # groups (prompts) per learner batch
    group_size: int = 4  # samples per prompt
    # None: exactly batch_groups groups per batch. Otherwise at least batch_groups (the rate
    # the staleness rule admits them: fewer would let unconsumed groups pile up until more
    # fall due at once than a batch holds), then more while their tokens fit the budget,
    # at most max_batch_groups (None: no cap).
    token_budget: int | None = None
    max_batch_groups: int | None = None
    pool_capacity_tokens: int = 1 << 20
    priority: str = "uniform"
    alpha: float = 1.0
    beta: float = 1.0
    max_reuse: int = 1
    reward_threads: int = 4
    in_flight: str = "continue"  # on a weight update: "continue" or "requeue"
    mode: str = "async"
    # Dynamic sampling: groups whose rewards do not vary are left out (module doc).
    filter_groups: bool = False
    filter_max_rounds: int = 4

    def __post_init__(self):
        def at_least(name, value, low):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"async_rl.{name} must be an integer >= {low}, got {value!r}")

        at_least("max_staleness", self.max_staleness, 0)
        at_least("batch_groups", self.batch_groups, 1)
        at_least("group_size", self.group_size, 1)
        at_least("pool_capacity_tokens", self.pool_capacity_tokens, 1)
        at_least("max_reuse", self.max_reuse, 1)
        at_least("reward_threads", self.reward_threads, 1)
        at_least("filter_max_rounds", self.filter_max_rounds, 1)
        if self.token_budget is not None:
            at_least("token_budget", self.token_budget, 1)
        if self.max_batch_groups is not None:
            at_least("max_batch_groups", self.max_batch_groups, self.batch_groups)
        for name, value, allowed in (
            ("priority", self.priority, PRIORITIES),
            ("in_flight", self.in_flight, ("continue", "requeue")),
            ("mode", self.mode, MODES),
        ):
            if value not in allowed:
                raise ValueError(f"async_rl.{name} must be one of {allowed}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: ``key`` its position in the prompt stream (unique), ``tokens`` its ids,
    ``info`` whatever the reward function needs (a task, a domain)."""

    key: int
    tokens: tuple[int, ...]
    info: Any = None
    domain: int = 0
    max_tokens: int | None = None  # this prompt's generation budget (default: the run's)

    def to_json(self) -> dict:
        return {"key": self.key, "prompt": list(self.tokens), "info": self.info,
                "domain": self.domain, "max_tokens": self.max_tokens}  # fmt: skip

    @staticmethod
    def from_json(d: dict) -> Prompt:
        return Prompt(int(d["key"]), tuple(int(t) for t in d["prompt"]), d["info"],
                      int(d["domain"]), d.get("max_tokens"))  # fmt: skip


class PromptSource(Protocol):
    def next(self) -> Prompt: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@dataclasses.dataclass(frozen=True)
class GroupReward:
    """A judged group: ``rewards`` and ``success`` [G] in sample order; ``extra`` anything
    JSON-safe the learner needs besides (validity, loss weights, texts)."""

    rewards: np.ndarray
    success: np.ndarray
    extra: Any = None


RewardFn = Callable[[Prompt, Sequence[Completion]], GroupReward]


def rewards_vary(reward: GroupReward, valid=None) -> bool:
    """The test of dynamic sampling (``group_varies`` for one group): do the group's
    ``valid`` rewards (default: all) differ at all?"""
    rewards = np.asarray(reward.rewards)
    return bool(group_varies(rewards, np.zeros(rewards.shape, int), num_groups=1, valid=valid)[0])


@dataclasses.dataclass(frozen=True)
class Group:
    """A scored group as the learner gets it (a pool item's payload)."""

    prompt: Prompt
    tokens: list[np.ndarray]  # G x [n_i] the sampled ids
    logprobs: list[np.ndarray]  # G x [n_i] behaviour log-probs
    versions: list[np.ndarray]  # G x [n_i] the version that sampled each token
    finish: list[str]
    rewards: np.ndarray  # [G]
    success: np.ndarray  # [G]
    extra: Any = None  # the reward function's GroupReward.extra

    def to_json(self) -> dict:
        return {
            **self.prompt.to_json(),
            "tokens": [t.tolist() for t in self.tokens],
            "logprobs": [x.tolist() for x in self.logprobs],
            "versions": [v.tolist() for v in self.versions], "finish": list(self.finish),
            "rewards": self.rewards.tolist(), "success": self.success.tolist(),
            "extra": self.extra,
        }  # fmt: skip

    @staticmethod
    def from_json(d: dict) -> Group:
        return Group(
            prompt=Prompt.from_json(d),
            tokens=[np.asarray(t, np.int32) for t in d["tokens"]],
            logprobs=[np.asarray(x, np.float32) for x in d["logprobs"]],
            versions=[np.asarray(v, np.int32) for v in d["versions"]],
            finish=list(d["finish"]), rewards=np.asarray(d["rewards"], np.float32),
            success=np.asarray(d["success"], np.float32), extra=d.get("extra"),
        )  # fmt: skip


# The learner: (batch draw, learner version) -> (new actor weights, metrics).
LearnerFn = Callable[[Draw, int], tuple[Any, dict[str, Any]]]


def request_seed(seed: int, key: int) -> int:
    """A request's sampling seed from the run's seed and the prompt's key alone, so its
    tokens do not depend on when, or beside what, it was generated."""
    return int(np.random.SeedSequence([seed, key]).generate_state(1)[0] & 0x7FFFFFFF)


class AsyncRunner:
    """Generation, rewards and learning for ``num_steps`` learner steps (see module doc)."""

    def __init__(
        self,
        cfg: AsyncConfig,
        engine: Engine,
        prompts: PromptSource,
        reward_fn: RewardFn,
        learner: LearnerFn,
        sampling: RequestParams,
        *,
        seed: int = 0,
        version: int = 0,
        varies: Callable[[GroupReward], bool] = rewards_vary,
    ):
        """``varies``: with ``cfg.filter_groups``, whether a judged group is informative
        (default: its rewards differ); the others are filtered out."""
        self.cfg = cfg
        self.varies = varies
        self.engine = engine
        self.prompts = prompts
        self.reward_fn = reward_fn
        self.learner = learner
        self.sampling = dataclasses.replace(sampling, n=cfg.group_size)
        self.seed = seed
        self.version = version
        self.pool = ExperiencePool(
            cfg.pool_capacity_tokens, cfg.priority, cfg.alpha, cfg.beta, cfg.max_reuse, seed=seed
        )
        self.started = version * cfg.batch_groups  # prompts admitted so far
        self.filtered = 0  # of them, left out by dynamic sampling (the rule's s: the rest)
        # Dynamic sampling's bound: [engine version, prompts admitted at it].
        self._admitted_count = [version, 0]
        self._filterable: dict[int, bool] = {}  # key -> may be filtered, until judged
        self._filtered_groups: list[Group] = []  # filtered since the last take_filtered
        self._lock = threading.Condition()
        self._inflight: dict[int, Prompt] = {}  # key -> prompt, in the engine
        self._judging: dict[int, Prompt] = {}  # key -> prompt, with the reward threads
        self._admitted_at: dict[int, int] = {}  # key -> version at admission, until pooled
        self._requeue: list[Prompt] = []  # in flight at a checkpoint: regenerated first
        self._pending: list[PoolItem] = []  # judged, waiting for room in the pool
        self._weights: tuple[Any, int] | None = None  # published, not yet in the engine
        self._stop = False
        self._error: BaseException | None = None
        self._partial: dict[int, list[Completion]] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.decode_s = 0.0  # the actor's wall time in engine steps, all told

    def paused(self) -> threading.Condition:
        """``with runner.paused():`` the actor admits nothing and swaps no weights meanwhile
        (for host state it shares with the caller: the prompt loader, a checkpoint)."""
        return self._lock

    # -- checkpoint ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a resume needs besides the learner's own state (JSON-safe)."""
        with self._lock:
            inflight = list(self._inflight.values()) + list(self._judging.values())
            inflight += [i.payload.prompt for i in self._pending]
            return {
                "version": self.version,
                "started": self.started,
                "filtered": self.filtered,
                "admitted_count": list(self._admitted_count),
                "inflight": [
                    p.to_json() for p in sorted(inflight + self._requeue, key=lambda p: p.key)
                ],
                "pool": self.pool.state_dict(encode_payload=Group.to_json),
                "prompts": self.prompts.state_dict(),
            }

    def load_state_dict(self, state: dict, weights) -> None:
        """Resume from ``state_dict()``; ``weights`` are the actors' policy at that version
        (the restored learner's)."""
        self.version = int(state["version"])
        self.engine.update_weights(weights, self.version)
        self.started = int(state["started"])
        self.filtered = int(state.get("filtered", 0))
        self._admitted_count = [int(x) for x in state.get("admitted_count", [self.version, 0])]
        self._requeue = [Prompt.from_json(p) for p in state["inflight"]]
        self.pool.load_state_dict(state["pool"], decode_payload=Group.from_json)
        self.prompts.load_state_dict(state["prompts"])

    def take_filtered(self) -> list[Group]:
        """The groups dynamic sampling left out since the last call (for statistics)."""
        with self._lock:
            out, self._filtered_groups = self._filtered_groups, []
            return out

    def _count_admission(self, prompt: Prompt) -> None:
        """Dynamic sampling's bound: may this prompt, admitted now, be filtered?"""
        version = self.engine.version
        if self._admitted_count[0] != version:
            self._admitted_count = [version, 0]
        quota = (self.cfg.filter_max_rounds - 1) * self.cfg.batch_groups
        self._filterable[prompt.key] = self._admitted_count[1] < quota
        self._admitted_count[1] += 1

    def _filter_out(self, item: PoolItem) -> bool:
        """Whether dynamic sampling leaves the judged ``item`` out (and then records it)."""
        filterable = self._filterable.pop(item.key, False)
        group = item.payload
        if not (self.cfg.filter_groups and filterable):
            return False
        if self.varies(GroupReward(group.rewards, group.success, group.extra)):
            return False
        self.filtered += 1
        self._filtered_groups.append(group)
        return True

    # -- running -------------------------------------------------------------------------------

    def run(self, num_steps: int, on_step: Callable[[int, dict], Any] | None = None) -> list:
        """``num_steps`` learner steps; each step's metrics (also passed to ``on_step``, which
        ends the run early by returning True)."""
        metrics = []
        with concurrent.futures.ThreadPoolExecutor(self.cfg.reward_threads) as executor:
            self._executor = executor
            if self.cfg.mode == "sync":
                for _ in range(num_steps):
                    step_metrics, params = self._sync_step()
                    metrics.append(step_metrics)
                    stop = bool(on_step and on_step(self.version, step_metrics))
                    self.engine.update_weights(params, self.version)
                    if stop:
                        break
                return metrics
            self._stop = False
            actor = threading.Thread(target=self._actor_loop, name="rlpt-actor", daemon=True)
            actor.start()
            try:
                for _ in range(num_steps):
                    step_metrics, params = self._learner_step()
                    metrics.append(step_metrics)
                    # The caller's step (curriculum feedback, evaluation, a checkpoint) comes
                    # before the actor may see the new version, so prompts admitted for it
                    # are drawn after the feedback, as in the synchronous order.
                    stop = bool(on_step and on_step(self.version, step_metrics))
                    with self._lock:
                        self._weights = (params, self.version)
                        self._lock.notify_all()
                    if stop:
                        break
            finally:
                with self._lock:
                    self._stop = True
                    self._lock.notify_all()
                actor.join()
                self._drain_engine()
        return metrics

    def _drain_engine(self) -> None:
        """Stop the requests left in the engine; their prompts stay in flight (a checkpoint
        regenerates them), so nothing is lost when the run ends between steps."""
        for key in list(self._partial):
            self.engine.abort(key)
        while self.engine.has_work():
            self.engine.step()
        self._partial.clear()
        with self._lock:
            self._requeue = sorted(
                list(self._inflight.values()) + self._requeue, key=lambda p: p.key
            )
            self._inflight.clear()
            held = set(self._judging) | {i.key for i in self._pending}
            self._admitted_at = {k: v for k, v in self._admitted_at.items() if k in held}

    def _request(self, prompt: Prompt) -> Request:
        params = dataclasses.replace(
            self.sampling, seed=request_seed(self.seed, prompt.key),
            max_tokens=prompt.max_tokens or self.sampling.max_tokens,
        )  # fmt: skip
        return Request(prompt.key, list(prompt.tokens), params)

    def _judge(self, prompt: Prompt, completions: list[Completion]) -> PoolItem:
        completions = sorted(completions, key=lambda c: c.index)
        verdict = self.reward_fn(prompt, completions)
        group = Group(
            prompt=prompt, tokens=[c.tokens for c in completions],
            logprobs=[c.logprobs for c in completions],
            versions=[c.versions for c in completions],
            finish=[c.finish_reason for c in completions],
            rewards=np.asarray(verdict.rewards, np.float32),
            success=np.asarray(verdict.success, np.float32), extra=verdict.extra,
        )  # fmt: skip
        versions = np.concatenate([c.versions for c in completions] or [np.zeros(1, np.int32)])
        if versions.size == 0:
            versions = np.asarray([self.engine.version])
        return PoolItem(
            key=prompt.key, num_tokens=max(1, sum(len(c.tokens) for c in completions)),
            min_version=int(versions.min()), max_version=int(versions.max()),
            domain=prompt.domain, success=group.success, added_at=int(versions.max()),
            payload=group,
        )  # fmt: skip

    # -- the actor -----------------------------------------------------------------------------

    def _admit(self) -> list[Prompt]:
        """Prompts the staleness rule lets start now (under the lock). The rule counts from
        the version the engine holds, which is what the prompt's tokens will carry."""
        version = self.engine.version
        limit = (version + self.cfg.max_staleness + 1) * self.cfg.batch_groups
        admitted = []
        # Prompts in flight at a checkpoint were counted when they first started.
        while self._requeue and not self._pending:
            prompt = self._requeue.pop(0)
            self._inflight[prompt.key] = prompt
            self._admitted_at[prompt.key] = version
            self._count_admission(prompt)
            admitted.append(prompt)
        # Filtered prompts are not counted: another starts in each one's place.
        while self.started - self.filtered < limit and not self._pending:
            prompt = self.prompts.next()
            self._inflight[prompt.key] = prompt
            self._admitted_at[prompt.key] = version
            self._count_admission(prompt)
            self.started += 1
            admitted.append(prompt)
        return admitted

    def _actor_loop(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stop:
                        return
                    if self._weights is not None:
                        params, version = self._weights
                        self._weights = None
                        self.engine.update_weights(params, version, in_flight=self.cfg.in_flight)
                    self._retry_pending()
                    admitted = self._admit()
                    if not admitted and not self.engine.has_work():
                        self._lock.wait(timeout=0.05)
                        continue
                if admitted:
                    self.engine.submit([self._request(p) for p in admitted])
                t0 = time.perf_counter()
                done = self.engine.step()
                self.decode_s += time.perf_counter() - t0
                for c in done:
                    self._partial.setdefault(c.request_id, []).append(c)
                    if len(self._partial[c.request_id]) == self.cfg.group_size:
                        completions = self._partial.pop(c.request_id)
                        with self._lock:
                            prompt = self._inflight.pop(c.request_id)
                            self._judging[prompt.key] = prompt
                        future = self._executor.submit(self._judge, prompt, completions)
                        future.add_done_callback(self._pooled)
        except BaseException as e:  # surfaced in the learner's thread
            with self._lock:
                self._error = e
                self._lock.notify_all()

    def _pooled(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            try:
                item = future.result()
            except BaseException as e:
                self._error = e
                self._lock.notify_all()
                return
            self._judging.pop(item.key, None)
            if self._filter_out(item):
                self._admitted_at.pop(item.key, None)
                self._lock.notify_all()
                return
            self._pending.append(dataclasses.replace(item, added_at=self.version))
            self._retry_pending()
            self._lock.notify_all()

    def _retry_pending(self) -> None:
        """Judged groups into the pool while it has room (the actor pauses until then)."""
        while self._pending and self.pool.has_room(self._pending[0].num_tokens):
            item = self._pending.pop(0)
            self._admitted_at.pop(item.key, None)
            self.pool.add(item)

    # -- the learner ---------------------------------------------------------------------------

    def _ready(self) -> bool:
        cfg = self.cfg
        # Groups finish out of order, so admission alone does not bound staleness: a long
        # group admitted at version u must be in this batch if u + eta is this version.
        # Wait for it (it is in flight and will finish); by the admission rule at most
        # batch_groups unconsumed groups can be due at any version.
        if any(u + cfg.max_staleness <= self.version for u in self._admitted_at.values()):
            return False
        return len(self.pool) >= cfg.batch_groups

    def _learner_step(self) -> dict:
        t0 = time.perf_counter()
        with self._lock:
            while not self._ready():
                self._retry_pending()
                if self._error is not None:
                    raise RuntimeError("the actor failed") from self._error
                self._lock.wait(timeout=0.05)
            draw = self._draw()
        t_wait = time.perf_counter() - t0
        params, metrics = self.learner(draw, self.version)
        with self._lock:
            self.version += 1
        return self._step_metrics(draw, metrics, t_wait, time.perf_counter() - t0), params

    def _draw(self) -> Draw:
        cfg = self.cfg
        budget = cfg.token_budget if cfg.token_budget is not None else self.pool.tokens
        max_items = cfg.batch_groups if cfg.token_budget is None else cfg.max_batch_groups
        return self.pool.draw(
            budget, self.version, cfg.max_staleness,
            min_items=min(cfg.batch_groups, len(self.pool)), max_items=max_items,
        )  # fmt: skip

    def _step_metrics(self, draw: Draw, metrics: dict, wait_s: float, step_s: float) -> dict:
        hist = staleness_histogram(draw, self.cfg.max_staleness)
        out = dict(metrics)
        out.update({
            "async/staleness_hist": hist.tolist(),
            "async/staleness_mean": float(np.mean(draw.staleness)) if len(draw.items) else 0.0,
            "async/groups": len(draw.items), "async/tokens": draw.num_tokens,
            "async/due": draw.due, "async/learner_wait_s": wait_s, "time/step_s": step_s,
            "async/pool_groups": len(self.pool), "async/version": self.version,
            "async/filtered_total": self.filtered,
            "async/prompt_keys": sorted(int(k) for k in draw.keys),
        })  # fmt: skip
        return out

    def _sync_step(self) -> dict:
        """Generate the whole batch, then judge it, then update: strictly in turn."""
        t0 = time.perf_counter()
        generate_s = 0.0
        kept, all_prompts = 0, []
        by_key: dict[int, list[Completion]] = {}
        # One round without dynamic sampling; with it, rounds until the batch is full.
        while kept < self.cfg.batch_groups:
            with self._lock:
                need = self.cfg.batch_groups - kept
                prompts = self._requeue[:need]
                del self._requeue[: len(prompts)]
                fresh = need - len(prompts)
                prompts += [self.prompts.next() for _ in range(fresh)]
                self.started += fresh
                for p in prompts:
                    self._count_admission(p)
            t_round = time.perf_counter()
            done = self.engine.generate([self._request(p) for p in prompts])
            generate_s += time.perf_counter() - t_round
            for c in done:
                by_key.setdefault(c.request_id, []).append(c)
            items = list(self._executor.map(lambda p: self._judge(p, by_key[p.key]), prompts))
            for item in items:
                if not self._filter_out(item):
                    self.pool.add(dataclasses.replace(item, added_at=self.version))
                    kept += 1
            all_prompts += prompts
        prompts = all_prompts
        draw = self._draw()
        t_wait = time.perf_counter() - t0
        params, metrics = self.learner(draw, self.version)
        self.version += 1
        out = self._step_metrics(draw, metrics, t_wait, time.perf_counter() - t0)
        # Phase times and lengths (prompt by prompt, sample by sample): what the timeline
        # simulator's calibration fits (rlpt.asyncrl.simulator.PhaseTiming).
        out.update({
            "time/generate_s": generate_s, "time/reward_s": t_wait - generate_s,
            "time/update_s": out["time/step_s"] - t_wait,
            "async/response_lengths": [
                len(c.tokens) for p in prompts
                for c in sorted(by_key[p.key], key=lambda c: c.index)
            ],
        })  # fmt: skip
        return out, params
