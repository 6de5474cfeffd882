"""Process rewards: Math-Shepherd step labels, PRM training examples and step scores.

Step ``j`` of a completion is the text ended by its ``j``-th separator: a
``<step>`` token, or the final ``<answer>`` for the last step (as
``rlpt.tasks.split_steps`` numbers them). The PRM reads its score at that
separator token.

Labels (Math-Shepherd, Wang et al. 2023): for every step prefix of a sampled
solution (the text up to and including that step's ``<step>``), the current
policy writes ``N`` continuations; the soft label is the fraction whose final
answer the verifier accepts, the hard label whether any does. The last step's
label is the verdict on the solution itself. All prefixes of all solutions, N
copies each, go to ``Sampler.generate`` as one batched job (split into a few
fixed-size chunks so one compiled program serves every call).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from rlpt.rewards.preferences import encode_sequence, pad_rows
from rlpt.sampling.methods import SamplingParams
from rlpt.tasks.base import ANSWER, STEP, Task, extract_answer, split_steps
from rlpt.tokenizers import decode_response


@dataclasses.dataclass(frozen=True)
class StepLabels:
    """Labels per solution and step, and what producing them cost."""

    soft: list[list[float]]  # fraction of continuations reaching the verified answer
    hard: list[list[float]]  # 1.0 if any did
    samples: int  # continuations sampled (counts against a sample budget)
    tokens: int  # tokens those continuations generated


def step_prefixes(completion: str) -> list[str]:
    """The completion's text up to and including each ``<step>`` before the final answer."""
    end = completion.rfind(ANSWER)
    body = completion if end < 0 else completion[:end]
    prefixes, pos = [], 0
    while True:
        cut = body.find(STEP, pos)
        if cut < 0:
            return prefixes
        pos = cut + len(STEP)
        prefixes.append(completion[:pos])


def math_shepherd_labels(
    sampler: Any,
    policy_state: Any,
    domain: Any,
    tasks: Sequence[Task],
    completions: Sequence[str],
    tokenizer: Any,
    key: jax.Array,
    *,
    n_continuations: int = 8,
    max_new_tokens: int = 32,
    sampling: SamplingParams | None = None,
    chunk_rows: int = 256,
) -> StepLabels:
    """Math-Shepherd soft and hard labels for every step of every completion.

    ``sampler`` is a ``Sampler`` (or anything with its ``generate``) for the
    policy ``policy_state``; ``domain`` verifies the completed texts in one
    ``verify_batch``. Rows are padded to a multiple of ``chunk_rows`` (copies of
    the last row, discarded), so repeated calls reuse one compiled program.
    """
    sampling = sampling or SamplingParams()  # temperature 1: the policy's own distribution
    if n_continuations < 1:
        raise ValueError(f"n_continuations must be >= 1, got {n_continuations}")
    if len(tasks) != len(completions):
        raise ValueError(f"{len(tasks)} tasks but {len(completions)} completions")
    jobs: list[tuple[int, int, str]] = []  # (solution, step, prefix text)
    for i, completion in enumerate(completions):
        jobs += [(i, j, p) for j, p in enumerate(step_prefixes(completion))]
    rows = [
        tokenizer.encode(tasks[i].prompt, add_bos=True) + tokenizer.encode(prefix)
        for i, _, prefix in jobs
        for _ in range(n_continuations)
    ]
    continuations: list[str] = []
    n_tokens = 0
    if rows:
        n_real = len(rows)
        padded = rows + [rows[-1]] * (-n_real % chunk_rows)
        for c, start in enumerate(range(0, len(padded), chunk_rows)):
            out = sampler.generate(
                policy_state, padded[start : start + chunk_rows], jax.random.fold_in(key, c),
                max_new_tokens=max_new_tokens, sampling=sampling,
            )  # fmt: skip
            for r in range(len(out.lengths)):
                if start + r >= n_real:
                    break
                length = int(out.lengths[r])
                n_tokens += length
                continuations.append(decode_response(tokenizer, np.asarray(out.tokens[r][:length])))
    texts = [
        prefix + cont
        for (i, _, prefix), conts in zip(jobs, _chunks(continuations, n_continuations))
        for cont in conts
    ]
    job_tasks = [tasks[i] for i, _, _ in jobs for _ in range(n_continuations)]
    reached = np.zeros((len(jobs), n_continuations), np.float32)
    if texts:
        results = domain.verify_batch(job_tasks, texts)
        reached = np.asarray([r.correct for r in results], np.float32).reshape(reached.shape)
    final = [r.correct for r in domain.verify_batch(list(tasks), list(completions))]
    soft = [[0.0] * len(split_steps(c)) for c in completions]
    hard = [[0.0] * len(split_steps(c)) for c in completions]
    for (i, j, _), row in zip(jobs, reached):
        if j < len(soft[i]):
            soft[i][j] = float(row.mean())
            hard[i][j] = float(row.max())
    for i, c in enumerate(completions):
        if soft[i] and extract_answer(c) is not None:
            soft[i][-1] = hard[i][-1] = float(final[i])
    return StepLabels(soft, hard, samples=len(rows), tokens=n_tokens)


def _chunks(items: list, n: int) -> list[list]:
    return [items[k : k + n] for k in range(0, len(items), n)]


def separator_positions(ids: Sequence[int], step_id: int, answer_id: int) -> list[int]:
    """Indices of the step separators in ``ids``: ``<step>``s before the last ``<answer>``,
    then that ``<answer>`` (``split_steps``'s numbering)."""
    ids = list(ids)
    last_answer = max((k for k, t in enumerate(ids) if t == answer_id), default=-1)
    steps = [k for k, t in enumerate(ids) if t == step_id and (last_answer < 0 or k < last_answer)]
    return steps + ([last_answer] if last_answer >= 0 else [])


