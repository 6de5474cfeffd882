"""The rollout engine: continuous batching over decode slots, on a paged KV cache.

How it runs (``Engine.step``; ``Engine.generate`` steps until everything submitted is done):

* **Slots.** A fixed number of decode slots, split evenly over the mesh's data-parallel
  shards. A sequence that finishes frees its slot at once and the next waiting request takes
  it; one jitted decode program of fixed shape serves all slots, so nothing recompiles as
  requests come and go (one program per context-length bucket, a power-of-two number of
  blocks). Each call decodes ``decode_steps`` tokens per slot (fewer, larger calls: the host
  loop is what bounds small models), and a slot that finishes inside a call idles to its end.
* **Paged KV with shared prompts.** Keys and values live in fixed-size blocks of a pool per
  shard (``rlpt.models.transformer.PagedCache``); a sequence's page table lists its blocks.
  The ``n`` samples of a request (a GRPO group) prefill the prompt once and point at the same
  full blocks, with reference counts; only the prompt's last, partly filled block is copied
  per sample. KV memory per group grows with the responses, not with n copies of the prompt.
  The prompt but its last token is prefilled in chunks of ``prefill_chunk`` tokens, one chunk
  per request per step, between decode calls, so a long prompt does not stall decoding. Each
  sample then feeds the prompt's last token in its first decode step, so every token, the
  first included, is sampled by the same code with that sample's own key.
* **Exact log-probs, token in and token out.** A completion carries the ids it sampled, their
  log-probabilities under the distribution they were drawn from (temperature, top-k, top-p;
  under greedy decoding, the temperature-1 log-probability), and the policy version that
  produced each token.
* **Per-request settings**, reproducible: temperature or greedy, top-k, top-p, stop ids, stop
  strings (with a ``decode_fn``), max tokens, and a seed. Token t of sample i is drawn with
  ``fold_in(fold_in(PRNGKey(seed), i), t)``, and a row's computation never mixes with another
  row's, so a request's tokens do not depend on what else is in the batch.
* **Interruptible, versioned.** ``update_weights(state, version)`` between steps: requests in
  flight continue under the new weights (partial rollouts; their tokens say which version
  made them), or are aborted and requeued (``in_flight="requeue"``). ``abort`` drops a
  request. When a shard runs out of blocks, its youngest request is requeued (preempted).
* **Sliding windows.** For a model with ``sliding_window`` W and ``attention_sinks`` S, a
  decoding sample gives back each block that lies wholly behind its window and holds no sink,
  so it holds O((S + W) / block_size) blocks however long it runs (the prompt is held whole
  until its decoding starts). The step still reads a context of every position up to the
  newest (dropped blocks read the trash block, which the window masks out): the pool's
  memory is bounded, the per-call gathered context is not.

Sharding: slots and the block pools are split over the data axes (a sequence's blocks live
in its slot's shard, so no step communicates across shards), heads over the tensor axis, and
the parameters keep their logical-axis shardings, by the mesh rules in ``rlpt.parallel``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Hashable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rlpt.models.config import ModelConfig
from rlpt.models.transformer import PagedCache, gather_context
from rlpt.parallel.multihost import to_device, to_host
from rlpt.parallel.sharding import (
    DEFAULT_RULES,
    Rules,
    activation_sharding,
    data_parallel_size,
    logical_to_spec,
    state_shardings,
)
from rlpt.sampling.methods import sample_rows

_TRASH_BLOCK = 0  # block 0 of every shard: where idle rows write, never read
_MAX_STOP_IDS = 8


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """How to sample one request. ``n`` samples share its prompt (a GRPO group)."""

    max_tokens: int
    n: int = 1
    greedy: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (or greedy=True), got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if len(self.stop_ids) > _MAX_STOP_IDS - 1:
            raise ValueError(f"at most {_MAX_STOP_IDS - 1} stop_ids per request")


@dataclasses.dataclass
class Request:
    id: Hashable
    prompt: Sequence[int]
    params: RequestParams


@dataclasses.dataclass
class Completion:
    """One sample of a request: its ids, their sampling log-probs and policy versions."""

    request_id: Hashable
    index: int
    prompt: list[int]
    tokens: np.ndarray  # [n] int32, the stop token included
    logprobs: np.ndarray  # [n] float32
    versions: np.ndarray  # [n] int32: the policy version that sampled each token
    finish_reason: str  # "stop" (a stop id), "stop_string", "length", "aborted"


@dataclasses.dataclass
class EngineStats:
    decode_calls: int = 0
    prefill_calls: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    peak_blocks: int = 0  # most blocks in use at once, all shards together
    prefill_s: float = 0.0  # wall time in prefill calls (with their transfers)
    decode_s: float = 0.0  # wall time in decode calls


@dataclasses.dataclass(eq=False)
class _Group:
    """A submitted request: its prompt's blocks, its prefill progress and its samples."""

    request: Request
    order: int
    shard: int = -1
    prompt_blocks: list[int] = dataclasses.field(default_factory=list)
    prefilled: int = 0  # prompt tokens (of all but the last) already in the cache
    samples: list[_Sample] = dataclasses.field(default_factory=list)

    @property
    def prefix_len(self) -> int:
        return len(self.request.prompt) - 1


