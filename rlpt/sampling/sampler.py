"""Batched generation: a jitted prefill, then a decode loop over a preallocated KV cache.

Prompts are left-padded to one of a few bucket lengths, so a new prompt length
reuses a compiled program, and every row decodes in lockstep: the prompt's
last real token sits in the last column for every row.

What comes back (``SampleOutput``): the generated tokens, the response mask
(1 for generated tokens up to and including the stop token), and the
*sampling* log-probability of each token: the log-probability under the
distribution it was drawn from, after temperature, top-k and top-p. Those are
not the policy's own log-probabilities unless sampling is plain temperature 1;
PPO recomputes the policy's log-probabilities itself. Under greedy decoding the
figure is the model's temperature-1 log-probability of the arg-max token.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh

from rlpt.models.config import ModelConfig
from rlpt.models.transformer import KVCache, positions_from_mask
from rlpt.parallel.multihost import to_device, to_host
from rlpt.parallel.sharding import (
    DEFAULT_RULES,
    Rules,
    activation_sharding,
    batch_sharding,
    data_parallel_size,
    replicated,
    state_shardings,
)
from rlpt.sampling.methods import GREEDY, SamplingParams, sample_tokens

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@struct.dataclass
class SampleOutput:
    tokens: jax.Array  # [B, N] int32, pad after the stop token
    logprobs: jax.Array  # [B, N] float32 sampling log-probabilities, 0 where mask is 0
    mask: jax.Array  # [B, N] float32 response mask
    lengths: jax.Array  # [B] int32 number of generated tokens
    truncated: jax.Array  # [B] bool: reached max_new_tokens without a stop token


def generate(
    model,
    prompt_tokens: jax.Array,  # [B, P] int, left-padded
    prompt_mask: jax.Array,  # [B, P] bool
    key: jax.Array,
    *,
    config: ModelConfig,
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_ids: tuple[int, ...],
    pad_id: int,
) -> SampleOutput:
    """Pure generation with ``model`` (a ``CausalLM``); see the module docstring."""
    batch, prompt_len = prompt_tokens.shape
    # A sliding-window model decodes in a ring of sinks + window slots, whatever the length.
    cache = KVCache.for_generation(config, batch, prompt_len + max_new_tokens)
    prompt_mask = prompt_mask.astype(bool)
    logits, cache = model(prompt_tokens, positions_from_mask(prompt_mask), prompt_mask, cache=cache)
    stop = jnp.asarray(stop_ids, jnp.int32)

    first, first_lp = sample_tokens(logits[:, -1], jax.random.fold_in(key, 0), sampling)
    out_tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
    out_lp = jnp.zeros((batch, max_new_tokens), jnp.float32).at[:, 0].set(first_lp)
    out_mask = jnp.zeros((batch, max_new_tokens), jnp.float32).at[:, 0].set(1.0)
    done = jnp.isin(first, stop)
    positions = prompt_mask.sum(axis=1).astype(jnp.int32)  # next rotary position, per row

    def cond(carry):
        i, _, _, done, *_ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, token, positions, done, cache, out_tokens, out_lp, out_mask = carry
        logits, cache = model(
            token[:, None], positions[:, None], jnp.ones((batch, 1), bool), cache=cache
        )
        new, new_lp = sample_tokens(logits[:, 0], jax.random.fold_in(key, i), sampling)
        new = jnp.where(done, pad_id, new)
        out_tokens = jax.lax.dynamic_update_slice(out_tokens, new[:, None], (0, i))
        out_lp = jax.lax.dynamic_update_slice(out_lp, jnp.where(done, 0.0, new_lp)[:, None], (0, i))
        out_mask = jax.lax.dynamic_update_slice(
            out_mask, (~done).astype(jnp.float32)[:, None], (0, i)
        )
        done = done | jnp.isin(new, stop)
        return i + 1, new, positions + 1, done, cache, out_tokens, out_lp, out_mask

    carry = (jnp.int32(1), first, positions, done, cache, out_tokens, out_lp, out_mask)
    _, _, _, done, _, out_tokens, out_lp, out_mask = jax.lax.while_loop(cond, body, carry)
    return SampleOutput(
        tokens=out_tokens,
        logprobs=out_lp,
        mask=out_mask,
        lengths=out_mask.sum(axis=1).astype(jnp.int32),
        truncated=~done,
    )


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    for bucket in sorted(buckets):
        if length <= bucket:
            return bucket
    raise ValueError(f"prompt length {length} exceeds the largest bucket {max(buckets)}")


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int):
    """Left-pad ``prompts`` to ``length``: tokens [B, length] int32 and mask [B, length] bool."""
    tokens = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), bool)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            tokens[row, length - len(prompt) :] = prompt
            mask[row, length - len(prompt) :] = True
    return tokens, mask


class Sampler:
    """Generation for a model's graphdef, compiled once per (bucket, batch, settings).

    ``state`` is passed to every call, so the same sampler serves a policy whose
    parameters change during training. On a mesh, parameters keep their
    logical-axis shardings and the batch is split over the data-parallel axes.
    """

    def __init__(
        self,
        graphdef,
        config: ModelConfig,
        *,
        eos_id: int,
        pad_id: int,
        stop_ids: Sequence[int] = (),
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        mesh: Mesh | None = None,
        rules: Rules = DEFAULT_RULES,
    ):
        self.graphdef = graphdef
        self.config = config
        self.pad_id = pad_id
        self.stop_ids = tuple(sorted({eos_id, *stop_ids}))
        self.buckets = tuple(sorted(buckets))
        self.mesh = mesh
        self.rules = rules
        self.trace_count = 0  # how many programs were traced (tests count recompiles)
        self._compiled: dict = {}

    def _fn(self, state, max_new_tokens: int, sampling: SamplingParams):
        key = (max_new_tokens, sampling)
        if key in self._compiled:
            return self._compiled[key]

        def run(state, prompt_tokens, prompt_mask, rng):
            self.trace_count += 1
            with activation_sharding(self.mesh, self.rules):
                model = nnx.merge(self.graphdef, state)
                return generate(
                    model, prompt_tokens, prompt_mask, rng, config=self.config,
                    max_new_tokens=max_new_tokens, sampling=sampling,
                    stop_ids=self.stop_ids, pad_id=self.pad_id,
                )  # fmt: skip

        if self.mesh is None:
            fn = jax.jit(run)
        else:
            rows = batch_sharding(self.mesh, 2, self.rules)
            fn = jax.jit(
                run,
                in_shardings=(
                    state_shardings(state, self.mesh, self.rules), rows, rows,
                    replicated(self.mesh),
                ),
                out_shardings=SampleOutput(
                    tokens=rows, logprobs=rows, mask=rows,
                    lengths=batch_sharding(self.mesh, 1, self.rules),
                    truncated=batch_sharding(self.mesh, 1, self.rules),
                ),
            )  # fmt: skip
        self._compiled[key] = fn
        return fn

    def prepare(self, prompts: Sequence[Sequence[int]], max_new_tokens: int):
        """Validate and left-pad prompts to their bucket (and the batch to the mesh)."""
        if not prompts:
            raise ValueError("no prompts given")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in prompt if not 0 <= int(t) < self.config.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {i} has token ids {bad[:5]} outside the model's vocabulary "
                    f"[0, {self.config.vocab_size}) (model.vocab_size)"
                )
        longest = max(len(p) for p in prompts)
        length = bucket_length(longest, self.buckets)
        if length + max_new_tokens > self.config.max_seq_len:
            raise ValueError(
                f"prompt of {longest} tokens (bucket {length}) plus max_new_tokens="
                f"{max_new_tokens} exceeds the cache, model.max_seq_len={self.config.max_seq_len}"
            )
        rows = list(prompts)
        if self.mesh is not None:
            multiple = data_parallel_size(self.mesh, self.rules)
            rows += [[self.pad_id]] * (-len(rows) % multiple)
        return left_pad(rows, length, self.pad_id)

    def generate(
        self,
        state,
        prompts: Sequence[Sequence[int]],
        key: jax.Array,
        *,
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
    ) -> SampleOutput:
        """Generate for a list of token-id prompts; returns numpy arrays, one row per prompt."""
        tokens, mask = self.prepare(prompts, max_new_tokens)
        out = self.generate_padded(
            state, tokens, mask, key, max_new_tokens=max_new_tokens, sampling=sampling
        )
        return jax.tree.map(lambda x: x[: len(prompts)], out)

    def generate_padded(
        self,
        state,
        tokens: np.ndarray,  # [B, P] left-padded prompt ids
        mask: np.ndarray,  # [B, P] bool
        key: jax.Array,
        *,
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
    ) -> SampleOutput:
        """Generate for prompts already left-padded (a loader's batch), without padding them
        again; on a mesh, rows are added up to a multiple of the data-parallel devices and
        dropped from the result."""
        tokens, mask = np.asarray(tokens, np.int32), np.asarray(mask, bool)
        if tokens.shape[1] + max_new_tokens > self.config.max_seq_len:
            raise ValueError(
                f"prompts of {tokens.shape[1]} positions plus max_new_tokens={max_new_tokens} "
                f"exceed the cache, model.max_seq_len={self.config.max_seq_len}"
            )
        n = len(tokens)
        if self.mesh is not None:
            extra = -n % data_parallel_size(self.mesh, self.rules)
            tokens = np.pad(tokens, ((0, extra), (0, 0)), constant_values=self.pad_id)
            mask = np.pad(mask, ((0, extra), (0, 0)))
            mask[n:, -1] = True  # a one-token prompt in each filler row
        fn = self._fn(state, max_new_tokens, sampling)
        if self.mesh is not None:
            # Host values (equal in every process) onto the mesh; a placed state stays put.
            rows = batch_sharding(self.mesh, 2, self.rules)
            state = to_device(state, state_shardings(state, self.mesh, self.rules))
            tokens, mask = to_device((tokens, mask), (rows, rows))
            key = to_device(key, replicated(self.mesh))
        out = to_host(fn(state, tokens, mask, key))
        return jax.tree.map(lambda x: x[:n], out)