def separator_mask(
    tokens: jax.Array, mask: jax.Array, *, step_id: int, answer_id: int
) -> jax.Array:
    """``separator_positions`` as a float32 mask [B, T] over (padded) token rows [B, T]."""
    chex.assert_equal_shape([tokens, mask])
    real = mask > 0
    idx = jnp.arange(tokens.shape[1])[None, :]
    is_answer = (tokens == answer_id) & real
    last_answer = jnp.max(jnp.where(is_answer, idx, -1), axis=1, keepdims=True)  # [B, 1]
    before = (last_answer < 0) | (idx < last_answer)
    steps = (tokens == step_id) & real & before
    return (steps | (idx == last_answer)).astype(jnp.float32)


def encode_step_examples(
    tokenizer: Any,
    prompts: Sequence[str],
    completions: Sequence[str],
    labels: Sequence[Sequence[float]],
    *,
    max_len: int,
    pad_to: int | None = None,
) -> dict[str, np.ndarray]:
    """PRM training rows: ``tokens``, ``mask``, ``labels``, ``label_mask``, ``response_mask``
    [N, L].

    Row layout as ``encode_sequence``; labels sit on the separator tokens of the
    completion. Rows longer than ``max_len`` raise (the caller filters first).
    """
    rows, label_rows, offsets = [], [], []
    for prompt, completion, lab in zip(prompts, completions, labels, strict=True):
        ids = encode_sequence(tokenizer, prompt, completion)
        if len(ids) > max_len:
            raise ValueError(f"{len(ids)} tokens exceed the model's context of {max_len}")
        offset = len(tokenizer.encode(prompt, add_bos=True))
        seps = separator_positions(ids[offset:], tokenizer.step_id, tokenizer.answer_id)
        label_rows.append([(offset + k, y) for k, y in zip(seps, lab)])
        rows.append(ids)
        offsets.append(offset)
    length = pad_to or max(len(r) for r in rows)
    tokens, mask = pad_rows(rows, length, tokenizer.pad_id)
    y = np.zeros(tokens.shape, np.float32)
    y_mask = np.zeros(tokens.shape, np.float32)
    for r, pairs in enumerate(label_rows):
        for k, v in pairs:
            y[r, k] = v
            y_mask[r, k] = 1.0
    response = mask & (np.arange(length)[None, :] >= np.asarray(offsets)[:, None])
    return {"tokens": tokens, "mask": mask, "labels": y, "label_mask": y_mask,
            "response_mask": response}  # fmt: skip


def solution_score(step_probs: np.ndarray, step_mask: np.ndarray, how: str = "min") -> np.ndarray:
    """A solution's PRM score [N] from its step probabilities [N, L] at ``step_mask``.

    ``how``: ``min`` (the weakest step, Lightman et al. 2023), ``product`` (the
    chance every step is right, read as independent) or ``last`` (the final step's,
    which judges the whole solution). Rows without a step score 0, below any real
    solution.
    """
    on = step_mask > 0
    if how == "min":
        worst = np.where(on, step_probs, np.inf).min(axis=1)
        return np.where(np.isfinite(worst), worst, 0.0)
    if how == "product":
        return np.where(on.any(axis=1), np.prod(np.where(on, step_probs, 1.0), axis=1), 0.0)
    if how == "last":
        last = step_probs.shape[1] - 1 - np.argmax(on[:, ::-1], axis=1)
        return np.where(on.any(axis=1), step_probs[np.arange(len(on)), last], 0.0)
    raise ValueError(f"how must be 'min', 'product' or 'last', got {how!r}")


def best_of_n(
    scores: np.ndarray,  # [M, N] score of each of N candidates for M problems
    correct: np.ndarray,  # [M, N] verifier verdicts
    answers: Sequence[Sequence[str | None]],  # [M][N] extracted final answers
) -> dict[str, float]:
    """Held-out accuracy of picking one of N candidates by score, at random, or by majority.

    ``reranked`` takes the best-scored candidate; ``weighted_vote`` the answer whose
    candidates' scores sum highest (Math-Shepherd's PRM-weighted self-consistency;
    scores must be non-negative, such as probabilities); ``random`` is the exact
    expectation (mean correctness); ``majority`` picks the most frequent non-empty
    answer. Voting ties go to the answer seen first; a vote counts a problem solved
    when a candidate with the winning answer is correct.
    """
    scores = np.asarray(scores, np.float64)
    correct = np.asarray(correct, bool)
    if scores.shape != correct.shape:
        raise ValueError(f"scores {scores.shape} and correct {correct.shape} differ")
    picked = correct[np.arange(len(scores)), np.argmax(scores, axis=1)]
    if np.any(scores < 0):
        raise ValueError("best_of_n: weighted voting needs non-negative scores")

    def vote(row_answers, row_correct, weights) -> bool:
        totals: dict[str, float] = collections.defaultdict(float)
        for a, w in zip(row_answers, weights):
            if a:
                totals[a] += w
        if not totals:
            return False
        top = max(totals.values())
        winner = next(a for a in row_answers if a and totals[a] == top)
        return any(c for a, c in zip(row_answers, row_correct) if a == winner)

    majority = [vote(a, c, np.ones(len(a))) for a, c in zip(answers, correct)]
    weighted = [vote(a, c, s) for a, c, s in zip(answers, correct, scores)]
    return {
        "reranked": float(np.mean(picked)),
        "weighted_vote": float(np.mean(weighted)),
        "random": float(np.mean(correct)),
        "majority": float(np.mean(majority)),
    }
