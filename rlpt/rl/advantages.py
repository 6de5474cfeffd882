"""Critic-free advantage estimators for several sampled responses per prompt.

Sequence-level arrays are `[B]` with `group_ids` `[B]` (int in [0, num_groups))
naming the prompt each sample answers. Group statistics use segment sums, so
every function jits with a static `num_groups`; ids outside [0, num_groups) are
dropped from the statistics and their advantage is undefined.

`valid` `[B]` (float, 1 keep, 0 exclude) removes samples that must not be scored
(for instance a sandbox failure): they neither count in their group's statistics
nor receive an advantage (their advantage is 0).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from rlpt.models.heads import last_token_index


def _check_group_args(
    name: str, rewards: jax.Array, group_ids: jax.Array, valid: jax.Array | None
) -> jax.Array:
    chex.assert_rank(rewards, 1, custom_message=f"{name}: `rewards` must be [B]")
    chex.assert_type(rewards, float, custom_message=f"{name}: `rewards` must be float")
    chex.assert_equal_shape(
        [rewards, group_ids], custom_message=f"{name}: `group_ids` must be [B] like `rewards`"
    )
    chex.assert_type(group_ids, int, custom_message=f"{name}: `group_ids` must be integer")
    if valid is None:
        return jnp.ones(rewards.shape, jnp.float32)
    chex.assert_equal_shape(
        [rewards, valid], custom_message=f"{name}: `valid` must be [B] like `rewards`"
    )
    return (valid > 0).astype(jnp.float32)


def _group_sum(x: jax.Array, group_ids: jax.Array, num_groups: int) -> jax.Array:
    """Per-group sum gathered back to each sample: `[B]` -> `[B]`."""
    sums = jax.ops.segment_sum(x, group_ids, num_segments=num_groups)  # [G]
    return sums[group_ids]  # [B]


def grpo_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    *,
    num_groups: int,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    valid: jax.Array | None = None,
) -> jax.Array:
    """Group-relative advantages: GRPO (Shao et al. 2024, arXiv:2402.03300).

        A_i = (r_i - mean_g) / (std_g + eps)        scale_by_std=True (GRPO)
        A_i = r_i - mean_g                          scale_by_std=False (Dr. GRPO,
                                                    Liu et al. 2025, arXiv:2503.20783)

    mean_g and std_g are over the valid members of sample i's group; std_g is the
    population standard deviation (ddof=0), so a group of one valid sample, or one
    whose rewards are all equal, gets advantage 0.

    Args:
      rewards: `[B]` float sequence rewards.
      group_ids: `[B]` int group of each sample, in [0, num_groups).
      num_groups: number of groups G (static).
      scale_by_std: divide by the group std (GRPO) or not (Dr. GRPO).
      eps: added to the std before dividing.
      valid: optional `[B]` float mask; excluded samples get 0 and are not counted.

    Returns:
      `[B]` float32 advantages.
    """
    valid = _check_group_args("grpo_advantages", rewards, group_ids, valid)
    r = jnp.where(valid > 0, rewards.astype(jnp.float32), 0.0)  # [B]
    count = jnp.maximum(_group_sum(valid, group_ids, num_groups), 1.0)  # [B]
    mean = _group_sum(r, group_ids, num_groups) / count  # [B]
    centred = (r - mean) * valid  # [B]
    if scale_by_std:
        var = _group_sum(jnp.square(centred), group_ids, num_groups) / count  # [B]
        centred = centred / (jnp.sqrt(var) + eps)
    return centred * valid


def rloo_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    *,
    num_groups: int,
    valid: jax.Array | None = None,
) -> jax.Array:
    """REINFORCE leave-one-out advantages (Ahmadian et al. 2024, arXiv:2402.14740).

        A_i = r_i - (1 / (n_g - 1)) Σ_{j in g, j != i} r_j  =  n_g / (n_g - 1) (r_i - mean_g)

    over the n_g valid members of sample i's group; a group with a single valid
    member has no baseline and gets advantage 0.

    Args:
      rewards: `[B]` float sequence rewards.
      group_ids: `[B]` int group of each sample, in [0, num_groups).
      num_groups: number of groups G (static).
      valid: optional `[B]` float mask; excluded samples get 0 and are not counted.

    Returns:
      `[B]` float32 advantages.
    """
    valid = _check_group_args("rloo_advantages", rewards, group_ids, valid)
    r = jnp.where(valid > 0, rewards.astype(jnp.float32), 0.0)  # [B]
    count = _group_sum(valid, group_ids, num_groups)  # [B]
    others = count - 1.0  # [B]
    baseline = (_group_sum(r, group_ids, num_groups) - r) / jnp.maximum(others, 1.0)  # [B]
    return jnp.where((others > 0) & (valid > 0), r - baseline, 0.0)


def process_group_advantages(
    rewards: jax.Array,
    reward_positions: jax.Array,
    mask: jax.Array,
    group_ids: jax.Array,
    *,
    num_groups: int,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    valid: jax.Array | None = None,
) -> jax.Array:
    """Token advantages from per-step rewards: process supervision in GRPO (Shao et al.
    2024, arXiv:2402.03300, section 4.1.3).

    Every reward entry (a step's process reward, the outcome at the last token) is
    normalised by the mean (and std) of all reward entries of the valid samples in its
    group, and a token's advantage is the sum of the normalised rewards at or after it:

        r~ = (r - mean_g) / (std_g + eps)          A_t = Σ_{t' >= t} r~_{t'}

    so a token before a wrong step is credited differently from one after it, which a
    single sequence-level scalar cannot do. With rewards only at the last token this is
    ``grpo_advantages`` broadcast to every token.

    Args:
      rewards: `[B, T]` float per-token rewards (read only at ``reward_positions``).
      reward_positions: `[B, T]` 1 where a reward entry sits (step ends, the last token).
      mask: `[B, T]` response mask.
      group_ids: `[B]` int group of each sample, in [0, num_groups).
      num_groups: number of groups G (static).
      scale_by_std: divide by the group std (GRPO) or not (Dr. GRPO).
      eps: added to the std before dividing.
      valid: optional `[B]` float mask; excluded samples get 0 and are not counted.

    Returns:
      `[B, T]` float32 advantages, zero outside ``mask``.
    """
    chex.assert_rank([rewards, reward_positions, mask], 2)
    chex.assert_equal_shape([rewards, reward_positions, mask])
    valid = _check_group_args("process_group_advantages", rewards[:, 0], group_ids, valid)
    mask = mask.astype(jnp.float32)
    at = reward_positions.astype(jnp.float32) * mask * valid[:, None]  # [B, T]
    r = jnp.where(at > 0, rewards.astype(jnp.float32), 0.0)  # [B, T]
    count = jnp.maximum(_group_sum(jnp.sum(at, 1), group_ids, num_groups), 1.0)  # [B]
    mean = _group_sum(jnp.sum(r, 1), group_ids, num_groups) / count  # [B]
    centred = (r - mean[:, None]) * at  # [B, T]
    if scale_by_std:
        var = _group_sum(jnp.sum(jnp.square(centred), 1), group_ids, num_groups) / count
        centred = centred / (jnp.sqrt(var) + eps)[:, None]
    to_go = jnp.flip(jnp.cumsum(jnp.flip(centred, 1), 1), 1)  # [B, T]
    return to_go * mask * valid[:, None]


def trace_advantages(
    rewards: jax.Array,
    mask: jax.Array,
    row_trace: jax.Array,
    trace_group: jax.Array,
    row_valid: jax.Array,
    *,
    num_groups: int,
    estimator: str,
    eps: float = 1e-6,
) -> jax.Array:
    """Token advantages for rows that are chunks of longer traces (Delethink, Aghajohari
    et al. 2025, arXiv:2510.06557): every chunk of a trace gets the trace's advantage.

    A trace's reward is the sum of its rows' per-token rewards (the outcome on its last
    chunk plus any per-token terms over all chunks), so it equals what the same
    estimator would see for the unchunked trace; the group baseline is taken over
    traces, not rows, so a long trace counts once in its group however many chunks it
    has. A trace is valid when all its rows are.

    Args:
      rewards: `[R, T]` float per-token rewards of the rows.
      mask: `[R, T]` response mask.
      row_trace: `[R]` int trace of each row in [0, N); -1 (or any id outside) for
        filler rows, which get 0.
      trace_group: `[N]` int group of each trace, in [0, num_groups).
      row_valid: `[R]` float, 1 for rows in the loss.
      num_groups: G (static).
      estimator: "grpo", "dr_grpo" or "rloo".

    Returns:
      `[R, T]` float32 advantages, zero outside ``mask`` and on filler rows.
    """
    chex.assert_rank([rewards, mask], 2)
    chex.assert_equal_shape([rewards, mask])
    chex.assert_rank([row_trace, trace_group, row_valid], 1)
    num_traces = trace_group.shape[0]
    real = (row_trace >= 0) & (row_trace < num_traces)
    ids = jnp.where(real, row_trace, num_traces)  # filler rows fall outside every segment
    row_reward = jnp.sum(rewards.astype(jnp.float32) * mask, axis=1)  # [R]
    trace_reward = jax.ops.segment_sum(row_reward, ids, num_segments=num_traces)  # [N]
    invalid_rows = jnp.where(real, (row_valid <= 0).astype(jnp.float32), 0.0)
    trace_valid = jax.ops.segment_sum(invalid_rows, ids, num_segments=num_traces) == 0
    has_rows = jax.ops.segment_sum(real.astype(jnp.float32), ids, num_segments=num_traces) > 0
    trace_valid = (trace_valid & has_rows).astype(jnp.float32)  # [N]
    if estimator == "rloo":
        adv = rloo_advantages(trace_reward, trace_group, num_groups=num_groups, valid=trace_valid)
    elif estimator in ("grpo", "dr_grpo"):
        adv = grpo_advantages(
            trace_reward, trace_group, num_groups=num_groups,
            scale_by_std=estimator == "grpo", eps=eps, valid=trace_valid,
        )  # fmt: skip
    else:
        raise ValueError(f"trace advantages need a group estimator, got {estimator!r}")
    row_adv = jnp.where(real, adv[jnp.clip(ids, 0, num_traces - 1)], 0.0)  # [R]
    return sequence_to_tokens(row_adv, mask)


def sequence_to_tokens(seq_values: jax.Array, mask: jax.Array) -> jax.Array:
    """Broadcast a per-sequence value to every real token: out[b, t] = v[b] * mask[b, t].

    Args:
      seq_values: `[B]` per-sequence values (e.g. advantages).
      mask: `[B, T]` response mask.

    Returns:
      `[B, T]` float32, zero where mask is 0.
    """
    chex.assert_rank(seq_values, 1, custom_message="sequence_to_tokens: `seq_values` must be [B]")
    chex.assert_rank(mask, 2, custom_message="sequence_to_tokens: `mask` must be [B, T]")
    chex.assert_equal_shape_prefix(
        [seq_values, mask], 1, custom_message="sequence_to_tokens: batch sizes differ"
    )
    return seq_values.astype(jnp.float32)[:, None] * mask.astype(jnp.float32)  # [B, T]


def group_varies(
    rewards: np.ndarray, group_ids: np.ndarray, *, num_groups: int, valid: np.ndarray | None = None
) -> np.ndarray:
    """`[G]` bool: do a group's valid rewards differ at all?

    A group whose rewards are all equal has zero group-relative advantage and carries no
    policy gradient (DAPO's dynamic sampling, Yu et al. 2025, drops it); so does a group
    with fewer than two valid samples. Host-side numpy: choosing which groups to keep
    changes the batch's shape, which happens before anything is jitted.

    Args:
      rewards: `[B]` sequence rewards.
      group_ids: `[B]` int in [0, num_groups).
      num_groups: G.
      valid: `[B]` (1 keep, 0 exclude), default all valid.
    """
    rewards = np.asarray(rewards, np.float64)
    group_ids = np.asarray(group_ids)
    if rewards.ndim != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must both be [B], got {rewards.shape} and {group_ids.shape}"
        )
    ok = np.ones(rewards.shape, bool) if valid is None else np.asarray(valid) > 0
    high = np.full(num_groups, -np.inf)
    low = np.full(num_groups, np.inf)
    np.maximum.at(high, group_ids[ok], rewards[ok])
    np.minimum.at(low, group_ids[ok], rewards[ok])
    return high > low


def last_token_mask(mask: jax.Array) -> jax.Array:
    """One-hot `[B, T]` float32 of each row's last real token (all zero for an empty row):
    where a sequence-level reward or penalty sits."""
    chex.assert_rank(mask, 2, custom_message="last_token_mask: `mask` must be [B, T]")
    nonempty = jnp.any(mask > 0, axis=1)
    return jax.nn.one_hot(last_token_index(mask > 0), mask.shape[1]) * nonempty[:, None]
