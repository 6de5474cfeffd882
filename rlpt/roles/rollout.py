"""The rollout role: prompts in, trajectories out.

A ``Trajectories`` holds, one row per sample, exactly what generation produced: the
prompt's token ids (left-padded once, by the loader), the response token ids the
sampler drew (never decoded and re-encoded on the way to the learner), their behaviour
log-probs under the sampling distribution, the response mask, and the policy version
that generated them. The reward role adds its verdicts to the same rows (``Verdicts``).
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
            if f.name == "verdicts":
                continue
            fields[f.name] = join([getattr(p, f.name) for p in parts])
        verdicts = None
        if all(p.verdicts is not None for p in parts):
            verdicts = Verdicts(**{
                f.name: join([getattr(p.verdicts, f.name) for p in parts])
                for f in dataclasses.fields(Verdicts)
            })  # fmt: skip
        return Trajectories(**fields, verdicts=verdicts)

    def _widened(self, width: int) -> Trajectories:
        """The same rows with ``width - P`` masked columns before each prompt; they repeat
        the rows' first column, which the mask already hides (padding of the loader's)."""
        extra = width - self.prompt_tokens.shape[1]
        tokens = np.concatenate([np.repeat(self.prompt_tokens[:, :1], extra, axis=1),
                                 self.prompt_tokens], axis=1)  # fmt: skip
        mask = np.pad(self.prompt_mask, ((0, 0), (extra, 0)))
        return dataclasses.replace(self, prompt_tokens=tokens, prompt_mask=mask)


def _map_rows(traj: Trajectories, fn) -> Trajectories:
    fields: dict[str, Any] = {
        f.name: fn(getattr(traj, f.name)) for f in dataclasses.fields(traj) if f.name != "verdicts"
    }
    verdicts = None
    if traj.verdicts is not None:
        verdicts = Verdicts(**{
            f.name: fn(getattr(traj.verdicts, f.name)) for f in dataclasses.fields(Verdicts)
        })  # fmt: skip
    return Trajectories(**fields, verdicts=verdicts)


class RolloutWorker:
    """Samples responses to a prompt batch with the current policy weights."""

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
