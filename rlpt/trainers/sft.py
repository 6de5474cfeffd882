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
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from rlpt.tasks import Domain, stable_hash
from rlpt.tokenizers import Tokenizer


@struct.dataclass
class SFTState:
    step: jax.Array  # int32 optimiser steps taken
    params: Any  # nnx.State of the policy
    opt_state: Any


def make_optimizer(learning_rate: float, warmup_steps: int, weight_decay: float = 0.0):
    """Clip at global norm 1, AdamW with linear warmup to a constant ``learning_rate``."""
    schedule = optax.join_schedules(
        [
            optax.linear_schedule(learning_rate / max(warmup_steps, 1), learning_rate,
                                  max(warmup_steps, 1)),
            optax.constant_schedule(learning_rate),
        ],
        [max(warmup_steps, 1)],
    )  # fmt: skip
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=weight_decay)
    )


def init_sft_state(params: Any, tx: optax.GradientTransformation) -> SFTState:
    return SFTState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def sft_loss(
    graphdef: Any, params: Any, tokens: jax.Array, loss_mask: jax.Array, frozen: Any = None
):
    """Mean cross-entropy over the masked targets; ``tokens`` and ``loss_mask`` are [B, L].

    The target of position ``t`` is ``tokens[:, t + 1]``; ``loss_mask[:, t + 1]`` says
    whether it counts. Rows are right-padded, so positions are ``0..L-1``.
    """
    inputs = tokens[:, :-1]
    targets = tokens[:, 1:]
    weights = loss_mask[:, 1:].astype(jnp.float32)
    # Rows are right-padded and attention is causal, so no real token sees a pad: no mask.
    input_mask = jnp.ones(inputs.shape, bool)
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    states = (params,) if frozen is None else (params, frozen)
    logits, _ = nnx.merge(graphdef, *states)(inputs, positions, input_mask)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    count = jnp.maximum(weights.sum(), 1.0)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return (nll * weights).sum() / count, {"token_accuracy": (correct * weights).sum() / count}


def sft_step(
    graphdef: Any, tx: optax.GradientTransformation, state: SFTState, batch, frozen: Any = None
):
    """One AdamW step on a ``(tokens, loss_mask)`` batch -> ``(state, metrics)``.

    Only ``state.params`` is trained; ``frozen`` (a LoRA base) gets no gradient.
    """
    tokens, loss_mask = batch
    (loss, aux), grads = jax.value_and_grad(functools.partial(sft_loss, graphdef), has_aux=True)(
        state.params, tokens, loss_mask, frozen
    )
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), **aux}
    return SFTState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def make_step_fns(graphdef: Any, tx: optax.GradientTransformation, frozen: Any = None):
    """Jitted ``(train_step(state, batch), eval_loss(params, tokens, loss_mask))``.

    The train step donates its state. ``frozen``: model variables held fixed outside
    the trained ``params`` (a LoRA policy's base), merged in at every call.
    """
    step = jax.jit(functools.partial(sft_step, graphdef, tx), donate_argnums=0)
    loss = jax.jit(lambda params, tokens, mask, frozen: sft_loss(
        graphdef, params, tokens, mask, frozen)[0])  # fmt: skip

    def train(state, batch):
        return step(state, batch, frozen)

    def eval_loss(params, tokens, loss_mask):
        return loss(params, tokens, loss_mask, frozen)

    return train, eval_loss


def encode_example(
    tokenizer: Tokenizer, prompt: str, completion: str, max_len: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """(tokens [max_len], loss_mask [max_len]) for one example, or None if it is too long."""
    prompt_ids = tokenizer.encode(prompt, add_bos=True)
    completion_ids = tokenizer.encode(completion, add_eos=True)
    n = len(prompt_ids) + len(completion_ids)
    if n > max_len:
        return None
    tokens = np.full(max_len, tokenizer.pad_id, np.int32)
    mask = np.zeros(max_len, np.int32)
    tokens[:n] = prompt_ids + completion_ids
    mask[len(prompt_ids) : n] = 1
    return tokens, mask


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

    ``next_batch()`` gives ``(tokens, loss_mask, completion_tokens)``; ``position`` is
    how many examples were consumed (store it to resume).
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
        self.position = position
        self.too_long = 0

    def _example(self, i: int) -> tuple[str, str]:
        if self.examples is not None:
            # Epoch e visits the examples in a permutation fixed by (seed, e).
            n = len(self.examples)
            epoch, j = divmod(i, n)
            perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            return self.examples[perm[j]]
        return demonstration(self.domains, self.levels, self.seed, i)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray, int]:
        rows, masks = [], []
        skipped_in_a_row = 0
        while len(rows) < self.batch_size:
            encoded = encode_example(self.tokenizer, *self._example(self.position), self.max_len)
            self.position += 1
            if encoded is None:
                self.too_long += 1
                skipped_in_a_row += 1
                if skipped_in_a_row > 1000:
                    raise ValueError(f"SFT examples keep exceeding sft.max_len={self.max_len}")
                continue
            skipped_in_a_row = 0
            rows.append(encoded[0])
            masks.append(encoded[1])
        tokens, mask = np.stack(rows), np.stack(masks)
        return tokens, mask, int(mask.sum())


def heldout_batch(
    tokenizer: Tokenizer, pairs: Sequence[tuple[str, str]], max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """One batch of held-out examples for the held-out SFT loss (too-long ones dropped)."""
    enc = [e for e in (encode_example(tokenizer, p, c, max_len) for p, c in pairs) if e]
    return np.stack([e[0] for e in enc]), np.stack([e[1] for e in enc])


def steps_for_budget(stream: ExampleStream, token_budget: int) -> int:
    """How many batches the token budget buys, by reading the stream (not consuming it)."""
    probe = ExampleStream(
        stream.tokenizer, batch_size=stream.batch_size, max_len=stream.max_len,
        domains=stream.domains, levels=stream.levels, examples=stream.examples,
        seed=stream.seed,
    )  # fmt: skip
    steps, seen = 0, 0
    while seen < token_budget:
        seen += probe.next_batch()[2]
        steps += 1
    return max(steps, 1)


def lr_at(step: int, learning_rate: float, warmup_steps: int) -> float:
    w = max(warmup_steps, 1)
    if step >= w:
        return learning_rate
    return learning_rate / w + (learning_rate - learning_rate / w) * step / w


__all__ = [
    "ExampleStream",
    "SFTState",
    "demonstration",
    "encode_example",
    "heldout_batch",
    "init_sft_state",
    "lr_at",
    "make_optimizer",
    "make_step_fns",
    "read_jsonl_examples",
    "sft_loss",
    "sft_step",
    "steps_for_budget",
]
