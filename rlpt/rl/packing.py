"""Sequence packing for the PPO forward passes: padding-free scoring and updates.

A rollout batch is ``[B, P + T]``: every prompt left-padded to the longest prompt
bucket and every response right-padded to the longest response. When prompts and
responses vary a lot in length (a batch mixing ``7+5=`` with a program
specification), most of the forward and backward pass is spent on padding.
Packing places the real tokens of several sequences side by side in one row of
the same width, each sequence its own segment (attention never crosses a segment
boundary, rotary positions restart at 0), and gathers the logits back to the
batch's ``[B, T]`` response layout, so every loss, advantage and metric is
computed exactly as without packing.

The layout is planned on the host from the batch's ``input_mask`` (first-fit
decreasing bin packing; Grain's packing transforms pack a data stream into
training examples, not a batch into rows with an index back to it, so this small
planner is written here). Row counts are rounded up to ``ROW_MULTIPLE`` (and to
the data-parallel size) so a run compiles for a handful of shapes only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# Packed row counts are rounded up to a multiple of this: fewer distinct shapes to
# compile, at the cost of at most this many rows of padding.
ROW_MULTIPLE = 4


@struct.dataclass
class PackedRows:
    """Sequences of a batch (or of each unit of an update plan) packed into rows.

    Leading dimensions (``[...]``) are the plan's units: none for scoring,
    ``[E, M, G]`` (epochs, minibatches, microbatches) for an update.
    """

    tokens: jax.Array  # [..., N, L] int32
    positions: jax.Array  # [..., N, L] int32, restarting at 0 in each segment
    input_mask: jax.Array  # [..., N, L] bool, real tokens
    segment_ids: jax.Array  # [..., N, L] int32, 1.. per sequence in a row, 0 for padding
    # Flat index into the unit's N * L positions of the logits that predict response
    # token t of the unit's row b (its previous real token); 0 where there is none.
    logit_index: jax.Array  # [..., b, T] int32


@struct.dataclass
class UpdatePlan:
    """What a packed ``ppo_update`` needs beyond the batch: the shuffles and their layouts."""

    permutations: jax.Array  # [E, B] int32, row order of each epoch
    rows: PackedRows  # leading [E, M, G]


def row_multiple(data_parallel: int = 1) -> int:
    """Packed row counts are multiples of this: ``ROW_MULTIPLE`` and the data-parallel size."""
    return math.lcm(ROW_MULTIPLE, max(int(data_parallel), 1))


def _spans(input_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and length of each row's real tokens, which must be one contiguous run."""
    input_mask = np.asarray(input_mask, bool)
    lengths = input_mask.sum(axis=1)
    starts = np.argmax(input_mask, axis=1)
    width = input_mask.shape[1]
    cols = np.arange(width)
    contiguous = input_mask == ((cols >= starts[:, None]) & (cols < (starts + lengths)[:, None]))
    bad = np.flatnonzero(~contiguous.all(axis=1))
    if bad.size:
        raise ValueError(
            f"packing needs each row's real tokens to be one contiguous run (a left-padded "
            f"prompt followed by its response); rows {bad[:5].tolist()} are not"
        )
    return starts, lengths


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) holding items of ``lengths`` within ``capacity`` each."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        size = int(lengths[i])
        if size > capacity:
            raise ValueError(f"a sequence of {size} tokens does not fit a row of {capacity}")
        for b, free in enumerate(room):
            if size <= free:
                bins[b].append(i)
                room[b] -= size
                break
        else:
            bins.append([i])
            room.append(capacity - size)
    return bins


def rows_needed(input_mask: np.ndarray, units: np.ndarray) -> int:
    """The most packed rows any unit (a row of ``units``: batch row indices) needs."""
    _, lengths = _spans(input_mask)
    width = np.asarray(input_mask).shape[1]
    return max(len(first_fit_decreasing(lengths[u], width)) for u in np.asarray(units))


