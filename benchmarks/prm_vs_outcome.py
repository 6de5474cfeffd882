"""PPO on stepwise_math: outcome-only rewards against outcome plus dense process rewards.

Both runs start from the same policy, warm-started by a short supervised phase
on demonstrations, and use the same seeds, prompts and PPO budget. The process
run first spends samples on Math-Shepherd step labels (the solutions it samples
and every continuation) and those count against its budget; its PRM starts from
the warm-started policy's trunk. Both runs use GRPO; the process run credits
each token with the group-normalised rewards of its own and later steps
(``ppo.step_advantages``), so the PRM's step scores reach the steps they judge; the
PRM adds each step's log-likelihood under the policy to its score
(``ProcessRewardModel(likelihood=True)``).

Held-out accuracy is the policy's: the mean verdict of ``EVAL_SAMPLES`` samples per
held-out problem at temperature 1, the distribution PPO trains; greedy accuracy is
logged beside it (PPO sharpens the sampled distribution, and the greedy answer, its
mode, moves far less at this budget). The target is fixed beforehand as the
warm-started policy's held-out accuracy plus ``TARGET_GAIN``;
``samples_ratio_prm_vs_outcome`` is the samples the process run needed to reach it
over those the outcome run needed (null if either run never reached it: the curves
then say what happened).

Run: ``python benchmarks/prm_vs_outcome.py`` (about 20 minutes on a 2-core CPU). The last
line of standard output is one JSON object; logs go to standard error.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update(
    "jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "rlpt-bench-cache")
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

from rlpt.rewards import (  # noqa: E402
    RewardConfig,
    assemble_rewards,
    encode_sequence,
    encode_step_examples,
    init_norm_state,
    math_shepherd_labels,
    planted_error_solutions,
    roc_auc,
    rollout_process_scores,
)
from rlpt.rewards.recipes import (  # noqa: E402
    prm_step_probs,
    sample_solutions,
    small_config,
    train_prm,
    train_sft,
)
from rlpt.rl import PPOConfig, PPOTrainer, init_train_state, new_rollout_batch  # noqa: E402
from rlpt.sampling import GREEDY, Sampler, SamplingParams  # noqa: E402
from rlpt.tasks import get_domain  # noqa: E402
from rlpt.tokenizers import ByteTokenizer, decode_response  # noqa: E402

log = logging.getLogger("prm_vs_outcome")

SEED = 0
LEVEL = 2  # two instructions: two steps, the first one's correctness is what the PRM adds
TARGET_GAIN = 0.10  # target = warm-start accuracy + this, fixed before any PPO step
# A warm start that solves some level-2 problems (about a third), so both runs have
# reward signal and headroom; it also seeds the PRM's trunk.
SFT_STEPS = 300
# Measured on outcome-only runs: 16 prompts x 4 samples a step (with or without a small
# KL) left held-out accuracy flat or lower after 48 steps; 32 x 8 moves it.
PPO_STEPS = 48
PPO_LEARNING_RATE = 1e-4
PPO_EPOCHS = 1
KL_COEF = 0.0
PROMPTS_PER_STEP = 32
SAMPLES_PER_PROMPT = 8
MAX_NEW = 28
EVAL_TASKS = 128
EVAL_SAMPLES = 4  # per held-out problem, temperature 1
EVAL_EVERY = 4
LABEL_SOLUTIONS = 128  # solutions sampled for Math-Shepherd labels
LABEL_CONTINUATIONS = 4
PRM_STEPS = 300
# As in the PRM recipe (rlpt.rewards.recipes): hard labels judge the step itself, and a
# small learning rate keeps the arithmetic the policy's trunk starts with.
PRM_LEARNING_RATE = 3e-5
PROCESS_WEIGHT = 0.5
PAD = 64  # training rows (prompt and solution) fit in 64 tokens at this level


def evaluate(sampler, params, tasks, domain, tok) -> tuple[float, float]:
    """Held-out (sampled, greedy) accuracy; the same sampling key at every evaluation."""

    def accuracy(tasks, sampling) -> float:
        prompts = [tok.encode(t.prompt, add_bos=True) for t in tasks]
        out = sampler.generate(params, prompts, jax.random.key(0), max_new_tokens=MAX_NEW,
                               sampling=sampling)  # fmt: skip
        texts = [decode_response(tok, out.tokens[i][: out.lengths[i]]) for i in range(len(tasks))]
        return float(np.mean([r.correct for r in domain.verify_batch(tasks, texts)]))

    sampled = accuracy([t for t in tasks for _ in range(EVAL_SAMPLES)], SamplingParams())
    return sampled, accuracy(tasks, GREEDY)


def ppo_run(name, graph, sft_params, config, domain, tok, train_tasks, eval_tasks, prm=None):
    """PPO from the warm start; returns the accuracy curve as (samples, sampled accuracy,
    greedy accuracy) points."""
    # GRPO in both runs; the process run credits tokens step by step (GRPO's process
    # supervision), so its step rewards reach the steps they judge. Adam's first updates
    # move every weight by about the learning rate, which a sharp warm-started policy
    # feels as a large KL: a warmup keeps it near the reference.
    cfg = PPOConfig(
        estimator="grpo", step_advantages=prm is not None, kl_placement="loss",
        epochs=PPO_EPOCHS, num_minibatches=2, learning_rate=PPO_LEARNING_RATE,
        schedule="warmup_cosine", warmup_steps=10, total_steps=PPO_STEPS * 2 * PPO_EPOCHS,
        end_lr_fraction=0.3, kl_coef=KL_COEF,
        num_groups=PROMPTS_PER_STEP, whiten_advantages=False,
    )  # fmt: skip
    trainer = PPOTrainer(cfg, graph)
    # The update donates its state: the policy gets its own copy, the reference keeps the original.
    policy = jax.tree.map(jnp.copy, sft_params)
    state = init_train_state(cfg, policy, None, jax.random.key(SEED))
    ref = sft_params
    sampler = Sampler(graph, config, eos_id=tok.eos_id, pad_id=tok.pad_id)
    rcfg = RewardConfig(outcome=1.0, process=PROCESS_WEIGHT if prm else 0.0, clip=3.0)
    norm = init_norm_state()

    @jax.jit
    def rewards_fn(norm, batch, outcome, prm_params):
        kwargs = {}
        if prm is not None:
            probs, steps = rollout_process_scores(
                prm[0], prm_params, batch, step_id=tok.step_id, answer_id=tok.answer_id
            )
            kwargs = {"process": probs, "step_mask": steps}
        return assemble_rewards(rcfg, norm, batch.response_mask, outcome=outcome, **kwargs)

    curve = [(0, *evaluate(sampler, state.policy, eval_tasks, domain, tok))]
    samples = 0
    for step in range(PPO_STEPS):
        start = time.time()
        picked = [train_tasks[(step * PROMPTS_PER_STEP + i) % len(train_tasks)]
                  for i in range(PROMPTS_PER_STEP)]  # fmt: skip
        tasks = [t for t in picked for _ in range(SAMPLES_PER_PROMPT)]
        prompts = [tok.encode(t.prompt, add_bos=True) for t in tasks]
        out = sampler.generate(state.policy, prompts, jax.random.key(1000 + step),
                               max_new_tokens=MAX_NEW, sampling=SamplingParams())  # fmt: skip
        samples += len(prompts)
        texts = [decode_response(tok, out.tokens[i][: out.lengths[i]]) for i in range(len(tasks))]
        outcome = np.asarray([r.reward for r in domain.verify_batch(tasks, texts)], np.float32)
        p_tok, p_mask = sampler.prepare(prompts, MAX_NEW)
        batch = new_rollout_batch(
            p_tok, p_mask, out.tokens, out.mask,
            group_id=np.arange(len(tasks)) // SAMPLES_PER_PROMPT,
            truncated=out.truncated, step_token_id=tok.step_id,
        )  # fmt: skip
        rewards, norm, rmetrics = rewards_fn(norm, batch, jnp.asarray(outcome),
                                             None if prm is None else prm[1])  # fmt: skip
        batch = batch.replace(rewards=rewards)
        batch = trainer.advantages(state, trainer.score(state, ref, batch))
        state, metrics = trainer.update(state, batch)
        if (step + 1) % EVAL_EVERY == 0:
            curve.append((samples, *evaluate(sampler, state.policy, eval_tasks, domain, tok)))
        log.info("%s step %d: train acc %.3f %s kl %.4f (%.1fs) curve %s", name, step,
                 outcome.mean(), {k: round(float(v), 3) for k, v in rmetrics.items()},
                 float(metrics["kl"]), time.time() - start, curve[-1])  # fmt: skip
    return curve


def samples_to_reach(curve, target, offset=0):
    for samples, acc, _ in curve:
        if acc >= target:
            return samples + offset
    return None


def main() -> dict:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    t0 = time.time()
    tok = ByteTokenizer()
    domain = get_domain("stepwise_math")
    config = small_config(max_seq_len=96)
    sft_tasks = domain.tasks("train", 3000, LEVEL, seed=SEED + 1)
    train_tasks = domain.tasks("train", PPO_STEPS * PROMPTS_PER_STEP, LEVEL, seed=SEED + 2)
    eval_tasks = domain.tasks("heldout", EVAL_TASKS, LEVEL, seed=SEED)

    graph, sft_params, sft_metrics = train_sft(
        config, domain, sft_tasks, tok, steps=SFT_STEPS, batch_size=64, learning_rate=2e-3,
        seed=SEED, pad_to=PAD,
    )  # fmt: skip
    log.info("sft done in %.0fs: %s", time.time() - t0, sft_metrics)
    sampler = Sampler(graph, config, eos_id=tok.eos_id, pad_id=tok.pad_id)
    sft_acc, sft_greedy = evaluate(sampler, sft_params, eval_tasks, domain, tok)
    target = sft_acc + TARGET_GAIN
    log.info("warm start held-out accuracy %.3f (greedy %.3f), target %.3f", sft_acc, sft_greedy,
             target)  # fmt: skip

    # Process reward model from Math-Shepherd labels of the warm-started policy's own samples.
    t1 = time.time()
    label_tasks = domain.tasks("train", LABEL_SOLUTIONS, LEVEL, seed=SEED + 3)
    solutions = [s[0] for s in sample_solutions(
        sampler, sft_params, label_tasks, tok, jax.random.key(7), n=1, max_new_tokens=MAX_NEW
    )]  # fmt: skip
    labels = math_shepherd_labels(
        sampler, sft_params, domain, label_tasks, solutions, tok, jax.random.key(8),
        n_continuations=LABEL_CONTINUATIONS, max_new_tokens=MAX_NEW, chunk_rows=256,
    )  # fmt: skip
    label_samples = len(solutions) + labels.samples
    # Planted wrong steps in demonstrations, labelled the same way (their continuations count
    # as spent samples too), so wrong steps are well represented in the PRM's training data.
    planted_tasks = label_tasks[: LABEL_SOLUTIONS // 2]
    planted, _ = planted_error_solutions(domain, planted_tasks, seed=SEED + 4)
    planted_tasks = [t for t in planted_tasks for _ in (0, 1)]
    planted_labels = math_shepherd_labels(
        sampler, sft_params, domain, planted_tasks, planted, tok, jax.random.key(9),
        n_continuations=LABEL_CONTINUATIONS, max_new_tokens=MAX_NEW, chunk_rows=256,
    )  # fmt: skip
    label_samples += planted_labels.samples
    all_tasks = list(label_tasks) + planted_tasks
    all_texts = solutions + planted
    all_labels = labels.hard + planted_labels.hard
    keep = [
        i for i, lab in enumerate(all_labels)
        if lab and len(encode_sequence(tok, all_tasks[i].prompt, all_texts[i])) <= PAD
    ]  # fmt: skip
    examples = encode_step_examples(
        tok, [all_tasks[i].prompt for i in keep], [all_texts[i] for i in keep],
        [all_labels[i] for i in keep], max_len=PAD, pad_to=PAD,
    )  # fmt: skip
    prm_graph, prm_params, prm_metrics = train_prm(
        config, examples, tok, steps=PRM_STEPS, batch_size=32, seed=SEED, policy=sft_params,
        likelihood=True, learning_rate=PRM_LEARNING_RATE,
    )  # fmt: skip
    held = domain.tasks("heldout", 64, LEVEL, seed=SEED + 5)
    texts, step_labels = planted_error_solutions(domain, held, seed=SEED)
    ev = encode_step_examples(tok, [t.prompt for t in held for _ in (0, 1)], texts, step_labels,
                              max_len=PAD, pad_to=PAD)  # fmt: skip
    probs = prm_step_probs(prm_graph, prm_params, ev)
    on = ev["label_mask"] > 0
    prm_auc = roc_auc(probs[on], ev["labels"][on])
    log.info("prm: %d label samples, train %s, planted-error AUC %.3f (%.0fs)", label_samples,
             prm_metrics, prm_auc, time.time() - t1)  # fmt: skip

    outcome_curve = ppo_run("outcome", graph, sft_params, config, domain, tok, train_tasks,
                            eval_tasks)  # fmt: skip
    process_curve = ppo_run("process", graph, sft_params, config, domain, tok, train_tasks,
                            eval_tasks, prm=(prm_graph, prm_params))  # fmt: skip
    n_out = samples_to_reach(outcome_curve, target)
    n_prm = samples_to_reach(process_curve, target, offset=label_samples)
    ratio = None if n_out is None or n_prm is None else n_prm / max(n_out, 1)
    result = {
        "samples_ratio_prm_vs_outcome": ratio,
        "target_accuracy": target,
        "warm_start_accuracy": sft_acc,
        "warm_start_greedy_accuracy": sft_greedy,
        "curves_are": "[samples, held-out sampled accuracy, held-out greedy accuracy]",
        "samples_to_target_outcome": n_out,
        "samples_to_target_prm": n_prm,
        "prm_label_samples": label_samples,
        "outcome_curve": outcome_curve,
        "prm_curve": [(s + label_samples, a, g) for s, a, g in process_curve],
        "prm_planted_error_auc": prm_auc,
        "seed": SEED,
        "time/total_s": time.time() - t0,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
