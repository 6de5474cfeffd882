"""Multi-turn rollouts: the model sees why its answer failed and tries again.

Turn 1 samples a completion from the prompt. The completion is verified (the same
``Verifier`` the reward role uses, so sandboxed domains run in the pool); a row that is
not yet correct gets the verifier's feedback appended to its context as *environment
tokens*, and the model samples again from everything so far, up to ``turns`` turns.
A row stops at its first correct answer, or when the sandbox fails on it (an invalid
verdict says nothing about the policy, so retrying would not either). A row is one
sequence::

    prompt | completion 1 | feedback 1 | completion 2 | feedback 2 | completion 3

Feedback format (``FEEDBACK_PREFIX + message + FEEDBACK_SUFFIX``)::

    "\\nfeedback: f(3) gave 7, expected 10\\n"

``message`` is the verdict's ``details["feedback"]`` (program_synthesis: the first
failing point; list_programs: the first failing input, or why the answer does not
parse; sandbox errors: the status and the error's tail) or, where a verifier gives
none, a short phrase for its outcome (``OUTCOME_MESSAGES``: ``"no answer given"``,
``"wrong answer"``). It is encoded once by the tokenizer, at most ``feedback_tokens``
ids (a longer message keeps its start and ends in ``...``), and never decoded again.

Token in, token out: a completion is kept exactly as sampled (ids and behaviour
log-probs, its stop token included, since that is the action that ended the turn) and
the next turn's context is built from those ids, never from decoded text. Each row
comes with a presence mask (every token of the row) and a loss mask (1 on the model's
tokens, 0 on the environment's): the learner attends over the feedback but trains only
on what the model wrote (``rlpt.rl.batch``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rlpt.data.loader import PromptBatch
from rlpt.roles.rollout import RolloutWorker, Trajectories, TurnRecord
from rlpt.sampling import SampleOutput, Sampler, SamplingParams, left_pad
from rlpt.tasks import VerifyResult
from rlpt.tokenizers import Tokenizer, decode_response

FEEDBACK_PREFIX = "\nfeedback: "
FEEDBACK_SUFFIX = "\n"
_ELLIPSIS = "..."
# Messages for verdicts whose verifier wrote no ``details["feedback"]``.
OUTCOME_MESSAGES = {
    "no_answer": "no answer given",
    "wrong": "wrong answer",
    "partial": "partly wrong answer",
}
# Contexts of later turns are left-padded to a multiple of this many columns, so the
# static sampler compiles for a few widths only.
CONTEXT_MULTIPLE = 32

# (contexts, key) -> a SampleOutput (numpy) with one row per context.
GenerateFn = Callable[[list[list[int]], jax.Array], SampleOutput]
# (row indices, completion texts) -> one VerifyResult per row.
VerifyFn = Callable[[list[int], list[str]], list[VerifyResult]]


def response_width(turns: int, max_new_tokens: int, feedback_tokens: int) -> int:
    """Columns a multi-turn row's response needs: every completion and every feedback."""
    return turns * max_new_tokens + (turns - 1) * feedback_tokens


def feedback_message(result: VerifyResult) -> str:
    """What the environment tells the model about a failed answer (see the module doc)."""
    text = str(result.details.get("feedback") or "").strip()
    return text or OUTCOME_MESSAGES.get(result.outcome, result.outcome)


def encode_feedback(tokenizer: Tokenizer, message: str, max_tokens: int) -> list[int]:
    """``FEEDBACK_PREFIX + message + FEEDBACK_SUFFIX`` as at most ``max_tokens`` ids; a
    message too long keeps its start (where verifiers put the failing case) and ends in
    ``...``."""
    ids = tokenizer.encode(FEEDBACK_PREFIX + message + FEEDBACK_SUFFIX)
    keep = len(message)
    while len(ids) > max_tokens and keep > 0:
        keep = max(keep - (len(ids) - max_tokens), 0)
        ids = tokenizer.encode(FEEDBACK_PREFIX + message[:keep] + _ELLIPSIS + FEEDBACK_SUFFIX)
    return ids[:max_tokens]


@dataclasses.dataclass(frozen=True)
class Episodes:
    """Multi-turn rows, ``[N, W]`` arrays with ``W = response_width(...)`` columns after
    the prompt, left-aligned: ``completion 1 | feedback 1 | completion 2 | ...``."""

    tokens: np.ndarray  # [N, W] int32, pad after the row
    logprobs: np.ndarray  # [N, W] float32 behaviour log-probs of the model's tokens, else 0
    mask: np.ndarray  # [N, W] float32, 1 on every token of the row (present)
    loss_mask: np.ndarray  # [N, W] float32, 1 on the model's tokens only
    lengths: np.ndarray  # [N] int32 tokens of the row (model and environment)
    truncated: np.ndarray  # [N] bool, the last completion hit max_new_tokens
    turns: np.ndarray  # [N] int32 completions sampled
    first_success: np.ndarray  # [N] float32, correct at the first turn
    success: np.ndarray  # [N] float32, correct within the turns (the last verdict)
    results: list  # [N] the last completion's VerifyResult
    texts: list  # [N] the last completion's text (what ``results`` judged)


