"""PPO with outcome-only rewards against outcome plus dense process rewards, over seeds.

Every run of a seed starts from the same policy, warm-started by a short supervised phase
on demonstrations, and uses the same prompts and PPO budget. Process rewards come in two
kinds (``--process``):

- ``math_shepherd``: a PRM trained on Math-Shepherd step labels of the warm start's own
  samples (the solutions it samples and every continuation; those samples count against
  the process run's budget), starting from the warm start's trunk and adding each step's
  log-likelihood under the policy to its score (``ProcessRewardModel(likelihood=True)``);
- ``implicit``: PRIME's implicit PRM (``rlpt.rewards.implicit``), a copy of the warm
  start updated online, one step per PPO step, on that step's own rollouts labelled by
  the verifier's outcome: it costs no samples beyond the rollouts.

All runs use GRPO; a process run credits each token with the group-normalised rewards of
its own and later steps (``ppo.step_advantages``), so the step scores reach the steps they
judge.

``--domain=state_tracking`` (the default) is the regime process rewards are for: a long
horizon (8 to 10 checkable steps at level 2, each one three-digit addition modulo 1000)
whose outcome reward is sparse at the warm start (the warm start is trained only until
single steps mostly come out right; ``warm_start_sparse`` says whether its test accuracy
is at most 10%). ``--domain=stepwise_math`` is the earlier two-step setting.

Held-out accuracy is the policy's: the mean verdict of ``EVAL_SAMPLES`` samples per test
problem at temperature 1, the distribution PPO trains; greedy accuracy is logged beside
it. The target is fixed beforehand as the warm start's test accuracy plus ``TARGET_GAIN``;
a seed's ratio is the samples its process run needed to reach it over those the outcome
run needed (null where either never reached it: the curves then say what happened).
``samples_ratio_prm_vs_outcome`` is the mean over seeds of the Math-Shepherd ratio
(``_se`` its standard error), ``samples_ratio_implicit_vs_outcome`` the same for the
implicit PRM. The warm start's SFT length is to be set on the validation split
(``--probe_sft`` prints the validation accuracy of a few lengths; see ``SETTINGS``);
test items report.

Run: ``python benchmarks/prm_vs_outcome.py --seeds=0,1,2 --workdir=DIR`` (about 40 minutes
a seed on a 2-core CPU, plus the warm start). The last line of standard output is one JSON
object; logs go to standard error. ``--workdir`` keeps each warm start and each finished
seed's result, so the steps can run apart and in parallel:

    python benchmarks/prm_vs_outcome.py --probe_sft=500,1000,1500,2000 --workdir=DIR
    for s in 0 1 2; do   # after setting sft_steps from the probe
      python benchmarks/prm_vs_outcome.py --seeds=$s --shared_warm_start --workdir=DIR &
    done; wait
    python benchmarks/prm_vs_outcome.py --seeds=0,1,2 --shared_warm_start --workdir=DIR

(the last command only reads the three results back and aggregates them).
``--shared_warm_start`` starts every seed from seed 0's warm start, the one the probe
kept, so seeds vary the RL runs and the PRM's data but not the SFT run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

jax.config.update(
    "jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "rlpt-bench-cache")
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

from rlpt.checkpoint import Checkpointer  # noqa: E402
from rlpt.models import CausalLM, create_model  # noqa: E402
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
from rlpt.rewards.implicit import (  # noqa: E402
    encode_implicit_examples,
    implicit_prm_trainer,
    reference_log_probs,
    rollout_implicit_rewards,
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
from rlpt.supervised import TrainConfig  # noqa: E402
from rlpt.tasks import get_domain  # noqa: E402
from rlpt.tokenizers import ByteTokenizer, decode_response  # noqa: E402

_DOMAIN = flags.DEFINE_enum(
    "domain", "state_tracking", ["state_tracking", "state_tracking/100", "stepwise_math"],
    "The stepwise domain.")  # fmt: skip
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds; each trains its own warm start.")
_PROCESS = flags.DEFINE_list("process", ["math_shepherd", "implicit"],
                             "Process-reward kinds run against outcome-only PPO.")  # fmt: skip
_PROBE_SFT = flags.DEFINE_list(
    "probe_sft", [], "Instead of the comparison: the validation accuracy of warm starts of "
    "these SFT lengths (seed 0).")  # fmt: skip
_QUICK = flags.DEFINE_bool("quick", False, "A few steps of everything: a smoke run.")
_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "Keeps warm starts (orbax checkpoints, reused by later runs with the same "
    "setting) and each finished seed's result (seed_N.json). Default: a fresh temporary dir.",
)
_PLOT = flags.DEFINE_string(
    "plot", "", "Write a PNG of test accuracy against samples (mean over seeds) here."
)
_TUNE_LR = flags.DEFINE_list(
    "tune_lr", [], "Instead of the comparison: outcome-only PPO from seed 0's warm start at "
    "each of these learning rates, on tuning seed TUNE_SEED's prompts, scored on validation "
    "(tune_lr_RATE.json in --workdir, so rates can run as parallel processes).")  # fmt: skip
_SHARED_WARM_START = flags.DEFINE_bool(
    "shared_warm_start", False, "Every seed starts from seed 0's warm start (seeds then vary "
    "the prompts, the PPO randomness and the PRM data, not the SFT run).")  # fmt: skip

log = logging.getLogger("prm_vs_outcome")


@dataclasses.dataclass(frozen=True)
class Setting:
    """What differs between the domains: level, lengths and the warm start's SFT steps.

    The warm start's learning rate decays over ``sft_horizon`` steps and the run stops
    after ``sft_steps`` of them (early stopping, its point chosen on validation by
    ``--probe_sft``, which scores every candidate length in one run of that schedule).
    """

    level: int
    sft_steps: int
    sft_horizon: int
    max_new: int  # generation budget: the longest demonstration and a margin
    pad: int  # training rows (prompt and solution) fit in this many tokens
    max_seq_len: int
    # Every arm's PPO learning rate; ``--tune_lr`` scores candidates on validation.
    ppo_learning_rate: float = 1e-4


SETTINGS = {
    # Two instructions: two steps; the first one's correctness is what the PRM adds. A warm
    # start that solves about a third, so both runs have reward signal and headroom.
    "stepwise_math": Setting(
        level=2, sft_steps=300, sft_horizon=300, max_new=28, pad=64, max_seq_len=96
    ),  # fmt: skip
    # 8 to 10 steps of at most 7 tokens, the answer and <eos>: 80 new tokens; the prompt
    # is at most 33. The cache holds a Math-Shepherd continuation after a long prefix (a
    # prompt bucket of 256 and 80 more); the sampler sizes its cache to what it is asked.
    # SFT length: with the schedule's horizon equal to the length, 100, 200 and 400 steps
    # gave validation accuracy (sampled) 0.002, 0.002 and 0.000 (greedy 0.008 at 400; seed
    # 0; token accuracy 0.55 at 200 steps): too sparse for either run to move. On a
    # 2000-step horizon, 500 and 1000 steps gave 0.000 and 0.004 (greedy 0.000 both); the
    # training token accuracy then rose from 0.73 (step 1000) to 0.91 (step 1450), where the
    # probe was stopped for time: 1500-2000 steps are the next lengths to score. The
    # modulo-100 variant below reaches a sparse but nonzero warm start sooner.
    "state_tracking": Setting(
        level=2, sft_steps=2000, sft_horizon=2000, max_new=80, pad=128, max_seq_len=384
    ),  # fmt: skip
    # Modulo 100: 8 to 10 steps, the answer and <eos> in at most 54 tokens, after a prompt
    # of at most 29. SFT length, the first probed one whose validation accuracy (sampled)
    # reaches 3%, on a 1000-step horizon: --probe_sft=250,500,750,1000 gave 0.020 (greedy
    # 0.031) at 250 and 0.037 (greedy 0.023) at 500 (seed 0; stopped there). PPO learning
    # rate, --tune_lr=1e-3,3e-4,1e-4 (outcome only, 48 steps, validation, tuning seed 100):
    # final minus warm start (sampled) -0.031 at 1e-3 (KL to the warm start 5.3, accuracy 0
    # from 5,120 samples on), -0.016 at 3e-4, 0.000 at 1e-4 (best point +0.008). 1e-4 stays;
    # no rate lifts outcome-only PPO from this warm start within the budget
    # (benchmarks/results/prm_tune_lr.json).
    "state_tracking/100": Setting(
        level=2,
        sft_steps=500,
        sft_horizon=1000,
        max_new=64,
        pad=96,
        max_seq_len=320,
        ppo_learning_rate=1e-4,
    ),  # fmt: skip
}
TARGET_GAIN = 0.10  # target = warm-start accuracy + this, fixed before any PPO step
SPARSE = 0.10  # "sparse" outcome reward at the warm start: at most this test accuracy
# Measured on outcome-only stepwise_math runs: 16 prompts x 4 samples a step (with or
# without a small KL) left held-out accuracy flat or lower after 48 steps; 32 x 8 moves it.
PPO_STEPS = 48
PPO_EPOCHS = 1
KL_COEF = 0.0
PROMPTS_PER_STEP = 32
SAMPLES_PER_PROMPT = 8
EVAL_TASKS = 128
EVAL_SAMPLES = 4  # per test problem, temperature 1
EVAL_EVERY = 4
LABEL_SOLUTIONS = 128  # solutions sampled for Math-Shepherd labels
LABEL_CONTINUATIONS = 4
PRM_STEPS = 300
# As in the PRM recipe (rlpt.rewards.recipes): hard labels judge the step itself, and a
# small learning rate keeps the arithmetic the policy's trunk starts with.
PRM_LEARNING_RATE = 3e-5
PROCESS_WEIGHT = 0.5
# PRIME's implicit PRM: its beta, and a rate for one online step per PPO step (PRIME's
# 1e-6 is for 7B models; this 0.8M-parameter model moves little at that rate).
IMPLICIT_BETA = 0.05
IMPLICIT_LEARNING_RATE = 1e-4


@dataclasses.dataclass(frozen=True)
class Budget:
    """Step counts; ``--quick`` shrinks every one of them."""

    ppo_steps: int = PPO_STEPS
    prompts_per_step: int = PROMPTS_PER_STEP
    eval_tasks: int = EVAL_TASKS
    eval_every: int = EVAL_EVERY
    label_solutions: int = LABEL_SOLUTIONS
    prm_steps: int = PRM_STEPS

    @classmethod
    def quick(cls) -> Budget:
        return cls(ppo_steps=2, prompts_per_step=4, eval_tasks=8, eval_every=1,
                   label_solutions=8, prm_steps=2)  # fmt: skip


def evaluate(sampler, params, tasks, domain, tok, max_new) -> tuple[float, float]:
    """Held-out (sampled, greedy) accuracy; the same sampling key at every evaluation."""

    def accuracy(tasks, sampling) -> float:
        prompts = [tok.encode(t.prompt, add_bos=True) for t in tasks]
        out = sampler.generate(params, prompts, jax.random.key(0), max_new_tokens=max_new,
                               sampling=sampling)  # fmt: skip
        texts = [decode_response(tok, out.tokens[i][: out.lengths[i]]) for i in range(len(tasks))]
        return float(np.mean([r.correct for r in domain.verify_batch(tasks, texts)]))

    sampled = accuracy([t for t in tasks for _ in range(EVAL_SAMPLES)], SamplingParams())
    return sampled, accuracy(tasks, GREEDY)


class OnlineImplicitPRM:
    """PRIME's implicit PRM, updated on each PPO step's own rollouts and outcome labels.

    ``pi_phi`` starts as a copy of the warm start and the reference is the warm start
    itself (frozen, never donated: the PPO state holds its own copy of the policy).
    """

    def __init__(self, graph, warm_start, tok, pad: int):
        self.graph, self.ref, self.tok, self.pad = graph, warm_start, tok, pad
        self.trainer = implicit_prm_trainer(
            TrainConfig(learning_rate=IMPLICIT_LEARNING_RATE), graph, beta=IMPLICIT_BETA
        )
        self.state = self.trainer.init(jax.tree.map(jnp.copy, warm_start))

    def scores(self, batch):
        """Step rewards [B, T] and where they sit, from the current ``pi_phi``."""
        return _implicit_scores(self.graph, self.state.params, self.ref, batch,
                                self.tok.step_id, self.tok.answer_id)  # fmt: skip

    def update(self, prompts, responses, correct) -> dict[str, float]:
        """One step of cross-entropy on the rollouts' outcome labels."""
        examples = [(p, r, float(c)) for p, r, c in zip(prompts, responses, correct)
                    if r and len(p) + len(r) <= self.pad]  # fmt: skip
        data = encode_implicit_examples(examples, pad_id=self.tok.pad_id, pad_to=self.pad)
        data["ref_logp"] = reference_log_probs(self.graph, self.ref, data["tokens"], data["mask"],
                                               chunk=len(examples))  # fmt: skip
        self.state, metrics = self.trainer.step(self.state, data)
        return {k: round(float(v), 4) for k, v in jax.device_get(metrics).items()}


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _implicit_scores(graph, params, ref, batch, step_id, answer_id):
    return rollout_implicit_rewards(graph, params, ref, batch, beta=IMPLICIT_BETA,
                                    step_id=step_id, answer_id=answer_id)  # fmt: skip


