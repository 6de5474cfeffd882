"""The static ``Sampler``'s interface served by the rollout engine, and the run's choice
between the two (``rollout.sampler``)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from rlpt.models.config import ModelConfig
from rlpt.parallel.sharding import DEFAULT_RULES, Rules, data_parallel_size
from rlpt.sampling.engine import Engine, Request, RequestParams
from rlpt.sampling.methods import GREEDY
from rlpt.sampling.sampler import DEFAULT_BUCKETS, SampleOutput, Sampler


class EngineSampler:
    """The static ``Sampler``'s interface (``generate``, ``generate_padded``), served by an
    ``Engine``, so every caller of the sampler runs on continuous batching.

    Rows with the same prompt next to each other (a GRPO group as the loader lays it out)
    become one request whose samples share the prompt's KV blocks. Row i is drawn with a seed
    taken from ``key``, so the same key gives the same rows. A state other than the last one
    seen reaches the engine through ``update_weights`` (a new version).
    """

    def __init__(
        self,
        graphdef,
        config: ModelConfig,
        *,
        eos_id: int,
        pad_id: int,
        stop_ids: Sequence[int] = (),
        mesh: Mesh | None = None,
        rules: Rules = DEFAULT_RULES,
        num_slots: int = 64,
        block_size: int = 16,
        decode_steps: int = 8,
        max_seq_len: int | None = None,
        buckets: Sequence[int] | None = None,
    ):
        # Prompt lengths a loader pads to (as for the static sampler); the engine itself
        # takes each prompt without its padding.
        self.buckets = tuple(sorted(buckets or DEFAULT_BUCKETS))
        self.graphdef = graphdef
        self.config = config
        self.eos_id = int(eos_id)
        self.pad_id = int(pad_id)
        self.stop_ids = tuple(sorted({int(eos_id), *map(int, stop_ids)}))
        self.mesh = mesh
        self.rules = rules
        shards = 1 if mesh is None else data_parallel_size(mesh, rules)
        self.num_slots = -(-num_slots // shards) * shards
        self.block_size = block_size
        self.decode_steps = decode_steps
        self.max_seq_len = max_seq_len
        self.engine: Engine | None = None
        self._state = None
        self._version = 0

    @property
    def trace_count(self) -> int:
        return 0 if self.engine is None else self.engine.trace_count

    def _engine_for(self, state) -> Engine:
        if self.engine is None:
            self.engine = Engine(
                self.graphdef, state, self.config, eos_id=self.eos_id, pad_id=self.pad_id,
                num_slots=self.num_slots, block_size=self.block_size,
                prefill_chunk=max(self.block_size, 128 // self.block_size * self.block_size),
                decode_steps=self.decode_steps, max_seq_len=self.max_seq_len, mesh=self.mesh,
                rules=self.rules,
            )  # fmt: skip
        elif state is not self._state:
            self._version += 1
            self.engine.update_weights(state, self._version)
        self._state = state
        return self.engine

    def generate(
        self,
        state,
        prompts: Sequence[Sequence[int]],
        key: jax.Array,
        *,
        max_new_tokens: int,
        sampling=None,
    ):
        """A ``SampleOutput`` (numpy arrays), one row per prompt, as ``Sampler.generate``."""
        sampling = GREEDY if sampling is None else sampling
        prompts = [[int(t) for t in p] for p in prompts]
        if not prompts:
            raise ValueError("no prompts given")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        engine = self._engine_for(state)
        seeds = np.asarray(jax.random.randint(key, (len(prompts),), 0, 2**31 - 1))
        requests, rows = [], []
        start = 0
        while start < len(prompts):
            end = start + 1
            limit = min(len(prompts), start + engine.slots_per_shard)
            while end < limit and prompts[end] == prompts[start]:
                end += 1
            params = RequestParams(
                max_tokens=max_new_tokens, n=end - start, greedy=sampling.greedy,
                temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                stop_ids=tuple(t for t in self.stop_ids if t != self.eos_id),
                seed=int(seeds[start]),
            )  # fmt: skip
            requests.append(Request(len(requests), prompts[start], params))
            rows.append(start)
            start = end
        n = len(prompts)
        tokens = np.full((n, max_new_tokens), self.pad_id, np.int32)
        logprobs = np.zeros((n, max_new_tokens), np.float32)
        mask = np.zeros((n, max_new_tokens), np.float32)
        lengths = np.zeros((n,), np.int32)
        truncated = np.zeros((n,), bool)
        for c in engine.generate(requests):
            row = rows[c.request_id] + c.index
            k = len(c.tokens)
            tokens[row, :k], logprobs[row, :k], mask[row, :k] = c.tokens, c.logprobs, 1.0
            lengths[row] = k
            truncated[row] = c.finish_reason == "length"
        return SampleOutput(
            tokens=tokens, logprobs=logprobs, mask=mask, lengths=lengths, truncated=truncated
        )

    def generate_padded(
        self,
        state,
        tokens: np.ndarray,  # [B, P] left-padded prompt ids
        mask: np.ndarray,  # [B, P] bool
        key: jax.Array,
        *,
        max_new_tokens: int,
        sampling=None,
    ):
        """As ``Sampler.generate_padded``: prompts already padded (a loader's batch)."""
        tokens, mask = np.asarray(tokens), np.asarray(mask, bool)
        prompts = [row[m].tolist() for row, m in zip(tokens, mask)]
        return self.generate(state, prompts, key, max_new_tokens=max_new_tokens, sampling=sampling)


SAMPLERS = ("engine", "static")


def make_sampler(kind: str, graphdef, config: ModelConfig, *, slots: int = 64, **kwargs):
    """``rollout.sampler``: the engine ("engine", continuous batching) or the static sampler
    ("static", a batch decoded in lockstep to its longest row). ``kwargs``: eos_id, pad_id,
    stop_ids, buckets, mesh, rules."""
    if kind == "engine":
        return EngineSampler(graphdef, config, num_slots=slots, **kwargs)
    if kind == "static":
        return Sampler(graphdef, config, **kwargs)
    raise ValueError(f"rollout.sampler must be one of {SAMPLERS}, got {kind!r}")