def run_episodes(
    generate: GenerateFn,
    verify: VerifyFn,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    key: jax.Array,
    *,
    turns: int,
    max_new_tokens: int,
    feedback_tokens: int,
    first: SampleOutput | None = None,
    first_results: Sequence[VerifyResult] | None = None,
) -> Episodes:
    """Up to ``turns`` turns per prompt (the module docstring has the protocol).

    ``generate(contexts, key)`` samples at most ``max_new_tokens`` for each context;
    turn ``k`` (0-based) uses ``fold_in(key, k)``, except that ``first`` (turn 1's
    output for every prompt, already sampled) and ``first_results`` (its verdicts)
    are used as given. ``verify(rows, texts)`` judges the completions of ``rows``.
    """
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    n = len(prompts)
    prompts = [[int(t) for t in p] for p in prompts]
    # Per row, the pieces after the prompt: (ids, behaviour log-probs, model's or not).
    pieces: list[list[tuple[np.ndarray, np.ndarray, bool]]] = [[] for _ in range(n)]
    results: list[VerifyResult | None] = [None] * n
    firsts: list[VerifyResult | None] = [None] * n
    texts = [""] * n
    used = np.zeros(n, np.int32)
    truncated = np.zeros(n, bool)
    active = list(range(n))
    for turn in range(turns):
        if turn == 0 and first is not None:
            out = first
        else:
            contexts = [prompts[i] + _history(pieces[i]) for i in active]
            out = generate(contexts, key if turn == 0 else jax.random.fold_in(key, turn))
        out_tokens, out_lp = np.asarray(out.tokens), np.asarray(out.logprobs)
        out_len, out_trunc = np.asarray(out.lengths), np.asarray(out.truncated)
        new = [out_tokens[j, : int(out_len[j])].astype(np.int32) for j in range(len(active))]
        turn_texts = [decode_response(tokenizer, ids) for ids in new]
        if turn == 0 and first_results is not None:
            verdicts = list(first_results)
        else:
            verdicts = verify(active, turn_texts)
        for j, i in enumerate(active):
            lp = out_lp[j, : len(new[j])].astype(np.float32)
            pieces[i].append((new[j], lp, True))
            results[i], texts[i] = verdicts[j], turn_texts[j]
            used[i] = turn + 1
            truncated[i] = bool(out_trunc[j])
            if turn == 0:
                firsts[i] = verdicts[j]
        if turn == turns - 1:
            break
        active = [i for i in active if results[i].valid and not results[i].correct]
        for i in active:
            env = np.asarray(
                encode_feedback(tokenizer, feedback_message(results[i]), feedback_tokens), np.int32
            )
            pieces[i].append((env, np.zeros(len(env), np.float32), False))
        if not active:
            break
    width = response_width(turns, max_new_tokens, feedback_tokens)
    tokens = np.full((n, width), tokenizer.pad_id, np.int32)
    logprobs = np.zeros((n, width), np.float32)
    mask = np.zeros((n, width), np.float32)
    loss_mask = np.zeros((n, width), np.float32)
    lengths = np.zeros(n, np.int32)
    for i, row in enumerate(pieces):
        at = 0
        for ids, lp, model in row:
            k = len(ids)
            tokens[i, at : at + k], mask[i, at : at + k] = ids, 1.0
            if model:
                logprobs[i, at : at + k], loss_mask[i, at : at + k] = lp, 1.0
            at += k
        lengths[i] = at
    return Episodes(
        tokens=tokens, logprobs=logprobs, mask=mask, loss_mask=loss_mask, lengths=lengths,
        truncated=truncated, turns=used,
        first_success=np.asarray([float(r.valid and r.correct) for r in firsts], np.float32),
        success=np.asarray([float(r.valid and r.correct) for r in results], np.float32),
        results=list(results), texts=texts,
    )  # fmt: skip


def _history(pieces: list[tuple[np.ndarray, np.ndarray, bool]]) -> list[int]:
    return [int(t) for ids, _, _ in pieces for t in ids]