def ppo_run(name, graph, sft_params, config, domain, tok, setting, budget, train_tasks,
            eval_tasks, seed, process=None):  # fmt: skip
    """PPO from the warm start; returns the accuracy curve as (samples, sampled accuracy,
    greedy accuracy) points. ``process``: None, ``("math_shepherd", (graph, params))`` or
    ``("implicit", OnlineImplicitPRM)``."""
    # Adam's first updates move every weight by about the learning rate, which a sharp
    # warm-started policy feels as a large KL: a warmup keeps it near the reference.
    cfg = PPOConfig(
        estimator="grpo", step_advantages=process is not None, kl_placement="loss",
        epochs=PPO_EPOCHS, num_minibatches=2, learning_rate=setting.ppo_learning_rate,
        schedule="warmup_cosine", warmup_steps=min(10, budget.ppo_steps),
        total_steps=budget.ppo_steps * 2 * PPO_EPOCHS, end_lr_fraction=0.3, kl_coef=KL_COEF,
        num_groups=budget.prompts_per_step, whiten_advantages=False,
    )  # fmt: skip
    trainer = PPOTrainer(cfg, graph)
    # The update donates its state: the policy gets its own copy, the reference keeps the original.
    policy = jax.tree.map(jnp.copy, sft_params)
    state = init_train_state(cfg, policy, None, jax.random.key(seed))
    ref = sft_params
    sampler = Sampler(graph, config, eos_id=tok.eos_id, pad_id=tok.pad_id)
    rcfg = RewardConfig(outcome=1.0, process=PROCESS_WEIGHT if process else 0.0, clip=3.0)
    norm = init_norm_state()
    kind = None if process is None else process[0]

    @jax.jit
    def rewards_fn(norm, batch, outcome, scores):
        kwargs = {} if scores is None else {"process": scores[0], "step_mask": scores[1]}
        return assemble_rewards(rcfg, norm, batch.response_mask, outcome=outcome, **kwargs)

    @jax.jit
    def shepherd_scores(prm_params, batch):
        return rollout_process_scores(process[1][0], prm_params, batch, step_id=tok.step_id,
                                      answer_id=tok.answer_id)  # fmt: skip

    max_new = setting.max_new
    curve = [(0, *evaluate(sampler, state.policy, eval_tasks, domain, tok, max_new))]
    samples = 0
    for step in range(budget.ppo_steps):
        start = time.time()
        n = budget.prompts_per_step
        picked = [train_tasks[(step * n + i) % len(train_tasks)] for i in range(n)]
        tasks = [t for t in picked for _ in range(SAMPLES_PER_PROMPT)]
        prompts = [tok.encode(t.prompt, add_bos=True) for t in tasks]
        out = sampler.generate(state.policy, prompts, jax.random.key(1000 * (seed + 1) + step),
                               max_new_tokens=max_new, sampling=SamplingParams())  # fmt: skip
        samples += len(prompts)
        responses = [list(out.tokens[i][: out.lengths[i]]) for i in range(len(tasks))]
        texts = [decode_response(tok, r) for r in responses]
        verdicts = domain.verify_batch(tasks, texts)
        outcome = np.asarray([r.reward for r in verdicts], np.float32)
        p_tok, p_mask = sampler.prepare(prompts, max_new)
        batch = new_rollout_batch(
            p_tok, p_mask, out.tokens, out.mask,
            group_id=np.arange(len(tasks)) // SAMPLES_PER_PROMPT,
            truncated=out.truncated, step_token_id=tok.step_id,
        )  # fmt: skip
        scores, extra = None, {}
        if kind == "math_shepherd":
            scores = shepherd_scores(process[1][1], batch)
        elif kind == "implicit":
            scores = process[1].scores(batch)
        rewards, norm, rmetrics = rewards_fn(norm, batch, jnp.asarray(outcome), scores)
        batch = batch.replace(rewards=rewards)
        batch = trainer.advantages(state, trainer.score(state, ref, batch))
        state, metrics = trainer.update(state, batch)
        if kind == "implicit":  # after its scores were used: PRIME's order
            extra = process[1].update(prompts, responses, [r.correct for r in verdicts])
        if (step + 1) % budget.eval_every == 0:
            curve.append((samples, *evaluate(sampler, state.policy, eval_tasks, domain, tok,
                                             max_new)))  # fmt: skip
        log.info("%s step %d: train acc %.3f %s kl %.4f %s (%.1fs) curve %s", name, step,
                 outcome.mean(), {k: round(float(v), 3) for k, v in rmetrics.items()},
                 float(metrics["kl"]), extra, time.time() - start, curve[-1])  # fmt: skip
    return curve


