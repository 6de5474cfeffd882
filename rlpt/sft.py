"""Supervised warm start: next-token cross-entropy on demonstrations, completion tokens only.

Examples are ``(prompt, completion)`` text pairs: either demonstrations the task
domains write for their own training tasks (``Domain.demonstration``) or a user's JSONL
file with ``prompt`` and ``completion`` fields. Each becomes the token row

    <bos> prompt completion <eos>

exactly as the RL stage lays a prompt and its response out, right-padded to
``max_len``; the loss covers only the completion and ``<eos>`` targets.

How long the warm start trains is a fixed rule, not a tuned number: it consumes a
budget of completion tokens (``token_budget``), in a data order fixed by the seed.
The learning rate warms up linearly and then stays constant, so "more SFT" (the
continued-SFT control) is the same recipe run longer.

With chunked reasoning (``rollout.chunked_reasoning``, Delethink) a demonstration longer
than the model's window is cut into the examples chunked generation makes of it
(``encode_chunked_example``): chunk ``k`` is the row ``<bos> prompt carry chunk``, where
the carry is the last ``m`` completion tokens before the chunk, and the loss covers the
chunk. The cuts come from ``rlpt.sampling.chunked.chunk_spans``, the function the PPO
stage uses to rebuild rollouts' chunks, so supervised and RL rows are the same windows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rlpt.models.transformer import positions_from_mask
from rlpt.parallel.sharding import DEFAULT_RULES, Rules
from rlpt.sampling.chunked import chunk_spans
from rlpt.supervised import Batch, SupervisedTrainer, TrainConfig
from rlpt.tasks import Domain, stable_hash
from rlpt.tokenizers import Tokenizer


def train_config(learning_rate: float, warmup_steps: int, weight_decay: float = 0.0) -> TrainConfig:
    """SFT's optimiser settings: clip at global norm 1, AdamW warming up linearly from
    ``learning_rate / warmup_steps`` to a constant ``learning_rate`` (at least one step)."""
    warmup = max(warmup_steps, 1)
    return TrainConfig(
        learning_rate=learning_rate, weight_decay=weight_decay, max_grad_norm=1.0,
        warmup_steps=warmup, warmup_init=learning_rate / warmup,
    )  # fmt: skip


def next_token_loss(
    logits: jax.Array, targets: jax.Array, weights: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Weighted mean negative log-likelihood of ``targets`` and the weighted accuracy.

        loss = Σ_{b,t} w_{bt} · -log softmax(logits_{bt})[targets_{bt}] / max(Σ w, 1)

    Args:
      logits: `[B, T, V]` (any float dtype; the softmax runs in float32).
      targets: `[B, T]` int token ids.
      weights: `[B, T]` float, 1 for the targets that count.
    """
    chex.assert_rank(logits, 3)
    chex.assert_equal_shape([targets, weights, logits[..., 0]])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, T]
    return _weighted_nll(target_logp, jnp.argmax(logits, axis=-1), targets, weights)


