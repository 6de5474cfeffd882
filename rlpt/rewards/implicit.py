"""Implicit process rewards (PRIME): a language model trained on outcome labels alone.

Yuan et al. 2024 ("Free Process Rewards without Process Labels", arXiv:2412.01981)
parameterise the outcome reward of a response ``y`` as a log-likelihood ratio between a
trained causal LM ``pi_phi`` and a frozen reference ``pi_ref`` (both start from the
policy):

    r_phi(y) = beta * sum_t log pi_phi(y_t | y_<t) / pi_ref(y_t | y_<t)

and train it with binary cross-entropy on whether ``y`` was verified correct. The terms
of that sum are then a process reward for free: ``r_t = beta * log pi_phi(y_t) / pi_ref(y_t)``
per token, or summed over each reasoning step. PRIME (Cui et al. 2025, "Process
Reinforcement through Implicit Rewards", arXiv:2502.01456) uses these dense rewards in
RL, with ``beta = 0.05`` and ``pi_phi`` updated online on the policy's own rollouts.

Steps follow ``rlpt.rewards.process``: step ``j`` ends at its separator (a ``<step>``,
or the final ``<answer>`` for the last step), so a step reward sits at that token.
``step_ends`` adds the row's last real token as the end of one more segment, the
answer after ``<answer>``, whose tokens carry most of what an outcome label judges.

The maths (``implicit_*``, ``step_rewards``) are pure functions of arrays; the adapters
below them bind a ``CausalLM`` to those arrays and train ``pi_phi`` with
``rlpt.supervised.SupervisedTrainer``. The reference is frozen, so its log-probabilities
are computed once per example, before training, and travel in the batch as
``ref_logp``: nothing of the reference sits in the donated training state.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rlpt.models.transformer import positions_from_mask
from rlpt.parallel.sharding import DEFAULT_RULES, Rules
from rlpt.rewards.process import separator_mask
from rlpt.rl.advantages import last_token_mask
from rlpt.rl.batch import RolloutBatch
from rlpt.supervised import Batch, SupervisedTrainer, TrainConfig

DEFAULT_BETA = 0.05  # PRIME's coefficient


# -- maths -----------------------------------------------------------------------------------


def implicit_token_rewards(
    logp: jax.Array,  # [B, T] log pi_phi(y_t | y_<t)
    ref_logp: jax.Array,  # [B, T] log pi_ref(y_t | y_<t)
    mask: jax.Array,  # [B, T] 1 on the response tokens that count
    beta: float,
) -> jax.Array:
    """Dense implicit process rewards ``r_t = beta * (log pi_phi(y_t) - log pi_ref(y_t))``
    [B, T], 0 off ``mask`` (Yuan et al. 2024, eq. 3; PRIME)."""
    chex.assert_rank(logp, 2)
    chex.assert_equal_shape([logp, ref_logp, mask])
    diff = logp.astype(jnp.float32) - ref_logp.astype(jnp.float32)
    # `where`, not a product: a pad's log-probability may be -inf, and -inf * 0 is NaN.
    return jnp.where(mask > 0, beta * diff, 0.0)


def implicit_outcome_logits(
    logp: jax.Array,  # [B, T]
    ref_logp: jax.Array,  # [B, T]
    mask: jax.Array,  # [B, T]
    beta: float,
) -> jax.Array:
    """The implicit outcome reward ``r_phi(y) = sum_t r_t`` [B], read as the logit of
    P(correct)."""
    return jnp.sum(implicit_token_rewards(logp, ref_logp, mask, beta), axis=1)


def implicit_prm_loss(
    logp: jax.Array,  # [B, T] log pi_phi of the response tokens
    ref_logp: jax.Array,  # [B, T] log pi_ref of the same tokens
    mask: jax.Array,  # [B, T] 1 on response tokens
    labels: jax.Array,  # [B] 1 correct, 0 wrong (soft labels in [0, 1] allowed)
    beta: float,
    weights: jax.Array | None = None,  # [B] per-row weight (0 drops a padding row)
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy of outcome labels on the implicit outcome reward, weighted mean over rows:

        L = -[l log sigmoid(r_phi(y)) + (1 - l) log(1 - sigmoid(r_phi(y)))]
          = softplus(r_phi(y)) - l * r_phi(y)

    (the second form is exact and stable for any logit). Returns ``(loss, metrics)``:
    ``accuracy`` (sign of ``r_phi`` against ``l > 0.5``), ``reward_correct`` and
    ``reward_wrong`` (mean ``r_phi`` of each class, 0 where a class is absent).
    """
    chex.assert_rank(labels, 1)
    logits = implicit_outcome_logits(logp, ref_logp, mask, beta)  # [B]
    chex.assert_equal_shape([logits, labels])
    if weights is None:
        weights = jnp.ones_like(logits)
    chex.assert_equal_shape([logits, weights])
    labels = labels.astype(jnp.float32)
    weights = weights.astype(jnp.float32)
    per_row = jax.nn.softplus(logits) - labels * logits  # [B]
    total = jnp.maximum(jnp.sum(weights), 1e-9)
    loss = jnp.sum(per_row * weights) / total
    correct = (labels > 0.5).astype(jnp.float32) * weights
    wrong = (labels <= 0.5).astype(jnp.float32) * weights
    metrics = {
        "accuracy": jnp.sum(((logits > 0) == (labels > 0.5)) * weights) / total,
        "reward_correct": jnp.sum(logits * correct) / jnp.maximum(jnp.sum(correct), 1e-9),
        "reward_wrong": jnp.sum(logits * wrong) / jnp.maximum(jnp.sum(wrong), 1e-9),
    }
    return loss, metrics