def context_generate_fn(
    sampler: Any,
    params: Any,
    sampling: SamplingParams,
    *,
    max_new_tokens: int,
    batch_size: int | None = None,
) -> GenerateFn:
    """``sampler.generate_padded`` (a ``Sampler`` or an ``EngineSampler``) for contexts of
    any length as a ``GenerateFn``.

    Contexts are left-padded to a multiple of ``CONTEXT_MULTIPLE`` (not to the prompt
    buckets, which a prompt plus earlier turns outgrows). With ``batch_size``, calls take
    at most that many rows, each chunk drawn with ``fold_in(key, chunk)``; the static
    ``Sampler`` compiles one program per batch shape, so its chunks are filled up to
    ``batch_size`` by repeating the last context (results dropped); the engine takes
    any batch as it is.
    """
    limit = sampler.config.max_seq_len - max_new_tokens

    def one(contexts: list[list[int]], key: jax.Array) -> SampleOutput:
        n = len(contexts)
        rows = list(contexts)
        if isinstance(sampler, Sampler) and batch_size is not None and n < batch_size:
            rows += [contexts[-1]] * (batch_size - n)
        longest = max(len(c) for c in rows)
        width = max(min(-(-longest // CONTEXT_MULTIPLE) * CONTEXT_MULTIPLE, limit), longest)
        tokens, mask = left_pad(rows, width, sampler.pad_id)
        out = sampler.generate_padded(
            params, tokens, mask, key, max_new_tokens=max_new_tokens, sampling=sampling
        )
        return jax.tree.map(lambda x: np.asarray(x)[:n], out)

    def generate(contexts: list[list[int]], key: jax.Array) -> SampleOutput:
        size = batch_size or len(contexts)
        if len(contexts) <= size:
            return one(contexts, key)
        parts = [
            one(contexts[start : start + size], jax.random.fold_in(key, c))
            for c, start in enumerate(range(0, len(contexts), size))
        ]
        return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)

    return generate


class MultiTurnRolloutWorker(RolloutWorker):
    """Rollouts of up to ``turns`` turns with the verifier's feedback between them.

    Turn 1 is exactly ``RolloutWorker.generate``'s sample (the loader's padded batch, the
    same key). Each row of the returned ``Trajectories`` is ``response_width(turns,
    max_new_tokens, feedback_tokens)`` columns after the prompt, with ``loss_mask`` on the
    model's tokens, ``texts`` the last completion of each row and ``turns`` the
    ``TurnRecord`` whose ``results`` the reward role judges (nothing is verified twice).
    """

    def __init__(
        self,
        sampler: Any,
        tokenizer: Tokenizer,
        verifier: Any,
        *,
        domain_names: Sequence[str],
        max_new_tokens: int,
        sampling: SamplingParams,
        turns: int,
        feedback_tokens: int,
    ):
        super().__init__(
            sampler, tokenizer, domain_names=domain_names, max_new_tokens=max_new_tokens,
            sampling=sampling,
        )  # fmt: skip
        if turns < 1:
            raise ValueError(f"rollout.turns must be >= 1, got {turns}")
        self.verifier = verifier
        self.turns = turns
        self.feedback_tokens = feedback_tokens
        self.width = response_width(turns, max_new_tokens, feedback_tokens)

    def generate(
        self, params, prompts: PromptBatch, key: jax.Array, *, version: int
    ) -> Trajectories:
        """Multi-turn trajectories for every row of ``prompts``."""
        first = self.sampler.generate_padded(
            params, prompts.tokens, prompts.mask, key, max_new_tokens=self.max_new_tokens,
            sampling=self.sampling,
        )  # fmt: skip
        prompt_tokens, prompt_mask = np.asarray(prompts.tokens), np.asarray(prompts.mask, bool)
        rows = [row[m].tolist() for row, m in zip(prompt_tokens, prompt_mask)]
        names = [self.domain_names[d] for d in prompts.domain_index]
        tasks = list(prompts.tasks)
        self.verify_s = 0.0

        def verify(idx: list[int], texts: list[str]) -> list[VerifyResult]:
            t0 = time.perf_counter()
            out = self.verifier.verify([names[i] for i in idx], [tasks[i] for i in idx], texts)
            self.verify_s += time.perf_counter() - t0
            return out

        generate = context_generate_fn(
            self.sampler, params, self.sampling, max_new_tokens=self.max_new_tokens,
            batch_size=len(rows),
        )  # fmt: skip
        ep = run_episodes(
            generate, verify, self.tokenizer, rows, key, turns=self.turns,
            max_new_tokens=self.max_new_tokens, feedback_tokens=self.feedback_tokens,
            first=first,
        )  # fmt: skip
        n = len(rows)
        return Trajectories(
            prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tasks=tasks, names=names,
            texts=ep.texts, tokens=ep.tokens, logprobs=ep.logprobs, mask=ep.mask,
            lengths=ep.lengths, truncated=ep.truncated,
            loss_weight=np.asarray(prompts.loss_weight),
            domain_index=np.asarray(prompts.domain_index),
            difficulty=np.asarray(prompts.difficulty),
            policy_version=np.full(n, version, np.int32), loss_mask=ep.loss_mask,
            turns=TurnRecord(turns=ep.turns, first_success=ep.first_success,
                             success=ep.success, results=ep.results),
        )  # fmt: skip