def pack_unit(
    tokens: np.ndarray,  # [B, L]
    input_mask: np.ndarray,  # [B, L] bool
    prompt_len: int,
    rows: np.ndarray,  # [b] batch row indices, in the unit's order
    n_rows: int,
) -> dict[str, np.ndarray]:
    """The packed layout of batch ``rows`` in ``n_rows`` rows of width ``L`` (numpy)."""
    tokens = np.asarray(tokens)
    input_mask = np.asarray(input_mask, bool)
    starts, lengths = _spans(input_mask)
    width = tokens.shape[1]
    response_len = width - prompt_len
    rows = np.asarray(rows)
    bins = first_fit_decreasing(lengths[rows], width)
    if len(bins) > n_rows:
        raise ValueError(f"the unit needs {len(bins)} packed rows, only {n_rows} planned")
    out_tokens = np.zeros((n_rows, width), np.int32)
    out_positions = np.zeros((n_rows, width), np.int32)
    out_segments = np.zeros((n_rows, width), np.int32)
    logit_index = np.zeros((len(rows), response_len), np.int32)
    for r, members in enumerate(bins):
        offset = 0
        for segment, j in enumerate(members, start=1):
            src = rows[j]
            start, n = int(starts[src]), int(lengths[src])
            out_tokens[r, offset : offset + n] = tokens[src, start : start + n]
            out_positions[r, offset : offset + n] = np.arange(n)
            out_segments[r, offset : offset + n] = segment
            # Response token t sits at column prompt_len + t of the batch row, i.e. at
            # offset + (prompt_len + t - start) here; its logits come one position earlier.
            t = np.arange(response_len)
            src_col = prompt_len + t - 1
            real = (src_col >= start) & (src_col < start + n - 1)
            logit_index[j] = np.where(real, r * width + offset + src_col - start, 0)
            offset += n
    return {
        "tokens": out_tokens,
        "positions": out_positions,
        "input_mask": out_segments > 0,
        "segment_ids": out_segments,
        "logit_index": logit_index,
    }


def pack_batch(batch, data_parallel: int = 1) -> PackedRows:
    """The whole batch packed as one unit (for scoring), rows in batch order."""
    input_mask = np.asarray(batch.input_mask)
    everything = np.arange(input_mask.shape[0])[None]
    n_rows = _round_up(rows_needed(input_mask, everything), row_multiple(data_parallel))
    tokens = np.asarray(batch.tokens)
    packed = pack_unit(tokens, input_mask, batch.prompt_len, everything[0], n_rows)
    return PackedRows(**{k: jnp.asarray(v) for k, v in packed.items()})


def plan_update(
    batch,
    permutations: np.ndarray,  # [E, B]
    num_minibatches: int,
    grad_accum: int,
    data_parallel: int = 1,
) -> UpdatePlan:
    """Packed layouts of every (epoch, minibatch, microbatch) of a PPO update.

    Units are consecutive slices of each epoch's permutation, exactly as the
    unpacked update splits the shuffled batch; all share one row count (the most
    any unit needs, rounded up) so the update scans over them.
    """
    permutations = np.asarray(permutations)
    epochs, batch_size = permutations.shape
    per_unit = batch_size // (num_minibatches * grad_accum)
    units = permutations.reshape(epochs * num_minibatches * grad_accum, per_unit)
    input_mask = np.asarray(batch.input_mask)
    tokens = np.asarray(batch.tokens)
    n_rows = _round_up(rows_needed(input_mask, units), row_multiple(data_parallel))
    packed = [pack_unit(tokens, input_mask, batch.prompt_len, u, n_rows) for u in units]
    lead = (epochs, num_minibatches, grad_accum)
    stacked = {
        k: jnp.asarray(np.stack([p[k] for p in packed]).reshape(lead + packed[0][k].shape))
        for k in packed[0]
    }
    return UpdatePlan(
        permutations=jnp.asarray(permutations.astype(np.int32)), rows=PackedRows(**stacked)
    )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
