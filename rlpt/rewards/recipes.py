"""Small end-to-end recipes: SFT warm start, reward-model and PRM training and evaluation.

``python -m rlpt.rewards.recipes [--seed=0] [--parts=rm,prm]`` trains (on a 2-core CPU,
about 15 minutes for ``rm`` and 30 for ``prm``) a reward model on correctness-only
pairs of the built-in answer domains and a PRM on Math-Shepherd labels from a
warm-started policy, then prints one JSON line: held-out pairwise accuracy per
domain, step-level ROC-AUC on planted wrong steps, and best-of-N reranking accuracy
against random and majority vote.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from absl import app, flags

from rlpt.models import CausalLM, ModelConfig, ProcessRewardModel, RewardModel, create_model
from rlpt.models.config import BYTE_VOCAB_SIZE
from rlpt.rewards.data import correctness_pairs, planted_error_solutions
from rlpt.rewards.losses import pairwise_accuracy, roc_auc
from rlpt.rewards.preferences import PreferencePair, encode_pairs, encode_sequence, pad_rows
from rlpt.rewards.process import (
    best_of_n,
    encode_step_examples,
    math_shepherd_labels,
    solution_score,
)
from rlpt.rewards.train import (
    TrainConfig,
    prm_trainer,
    rm_trainer,
    sequence_scores,
    step_logits,
    with_trunk,
)
from rlpt.sampling import Sampler, SamplingParams
from rlpt.sft import sft_trainer
from rlpt.tasks.base import Task, extract_answer
from rlpt.tokenizers import ByteTokenizer, decode_response

log = logging.getLogger(__name__)


def small_config(d_model: int = 128, n_layers: int = 4, max_seq_len: int = 96) -> ModelConfig:
    """A CPU-sized model: big enough to check single-digit arithmetic, small enough to train
    in a minute."""
    return ModelConfig(
        vocab_size=BYTE_VOCAB_SIZE, d_model=d_model, n_layers=n_layers, n_heads=4,
        n_kv_heads=4, ffn_dim=4 * d_model, max_seq_len=max_seq_len,
    )  # fmt: skip


def _schedule(learning_rate: float, warmup_steps: int, steps: int) -> TrainConfig:
    """Warmup then cosine decay over the run's ``steps``."""
    return TrainConfig(
        learning_rate=learning_rate, warmup_steps=min(warmup_steps, steps // 2),
        decay_steps=max(steps, 1),
    )  # fmt: skip


def _minibatches(n: int, batch_size: int, steps: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield rng.integers(0, n, size=batch_size)


def sft_examples(
    tokenizer, tasks: Sequence[Task], completions: Sequence[str], length: int
) -> dict[str, np.ndarray]:
    """Rows ``<bos> prompt completion <eos>`` with the loss on completion tokens."""
    rows, starts = [], []
    for t, c in zip(tasks, completions):
        rows.append(encode_sequence(tokenizer, t.prompt, c))
        starts.append(len(tokenizer.encode(t.prompt, add_bos=True)))
    tokens, mask = pad_rows(rows, length, tokenizer.pad_id)
    loss_mask = mask & (np.arange(length)[None, :] >= np.asarray(starts)[:, None])
    return {"tokens": tokens, "mask": mask, "loss_mask": loss_mask}


def train_sft(
    config: ModelConfig, domain, tasks: Sequence[Task], tokenizer, *, steps: int,
    batch_size: int = 64, learning_rate: float = 2e-3, seed: int = 0, params=None,
    pad_to: int | None = None, decay_steps: int | None = None,
    on_step: Callable[[int, Any], None] | None = None,
):  # fmt: skip
    """Supervised warm start on demonstrations: ``(graphdef, params, last metrics)``.

    ``domain=None`` takes each task's demonstration from its own domain (``task.domain``),
    for a warm start on several domains. Rows are padded to ``pad_to`` (default the
    model's context). The learning rate decays over ``decay_steps`` (default ``steps``): a
    longer horizon stops the run early on the schedule of a longer one, so that one run
    can be scored at several lengths. ``on_step(n, params)`` is called after the n-th step
    (from 1); it must not keep ``params`` past the call without copying (the next step
    donates them)."""
    from rlpt.tasks import get_domain

    graphdef, init = create_model(lambda r: CausalLM(config, rngs=r), jax.random.key(seed))
    demos = [(domain or get_domain(t.domain)).demonstration(t) for t in tasks]
    data = sft_examples(tokenizer, tasks, demos, pad_to or config.max_seq_len)
    horizon = steps if decay_steps is None else decay_steps
    if horizon < steps:
        raise ValueError(f"decay_steps ({horizon}) must be at least steps ({steps})")
    trainer = sft_trainer(_schedule(learning_rate, 20, horizon), graphdef)
    state = trainer.init(init if params is None else params)
    metrics: dict[str, Any] = {}
    for i, pick in enumerate(_minibatches(len(tasks), batch_size, steps, seed)):
        state, metrics = trainer.step(state, {k: v[pick] for k, v in data.items()})
        _log_every(metrics, i, "sft")
        if on_step is not None:
            on_step(i + 1, state.params)
    return graphdef, state.params, jax.device_get(metrics)


def _pair_batch(arrays, pick) -> dict[str, np.ndarray]:
    return {
        "chosen": arrays.chosen[pick], "chosen_mask": arrays.chosen_mask[pick],
        "rejected": arrays.rejected[pick], "rejected_mask": arrays.rejected_mask[pick],
        "margin": arrays.margin[pick], "weight": np.ones(len(pick), np.float32),
    }  # fmt: skip


def train_reward_model(
    config: ModelConfig, pairs: Sequence[PreferencePair], tokenizer, *, steps: int,
    batch_size: int = 64, learning_rate: float = 1e-3, margin: float = 0.0, seed: int = 0,
    policy=None, likelihood: bool = False,
):  # fmt: skip
    """Bradley-Terry training on ``pairs``: ``(graphdef, params, last metrics)``.

    ``policy``: a ``CausalLM`` state whose trunk the reward model starts from (the
    usual practice: an RM initialised from the supervised policy already reads the
    domain's language, and learns the correctness judgement much faster)."""
    graphdef, params = create_model(
        lambda r: RewardModel(config, likelihood=likelihood, rngs=r), jax.random.key(seed)
    )
    if policy is not None:
        params = with_trunk(params, policy)
    arrays, _ = encode_pairs(pairs, tokenizer, config.max_seq_len, pad_to=config.max_seq_len)
    trainer = rm_trainer(_schedule(learning_rate, 50, steps), graphdef, margin=margin)
    state = trainer.init(params)
    metrics: dict[str, Any] = {}
    for i, pick in enumerate(_minibatches(len(arrays), batch_size, steps, seed)):
        state, metrics = trainer.step(state, _pair_batch(arrays, pick))
        _log_every(metrics, i, "rm")
    return graphdef, state.params, jax.device_get(metrics)


def score_sequences(graphdef, params, tokens: np.ndarray, mask: np.ndarray, chunk: int = 256):
    fn = jax.jit(lambda p, t, m: sequence_scores(graphdef, p, t, m))
    out = [np.asarray(fn(params, tokens[i : i + chunk], mask[i : i + chunk]))
           for i in range(0, len(tokens), chunk)]  # fmt: skip
    return np.concatenate(out)


def rm_pairwise_accuracy(
    graphdef, params, pairs: Sequence[PreferencePair], tokenizer, max_len: int
) -> float:
    arrays, _ = encode_pairs(pairs, tokenizer, max_len, pad_to=max_len)
    chosen = score_sequences(graphdef, params, arrays.chosen, arrays.chosen_mask)
    rejected = score_sequences(graphdef, params, arrays.rejected, arrays.rejected_mask)
    return pairwise_accuracy(chosen, rejected)


def train_prm(
    config: ModelConfig, examples: dict[str, np.ndarray], tokenizer, *, steps: int,
    batch_size: int = 64, learning_rate: float = 1e-3, seed: int = 0, policy=None,
    likelihood: bool = False,
):  # fmt: skip
    """BCE training at step separators: ``(graphdef, params, last metrics)``.

    ``policy``: a ``CausalLM`` state whose trunk (and language-model head) the PRM
    starts from; ``likelihood``: a likelihood-term PRM (see ``ProcessRewardModel``)."""
    graphdef, params = create_model(
        lambda r: ProcessRewardModel(
            config,
            tokenizer.step_id,
            likelihood=likelihood,
            answer_token_id=tokenizer.answer_id,
            rngs=r,
        ),
        jax.random.key(seed),
    )
    if policy is not None:
        params = with_trunk(params, policy)
    trainer = prm_trainer(_schedule(learning_rate, 50, steps), graphdef)
    state = trainer.init(params)
    metrics: dict[str, Any] = {}
    for i, pick in enumerate(_minibatches(len(examples["tokens"]), batch_size, steps, seed)):
        state, metrics = trainer.step(state, {k: v[pick] for k, v in examples.items()})
        _log_every(metrics, i, "prm")
    return graphdef, state.params, jax.device_get(metrics)


def prm_step_probs(graphdef, params, examples: dict[str, np.ndarray], chunk: int = 256):
    """Step probabilities [N, L] (meaningful where ``label_mask``)."""
    fn = jax.jit(lambda p, t, m, r: jax.nn.sigmoid(step_logits(graphdef, p, t, m, r)))
    out = [np.asarray(fn(params, examples["tokens"][i : i + chunk],
                         examples["mask"][i : i + chunk],
                         examples["response_mask"][i : i + chunk]))
           for i in range(0, len(examples["tokens"]), chunk)]  # fmt: skip
    return np.concatenate(out)


def sample_solutions(
    sampler: Sampler, params, tasks: Sequence[Task], tokenizer, key, *, n: int,
    max_new_tokens: int, temperature: float = 1.0,
) -> list[list[str]]:  # fmt: skip
    """``n`` sampled completions per task (one batched generate)."""
    prompts = [tokenizer.encode(t.prompt, add_bos=True) for t in tasks for _ in range(n)]
    out = sampler.generate(
        params, prompts, key, max_new_tokens=max_new_tokens,
        sampling=SamplingParams(temperature=temperature),
    )  # fmt: skip
    texts = [
        decode_response(tokenizer, out.tokens[i][: out.lengths[i]]) for i in range(len(prompts))
    ]
    return [texts[i * n : (i + 1) * n] for i in range(len(tasks))]


def _log_every(trainer_metrics: dict, step: int, what: str, every: int = 50) -> None:
    if step % every == 0:
        log.info(
            "%s step %d: %s",
            what,
            step,
            {k: round(float(v), 4) for k, v in trainer_metrics.items()},
        )


def reward_model_figures(
    seed: int = 0, steps: int = 400, sft_steps: int = 1500, learning_rate: float = 3e-4,
    likelihood: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Train an RM on correctness-only pairs of ``arithmetic`` and ``stepwise_math`` (levels
    1-2), its trunk (and, with ``likelihood``, language-model head) warm-started by
    ``sft_steps`` of supervised training on the same domains' demonstrations, and measure
    held-out pairwise accuracy per domain (and per level, and before any pair training)."""
    from rlpt.tasks import get_domain

    tok = ByteTokenizer()
    config = small_config(max_seq_len=64)
    per_level = 100  # held-out pairs per domain and level (levels 1 then 2)
    train_pairs: list[PreferencePair] = []
    sft_tasks: list[Task] = []
    heldout: dict[str, list[PreferencePair]] = {}
    for name in ("arithmetic", "stepwise_math"):
        dom = get_domain(name)
        for level in (1, 2):
            tasks = dom.tasks("train", 1500, level, seed=seed)
            sft_tasks += tasks
            train_pairs += correctness_pairs(dom, tasks, seed)
            held = correctness_pairs(
                dom, dom.tasks("heldout", per_level, level, seed=seed), seed + 1
            )
            heldout.setdefault(name, []).extend(held)
    start = time.time()
    policy = None
    if sft_steps:
        _, policy, _ = train_sft(config, None, sft_tasks, tok, steps=sft_steps, seed=seed)

    def accuracy(graph, params, pairs) -> float:
        return rm_pairwise_accuracy(graph, params, pairs, tok, config.max_seq_len)

    untrained = train_reward_model(config, train_pairs, tok, steps=0, seed=seed, policy=policy,
                                   likelihood=likelihood)  # fmt: skip
    graph, params, metrics = train_reward_model(
        config, train_pairs, tok, steps=steps, seed=seed, policy=policy,
        learning_rate=learning_rate, likelihood=likelihood,
    )  # fmt: skip
    return {
        "rm_pairwise_accuracy": {
            name: accuracy(graph, params, pairs) for name, pairs in heldout.items()
        },
        "rm_pairwise_accuracy_by_level": {
            name: [
                accuracy(graph, params, pairs[:per_level]),
                accuracy(graph, params, pairs[per_level:]),
            ]
            for name, pairs in heldout.items()
        },
        "rm_pairwise_accuracy_before_pair_training": {
            name: accuracy(untrained[0], untrained[1], pairs) for name, pairs in heldout.items()
        },
        "rm_likelihood": likelihood,
        "rm_train_accuracy_last_batch": float(metrics["accuracy"]),
        "rm_train_pairs": len(train_pairs),
        "rm_sft_steps": sft_steps,
        "time/rm_s": time.time() - start,
    }


def process_reward_figures(
    seed: int = 0, level: int = 2, sft_steps: int = 500, prm_steps: int = 600,
    n_label_tasks: int = 2000, n_continuations: int = 4, best_of: int = 8,
    samples_per_task: int = 4, likelihood: bool = True, best_of_tasks: int = 600,
    label_kind: str = "hard", prm_learning_rate: float = 3e-5,
) -> dict[str, Any]:  # fmt: skip
    """Warm-start a policy, label its samples (and planted-error variants of demonstrations)
    the Math-Shepherd way, train a PRM, and measure step ROC-AUC and best-of-N reranking.

    The policy's 500 supervised steps leave it right about two times in three when
    sampled: enough mistakes for reranking to have something to fix (after 1200 steps
    majority voting was within 2.3 points of the oracle). The PRM fine-tunes the policy
    gently: at a learning rate of 1e-3 the within-problem ordering of right and wrong
    solutions fell during training (pair accuracy 0.72 at the start, 0.65 after), as the
    trunk lost the arithmetic it starts with; at 3e-5 it rose to 0.78. Hard labels (does
    any continuation reach the answer) judge the step itself rather than how often the
    policy finishes from it."""
    from rlpt.tasks import get_domain

    if label_kind not in ("soft", "hard"):
        raise ValueError(f"label_kind must be 'soft' or 'hard', got {label_kind!r}")
    start = time.time()
    tok = ByteTokenizer()
    dom = get_domain("stepwise_math")
    config = small_config()
    # Training rows hold prompt + solution (at most ~50 tokens at level 2); the model's
    # longer context leaves the sampler room for step-prefix prompts plus max_new.
    train_len, max_new = 64, 32
    graph, policy, _ = train_sft(
        config, dom, dom.tasks("train", 3000, level, seed=seed + 1), tok, steps=sft_steps,
        seed=seed, pad_to=train_len,
    )  # fmt: skip
    # Step prefixes of rows that fit train_len are prompts of at most train_len tokens,
    # and the context leaves room for max_new after them.
    sampler = Sampler(graph, config, eos_id=tok.eos_id, pad_id=tok.pad_id,
                      buckets=(16, 32, 48, train_len))  # fmt: skip
    tasks = dom.tasks("train", n_label_tasks, level, seed=seed + 2)
    # Several samples per problem: the policy's own mistakes (a misread instruction, a
    # slip) are what best-of-N reranking must catch, and a good policy makes few of them.
    sampled = [c for row in sample_solutions(
        sampler, policy, tasks, tok, jax.random.key(seed), n=samples_per_task,
        max_new_tokens=max_new,
    ) for c in row]  # fmt: skip
    # Planted errors make sure wrong steps are well represented even when the policy is good.
    planted, _ = planted_error_solutions(dom, tasks, seed=seed)
    label_tasks = [t for t in tasks for _ in range(samples_per_task)]
    label_tasks += [t for t in tasks for _ in (0, 1)]
    completions = sampled + planted
    # Rows too long to train on are not worth labelling.
    fits = [
        i for i, c in enumerate(completions)
        if len(encode_sequence(tok, label_tasks[i].prompt, c)) <= train_len
    ]  # fmt: skip
    label_tasks = [label_tasks[i] for i in fits]
    completions = [completions[i] for i in fits]
    labels = math_shepherd_labels(
        sampler, policy, dom, label_tasks, completions, tok, jax.random.key(seed + 1),
        n_continuations=n_continuations, max_new_tokens=max_new,
    )  # fmt: skip
    targets = getattr(labels, label_kind)
    keep = [i for i in range(len(completions)) if targets[i]]
    examples = encode_step_examples(
        tok, [label_tasks[i].prompt for i in keep], [completions[i] for i in keep],
        [targets[i] for i in keep], max_len=train_len, pad_to=train_len,
    )  # fmt: skip
    prm_graph, prm_params, _ = train_prm(
        config, examples, tok, steps=prm_steps, seed=seed, policy=policy, likelihood=likelihood,
        learning_rate=prm_learning_rate,
    )  # fmt: skip

    held = dom.tasks("heldout", 150, level, seed=seed)
    texts, step_labels = planted_error_solutions(dom, held, seed=seed + 7)
    ev = encode_step_examples(
        tok, [t.prompt for t in held for _ in (0, 1)], texts, step_labels,
        max_len=train_len, pad_to=train_len,
    )  # fmt: skip
    probs = prm_step_probs(prm_graph, prm_params, ev)
    on = ev["label_mask"] > 0
    auc = roc_auc(probs[on], ev["labels"][on])
    log.info("prm held-out step ROC-AUC %.4f (%.0fs)", auc, time.time() - start)

    # Best-of-N on held-out problems with the policy's own samples: at the trained level,
    # and one level up, where the policy is weaker and majority voting has more to miss.
    def best_of_figures(level: int, max_new: int, row_len: int, key) -> dict[str, Any]:
        tasks = dom.tasks("heldout", best_of_tasks, level, seed=seed + 11)
        cand = sample_solutions(sampler, policy, tasks, tok, key, n=best_of,
                                max_new_tokens=max_new)  # fmt: skip
        flat_tasks = [t for t in tasks for _ in range(best_of)]
        flat = [c for row in cand for c in row]
        ok = [
            i for i, c in enumerate(flat)
            if len(encode_sequence(tok, flat_tasks[i].prompt, c)) <= row_len
        ]  # fmt: skip
        ex = encode_step_examples(
            tok, [flat_tasks[i].prompt for i in ok], [flat[i] for i in ok],
            [[0.0] * row_len for _ in ok], max_len=row_len, pad_to=row_len,
        )  # fmt: skip
        step_probs = prm_step_probs(prm_graph, prm_params, ex)
        correct = np.asarray([r.correct for r in dom.verify_batch(flat_tasks, flat)])
        answers = [[extract_answer(c) for c in row] for row in cand]
        m = len(tasks)
        # "min" is the solution score fixed beforehand; the others are for comparison.
        by_aggregation, scores = {}, {}
        for how in ("min", "product", "last"):
            scores[how] = np.zeros(len(flat))
            scores[how][ok] = solution_score(step_probs, ex["label_mask"], how)
            by_aggregation[how] = best_of_n(scores[how].reshape(m, best_of),
                                            correct.reshape(m, best_of), answers)  # fmt: skip
        return {
            "best_of_n": dict(by_aggregation["min"], n=best_of, problems=m, level=level,
                              oracle=float(correct.reshape(m, best_of).any(axis=1).mean())),
            "by_aggregation": {
                how: {k: v for k, v in r.items() if k in ("reranked", "weighted_vote")}
                for how, r in by_aggregation.items()
            },
            # How well the PRM separates the policy's own right and wrong solutions.
            "solution_auc": (roc_auc(scores["min"], correct.astype(np.float32))
                             if 0 < correct.mean() < 1 else None),
        }  # fmt: skip

    trained = best_of_figures(level, max_new, train_len, jax.random.key(seed + 9))
    # A level-(L+1) solution has one more step: more room to write it and to score it.
    harder = best_of_figures(level + 1, max_new + 16, config.max_seq_len,
                             jax.random.key(seed + 10))  # fmt: skip
    return {
        "prm_step_roc_auc": auc,
        "prm_best_of_n": trained["best_of_n"],
        "prm_best_of_n_by_aggregation": trained["by_aggregation"],
        "prm_best_of_n_next_level": harder["best_of_n"],
        "prm_best_of_n_next_level_by_aggregation": harder["by_aggregation"],
        "prm_likelihood": likelihood,
        "prm_labels": label_kind,
        "prm_learning_rate": prm_learning_rate,
        "prm_solution_roc_auc_on_samples": trained["solution_auc"],
        "prm_solution_roc_auc_on_samples_next_level": harder["solution_auc"],
        "prm_label_samples": labels.samples,
        "prm_train_examples": len(keep),
        "prm_sft_steps": sft_steps,
        "time/prm_s": time.time() - start,
    }


def main(argv: Sequence[str]) -> None:
    del argv
    logging.basicConfig(level=logging.INFO)
    parts = _PARTS.value.split(",")
    result: dict[str, Any] = {}
    if "rm" in parts:
        result.update(reward_model_figures(_SEED.value, _RM_STEPS.value, _RM_SFT_STEPS.value))
        log.info("%s", result)
    if "prm" in parts:
        result.update(process_reward_figures(
            _SEED.value, sft_steps=_PRM_SFT_STEPS.value, prm_steps=_PRM_STEPS.value,
            n_label_tasks=_PRM_LABEL_TASKS.value, likelihood=_PRM_LIKELIHOOD.value,
            label_kind=_PRM_LABELS.value, best_of_tasks=_PRM_BEST_OF_TASKS.value,
            prm_learning_rate=_PRM_LEARNING_RATE.value,
        ))  # fmt: skip
    print(json.dumps(result))


_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
_PARTS = flags.DEFINE_string("parts", "rm,prm", "Comma-separated: rm, prm.")
_RM_STEPS = flags.DEFINE_integer("rm_steps", 400, "Bradley-Terry optimiser steps.")
_RM_SFT_STEPS = flags.DEFINE_integer(
    "rm_sft_steps", 1500, "Supervised steps warm-starting the reward model's trunk (0: none)."
)
_PRM_LABEL_TASKS = flags.DEFINE_integer(
    "prm_label_tasks", 2000, "Train problems whose solutions (sampled and planted) are labelled."
)
_PRM_STEPS = flags.DEFINE_integer("prm_steps", 600, "PRM cross-entropy optimiser steps.")
_PRM_LIKELIHOOD = flags.DEFINE_bool(
    "prm_likelihood", True, "Add each step's log-likelihood under the policy to its PRM score."
)
_PRM_LEARNING_RATE = flags.DEFINE_float(
    "prm_learning_rate", 3e-5, "Peak learning rate of PRM training."
)
_PRM_LABELS = flags.DEFINE_enum(
    "prm_labels", "hard", ["soft", "hard"],
    "Math-Shepherd label the PRM trains on: the fraction of continuations that reach the "
    "verified answer (soft) or whether any does (hard).",
)  # fmt: skip
_PRM_BEST_OF_TASKS = flags.DEFINE_integer(
    "prm_best_of_tasks", 600, "Held-out problems for best-of-N, at each level."
)
_PRM_SFT_STEPS = flags.DEFINE_integer(
    "prm_sft_steps", 500, "Supervised steps of the policy that labels steps and seeds the PRM."
)

if __name__ == "__main__":
    app.run(main)