def step_rewards(
    token_rewards: jax.Array,  # [B, T] per-token rewards, 0 off the response
    step_mask: jax.Array,  # [B, T] 1 at each step's last token
) -> jax.Array:
    """Each step's summed token rewards [B, T], placed at its last token (0 elsewhere).

    The step ended by mark ``j`` holds the tokens after mark ``j - 1`` up to and
    including mark ``j``. Tokens after the row's last mark belong to no step and are
    dropped: mark the row's last real token too (``step_ends``) to keep them.
    """
    chex.assert_rank(token_rewards, 2)
    chex.assert_equal_shape([token_rewards, step_mask])
    on = step_mask > 0
    idx = jnp.arange(token_rewards.shape[1])[None, :]
    csum = jnp.cumsum(token_rewards.astype(jnp.float32), axis=1)  # [B, T] inclusive prefix sums
    last_mark = jax.lax.cummax(jnp.where(on, idx, -1), axis=1)  # [B, T] latest mark at or before t
    # The mark strictly before t: shift right by one column.
    prev = jnp.concatenate([jnp.full_like(last_mark[:, :1], -1), last_mark[:, :-1]], axis=1)
    before = jnp.take_along_axis(csum, jnp.maximum(prev, 0), axis=1)
    before = jnp.where(prev >= 0, before, 0.0)  # [B, T] prefix sum up to the previous mark
    return jnp.where(on, csum - before, 0.0)


def step_ends(tokens: jax.Array, mask: jax.Array, *, step_id: int, answer_id: int) -> jax.Array:
    """The separators of ``rlpt.rewards.process.separator_mask`` plus the last real token
    [B, T] (float32), so ``step_rewards`` counts every response token."""
    chex.assert_equal_shape([tokens, mask])
    seps = separator_mask(tokens, mask, step_id=step_id, answer_id=answer_id)
    return jnp.maximum(seps, last_token_mask((mask > 0).astype(jnp.float32)))


# -- adapters: a CausalLM as pi_phi ----------------------------------------------------------


def row_log_probs(
    graphdef, params, tokens: jax.Array, mask: jax.Array, frozen: Any = None
) -> jax.Array:
    """``log p(tokens[:, t + 1] | tokens[:, <= t])`` [N, L - 1] of right-padded rows [N, L].

    ``frozen``: variables merged with ``params`` but not trained (a LoRA policy's base).
    """
    states = (params,) if frozen is None else (params, frozen)
    model = nnx.merge(graphdef, *states)
    input_mask = mask[:, :-1].astype(bool)
    hidden, _ = model.trunk(tokens[:, :-1], positions_from_mask(input_mask), input_mask)
    return model.target_log_probs(hidden, tokens[:, 1:]).log_probs


def implicit_prm_objective(graphdef, params, batch: Batch, frozen: Any = None, *, beta: float):
    """``implicit_prm_loss`` of a batch of ``encode_implicit_examples`` rows with their
    ``ref_logp`` [N, L - 1] (from ``reference_log_probs``)."""
    logp = row_log_probs(graphdef, params, batch["tokens"], batch["mask"], frozen)
    targets = batch["response_mask"][:, 1:]  # [N, L - 1]: token t + 1 is a response token
    return implicit_prm_loss(
        logp, batch["ref_logp"], targets, batch["labels"], beta, batch.get("weight")
    )