@dataclasses.dataclass(eq=False)
class _Sample:
    group: _Group
    index: int
    slot: int = -1  # local slot in its shard
    blocks: list[int] = dataclasses.field(default_factory=list)
    pos: int = 0  # position of the next input token
    next_token: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    done: bool = False


class Engine:
    """Continuous-batching generation for a ``CausalLM`` (see the module docstring).

    Args:
      graphdef, state: the model, split (``nnx.split``); ``state`` may change later through
        ``update_weights``.
      config: its ``ModelConfig``.
      eos_id: a stop id for every request; ``pad_id`` fills idle inputs.
      num_slots: decode slots in all (a multiple of the data-parallel shards).
      block_size: tokens per KV block. ``num_blocks``: blocks per shard, the idle rows' block
        included (default: enough for every slot at ``max_seq_len``).
      max_seq_len: the longest prompt plus response (default: the model's).
      prefill_chunk: prompt tokens per prefill call per request (a multiple of block_size).
      prefill_rows: requests prefilled together per shard in one call.
      decode_steps: tokens each decode call produces per slot.
      decode_fn: ids -> text, for stop strings.
    """

    def __init__(
        self,
        graphdef,
        state,
        config: ModelConfig,
        *,
        eos_id: int,
        pad_id: int = 0,
        num_slots: int = 32,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_seq_len: int | None = None,
        prefill_chunk: int = 128,
        prefill_rows: int = 4,
        decode_steps: int = 8,
        mesh: Mesh | None = None,
        rules: Rules = DEFAULT_RULES,
        decode_fn: Callable[[Sequence[int]], str] | None = None,
        version: int = 0,
    ):
        self.graphdef = graphdef
        self.config = config
        self.eos_id = int(eos_id)
        self.pad_id = int(pad_id)
        self.mesh = mesh
        self.rules = rules
        self.decode_fn = decode_fn
        self.shards = 1 if mesh is None else data_parallel_size(mesh, rules)
        if num_slots < 1 or num_slots % self.shards:
            raise ValueError(
                f"num_slots ({num_slots}) must be a positive multiple of the data-parallel "
                f"shards ({self.shards})"
            )
        if block_size < 1 or prefill_chunk < block_size or prefill_chunk % block_size:
            raise ValueError(
                f"prefill_chunk ({prefill_chunk}) must be a positive multiple of block_size "
                f"({block_size})"
            )
        self.slots_per_shard = num_slots // self.shards
        self.block_size = block_size
        self.max_seq_len = int(max_seq_len or config.max_seq_len)
        if self.max_seq_len > config.max_seq_len:
            raise ValueError(
                f"max_seq_len ({self.max_seq_len}) exceeds model.max_seq_len ({config.max_seq_len})"
            )
        self.max_blocks = math.ceil(self.max_seq_len / block_size)
        self.decode_steps = decode_steps
        # A sliding-window model's sample gives back the blocks behind its window (the sinks'
        # kept); MoBA reads blocks outside the window, so it keeps them all.
        self.window = config.sliding_window if config.sparse_attention == "none" else 0
        self.sinks = config.attention_sinks if self.window else 0
        self.num_blocks = int(num_blocks or self.slots_per_shard * self.max_blocks + 1)
        least = self.max_blocks
        if self.window:
            least = min(least, self._window_blocks() + 1)
        if self.num_blocks < least + 1:
            raise ValueError(
                f"num_blocks ({self.num_blocks}) must hold at least one whole sequence "
                f"({least} blocks) plus the idle rows' block"
            )
        self.prefill_chunk = prefill_chunk
        self.prefill_rows = prefill_rows
        self.version = int(version)
        self.stats = EngineStats()
        self.trace_count = 0

        self._waiting: collections.deque[_Group] = collections.deque()
        self._prefilling: list[_Group] = []
        self._running: list[_Sample | None] = [None] * (self.shards * self.slots_per_shard)
        self._free_blocks = [list(range(self.num_blocks - 1, 0, -1)) for _ in range(self.shards)]
        self.refcounts = np.zeros((self.shards, self.num_blocks), np.int32)
        self._done: list[Completion] = []
        self._order = itertools.count()
        self._copies: list[tuple[int, int, int]] = []  # (shard, src, dst) waiting to be made
        self._fns: dict = {}
        self._pool = self._empty_pool()
        self.state = self._place_state(state)

    # -- public API ---------------------------------------------------------------------------

    def submit(self, requests: Iterable[Request]) -> None:
        """Queue requests (validated now, before anything is compiled)."""
        for request in requests:
            prompt = [int(t) for t in request.prompt]
            if not prompt:
                raise ValueError(f"request {request.id!r}: the prompt is empty")
            bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(
                    f"request {request.id!r}: prompt ids {bad[:5]} are outside the vocabulary "
                    f"[0, {self.config.vocab_size})"
                )
            p = request.params
            if len(prompt) + p.max_tokens > self.max_seq_len:
                raise ValueError(
                    f"request {request.id!r}: prompt of {len(prompt)} tokens plus max_tokens="
                    f"{p.max_tokens} exceeds the engine's max_seq_len ({self.max_seq_len})"
                )
            if p.n > self.slots_per_shard:
                raise ValueError(
                    f"request {request.id!r}: n={p.n} samples exceed the slots of one shard "
                    f"({self.slots_per_shard}); a request's samples share one shard's blocks"
                )
            shared = (len(prompt) - 1) // self.block_size
            worst = shared + p.n * (-(-(len(prompt) + p.max_tokens) // self.block_size) - shared)
            if self.window:
                # The prompt is held whole until decoding starts; then each sample holds its
                # sinks and its window (the group's partial prompt block is copied once).
                worst = min(worst, shared + 1 + p.n * self._window_blocks())
            if worst > self.num_blocks - 1:
                raise ValueError(
                    f"request {request.id!r}: {p.n} samples of up to {len(prompt)} + "
                    f"{p.max_tokens} tokens may need {worst} KV blocks; a shard has "
                    f"{self.num_blocks - 1} (raise num_blocks)"
                )
            if p.stop_strings and self.decode_fn is None:
                raise ValueError(f"request {request.id!r}: stop_strings need a decode_fn")
            group = _Group(Request(request.id, prompt, p), next(self._order))
            group.samples = [_Sample(group, i) for i in range(p.n)]
            self._waiting.append(group)

    def update_weights(self, state, version: int, *, in_flight: str = "continue") -> None:
        """New parameters from the next step on; ``in_flight``: "continue" or "requeue"."""
        if in_flight not in ("continue", "requeue"):
            raise ValueError(f"in_flight must be 'continue' or 'requeue', got {in_flight!r}")
        self.state = self._place_state(state)
        self.version = int(version)
        if in_flight == "requeue":
            for group in sorted(self._active_groups(), key=lambda g: -g.order):
                self._requeue(group)

    def abort(self, request_id: Hashable, *, requeue: bool = False) -> None:
        """Stop a request: requeued from scratch, or finished as "aborted"."""
        for group in self._active_groups() + list(self._waiting):
            if group.request.id != request_id:
                continue
            if requeue:
                self._requeue(group)
            else:
                if group in self._waiting:
                    self._waiting.remove(group)
                for sample in group.samples:
                    if not sample.done:
                        self._finish(sample, "aborted")
                self._release_group(group)

    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or any(self._running))

    def step(self) -> list[Completion]:
        """Admit, prefill one chunk, decode ``decode_steps`` tokens; the completions finished."""
        self._admit()
        if self._prefilling:
            self._prefill()
        if any(self._running):
            self._decode()
        done, self._done = self._done, []
        return done

    def generate(self, requests: Iterable[Request]) -> list[Completion]:
        """Run ``requests`` to the end; completions in request order, then sample index."""
        requests = list(requests)
        self.submit(requests)
        done: list[Completion] = []
        while self.has_work():
            done += self.step()
        order = {r.id: i for i, r in enumerate(requests)}
        return sorted(done, key=lambda c: (order.get(c.request_id, -1), c.index))

    def warm_up(self, *, filtered: bool = False) -> int:
        """Compiles every program a run can call (prefill and decode at each context bucket,
        each copy count), so that none compiles in the middle of a run, where it would stall
        every request for seconds. Each runs once on idle rows, which write only to the trash
        block and change nothing. ``filtered``: the top-k/top-p decode programs too. Call it
        before submitting requests; returns the programs traced."""
        if self.has_work():
            raise RuntimeError("warm_up() runs before any request is submitted")
        before = self.trace_count
        d, r, c, slots = self.shards, self.prefill_rows, self.prefill_chunk, self.slots_per_shard
        buckets = sorted({min(_context_bucket(n), self.max_blocks)
                          for n in range(1, self.max_blocks + 1)})  # fmt: skip
        for blocks in buckets:
            rows = np.zeros((d, r, c), np.int32)
            self._call(self._prefill_fn(blocks), rows, rows, rows.astype(bool),
                       np.zeros((d, r, blocks), np.int32))  # fmt: skip
            for top in sorted({False, filtered}):
                idle = np.zeros((d, slots), np.int32)
                params = np.zeros((d, slots, 4), np.float32)
                params[..., 1] = params[..., 3] = 1.0
                self._call(
                    self._decode_fn(blocks, top), idle, idle, idle.astype(bool),
                    np.zeros((d, slots, blocks), np.int32), idle, np.ones((d, slots), np.int32),
                    np.full((d, slots, _MAX_STOP_IDS), -1, np.int32),
                    np.zeros((d, slots, 2), np.uint32), params,
                )  # fmt: skip
        # A shard copies at most one partly filled prompt block per sample it starts.
        for n in sorted({_bucket(k) for k in range(1, slots + 1)}):
            trash = np.full((d, n), _TRASH_BLOCK, np.int32)
            self._call(self._copy_fn(n), trash, trash)
        return self.trace_count - before

    def blocks_in_use(self) -> int:
        return int(sum(self.num_blocks - 1 - len(free) for free in self._free_blocks))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's keys and values over all layers."""
        cfg = self.config
        per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.resolved_head_dim
        return self.block_size * per_token * jnp.dtype(cfg.compute_dtype).itemsize

    # -- scheduling -----------------------------------------------------------------------------

    def _active_groups(self) -> list[_Group]:
        groups = {id(g): g for g in self._prefilling}
        for sample in self._running:
            if sample is not None:
                groups[id(sample.group)] = sample.group
        return list(groups.values())

    def _free_slots(self, shard: int) -> list[int]:
        base = shard * self.slots_per_shard
        taken = {s.slot for s in self._reserved(shard)}
        return [
            i
            for i in range(self.slots_per_shard)
            if self._running[base + i] is None and i not in taken
        ]

    def _reserved(self, shard: int) -> list[_Sample]:
        return [s for g in self._prefilling if g.shard == shard for s in g.samples if s.slot >= 0]

    def _admit(self) -> None:
        """Give waiting requests (in order) a shard with slots for all their samples."""
        while self._waiting:
            group = self._waiting[0]
            todo = [s for s in group.samples if not s.done]
            n = len(todo)
            need = math.ceil(group.prefix_len / self.block_size) + n
            best, room = -1, -1
            for shard in range(self.shards):
                slots = len(self._free_slots(shard))
                if slots >= n and len(self._free_blocks[shard]) >= need and slots > room:
                    best, room = shard, slots
            if best < 0:
                return
            self._waiting.popleft()
            group.shard = best
            for sample, slot in zip(todo, self._free_slots(best)):
                sample.slot = slot
            blocks = self._alloc(best, math.ceil(group.prefix_len / self.block_size))
            group.prompt_blocks = blocks
            group.prefilled = 0
            self._prefilling.append(group)

    def _alloc(self, shard: int, n: int) -> list[int] | None:
        free = self._free_blocks[shard]
        if len(free) < n:
            return None
        blocks = [free.pop() for _ in range(n)]
        self.refcounts[shard, blocks] = 1
        self.stats.peak_blocks = max(self.stats.peak_blocks, self.blocks_in_use())
        return blocks

    def _window_blocks(self) -> int:
        """The most blocks a decoding sample of a sliding-window model holds: the sinks', the
        window's behind its next position and those a decode call writes, one more for
        alignment and one for the copy of its prompt's partial block."""
        bs = self.block_size
        behind = -(-(self.window - 1 + self.decode_steps) // bs)
        return -(-self.sinks // bs) + behind + 2

    def _drop_behind_window(self) -> None:
        """Give back the blocks no query of a sliding-window sample reads again: wholly before
        the window of its next position and holding no sink. Their page-table entries point
        at the trash block from then on, whose keys the window masks out."""
        if not self.window:
            return
        bs = self.block_size
        first = -(-self.sinks // bs)  # the first block that holds no sink
        for sample in self._running:
            if sample is None:
                continue
            # The query at ``pos`` and every later one see no position <= pos - W.
            behind = (sample.pos - self.window + 1) // bs
            for j in range(first, min(behind, len(sample.blocks))):
                if sample.blocks[j] != _TRASH_BLOCK:
                    self._release(sample.group.shard, [sample.blocks[j]])
                    sample.blocks[j] = _TRASH_BLOCK

    def _release(self, shard: int, blocks: Iterable[int]) -> None:
        for b in blocks:
            if b == _TRASH_BLOCK:  # a dropped block of a sliding-window sample
                continue
            self.refcounts[shard, b] -= 1
            if self.refcounts[shard, b] == 0:
                self._free_blocks[shard].append(b)
            elif self.refcounts[shard, b] < 0:
                raise AssertionError(f"block {b} of shard {shard} released twice")

    def _release_group(self, group: _Group) -> None:
        if group.prompt_blocks:
            self._release(group.shard, group.prompt_blocks)
            group.prompt_blocks = []
        if group in self._prefilling:
            self._prefilling.remove(group)

    def _requeue(self, group: _Group) -> None:
        """Drop everything the request holds and put it first in the queue."""
        for sample in group.samples:
            if sample.done:
                continue  # already returned
            if sample.slot >= 0:
                base = group.shard * self.slots_per_shard
                if self._running[base + sample.slot] is sample:
                    self._running[base + sample.slot] = None
                self._release(group.shard, sample.blocks)
            sample.slot, sample.blocks, sample.pos = -1, [], 0
            sample.tokens, sample.logprobs, sample.versions = [], [], []
        self._release_group(group)
        group.shard, group.prefilled = -1, 0
        if group not in self._waiting:
            self._waiting.appendleft(group)

    def _start_samples(self, group: _Group) -> None:
        """The prompt is in: each sample shares its full blocks and copies the partial one."""
        full, partial = divmod(group.prefix_len, self.block_size)
        shard = group.shard
        for sample in group.samples:
            if sample.done:
                continue
            shared = group.prompt_blocks[:full]
            self.refcounts[shard, shared] += 1
            sample.blocks = list(shared)
            if partial:
                (own,) = self._alloc(shard, 1) or self._preempt_for(group, 1)
                self._copies.append((shard, group.prompt_blocks[full], own))
                sample.blocks.append(own)
            sample.pos = group.prefix_len
            sample.next_token = group.request.prompt[-1]
            self._running[shard * self.slots_per_shard + sample.slot] = sample
        # The request's own hold on its prompt goes; the samples hold what they share.
        self._release_group(group)

    def _preempt_for(self, keep: _Group, n: int) -> list[int]:
        """Free blocks in ``keep``'s shard by requeueing its youngest other request."""
        shard = keep.shard
        while len(self._free_blocks[shard]) < n:
            victims = [g for g in self._active_groups() if g.shard == shard and g is not keep]
            if not victims:
                raise RuntimeError(
                    f"shard {shard} has too few KV blocks ({self.num_blocks}) for one request"
                )
            self._requeue(max(victims, key=lambda g: g.order))
            self.stats.preemptions += 1
        return self._alloc(shard, n)

    def _finish(self, sample: _Sample, reason: str) -> None:
        group = sample.group
        if sample.slot >= 0:
            index = group.shard * self.slots_per_shard + sample.slot
            if self._running[index] is sample:
                self._running[index] = None
            self._release(group.shard, sample.blocks)
        sample.slot, sample.blocks, sample.done = -1, [], True
        self._done.append(
            Completion(
                request_id=group.request.id,
                index=sample.index,
                prompt=list(group.request.prompt),
                tokens=np.asarray(sample.tokens, np.int32),
                logprobs=np.asarray(sample.logprobs, np.float32),
                versions=np.asarray(sample.versions, np.int32),
                finish_reason=reason,
            )
        )

    # -- device work ----------------------------------------------------------------------------

    def _pool_sharding(self):
        if self.mesh is None:
            return None
        shape = (self.shards, self.num_blocks, self.block_size, self.config.n_kv_heads, 1)
        names = ("batch", None, None, "act_kv_heads", None)
        return NamedSharding(self.mesh, logical_to_spec(names, shape, self.mesh, self.rules))

    def _rows_sharding(self, ndim: int):
        if self.mesh is None:
            return None
        names = ("batch",) + (None,) * (ndim - 1)
        return NamedSharding(self.mesh, logical_to_spec(names, None, self.mesh, self.rules))

    def _empty_pool(self):
        cfg = self.config
        shape = (
            self.shards,
            self.num_blocks,
            self.block_size,
            cfg.n_kv_heads,
            cfg.resolved_head_dim,
        )

        def make():
            zeros = tuple(jnp.zeros(shape, cfg.compute_dtype) for _ in range(cfg.n_layers))
            return zeros, zeros

        if self.mesh is None:
            return jax.jit(make)()
        sharding = self._pool_sharding()
        n = cfg.n_layers
        return jax.jit(make, out_shardings=((sharding,) * n, (sharding,) * n))()

    def _place_state(self, state):
        if self.mesh is None:
            return state
        return to_device(state, state_shardings(state, self.mesh, self.rules))

    def _jit(self, fn, ndims: tuple, out_ndims: tuple):
        """jit with the engine's shardings: state, pools, row arrays (shard-major)."""
        if self.mesh is None:
            return jax.jit(fn, donate_argnums=(1,))
        pool = self._pool_sharding()
        n = self.config.n_layers
        pools = ((pool,) * n, (pool,) * n)
        rows_in = tuple(self._rows_sharding(d) for d in ndims)
        rows_out = tuple(self._rows_sharding(d) for d in out_ndims)
        return jax.jit(
            fn,
            in_shardings=(state_shardings(self.state, self.mesh, self.rules), pools, *rows_in),
            out_shardings=(pools, *rows_out),
            donate_argnums=(1,),
        )

    def _model(self, state):
        return nnx.merge(self.graphdef, state)

    def _prefill_fn(self, context_blocks: int):
        key = ("prefill", context_blocks)
        if key in self._fns:
            return self._fns[key]
        bs = self.block_size

        def run(state, pool, tokens, positions, mask, tables):
            # tokens, positions, mask [D, R, C]; tables [D, R, context_blocks]
            self.trace_count += 1
            d, r, c = tokens.shape
            with activation_sharding(self.mesh, self.rules):
                write = _slots(tables, positions, bs)
                write = jnp.where(mask, write, _TRASH_BLOCK * bs)
                read = _context_slots(tables, context_blocks * bs, bs)
                cache = PagedCache(pool[0], pool[1], write.reshape(d * r, c), read)
                model = self._model(state)
                _, cache = model(
                    tokens.reshape(d * r, c),
                    positions.reshape(d * r, c),
                    mask.reshape(d * r, c),
                    cache=cache,
                )
            return (cache.k, cache.v), jnp.zeros((d,), jnp.int32)

        fn = self._jit(run, (3, 3, 3, 3), (1,))
        self._fns[key] = fn
        return fn

    def _decode_fn(self, context_blocks: int, filtered: bool):
        key = ("decode", context_blocks, filtered)
        if key in self._fns:
            return self._fns[key]
        bs, steps = self.block_size, self.decode_steps

        def run(state, pool, token, pos, active, tables, gen, limits, stops, keys, params):
            # per slot [D, S]: token, pos, active, gen (tokens made so far), limits (max
            # tokens); tables [D, S, context_blocks]; stops [D, S, M]; keys [D, S, 2]: the
            # request's seed and the sample's index (keys are made here, not on the host);
            # params [D, S, 4]: greedy, temperature, top_k (0: off), top_p.
            self.trace_count += 1
            d, s = token.shape
            model = self._model(state)
            read = _context_slots(tables, context_blocks * bs, bs)  # [D*S, context]
            flat = lambda x: x.reshape((d * s,) + x.shape[2:])  # noqa: E731
            sample_keys = jax.vmap(lambda k: jax.random.fold_in(jax.random.PRNGKey(k[0]), k[1]))(
                flat(keys)
            )
            # The context so far, gathered once for the whole call: each step then writes
            # its token into the rows as well as the pool and reads the rows in place.
            with activation_sharding(self.mesh, self.rules):
                rows_k = tuple(gather_context(p, read) for p in pool[0])
                rows_v = tuple(gather_context(p, read) for p in pool[1])

            def one(carry, _):
                k_pool, v_pool, rows_k, rows_v, token, pos, active, gen = carry
                with activation_sharding(self.mesh, self.rules):
                    safe = jnp.where(active, pos, 0)
                    write = jnp.where(
                        active, _slots(tables, safe[..., None], bs)[..., 0], _TRASH_BLOCK * bs
                    )
                    cache = PagedCache(k_pool, v_pool, flat(write)[:, None], None, rows_k, rows_v)
                    logits, cache = model(
                        flat(token)[:, None], flat(safe)[:, None], flat(active)[:, None],
                        cache=cache,
                    )  # fmt: skip
                step_keys = jax.vmap(jax.random.fold_in)(sample_keys, flat(gen))
                new, lp = sample_rows(logits[:, 0], step_keys, flat(params), filtered)
                new, lp = new.reshape(d, s), lp.reshape(d, s)
                stop = jnp.any(new[..., None] == stops, axis=-1) | (gen + 1 >= limits)
                out = (jnp.where(active, new, -1), lp)
                carry = (
                    cache.k, cache.v, cache.rows_k, cache.rows_v, new, pos + 1, active & ~stop,
                    gen + 1,
                )  # fmt: skip
                return carry, out

            carry = (pool[0], pool[1], rows_k, rows_v, token, pos, active, gen)
            (k_pool, v_pool, *_), (tokens, logprobs) = jax.lax.scan(one, carry, None, steps)
            # [steps, D, S] -> [D, S, steps]
            return (k_pool, v_pool), tokens.transpose(1, 2, 0), logprobs.transpose(1, 2, 0)

        ndims = (2, 2, 2, 3, 2, 2, 3, 3, 3)
        fn = self._jit(run, ndims, (3, 3))
        self._fns[key] = fn
        return fn

    def _copy_fn(self, n: int):
        key = ("copy", n)
        if key in self._fns:
            return self._fns[key]

        def run(state, pool, src, dst):
            # src, dst [D, n] block ids within each shard
            del state
            self.trace_count += 1

            def copy(p):
                return jax.vmap(lambda q, a, b: q.at[b].set(q[a]))(p, src, dst)

            return (tuple(map(copy, pool[0])), tuple(map(copy, pool[1]))), jnp.zeros(
                (src.shape[0],), jnp.int32
            )

        fn = self._jit(run, (2, 2), (1,))
        self._fns[key] = fn
        return fn

    def _call(self, fn, *rows):
        if self.mesh is not None:
            shardings = tuple(self._rows_sharding(np.ndim(x)) for x in rows)
            rows = to_device(rows, shardings)
        out = fn(self.state, self._pool, *rows)
        self._pool = out[0]
        return to_host(out[1:])

    def _make_copies(self) -> None:
        if not self._copies:
            return
        per_shard = [[c for c in self._copies if c[0] == d] for d in range(self.shards)]
        n = _bucket(max(len(c) for c in per_shard))
        src = np.zeros((self.shards, n), np.int32)
        dst = np.zeros((self.shards, n), np.int32)
        for d, copies in enumerate(per_shard):
            for i, (_, a, b) in enumerate(copies):
                src[d, i], dst[d, i] = a, b
        self._call(self._copy_fn(n), src, dst)
        self._copies = []

    def _prefill(self) -> None:
        """One chunk of each prefilling request (up to ``prefill_rows`` per shard)."""
        bs, chunk = self.block_size, self.prefill_chunk
        rows: list[list[_Group]] = [[] for _ in range(self.shards)]
        for group in self._prefilling:
            if len(rows[group.shard]) < self.prefill_rows:
                rows[group.shard].append(group)
        ready = []
        work = [g for shard_rows in rows for g in shard_rows if g.prefilled < g.prefix_len]
        if work:
            context = max(min(g.prefilled + chunk, g.prefix_len) for g in work)
            context_blocks = min(_context_bucket(math.ceil(context / bs)), self.max_blocks)
            r = self.prefill_rows
            tokens = np.full((self.shards, r, chunk), self.pad_id, np.int32)
            positions = np.zeros((self.shards, r, chunk), np.int32)
            mask = np.zeros((self.shards, r, chunk), bool)
            tables = np.zeros((self.shards, r, context_blocks), np.int32)
            for d, shard_rows in enumerate(rows):
                for i, group in enumerate(g for g in shard_rows if g.prefilled < g.prefix_len):
                    start = group.prefilled
                    stop = min(start + chunk, group.prefix_len)
                    tokens[d, i, : stop - start] = group.request.prompt[start:stop]
                    positions[d, i, : stop - start] = np.arange(start, stop)
                    mask[d, i, : stop - start] = True
                    blocks = group.prompt_blocks[:context_blocks]
                    tables[d, i, : len(blocks)] = blocks
                    group.prefilled = stop
            t0 = time.perf_counter()
            self._call(self._prefill_fn(context_blocks), tokens, positions, mask, tables)
            self.stats.prefill_s += time.perf_counter() - t0
            self.stats.prefill_calls += 1
        for shard_rows in rows:
            ready += [g for g in shard_rows if g.prefilled >= g.prefix_len]
        for group in ready:
            self._start_samples(group)
        self._make_copies()

    def _decode(self) -> None:
        bs, steps = self.block_size, self.decode_steps
        self._drop_behind_window()
        # Blocks for every position this call may write.
        for i, sample in enumerate(self._running):
            if sample is None:
                continue
            room = sample.group.request.params.max_tokens - len(sample.tokens)
            last = sample.pos + min(steps, room) - 1
            need = last // bs + 1 - len(sample.blocks)
            if need > 0:
                got = self._alloc(sample.group.shard, need)
                if got is None:
                    got = self._preempt_for(sample.group, need)
                if self._running[i] is not sample:  # requeued by its own preemption
                    continue
                sample.blocks += got
        self._make_copies()
        running = [(i, s) for i, s in enumerate(self._running) if s is not None]
        if not running:
            return
        context = max(s.pos + steps for _, s in running)
        context_blocks = min(_context_bucket(math.ceil(context / bs)), self.max_blocks)
        d, slots = self.shards, self.slots_per_shard
        token = np.full((d, slots), self.pad_id, np.int32)
        pos = np.zeros((d, slots), np.int32)
        active = np.zeros((d, slots), bool)
        tables = np.zeros((d, slots, context_blocks), np.int32)
        gen = np.zeros((d, slots), np.int32)
        limits = np.ones((d, slots), np.int32)
        stops = np.full((d, slots, _MAX_STOP_IDS), -1, np.int32)
        keys = np.zeros((d, slots, 2), np.uint32)
        params = np.zeros((d, slots, 4), np.float32)
        params[..., 1] = 1.0
        params[..., 3] = 1.0
        filtered = False
        for i, sample in running:
            a, b = divmod(i, slots)
            p = sample.group.request.params
            token[a, b] = sample.next_token
            pos[a, b] = sample.pos
            active[a, b] = True
            blocks = sample.blocks[:context_blocks]
            tables[a, b, : len(blocks)] = blocks
            gen[a, b] = len(sample.tokens)
            limits[a, b] = p.max_tokens
            ids = sorted({self.eos_id, *p.stop_ids})
            stops[a, b, : len(ids)] = ids
            keys[a, b] = (p.seed, sample.index)
            params[a, b] = (p.greedy, p.temperature, p.top_k or 0, p.top_p or 1.0)
            filtered |= (p.top_k is not None or p.top_p is not None) and not p.greedy
        fn = self._decode_fn(context_blocks, filtered)
        t0 = time.perf_counter()
        tokens, logprobs = self._call(
            fn, token, pos, active, tables, gen, limits, stops, keys, params
        )
        self.stats.decode_s += time.perf_counter() - t0
        self.stats.decode_calls += 1
        for i, sample in running:
            a, b = divmod(i, slots)
            self._harvest(sample, tokens[a, b], logprobs[a, b])

    def _harvest(self, sample: _Sample, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        p = sample.group.request.params
        stops = {self.eos_id, *p.stop_ids}
        for t, lp in zip(tokens.tolist(), logprobs.tolist()):
            if t < 0:
                break
            sample.tokens.append(t)
            sample.logprobs.append(lp)
            sample.versions.append(self.version)
            sample.pos += 1
            sample.next_token = t
            self.stats.generated_tokens += 1
            if t in stops:
                self._finish(sample, "stop")
                return
            if p.stop_strings and self._hit_stop_string(sample):
                self._finish(sample, "stop_string")
                return
            if len(sample.tokens) >= p.max_tokens:
                self._finish(sample, "length")
                return

    def _hit_stop_string(self, sample: _Sample) -> bool:
        text = self.decode_fn(sample.tokens)
        return any(s in text for s in sample.group.request.params.stop_strings)


def _bucket(n: int) -> int:
    """The next power of two at or above ``n`` (at least 1): few distinct shapes to compile."""
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _context_bucket(n: int) -> int:
    """Context blocks to compile for: two sizes per power of two (4, 6, 8, 12, 16, 24 ...),
    so a step attends to at most a third more positions than the longest row needs."""
    if n <= 4:
        return _bucket(n)
    step = _bucket(n) // 4
    return -(-n // step) * step


def _slots(tables: jax.Array, positions: jax.Array, block_size: int) -> jax.Array:
    """Flat pool slots of ``positions`` [..., T] through page ``tables`` [..., blocks]."""
    blocks = jnp.take_along_axis(tables, positions // block_size, axis=-1)
    return blocks * block_size + positions % block_size


def _context_slots(tables: jax.Array, length: int, block_size: int) -> jax.Array:
    """Flat slots of context positions 0..length-1 of every row: [rows, length]."""
    rows = tables.reshape(-1, tables.shape[-1])
    positions = jnp.arange(length)
    return rows[:, positions // block_size] * block_size + positions % block_size