def samples_to_reach(curve, target, offset=0):
    for samples, acc, _ in curve:
        if acc >= target:
            return samples + offset
    return None


def warm_start(domain, tok, setting, seed, steps, workdir=None, keep_at=(), on_kept=None):
    """``(config, graph, params)``: SFT on 3,000 training demonstrations, stopped after
    ``steps`` steps of a ``setting.sft_horizon``-step schedule.

    With ``workdir`` the params after ``steps`` and each of ``keep_at`` steps are saved
    (orbax), and a saved warm start of this setting and seed is loaded instead of
    trained. ``on_kept(n, params)`` is called at each of them.
    """
    config = small_config(max_seq_len=setting.max_seq_len)
    graph, template = create_model(lambda r: CausalLM(config, rngs=r), jax.random.key(seed))
    keep = sorted({*keep_at, steps})
    ckpt = None
    if workdir is not None:
        tag = domain.name.replace("/", "_")
        name = f"warm_start_{tag}_level{setting.level}_h{setting.sft_horizon}_s{seed}"
        ckpt = Checkpointer(os.path.join(workdir, name), keep=len(keep) + 8, async_save=False)
        if set(keep) <= set(ckpt.all_steps()):
            loaded = {}
            for n in keep:
                loaded[n] = ckpt.restore(n, {"params": template}, only=True)[0]["params"]
                if on_kept is not None:
                    on_kept(n, loaded[n])
            log.info("warm start of seed %d: loaded steps %s from %s", seed, keep, ckpt.directory)
            return config, graph, loaded[steps]

    def kept(n, params):
        if n in keep:
            if ckpt is not None:
                ckpt.save(
                    n,
                    {"params": params},
                    {"sft_steps": n, "seed": seed, "setting": dataclasses.asdict(setting)},
                )
            if on_kept is not None:
                on_kept(n, params)

    sft_tasks = domain.tasks("train", 3000, setting.level, seed=seed + 1)
    graph, params, metrics = train_sft(
        config, domain, sft_tasks, tok, steps=steps, batch_size=64, learning_rate=2e-3,
        seed=seed, pad_to=setting.pad, decay_steps=setting.sft_horizon, on_step=kept,
    )  # fmt: skip
    log.info("sft (%d of %d steps): %s", steps, setting.sft_horizon, metrics)
    return config, graph, params