def implicit_prm_trainer(
    cfg: TrainConfig,
    graphdef,
    *,
    beta: float = DEFAULT_BETA,
    frozen: Any = None,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
) -> SupervisedTrainer:
    """The supervised trainer on ``implicit_prm_objective`` (``graphdef``: the policy's)."""
    objective = functools.partial(implicit_prm_objective, beta=beta)
    return SupervisedTrainer(cfg, graphdef, objective, mesh=mesh, rules=rules, frozen=frozen)


def encode_implicit_examples(
    examples: Sequence[tuple[Sequence[int], Sequence[int], float]],
    *,
    pad_id: int,
    pad_to: int,
) -> dict[str, np.ndarray]:
    """``(prompt ids, response ids, label)`` triples to right-padded rows: ``tokens``,
    ``mask``, ``response_mask`` [N, pad_to] and ``labels``, ``weight`` [N].

    The prompt ids carry their ``<bos>``, the response ids their ``<eos>`` (as a rollout
    writes them). A row longer than ``pad_to`` raises (the caller filters first).
    """
    n = len(examples)
    tokens = np.full((n, pad_to), pad_id, np.int32)
    mask = np.zeros((n, pad_to), bool)
    response = np.zeros((n, pad_to), bool)
    labels = np.zeros(n, np.float32)
    for i, (prompt, resp, label) in enumerate(examples):
        p, r = len(prompt), len(resp)
        if p + r > pad_to:
            raise ValueError(f"example {i}: {p + r} tokens exceed pad_to={pad_to}")
        if not p or not r:
            raise ValueError(f"example {i}: empty prompt or response")
        tokens[i, : p + r] = list(prompt) + list(resp)
        mask[i, : p + r] = True
        response[i, p : p + r] = True
        labels[i] = label
    return {"tokens": tokens, "mask": mask, "response_mask": response, "labels": labels,
            "weight": np.ones(n, np.float32)}  # fmt: skip


def reference_log_probs(
    graphdef, ref_params, tokens: np.ndarray, mask: np.ndarray, *, frozen: Any = None,
    chunk: int = 64,
) -> np.ndarray:  # fmt: skip
    """``row_log_probs`` of the frozen reference [N, L - 1], in chunks of ``chunk`` rows
    (the last padded with copies, so one program serves every chunk)."""
    fn = jax.jit(lambda p, t, m, f: row_log_probs(graphdef, p, t, m, f))
    n = len(tokens)
    out = []
    for start in range(0, n, chunk):
        t, m = tokens[start : start + chunk], mask[start : start + chunk]
        real = len(t)
        if real < chunk and n > chunk:
            t = np.concatenate([t, np.repeat(t[-1:], chunk - real, 0)])
            m = np.concatenate([m, np.repeat(m[-1:], chunk - real, 0)])
        out.append(np.asarray(fn(ref_params, t, m, frozen))[:real])
    return np.concatenate(out)


@dataclasses.dataclass
class ImplicitPRM:
    """A trained ``pi_phi``, its frozen reference and ``beta``: the implicit PRM."""

    graphdef: Any
    params: Any  # pi_phi
    ref_params: Any  # pi_ref: the policy it started from
    beta: float = DEFAULT_BETA
    frozen: Any = None  # a LoRA policy's shared base

    def token_rewards(self, tokens, mask, response_mask) -> jax.Array:
        """Implicit process rewards [N, L - 1] of right-padded rows [N, L]; column t
        rewards token t + 1."""
        return _token_rewards(
            self.graphdef, self.beta, self.params, self.ref_params, self.frozen,
            jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(response_mask),
        )  # fmt: skip

    def outcome_logits(self, tokens, mask, response_mask) -> jax.Array:
        """``r_phi(y)`` [N]: the logit of P(correct) for each row."""
        return jnp.sum(self.token_rewards(tokens, mask, response_mask), axis=1)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _token_rewards(graphdef, beta, params, ref_params, frozen, tokens, mask, response_mask):
    logp = row_log_probs(graphdef, params, tokens, mask, frozen)
    ref_logp = row_log_probs(graphdef, ref_params, tokens, mask, frozen)
    return implicit_token_rewards(logp, ref_logp, response_mask[:, 1:], beta)


