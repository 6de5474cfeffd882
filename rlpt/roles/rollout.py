"""The rollout role: prompts in, trajectories out.

A ``Trajectories`` holds, one row per sample, exactly what generation produced: the
prompt's token ids (left-padded once, by the loader), the response token ids the
sampler drew (never decoded and re-encoded on the way to the learner), their behaviour
log-probs under the sampling distribution, the response mask, and the policy version
that generated them. The reward role adds its verdicts to the same rows (``Verdicts``).

A multi-turn rollout (``MultiTurnRolloutWorker``, ``rlpt.roles.multiturn``) lays each row
out as ``completion 1 | feedback 1 | completion 2 | ...``: ``mask`` covers every token of
the row, ``loss_mask`` only the model's, and ``turns`` (a ``TurnRecord``) says how each
row went.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from rlpt.data.loader import PromptBatch
from rlpt.sampling import ChunkedSampler, Sampler, SamplingParams, traces_output
from rlpt.tokenizers import Tokenizer, decode_response


@dataclasses.dataclass(frozen=True)
class Verdicts:
    """The reward role's judgement of each row, all ``[N]`` arrays (``results`` a list)."""

    results: list  # VerifyResult per row
    rewards: np.ndarray  # weighted rule and verifier terms, summed per sequence
    weight: np.ndarray  # 0 where the sample is dropped (sandbox failure, non-finite reward)
    success: np.ndarray  # 1 where the verifier says the answer is correct
    valid: np.ndarray  # 0 where the verdict says nothing about the policy


@dataclasses.dataclass(frozen=True)
class TurnRecord:
    """How each row of a multi-turn rollout went, all ``[N]`` (``results`` a list)."""

    turns: np.ndarray  # int32 completions sampled (1..rollout.turns)
    first_success: np.ndarray  # float32, 1 where the first completion was correct
    success: np.ndarray  # float32, 1 where the last completion was correct
    results: list  # the last completion's VerifyResult: the row's verdict


@dataclasses.dataclass(frozen=True)
class Trajectories:
    """Generated samples, one row each: ``[N]`` arrays, ``[N, T]`` for the response
    arrays (``T`` = the rollout's ``max_new_tokens``), and per-row lists."""

    prompt_tokens: np.ndarray  # [N, P] left-padded as the loader padded them
    prompt_mask: np.ndarray  # [N, P] bool
    tasks: list
    names: list  # domain name per row
    texts: list  # decoded responses, for verifiers and logs only
    tokens: np.ndarray  # [N, T] the sampled ids, exactly
    logprobs: np.ndarray  # [N, T] behaviour log-probs of those ids
    mask: np.ndarray  # [N, T]
    lengths: np.ndarray  # [N]
    truncated: np.ndarray  # [N]
    loss_weight: np.ndarray  # [N] the curriculum's per-domain loss weight
    domain_index: np.ndarray  # [N]
    difficulty: np.ndarray  # [N]
    policy_version: np.ndarray  # [N] the learner step whose weights generated the row
    verdicts: Verdicts | None = None
    # Multi-turn rows: [N, T] 1 on the model's tokens (``mask`` also covers the
    # environment's feedback tokens); None where every token of ``mask`` is the model's.
    loss_mask: np.ndarray | None = None
    turns: TurnRecord | None = None

    def __len__(self) -> int:
        return len(self.tasks)

    def take(self, rows: np.ndarray) -> Trajectories:
        """The rows ``rows`` (indices into this set), in that order."""
        return _map_rows(self, lambda v: v[rows] if isinstance(v, np.ndarray) else
                         [v[i] for i in rows])  # fmt: skip

    @staticmethod
    def concat(parts: Sequence[Trajectories]) -> Trajectories:
        """The rows of ``parts`` in order; prompts of different widths (batches padded
        to different buckets) are left-aligned to the widest by masked columns."""

        def join(values):
            if isinstance(values[0], np.ndarray):
                return np.concatenate(values)
            return [v for vs in values for v in vs]

        width = max(p.prompt_tokens.shape[1] for p in parts)
        parts = [p if p.prompt_tokens.shape[1] == width else p._widened(width) for p in parts]
        fields = {}
        for f in dataclasses.fields(Trajectories):
            if f.name in _RECORDS:
                continue
            values = [getattr(p, f.name) for p in parts]
            fields[f.name] = None if any(v is None for v in values) else join(values)
        for name, record in _RECORDS.items():
            values = [getattr(p, name) for p in parts]
            fields[name] = None
            if all(v is not None for v in values):
                fields[name] = record(**{
                    f.name: join([getattr(v, f.name) for v in values])
                    for f in dataclasses.fields(record)
                })  # fmt: skip
        return Trajectories(**fields)

    def _widened(self, width: int) -> Trajectories:
        """The same rows with ``width - P`` masked columns before each prompt; they repeat
        the rows' first column, which the mask already hides (padding of the loader's)."""
        extra = width - self.prompt_tokens.shape[1]
        tokens = np.concatenate([np.repeat(self.prompt_tokens[:, :1], extra, axis=1),
                                 self.prompt_tokens], axis=1)  # fmt: skip
        mask = np.pad(self.prompt_mask, ((0, 0), (extra, 0)))
        return dataclasses.replace(self, prompt_tokens=tokens, prompt_mask=mask)