def _weighted_nll(
    target_logp: jax.Array, argmax: jax.Array, targets: jax.Array, weights: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``next_token_loss`` from per-token log p(target) and most likely ids [B, T]."""
    nll = -target_logp
    count = jnp.maximum(weights.sum(), 1.0)
    correct = (argmax == targets).astype(jnp.float32)
    return (nll * weights).sum() / count, {"token_accuracy": (correct * weights).sum() / count}


def sft_objective(graphdef: Any, params: Any, batch: Batch, frozen: Any = None):
    """Next-token cross-entropy on the completion tokens of a batch of rows [N, L].

    ``batch``: ``tokens`` [N, L]; ``loss_mask`` [N, L], where ``loss_mask[:, t]`` marks
    token t as a target, predicted from position t - 1; optionally ``mask`` [N, L] of
    real tokens (left padding; without it rows are right-padded and need no mask, since
    attention is causal and no real token sees a pad). ``frozen``: model variables held
    fixed outside ``params`` (a LoRA policy's base).
    """
    tokens = batch["tokens"]
    inputs = tokens[:, :-1]
    if batch.get("mask") is None:
        input_mask = jnp.ones(inputs.shape, bool)
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    else:
        input_mask = batch["mask"][:, :-1].astype(bool)
        positions = positions_from_mask(input_mask)
    states = (params,) if frozen is None else (params, frozen)
    model = nnx.merge(graphdef, *states)
    hidden, _ = model.trunk(inputs, positions, input_mask)  # [N, L - 1, D]
    targets = tokens[:, 1:]
    # The model's vocabulary head: with ``vocab_chunk`` > 0 no [N, L, V] logits are built.
    stats = model.target_log_probs(hidden, targets, with_argmax=True)
    weights = batch["loss_mask"][:, 1:].astype(jnp.float32)
    return _weighted_nll(stats.log_probs, stats.argmax, targets, weights)


def sft_trainer(
    cfg: TrainConfig,
    graphdef: Any,
    *,
    frozen: Any = None,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
) -> SupervisedTrainer:
    """The supervised trainer on ``sft_objective``; batches are dicts of ``tokens`` and
    ``loss_mask`` (and optionally ``mask``)."""
    return SupervisedTrainer(cfg, graphdef, sft_objective, mesh=mesh, rules=rules, frozen=frozen)


def encode_example(
    tokenizer: Tokenizer, prompt: str, completion: str, max_len: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """(tokens [max_len], loss_mask [max_len]) for one example, or None if it is too long."""
    prompt_ids = tokenizer.encode(prompt, add_bos=True)
    completion_ids = tokenizer.encode(completion, add_eos=True)
    return _padded_row(tokenizer.pad_id, prompt_ids, completion_ids, max_len)


def _padded_row(
    pad_id: int, context: Sequence[int], targets: Sequence[int], max_len: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """``context + targets`` right-padded to ``max_len`` and the mask of the targets, or None
    if they do not fit."""
    n = len(context) + len(targets)
    if n > max_len:
        return None
    tokens = np.full(max_len, pad_id, np.int32)
    mask = np.zeros(max_len, np.int32)
    tokens[:n] = list(context) + list(targets)
    mask[len(context) : n] = 1
    return tokens, mask


def chunked_examples(
    prompt_ids: Sequence[int], completion_ids: Sequence[int], chunk_tokens: int, carry_tokens: int
) -> list[tuple[list[int], list[int]]]:
    """``(context, chunk)`` per chunk of a completion: the context chunked generation
    feeds the model (prompt, then the last ``carry_tokens`` completion tokens before the
    chunk) and the ``chunk_tokens`` (or fewer, at the end) it should write."""
    prompt_ids, completion_ids = list(prompt_ids), list(completion_ids)
    return [
        (prompt_ids + completion_ids[carry_start:start], completion_ids[start:end])
        for carry_start, start, end in chunk_spans(len(completion_ids), chunk_tokens, carry_tokens)
    ]


def encode_chunked_example(
    tokenizer: Tokenizer,
    prompt: str,
    completion: str,
    max_len: int,
    *,
    chunk_tokens: int,
    carry_tokens: int,
) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """One ``(tokens [max_len], loss_mask [max_len])`` row per chunk of the completion
    (``chunked_examples``; the completion ends in ``<eos>`` as a finished trace does), or
    None if a row is longer than ``max_len``. Rows are right-padded with positions from 0,
    as the sampler's left-padded contexts are numbered."""
    prompt_ids = tokenizer.encode(prompt, add_bos=True)
    completion_ids = tokenizer.encode(completion, add_eos=True)
    rows = []
    for context, chunk in chunked_examples(prompt_ids, completion_ids, chunk_tokens, carry_tokens):
        row = _padded_row(tokenizer.pad_id, context, chunk, max_len)
        if row is None:
            return None
        rows.append(row)
    return rows


def demonstration(domains: Mapping[str, Domain], levels: Mapping[str, int], seed: int, i: int):
    """Example ``i`` of the demonstration stream: ``(prompt, completion)``.

    Domains take turns; within a domain, levels ``1..levels[d]`` take turns; the
    task is the domain's training task for a seed hashed from ``(seed, i)``.
    """
    names = sorted(domains)
    name = names[i % len(names)]
    level = 1 + (i // len(names)) % int(levels[name])
    task = domains[name].generate("train", stable_hash("rlpt-sft", seed, i) % (1 << 62), level)
    return task.prompt, domains[name].demonstration(task)


def fixed_demonstrations(
    domains: Mapping[str, Domain], levels: Mapping[str, int], seed: int, per_domain: int
) -> list[tuple[str, str]]:
    """The first ``per_domain`` demonstrations of each domain in the stream's order
    (levels taking turns): a fixed, small supervised set."""
    return [demonstration(domains, levels, seed, i) for i in range(per_domain * len(domains))]


def read_jsonl_examples(path: str) -> list[tuple[str, str]]:
    """``(prompt, completion)`` pairs from a JSONL file; a line without them is an error."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "prompt" not in record or "completion" not in record:
                raise ValueError(f"{path}:{lineno}: a record needs 'prompt' and 'completion'")
            out.append((str(record["prompt"]), str(record["completion"])))
    if not out:
        raise ValueError(f"{path}: no examples")
    return out


class ExampleStream:
    """Encoded SFT batches in a fixed order, resumable by the example counter.

    ``next_batch()`` gives ``(tokens, loss_mask, completion_tokens)``. With
    ``chunk_tokens`` set, each example gives one row per chunk (``encode_chunked_example``)
    and a batch may end inside an example. ``position`` is how many examples were started
    and ``chunk_offset`` how many rows of the last one were used: store both to resume
    (``seek``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        batch_size: int,
        max_len: int,
        domains: Mapping[str, Domain] | None = None,
        levels: Mapping[str, int] | None = None,
        examples: Sequence[tuple[str, str]] | None = None,
        seed: int = 0,
        position: int = 0,
        chunk_tokens: int | None = None,
        carry_tokens: int = 0,
    ):
        if examples is None and not domains:
            raise ValueError("SFT needs domains to write demonstrations or a JSONL file")
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_len = max_len
        self.domains = domains
        self.levels = levels
        self.examples = list(examples) if examples is not None else None
        self.seed = seed
        self.chunk_tokens = chunk_tokens
        self.carry_tokens = carry_tokens
        self.too_long = 0
        self.seek(position)

    def seek(self, position: int, chunk_offset: int = 0) -> None:
        """Resume after example ``position - 1``'s first ``chunk_offset`` rows."""
        self.position = position
        self.chunk_offset = chunk_offset
        self._pending: list[tuple[np.ndarray, np.ndarray]] | None = None

    def _example(self, i: int) -> tuple[str, str]:
        if self.examples is not None:
            # Epoch e visits the examples in a permutation fixed by (seed, e).
            n = len(self.examples)
            epoch, j = divmod(i, n)
            perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            return self.examples[perm[j]]
        return demonstration(self.domains, self.levels, self.seed, i)

    def rows(self, i: int) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Example ``i``'s rows, or None if one is longer than ``max_len``."""
        prompt, completion = self._example(i)
        if self.chunk_tokens is None:
            encoded = encode_example(self.tokenizer, prompt, completion, self.max_len)
            return None if encoded is None else [encoded]
        return encode_chunked_example(
            self.tokenizer, prompt, completion, self.max_len,
            chunk_tokens=self.chunk_tokens, carry_tokens=self.carry_tokens,
        )  # fmt: skip

    def next_batch(self) -> tuple[np.ndarray, np.ndarray, int]:
        if self._pending is None:
            # After a seek: the rest of the example a batch ended in.
            done = self.position > 0 and self.chunk_offset > 0
            self._pending = (
                (self.rows(self.position - 1) or [])[self.chunk_offset :] if done else []
            )
        rows, masks = [], []
        skipped_in_a_row = 0
        while len(rows) < self.batch_size:
            if not self._pending:
                encoded = self.rows(self.position)
                self.position += 1
                self.chunk_offset = 0
                if encoded is None:
                    self.too_long += 1
                    skipped_in_a_row += 1
                    if skipped_in_a_row > 1000:
                        raise ValueError(f"SFT examples keep exceeding sft.max_len={self.max_len}")
                    continue
                skipped_in_a_row = 0
                self._pending = encoded
            row, mask = self._pending.pop(0)
            self.chunk_offset += 1
            rows.append(row)
            masks.append(mask)
        tokens, mask = np.stack(rows), np.stack(masks)
        return tokens, mask, int(mask.sum())


def heldout_batch(
    tokenizer: Tokenizer,
    pairs: Sequence[tuple[str, str]],
    max_len: int,
    *,
    chunk_tokens: int | None = None,
    carry_tokens: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """One batch of held-out examples for the held-out SFT loss (too-long ones dropped;
    with ``chunk_tokens``, every chunk row of every example)."""
    if chunk_tokens is None:
        enc = [e for e in (encode_example(tokenizer, p, c, max_len) for p, c in pairs) if e]
    else:
        enc = [
            row
            for p, c in pairs
            for row in encode_chunked_example(
                tokenizer, p, c, max_len, chunk_tokens=chunk_tokens, carry_tokens=carry_tokens
            )
            or []
        ]
    if not enc:
        raise ValueError(f"no held-out SFT example fits sft.max_len={max_len}")
    return np.stack([e[0] for e in enc]), np.stack([e[1] for e in enc])


def steps_for_budget(stream: ExampleStream, token_budget: int) -> int:
    """How many batches the token budget buys, by reading the stream (not consuming it)."""
    probe = ExampleStream(
        stream.tokenizer, batch_size=stream.batch_size, max_len=stream.max_len,
        domains=stream.domains, levels=stream.levels, examples=stream.examples,
        seed=stream.seed, chunk_tokens=stream.chunk_tokens, carry_tokens=stream.carry_tokens,
    )  # fmt: skip
    steps, seen = 0, 0
    while seen < token_budget:
        seen += probe.next_batch()[2]
        steps += 1
    return max(steps, 1)


__all__ = [
    "ExampleStream",
    "chunked_examples",
    "demonstration",
    "encode_chunked_example",
    "encode_example",
    "fixed_demonstrations",
    "heldout_batch",
    "next_token_loss",
    "read_jsonl_examples",
    "sft_objective",
    "sft_trainer",
    "steps_for_budget",
    "train_config",
]