def rollout_implicit_rewards(
    graphdef,
    params,
    ref_params,
    batch: RolloutBatch,
    *,
    beta: float,
    step_id: int,
    answer_id: int,
    dense: bool = False,
    frozen: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """Implicit process rewards of a rollout and where they sit, both [B, T] over response
    columns: what ``assemble_rewards`` takes as ``process`` and ``step_mask``.

    ``dense``: one reward per trained token (PRIME's token-level use); otherwise each
    step's summed reward at its end (``step_ends``). Untrained tokens (a multi-turn
    environment's) get none. Jittable; ``graphdef`` is the policy's.
    """
    mask = batch.response_mask  # [B, T]
    states = (params,) if frozen is None else (params, frozen)
    ref_states = (ref_params,) if frozen is None else (ref_params, frozen)
    p = batch.prompt_len
    targets = batch.tokens[:, p:]  # [B, T]

    def logp(*s):
        model = nnx.merge(graphdef, *s)
        hidden, _ = model.trunk(batch.tokens, batch.positions, batch.input_mask)
        return model.target_log_probs(hidden[:, p - 1 : -1], targets).log_probs  # [B, T]

    tokens = implicit_token_rewards(logp(*states), logp(*ref_states), mask, beta)
    if dense:
        return tokens, (mask > 0).astype(jnp.float32)
    ends = step_ends(targets, mask, step_id=step_id, answer_id=answer_id)
    return step_rewards(tokens, ends), ends


def rollout_implicit_examples(
    batch: RolloutBatch,
    labels: jax.Array,  # [B] 1 correct, 0 wrong
    weights: jax.Array,  # [B] 0 drops a row (an invalid verdict)
) -> dict[str, jax.Array]:
    """A rollout batch as ``implicit_prm_objective`` rows, without ``ref_logp``: PRIME's
    online update trains ``pi_phi`` on the very rollouts it scored, token in, token out.

    The rows keep the rollout's layout (left-padded prompt, then the response); only the
    trained response tokens (``response_mask``) enter the implicit reward, so a multi-turn
    environment's tokens condition it but are not judged."""
    b, p = batch.tokens.shape[0], batch.prompt_len
    chex.assert_shape(labels, (b,))
    chex.assert_shape(weights, (b,))
    response = jnp.concatenate([jnp.zeros((b, p), bool), batch.response_mask > 0], axis=1)  # [B, L]
    return {
        "tokens": batch.tokens, "mask": batch.input_mask.astype(bool), "response_mask": response,
        "labels": labels.astype(jnp.float32), "weight": weights.astype(jnp.float32),
    }  # fmt: skip


def train_implicit_prm(
    graphdef,
    policy_params,
    examples: Sequence[tuple[Sequence[int], Sequence[int], float]],
    *,
    pad_id: int,
    pad_to: int,
    steps: int,
    batch_size: int,
    cfg: TrainConfig | None = None,
    beta: float = DEFAULT_BETA,
    frozen: Any = None,
    seed: int = 0,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
) -> tuple[ImplicitPRM, list[dict[str, float]]]:
    """Trains ``pi_phi`` from the policy on outcome-labelled rollouts; returns the PRM and
    each step's metrics (``loss``, ``accuracy``, ``reward_correct``, ``reward_wrong``, ...).

    ``examples``: ``(prompt ids, response ids, label)``. ``pi_phi`` starts as a copy of
    ``policy_params`` and the PRM keeps another as its reference: the PRM's training
    state is donated, and so is the policy's in a PPO update that follows, so neither may
    hold the other's arrays (holding the policy's own crashed the scoring after an update).
    Minibatches of ``batch_size`` rows are drawn uniformly with replacement.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps} and {batch_size}")
    if not examples:
        raise ValueError("train_implicit_prm: no examples")
    cfg = cfg or TrainConfig()
    data = encode_implicit_examples(examples, pad_id=pad_id, pad_to=pad_to)
    data["ref_logp"] = reference_log_probs(
        graphdef, policy_params, data["tokens"], data["mask"], frozen=frozen
    )
    trainer = implicit_prm_trainer(cfg, graphdef, beta=beta, frozen=frozen, mesh=mesh, rules=rules)
    state = trainer.init(jax.tree.map(jnp.copy, policy_params))
    rng = np.random.default_rng(seed)
    history = []
    for _ in range(steps):
        pick = rng.integers(0, len(examples), size=batch_size)
        state, m = trainer.step(state, {k: v[pick] for k, v in data.items()})
        history.append({k: float(v) for k, v in jax.device_get(m).items()})
    reference = jax.tree.map(jnp.copy, policy_params)
    prm = ImplicitPRM(graphdef, state.params, reference, beta=beta, frozen=frozen)
    return prm, history


__all__ = [
    "DEFAULT_BETA",
    "ImplicitPRM",
    "encode_implicit_examples",
    "implicit_outcome_logits",
    "implicit_prm_loss",
    "implicit_prm_objective",
    "implicit_prm_trainer",
    "implicit_token_rewards",
    "reference_log_probs",
    "rollout_implicit_examples",
    "rollout_implicit_rewards",
    "row_log_probs",
    "step_ends",
    "step_rewards",
    "train_implicit_prm",
]