# Per-row records a Trajectories may carry (None when absent).
_RECORDS = {"verdicts": Verdicts, "turns": TurnRecord}


def _map_rows(traj: Trajectories, fn) -> Trajectories:
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(traj):
        value = getattr(traj, f.name)
        if value is None:
            fields[f.name] = None
        elif f.name in _RECORDS:
            fields[f.name] = _RECORDS[f.name](**{
                g.name: fn(getattr(value, g.name)) for g in dataclasses.fields(value)
            })  # fmt: skip
        else:
            fields[f.name] = fn(value)
    return Trajectories(**fields)


class RolloutWorker:
    """Samples responses to a prompt batch with the current policy weights."""

    # Seconds the last ``generate`` spent verifying (a multi-turn rollout verifies
    # between turns; this one never does).
    verify_s: float = 0.0

    def __init__(
        self,
        sampler: Sampler,
        tokenizer: Tokenizer,
        *,
        domain_names: Sequence[str],
        max_new_tokens: int,
        sampling: SamplingParams,
    ):
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.domain_names = tuple(domain_names)
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling

    def generate(
        self, params, prompts: PromptBatch, key: jax.Array, *, version: int
    ) -> Trajectories:
        """Trajectories for every row of ``prompts``, sampled from the loader's padded
        batch as it is."""
        out = self.sampler.generate_padded(
            params, prompts.tokens, prompts.mask, key, max_new_tokens=self.max_new_tokens,
            sampling=self.sampling,
        )  # fmt: skip
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        n = len(tokens)
        texts = [decode_response(self.tokenizer, tokens[i, : lengths[i]]) for i in range(n)]
        return Trajectories(
            prompt_tokens=np.asarray(prompts.tokens), prompt_mask=np.asarray(prompts.mask, bool),
            tasks=list(prompts.tasks),
            names=[self.domain_names[d] for d in prompts.domain_index], texts=texts,
            tokens=tokens, logprobs=np.asarray(out.logprobs), mask=np.asarray(out.mask),
            lengths=lengths, truncated=np.asarray(out.truncated),
            loss_weight=np.asarray(prompts.loss_weight),
            domain_index=np.asarray(prompts.domain_index),
            difficulty=np.asarray(prompts.difficulty),
            policy_version=np.full(n, version, np.int32),
        )  # fmt: skip


class ChunkedRolloutWorker(RolloutWorker):
    """Rollouts that reason in chunks with a bounded carry (Delethink; see
    ``rlpt.sampling.chunked``). Each row of the ``Trajectories`` is a whole trace: its
    tokens are every chunk concatenated, ``max_chunks * chunk_tokens`` columns, and
    ``truncated`` marks traces that used up the budget. ``max_chunks`` is the current
    budget, which the length curriculum changes between steps."""

    def __init__(
        self,
        sampler: Sampler,
        tokenizer: Tokenizer,
        *,
        domain_names: Sequence[str],
        chunk_tokens: int,
        carry_tokens: int,
        max_chunks: int,
        sampling: SamplingParams,
    ):
        super().__init__(
            sampler, tokenizer, domain_names=domain_names,
            max_new_tokens=chunk_tokens * max_chunks, sampling=sampling,
        )  # fmt: skip
        self.chunked = ChunkedSampler(sampler, chunk_tokens=chunk_tokens, carry_tokens=carry_tokens)
        self.max_chunks = max_chunks

    def generate(
        self, params, prompts: PromptBatch, key: jax.Array, *, version: int
    ) -> Trajectories:
        """Chunked traces for every row of ``prompts`` (the loader's padding removed)."""
        rows = [row[m].tolist() for row, m in zip(np.asarray(prompts.tokens),
                                                   np.asarray(prompts.mask, bool))]  # fmt: skip
        traces = self.chunked.traces(
            params, rows, key, max_chunks=self.max_chunks, sampling=self.sampling
        )
        self.max_new_tokens = self.chunked.chunk_tokens * self.max_chunks
        out = traces_output(traces, self.max_new_tokens, self.tokenizer.pad_id)
        n = len(rows)
        texts = [decode_response(self.tokenizer, out.tokens[i, : out.lengths[i]]) for i in range(n)]
        return Trajectories(
            prompt_tokens=np.asarray(prompts.tokens), prompt_mask=np.asarray(prompts.mask, bool),
            tasks=list(prompts.tasks),
            names=[self.domain_names[d] for d in prompts.domain_index], texts=texts,
            tokens=out.tokens, logprobs=out.logprobs, mask=out.mask, lengths=out.lengths,
            truncated=out.truncated, loss_weight=np.asarray(prompts.loss_weight),
            domain_index=np.asarray(prompts.domain_index),
            difficulty=np.asarray(prompts.difficulty),
            policy_version=np.full(n, version, np.int32),
        )  # fmt: skip
