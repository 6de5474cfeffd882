"""Chunked reasoning with a bounded carry: Delethink (Aghajohari et al. 2025, "The
Markovian Thinker", arXiv:2510.06557).

The policy reasons in chunks of ``C`` tokens. Chunk 0 is generated from the prompt;
at each chunk boundary the context is reset to the prompt followed by the last ``m``
tokens of the reasoning so far, and generation goes on from there. A trace ends at a
stop token or after ``max_chunks`` chunks; its text is the concatenation of every
chunk, and the answer is read from that. Each generation call needs one window of
memory, ``len(prompt) + m + C`` positions, however long the whole trace grows.

Because every chunk but a trace's last holds exactly ``C`` tokens, a trace's chunks
are a function of the prompt and the concatenated tokens alone (``chunk_spans``):
chunk ``k`` covers trace tokens ``[k C, (k + 1) C)`` and was generated from the
prompt plus trace tokens ``[max(0, k C - m), k C)``. The rollout keeps only full
traces; ``chunk_rows`` rebuilds the chunks as training rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rlpt.sampling.methods import GREEDY, SamplingParams
from rlpt.sampling.sampler import SampleOutput, Sampler, bucket_length, left_pad

# (contexts, key, max_new_tokens) -> a SampleOutput with one row per context.
GenerateFn = Callable[[list[list[int]], jax.Array, int], SampleOutput]


@dataclasses.dataclass(frozen=True)
class ChunkSegment:
    """One generation call of a trace: what the model saw and what it wrote."""

    context: np.ndarray  # [c] int32: the prompt, then the carried tokens
    tokens: np.ndarray  # [n] int32 generated, n <= C
    logprobs: np.ndarray  # [n] float32 behaviour (sampling) log-probs


@dataclasses.dataclass(frozen=True)
class ChunkedTrace:
    """A whole chunked trace: its segments and their concatenation."""

    prompt: np.ndarray  # [p] int32
    segments: list[ChunkSegment]
    tokens: np.ndarray  # [n] int32, every segment's tokens in order
    logprobs: np.ndarray  # [n] float32
    finished: bool  # ended at a stop token (else the chunk budget ran out)

    @property
    def truncated(self) -> bool:
        return not self.finished


def chunked_generate(
    generate_fn: GenerateFn,
    prompts: Sequence[Sequence[int]],
    key: jax.Array,
    *,
    chunk_tokens: int,
    carry_tokens: int,
    max_chunks: int,
) -> list[ChunkedTrace]:
    """Delethink rollouts: one ``ChunkedTrace`` per prompt (see the module docstring).

    ``generate_fn(contexts, key, max_new_tokens)`` generates for the traces still
    running (``sampler_generate_fn`` binds a sampler); a row that is not ``truncated``
    stopped at a stop token, which ends its trace. Chunk ``k`` is drawn with
    ``fold_in(key, k)``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if carry_tokens < 0:
        raise ValueError(f"carry_tokens must be >= 0, got {carry_tokens}")
    if max_chunks < 1:
        raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
    prompts = [np.asarray(p, np.int32) for p in prompts]
    segments: list[list[ChunkSegment]] = [[] for _ in prompts]
    tokens: list[list[np.ndarray]] = [[] for _ in prompts]
    logprobs: list[list[np.ndarray]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    carry = [np.zeros(0, np.int32) for _ in prompts]
    for k in range(max_chunks):
        active = [i for i, done in enumerate(finished) if not done]
        if not active:
            break
        contexts = [np.concatenate([prompts[i], carry[i]]) for i in active]
        out = generate_fn([c.tolist() for c in contexts], jax.random.fold_in(key, k), chunk_tokens)
        out_tokens, out_lp = np.asarray(out.tokens), np.asarray(out.logprobs)
        out_len, out_trunc = np.asarray(out.lengths), np.asarray(out.truncated)
        for row, i in enumerate(active):
            n = int(out_len[row])
            new = out_tokens[row, :n].astype(np.int32)
            lp = out_lp[row, :n].astype(np.float32)
            segments[i].append(ChunkSegment(contexts[row], new, lp))
            tokens[i].append(new)
            logprobs[i].append(lp)
            finished[i] = not bool(out_trunc[row])
            if carry_tokens:
                trace = np.concatenate(tokens[i])
                carry[i] = trace[max(len(trace) - carry_tokens, 0) :]
    return [
        ChunkedTrace(
            prompt=prompts[i],
            segments=segments[i],
            tokens=np.concatenate(tokens[i]) if tokens[i] else np.zeros(0, np.int32),
            logprobs=np.concatenate(logprobs[i]) if logprobs[i] else np.zeros(0, np.float32),
            finished=finished[i],
        )  # fmt: skip
        for i in range(len(prompts))
    ]


def sampler_generate_fn(
    sampler: Any, params: Any, sampling: SamplingParams = GREEDY, *, batch_size: int | None = None
) -> GenerateFn:
    """``sampler.generate`` (a ``Sampler`` or ``EngineSampler``) as a ``GenerateFn``.

    The static ``Sampler`` compiles one program per batch shape: as traces finish the
    running batch shrinks, so its calls are filled up to ``batch_size`` rows by
    repeating the last context (results dropped). The engine takes any batch as it is.
    """

    def generate(contexts: list[list[int]], key: jax.Array, max_new_tokens: int) -> SampleOutput:
        n = len(contexts)
        rows = contexts
        if isinstance(sampler, Sampler) and batch_size is not None and n < batch_size:
            rows = contexts + [contexts[-1]] * (batch_size - n)
        out = sampler.generate(params, rows, key, max_new_tokens=max_new_tokens, sampling=sampling)
        return jax.tree.map(lambda x: np.asarray(x)[:n], out)

    return generate


def traces_output(traces: Sequence[ChunkedTrace], width: int, pad_id: int) -> SampleOutput:
    """Traces as one ``SampleOutput`` of ``width`` columns (numpy; a trace is at most
    ``max_chunks * C`` tokens long, so ``width`` = that budget holds every one)."""
    n = len(traces)
    tokens = np.full((n, width), pad_id, np.int32)
    logprobs = np.zeros((n, width), np.float32)
    mask = np.zeros((n, width), np.float32)
    lengths = np.zeros(n, np.int32)
    for i, t in enumerate(traces):
        k = len(t.tokens)
        if k > width:
            raise ValueError(f"trace {i} has {k} tokens, more than the width {width}")
        tokens[i, :k], logprobs[i, :k], mask[i, :k], lengths[i] = t.tokens, t.logprobs, 1.0, k
    truncated = np.asarray([t.truncated for t in traces], bool)
    return SampleOutput(
        tokens=tokens, logprobs=logprobs, mask=mask, lengths=lengths, truncated=truncated
    )


class ChunkedSampler:
    """A sampler whose ``generate`` reasons in chunks (``chunked_generate``) and returns
    the concatenated traces, so code written for ``Sampler.generate`` (evaluation)
    runs chunked. ``max_new_tokens`` is the trace budget: ``max_new_tokens // C``
    chunks (at least one)."""

    def __init__(self, sampler: Any, *, chunk_tokens: int, carry_tokens: int):
        self.sampler = sampler
        self.chunk_tokens = chunk_tokens
        self.carry_tokens = carry_tokens
        self.buckets = sampler.buckets
        self.pad_id = sampler.pad_id

    @property
    def trace_count(self) -> int:
        return self.sampler.trace_count

    def traces(
        self,
        state: Any,
        prompts: Sequence[Sequence[int]],
        key: jax.Array,
        *,
        max_chunks: int,
        sampling: SamplingParams = GREEDY,
    ) -> list[ChunkedTrace]:
        fn = sampler_generate_fn(self.sampler, state, sampling, batch_size=len(prompts))
        return chunked_generate(
            fn, prompts, key, chunk_tokens=self.chunk_tokens, carry_tokens=self.carry_tokens,
            max_chunks=max_chunks,
        )  # fmt: skip

    def generate(
        self,
        state: Any,
        prompts: Sequence[Sequence[int]],
        key: jax.Array,
        *,
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
    ) -> SampleOutput:
        max_chunks = max(max_new_tokens // self.chunk_tokens, 1)
        traces = self.traces(state, prompts, key, max_chunks=max_chunks, sampling=sampling)
        return traces_output(traces, max_chunks * self.chunk_tokens, self.pad_id)


@dataclasses.dataclass(frozen=True)
class ChunkRows:
    """A batch's traces cut back into their chunks, one training row per chunk.

    Rows ``[R]`` = traces x the chunk budget, real chunks first in trace order, then
    filler rows (``row_trace == -1``, empty masks) so the row count, and so the
    learner's compiled shapes, depend only on the budget.
    """

    context_tokens: np.ndarray  # [R, P] left-padded prompt + carried tokens
    context_mask: np.ndarray  # [R, P] bool
    tokens: np.ndarray  # [R, C] the chunk's generated ids
    logprobs: np.ndarray  # [R, C] their behaviour log-probs
    mask: np.ndarray  # [R, C] float32
    row_trace: np.ndarray  # [R] int32 trace of each row, -1 for filler
    last: np.ndarray  # [R] bool: the row is its trace's last chunk


def chunk_spans(length: int, chunk_tokens: int, carry_tokens: int) -> list[tuple[int, int, int]]:
    """``(carry_start, start, end)`` of each chunk of a trace of ``length`` tokens: chunk
    ``k`` generated trace tokens ``[start, end)`` from the prompt plus ``[carry_start,
    start)``. An empty trace has one empty chunk (a generation that stopped at once)."""
    spans = []
    for start in range(0, max(length, 1), chunk_tokens):
        spans.append((max(start - carry_tokens, 0), start, min(start + chunk_tokens, length)))
    return spans


def chunk_rows(
    prompts: Sequence[Sequence[int]],
    tokens: np.ndarray,  # [N, W] concatenated traces
    logprobs: np.ndarray,  # [N, W]
    lengths: np.ndarray,  # [N]
    *,
    chunk_tokens: int,
    carry_tokens: int,
    max_chunks: int,
    buckets: Sequence[int],
    pad_id: int,
) -> ChunkRows:
    """Training rows of Delethink's objective: each chunk of each trace is a row whose
    prompt is the context it was generated from and whose response is the chunk. The
    contexts are left-padded to the bucket (of ``buckets``) of the longest one."""
    rows: list[tuple[int, np.ndarray, int, int, bool]] = []
    for i, prompt in enumerate(prompts):
        prompt = np.asarray(prompt, np.int32)
        spans = chunk_spans(int(lengths[i]), chunk_tokens, carry_tokens)
        if len(spans) > max_chunks:
            raise ValueError(
                f"trace {i} has {len(spans)} chunks of {chunk_tokens} tokens, more than "
                f"max_chunks={max_chunks}"
            )
        for k, (carry_start, start, end) in enumerate(spans):
            context = np.concatenate([prompt, np.asarray(tokens[i, carry_start:start], np.int32)])
            rows.append((i, context, start, end, k == len(spans) - 1))
    total = len(prompts) * max_chunks
    width = bucket_length(max(len(r[1]) for r in rows), buckets)
    contexts = [r[1] for r in rows] + [rows[0][1]] * (total - len(rows))
    context_tokens, context_mask = left_pad(contexts, width, pad_id)
    out_tokens = np.full((total, chunk_tokens), pad_id, np.int32)
    out_lp = np.zeros((total, chunk_tokens), np.float32)
    out_mask = np.zeros((total, chunk_tokens), np.float32)
    row_trace = np.full(total, -1, np.int32)
    last = np.zeros(total, bool)
    for r, (i, _, start, end, is_last) in enumerate(rows):
        n = end - start
        out_tokens[r, :n] = tokens[i, start:end]
        out_lp[r, :n] = logprobs[i, start:end]
        out_mask[r, :n] = 1.0
        row_trace[r], last[r] = i, is_last
    return ChunkRows(context_tokens, context_mask, out_tokens, out_lp, out_mask, row_trace, last)