def math_shepherd_prm(domain, tok, setting, budget, seed, config, sampler, sft_params):
    """``(graph, params)``, the label samples it spent and its planted-error AUC."""
    level, pad, max_new = setting.level, setting.pad, setting.max_new
    label_tasks = domain.tasks("train", budget.label_solutions, level, seed=seed + 3)
    solutions = [s[0] for s in sample_solutions(
        sampler, sft_params, label_tasks, tok, jax.random.key(7 + seed), n=1,
        max_new_tokens=max_new,
    )]  # fmt: skip
    labels = math_shepherd_labels(
        sampler, sft_params, domain, label_tasks, solutions, tok, jax.random.key(8 + seed),
        n_continuations=LABEL_CONTINUATIONS, max_new_tokens=max_new, chunk_rows=256,
    )  # fmt: skip
    label_samples = len(solutions) + labels.samples
    # Planted wrong steps in demonstrations, labelled the same way (their continuations count
    # as spent samples too), so wrong steps are well represented in the PRM's training data.
    planted_tasks = label_tasks[: budget.label_solutions // 2]
    planted, _ = planted_error_solutions(domain, planted_tasks, seed=seed + 4)
    planted_tasks = [t for t in planted_tasks for _ in (0, 1)]
    planted_labels = math_shepherd_labels(
        sampler, sft_params, domain, planted_tasks, planted, tok, jax.random.key(9 + seed),
        n_continuations=LABEL_CONTINUATIONS, max_new_tokens=max_new, chunk_rows=256,
    )  # fmt: skip
    label_samples += planted_labels.samples
    all_tasks = list(label_tasks) + planted_tasks
    all_texts = solutions + planted
    all_labels = labels.hard + planted_labels.hard
    keep = [
        i for i, lab in enumerate(all_labels)
        if lab and len(encode_sequence(tok, all_tasks[i].prompt, all_texts[i])) <= pad
    ]  # fmt: skip
    examples = encode_step_examples(
        tok, [all_tasks[i].prompt for i in keep], [all_texts[i] for i in keep],
        [all_labels[i] for i in keep], max_len=pad, pad_to=pad,
    )  # fmt: skip
    prm_graph, prm_params, prm_metrics = train_prm(
        config, examples, tok, steps=budget.prm_steps, batch_size=32, seed=seed,
        policy=sft_params, likelihood=True, learning_rate=PRM_LEARNING_RATE,
    )  # fmt: skip
    held = domain.tasks("validation", 64, level, seed=seed + 5)
    texts, step_labels = planted_error_solutions(domain, held, seed=seed)
    ev = encode_step_examples(tok, [t.prompt for t in held for _ in (0, 1)], texts, step_labels,
                              max_len=pad, pad_to=pad)  # fmt: skip
    probs = prm_step_probs(prm_graph, prm_params, ev)
    on = ev["label_mask"] > 0
    auc = roc_auc(probs[on], ev["labels"][on])
    log.info("prm: %d label samples, train %s, planted-error AUC %.3f", label_samples,
             prm_metrics, auc)  # fmt: skip
    return (prm_graph, prm_params), label_samples, auc


def run_seed(domain, tok, setting, budget, seed, kinds, workdir, warm_seed) -> dict:
    """Every arm of one seed from the warm start of ``warm_seed``."""
    t0 = time.time()
    config, graph, sft_params = warm_start(domain, tok, setting, warm_seed, setting.sft_steps,
                                           workdir)  # fmt: skip
    train_tasks = domain.tasks("train", budget.ppo_steps * budget.prompts_per_step,
                               setting.level, seed=seed + 2)  # fmt: skip
    eval_tasks = domain.tasks("test", budget.eval_tasks, setting.level, seed=seed)
    sampler = Sampler(graph, config, eos_id=tok.eos_id, pad_id=tok.pad_id)
    sft_acc, sft_greedy = evaluate(sampler, sft_params, eval_tasks, domain, tok, setting.max_new)
    target = sft_acc + TARGET_GAIN
    log.info("seed %d: warm start test accuracy %.3f (greedy %.3f), target %.3f", seed, sft_acc,
             sft_greedy, target)  # fmt: skip
    common = (graph, sft_params, config, domain, tok, setting, budget, train_tasks, eval_tasks,
              seed)  # fmt: skip
    outcome_curve = ppo_run("outcome", *common)
    n_out = samples_to_reach(outcome_curve, target)
    result = {
        "seed": seed, "warm_start_seed": warm_seed, "warm_start_accuracy": sft_acc,
        "warm_start_greedy_accuracy": sft_greedy,
        "target_accuracy": target, "samples_to_target_outcome": n_out,
        "outcome_curve": outcome_curve,
    }  # fmt: skip
    for kind in kinds:
        if kind == "math_shepherd":
            prm, offset, auc = math_shepherd_prm(domain, tok, setting, budget, seed, config,
                                                 sampler, sft_params)  # fmt: skip
            result.update(prm_label_samples=offset, prm_planted_error_auc=auc)
            curve = ppo_run(kind, *common, process=(kind, prm))
            key = "prm"
        else:
            online = OnlineImplicitPRM(graph, sft_params, tok, setting.pad)
            curve, offset = ppo_run(kind, *common, process=(kind, online)), 0
            key = "implicit"
        n = samples_to_reach(curve, target, offset=offset)
        result[f"samples_to_target_{key}"] = n
        result[f"{key}_curve"] = [(s + offset, a, g) for s, a, g in curve]
        result[f"samples_ratio_{key}_vs_outcome"] = (
            None if n is None or n_out is None else n / max(n_out, 1)
        )
    result["time_s"] = time.time() - t0
    return result


def mean_se(values) -> tuple[float | None, float | None, int]:
    """Mean, standard error and count of the values that are not None."""
    x = np.asarray([v for v in values if v is not None], np.float64)
    if not x.size:
        return None, None, 0
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else None
    return float(x.mean()), se, int(x.size)


def summarise(per_seed: list[dict], kinds) -> dict:
    """The JSON line: mean ratios over seeds (null unless every seed reached the target)."""
    out: dict = {"seeds": [r["seed"] for r in per_seed]}
    for kind in kinds:
        key = "prm" if kind == "math_shepherd" else "implicit"
        ratios = [r[f"samples_ratio_{key}_vs_outcome"] for r in per_seed]
        mean, se, n = mean_se(ratios)
        complete = n == len(per_seed)
        out[f"samples_ratio_{key}_vs_outcome"] = mean if complete else None
        out[f"samples_ratio_{key}_vs_outcome_se"] = se if complete else None
        out[f"seeds_reaching_target_{key}"] = sum(
            r[f"samples_to_target_{key}"] is not None for r in per_seed
        )
    out["seeds_reaching_target_outcome"] = sum(
        r["samples_to_target_outcome"] is not None for r in per_seed
    )
    warm = [r["warm_start_accuracy"] for r in per_seed]
    out["warm_start_accuracy_mean"] = float(np.mean(warm))
    out["warm_start_sparse"] = bool(max(warm) <= SPARSE)
    out["curves_are"] = "[samples, test sampled accuracy, test greedy accuracy]"
    out["per_seed"] = per_seed
    return out


def plot(per_seed: list[dict], kinds, path: str) -> None:
    """Test accuracy (sampled) against samples, each arm's mean over seeds with its
    standard error as a band; label samples are on the Math-Shepherd arm's axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [("outcome", "outcome only")]
    for kind in kinds:
        key = "prm" if kind == "math_shepherd" else "implicit"
        arms.append((key, {"prm": "Math-Shepherd PRM", "implicit": "implicit PRM (online)"}[key]))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, label in arms:
        curves = np.asarray([[p[:2] for p in r[f"{key}_curve"]] for r in per_seed], np.float64)
        # Sample counts agree across seeds but for the PRM's label samples: their mean.
        x, acc = curves[:, :, 0].mean(0), curves[:, :, 1]
        mean = acc.mean(0)
        se = acc.std(0, ddof=1) / math.sqrt(len(acc)) if len(acc) > 1 else 0 * mean
        ax.plot(x, mean, marker="o", markersize=3, label=label)
        ax.fill_between(x, mean - se, mean + se, alpha=0.2)
    target = np.mean([r["target_accuracy"] for r in per_seed])
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target (mean)")
    ax.set_xlabel("samples (policy rollouts and PRM label samples)")
    ax.set_ylabel("test accuracy (sampled)")
    ax.set_title(f"{len(per_seed)} seeds, mean +- SE")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def probe(domain, tok, setting, lengths, workdir) -> dict:
    """Validation accuracy (sampled, greedy) of the warm start stopped after each of
    ``lengths`` steps: one SFT run (seed 0) on the setting's schedule, scored as it goes."""
    if max(lengths) > setting.sft_horizon:
        raise ValueError(f"--probe_sft: {max(lengths)} steps exceed the schedule's horizon "
                         f"({setting.sft_horizon})")  # fmt: skip
    tasks = domain.tasks("validation", EVAL_TASKS, setting.level, seed=0)
    config = small_config(max_seq_len=setting.max_seq_len)
    graph, _ = create_model(lambda r: CausalLM(config, rngs=r), jax.random.key(0))
    sampler = Sampler(graph, config, eos_id=tok.eos_id, pad_id=tok.pad_id)
    found = {}

    def score(n, params):
        found[n] = evaluate(sampler, params, tasks, domain, tok, setting.max_new)
        log.info("probe: %d SFT steps -> validation (sampled, greedy) %s", n, found[n])

    warm_start(domain, tok, setting, 0, max(lengths), workdir, keep_at=lengths, on_kept=score)
    return {"sft_horizon": setting.sft_horizon, "validation_accuracy_by_sft_steps": found}


TUNE_SEED = 100  # the learning-rate tuning's prompts and PPO randomness; reports use 0, 1, 2


def tune_learning_rate(domain, tok, setting, budget, rates, workdir) -> dict:
    """Outcome-only PPO at each learning rate from seed 0's warm start, on the tuning
    seed's training prompts, scored on the validation split (never on test)."""
    config, graph, sft_params = warm_start(domain, tok, setting, 0, setting.sft_steps, workdir)
    train_tasks = domain.tasks("train", budget.ppo_steps * budget.prompts_per_step,
                               setting.level, seed=TUNE_SEED + 2)  # fmt: skip
    eval_tasks = domain.tasks("validation", budget.eval_tasks, setting.level, seed=TUNE_SEED)
    found = {}
    for rate in rates:
        path = os.path.join(workdir, f"tune_lr_{rate:g}.json")
        if os.path.exists(path):
            with open(path) as f:
                found[f"{rate:g}"] = json.load(f)
            continue
        tuned = dataclasses.replace(setting, ppo_learning_rate=rate)
        curve = ppo_run(f"outcome lr {rate:g}", graph, sft_params, config, domain, tok, tuned,
                        budget, train_tasks, eval_tasks, TUNE_SEED)  # fmt: skip
        found[f"{rate:g}"] = {
            "validation_curve": curve,
            "final_minus_warm_start": curve[-1][1] - curve[0][1],
            "best_minus_warm_start": max(a for _, a, _ in curve) - curve[0][1],
        }
        with open(path, "w") as f:
            json.dump(found[f"{rate:g}"], f)
    return {"ppo_steps": budget.ppo_steps, "validation_by_learning_rate": found}


def main(argv) -> dict:
    del argv
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    t0 = time.time()
    tok = ByteTokenizer()
    domain = get_domain(_DOMAIN.value)
    setting = SETTINGS[_DOMAIN.value]
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="prm_vs_outcome-")
    if _PROBE_SFT.value:
        result = probe(domain, tok, setting, [int(v) for v in _PROBE_SFT.value], workdir)
    elif _TUNE_LR.value:
        rates = [float(v) for v in _TUNE_LR.value]
        budget = Budget.quick() if _QUICK.value else Budget()
        if _QUICK.value:
            setting = dataclasses.replace(setting, sft_steps=2, sft_horizon=2)
        result = tune_learning_rate(domain, tok, setting, budget, rates, workdir)
    else:
        kinds = list(_PROCESS.value)
        unknown = set(kinds) - {"math_shepherd", "implicit"}
        if unknown:
            raise ValueError(f"--process: unknown kinds {sorted(unknown)}")
        if _QUICK.value:
            budget = Budget.quick()
            setting = dataclasses.replace(setting, sft_steps=2, sft_horizon=2)
        else:
            budget = Budget()
        per_seed = []
        for s in (int(v) for v in _SEEDS.value):
            # A finished seed is read back, so seeds can run as separate processes
            # sharing --workdir and a last run over all of them aggregates.
            path = os.path.join(workdir, f"seed_{s}{'_quick' if _QUICK.value else ''}.json")
            if os.path.exists(path):
                with open(path) as f:
                    per_seed.append(json.load(f))
                continue
            warm_seed = 0 if _SHARED_WARM_START.value else s
            per_seed.append(run_seed(domain, tok, setting, budget, s, kinds, workdir, warm_seed))
            with open(path, "w") as f:
                json.dump(per_seed[-1], f)
        result = {"domain": _DOMAIN.value, "level": setting.level, **summarise(per_seed, kinds)}
        if _PLOT.value:
            plot(per_seed, kinds, _PLOT.value)
    result["time/total_s"] = time.time() - t0
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    app.run(main)
