"""The ``ppo`` stage: rollouts from the curriculum loader, rewards, PPO updates.

Each step: the rollout role samples a prompt batch from the curriculum loader (with
``rollout.turns > 1``, retrying failed answers with the verifier's feedback); the
reward role judges it (program synthesis runs in the sandbox pool); with
``rollout.filter_groups`` (DAPO's dynamic sampling) more prompt batches are drawn
until the groups the update sees all have rewards that differ; the learner lays
the rows out as its batch, the reward role adds any learned terms to the per-token
rewards, and the learner scores, computes advantages and updates. The curriculum
hears of every valid sample. Periodic held-out evaluation every ``eval.every``
steps, the full one on the last step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from rlpt.data import CurriculumLoader, Feedback
from rlpt.metrics import rl_step_model_flops
from rlpt.parallel.multihost import to_host
from rlpt.rl import group_varies
from rlpt.roles import PPOLearner, RewardRole, RolloutWorker, Trajectories
from rlpt.trainers.context import RunEvaluation, StageContext


@dataclasses.dataclass
class StepRollout:
    """One PPO step's samples: ``generated`` holds every row sampled for the step,
    ``update`` the rows the update sees (groups consecutive, ids ``group_id``) and
    ``left_out`` the uniform groups it does not (their advantage is exactly zero)."""

    generated: Trajectories
    update: Trajectories
    left_out: Trajectories
    group_id: np.ndarray
    rounds: int
    informative_frac: float  # generated groups whose valid rewards vary
    update_informative_frac: float  # groups in the update whose valid rewards vary
    generate_s: float
    verify_s: float


class PPOStage:
    """The RL stage, wired from its roles."""

    def __init__(
        self,
        config,
        *,
        loader: CurriculumLoader,
        rollout: RolloutWorker,
        reward: RewardRole,
        learner: PPOLearner,
        evaluation: RunEvaluation,
        make_batch_kwargs: dict[str, Any],
        n_policy_params: int,
        peak_flops: Callable[[], float],
    ):
        self.config = config
        self.loader = loader
        self.rollout = rollout
        self.reward = reward
        self.learner = learner
        self.evaluation = evaluation
        self.make_batch_kwargs = make_batch_kwargs
        self.n_policy_params = n_policy_params
        self.peak_flops = peak_flops

    def run(self, ctx: StageContext) -> bool:
        """PPO to ``ppo_steps``; False if ``stop_after_step`` stopped it first."""
        total = self.config.ppo_steps
        progress = ctx.progress(total, "ppo")
        try:
            while ctx.stage_step < total:
                last, metrics = self.step(ctx, total)
                progress.update({k: metrics[k] for k in ("ppo/success", "ppo/kl") if k in metrics})
                if ctx.should_stop(last):
                    return False
            return True
        finally:
            progress.close()

    def step(self, ctx: StageContext, total: int) -> tuple[bool, dict[str, Any]]:
        """One PPO step, its metrics line and checkpoint: (was it the last, its metrics)."""
        cfg = self.learner.cfg
        t0 = time.perf_counter()
        step = ctx.step + 1
        ctx.profiler.start(step)
        chunking = self.config.rollout.chunked_reasoning
        if chunking.enabled:
            # The length curriculum: this step's chunk budget.
            self.rollout.max_chunks = chunking.budget(ctx.stage_step)
        ro = self.collect(step, ctx.keys["rollout"])
        up = ro.update
        t_collected = time.perf_counter()
        rows = None
        if chunking.enabled:
            # Rows for the ceiling (chunking.max_chunks), not this step's budget: the score
            # and update programs compile once for the whole length curriculum; the
            # unused rows are filler with zero loss weight.
            batch, layout, rows = self.learner.make_chunked_batch(
                up, ro.group_id, chunk_tokens=chunking.chunk_tokens,
                carry_tokens=chunking.carry_tokens, max_chunks=chunking.max_chunks,
                prompt_buckets=self.make_batch_kwargs["prompt_buckets"],
                pad_id=self.make_batch_kwargs["pad_id"], step_id=self.make_batch_kwargs["step_id"],
            )  # fmt: skip
        else:
            batch, layout = self.learner.make_batch(up, ro.group_id, **self.make_batch_kwargs)
        batch, learned_metrics, confidence = self.reward.assemble(batch, up)
        batch = self.learner.score(batch)
        # The sampler's log-probs against the scored ones, every step: the train/inference
        # mismatch that off-policy corrections (ppo.behaviour_correction) act on.
        mismatch = self.learner.trainer.mismatch(batch)
        if rows is None:
            batch = self.learner.advantages(batch)
        else:
            batch = self.learner.chunked_advantages(batch, rows, ro.group_id)
        jax.block_until_ready(batch.advantages)
        t_score = time.perf_counter()
        update_metrics = {**mismatch, **self.learner.update(batch)}
        adv, mask = to_host((batch.advantages, batch.response_mask))
        abs_adv = np.abs(adv * mask).sum(1) / np.maximum(mask.sum(1), 1.0)
        if rows is not None:
            # Per trace: every chunk of a trace has the trace's advantage.
            per_trace = np.zeros(len(up))
            real = rows.row_trace >= 0
            np.maximum.at(per_trace, rows.row_trace[real], abs_adv[real])
            abs_adv = per_trace
        # The curriculum hears of every valid sample in the update and of the uniform
        # groups left out of it, whose advantage is exactly zero.
        fed = Trajectories.concat([up, ro.left_out])
        keep = fed.verdicts.valid > 0
        fed_abs_adv = np.concatenate([abs_adv, np.zeros(len(ro.left_out))])
        self.loader.update(Feedback(
            domain_index=fed.domain_index[keep], success=fed.verdicts.success[keep],
            reward=fed.verdicts.rewards[keep], abs_advantage=fed_abs_adv[keep],
            difficulty=fed.difficulty[keep], confidence=confidence,
        ))  # fmt: skip
        update_metrics = to_host(update_metrics)
        # The reward model learns from this rollout's verdicts; refreshed, it scores the next.
        learned_metrics.update(self.reward.learned.observe(
            step, up.tasks, up.texts, up.verdicts.results,
            jax.random.fold_in(ctx.keys["rm_refresh"], step),
        ))  # fmt: skip
        ctx.profiler.stop(step, self.learner.state)
        t_upd = time.perf_counter()
        ctx.advance()
        metrics = {f"ppo/{k}": v for k, v in update_metrics.items()}
        metrics.update(self.rollout_metrics(ro))
        metrics.update(learned_metrics)
        metrics.update(self.loader.metrics())
        if rows is not None:
            metrics.update(self.chunk_metrics(up, rows))
        flops = rl_step_model_flops(
            self.n_policy_params, layout.get("rows", len(up)), layout["prompt_len"],
            layout["width"],
            int(up.lengths.sum()), epochs=cfg.epochs, critic=cfg.uses_critic,
            scored_tokens=layout["scored_tokens"],
        )  # fmt: skip
        step_s = t_upd - t0
        metrics.update({
            "time/generate_s": ro.generate_s, "time/verify_s": ro.verify_s,
            "time/score_s": t_score - t_collected, "time/update_s": t_upd - t_score,
            "time/step_s": step_s, "time/tokens_per_s": float(up.lengths.sum()) / step_s,
            "time/model_flops_per_s": flops / step_s,
            "time/mfu": flops / step_s / self.peak_flops(),
        })  # fmt: skip
        last = ctx.stage_step == total
        metrics.update(self.evaluation.after_rl_step(
            self.learner.policy_params, step, ctx.stage_step, total, ctx.meta["eval"]
        ))  # fmt: skip
        ctx.write(metrics, "ppo")
        if last or ctx.checkpoint_due(step):
            ctx.save()
        return last, metrics

    def collect(self, step: int, rollout_key: jax.Array) -> StepRollout:
        """Samples and judges one step's rollouts.

        With ``rollout.filter_groups`` (DAPO's dynamic sampling), a group whose valid
        rewards are all equal (all right or all wrong) has zero advantage under a
        group-relative estimator and only costs update time; prompt batches are drawn
        until the update's ``batch_size / group_size`` groups all vary, or for at most
        ``rollout.filter_max_rounds`` rounds, after which uniform groups fill the rest.
        """
        r = self.config.rollout
        group_size = r.group_size
        need = r.batch_size // group_size
        rounds = r.filter_max_rounds if r.filter_groups else 1
        key = jax.random.fold_in(rollout_key, step)
        params = self.learner.policy_params()
        version = int(self.learner.state.step)
        parts: list[Trajectories] = []
        generate_s = verify_s = 0.0
        informative: list[int] = []  # groups (over all rounds) in generation order
        uniform: list[int] = []
        for i in range(rounds):
            t0 = time.perf_counter()
            prompts = self.loader.next()
            traj = self.rollout.generate(
                params, prompts, key if i == 0 else jax.random.fold_in(key, i), version=version
            )
            t1 = time.perf_counter()
            traj = self.reward.judge(traj)
            # A multi-turn rollout verifies between its turns: that time is verification.
            inner = self.rollout.verify_s
            verify_s += time.perf_counter() - t1 + inner
            generate_s += t1 - t0 - inner
            first = sum(len(p) for p in parts) // group_size
            v = traj.verdicts
            varied = group_varies(
                v.rewards, np.arange(len(traj)) // group_size,
                num_groups=len(traj) // group_size, valid=v.valid,
            )  # fmt: skip
            for g, varies in enumerate(varied, start=first):
                (informative if varies else uniform).append(g)
            parts.append(traj)
            if len(informative) >= need:
                break
        generated = Trajectories.concat(parts)
        chosen = sorted(informative[:need] + uniform[: max(need - len(informative), 0)])
        # Surplus varying groups of the last round are dropped unseen.
        left_out = sorted(set(uniform) - set(chosen))

        def rows(groups: list[int]) -> np.ndarray:
            return (np.asarray(groups, int)[:, None] * group_size
                    + np.arange(group_size)).reshape(-1)  # fmt: skip

        return StepRollout(
            generated=generated, update=generated.take(rows(chosen)),
            left_out=generated.take(rows(left_out)),
            group_id=np.repeat(np.arange(len(chosen)), group_size).astype(np.int32),
            rounds=len(parts),
            informative_frac=len(informative) / max(len(informative) + len(uniform), 1),
            update_informative_frac=min(len(informative), need) / need,
            generate_s=generate_s, verify_s=verify_s,
        )  # fmt: skip

    def chunk_metrics(self, up: Trajectories, rows) -> dict[str, Any]:
        """Chunked reasoning: the budget, chunks per trace and the longest context a
        forward pass saw (prompt + carry + chunk), against the trace lengths."""
        real = rows.row_trace >= 0
        window = rows.context_mask.sum(1) + rows.mask.sum(1)
        return {
            "ppo/max_chunks": self.rollout.max_chunks,
            "ppo/chunks_per_trace": float(real.sum()) / max(len(up), 1),
            "ppo/trace_len_mean": float(np.mean(up.lengths)),
            "ppo/trace_len_max": int(np.max(up.lengths)),
            "ppo/window_max": int(window[real].max()),
        }

    def rollout_metrics(self, ro: StepRollout) -> dict[str, Any]:
        """What the policy did this step: over every sample generated, whether or not
        group filtering kept it for the update."""
        gen = ro.generated
        v = gen.verdicts
        valid, success = v.valid > 0, v.success
        counters = self.reward.counters
        m: dict[str, Any] = {
            "ppo/score": float(v.rewards[valid].mean()) if valid.any() else float("nan"),
            "ppo/success": float(success[valid].mean()) if valid.any() else float("nan"),
            "ppo/truncated_frac": float(np.mean(gen.truncated)),
            "ppo/sandbox_failures": counters["sandbox_failures"],
            "ppo/nonfinite_rewards": counters["nonfinite_rewards"],
            "ppo/dropped_samples": int((ro.update.verdicts.valid == 0).sum()),
            "ppo/varying_groups_frac": ro.informative_frac,
        }
        if gen.turns is not None:
            # Multi-turn rollouts: solved at the first try, solved within the turns (the
            # verdict ``ppo/success`` reports too) and completions sampled per row.
            t = gen.turns
            for key, values in (
                ("first_turn_success", t.first_success),
                ("success_within_turns", t.success),
                ("mean_turns", t.turns),
            ):
                m[f"ppo/{key}"] = float(values[valid].mean()) if valid.any() else float("nan")
        if self.config.rollout.filter_groups:
            m["ppo/rollout_rounds"] = ro.rounds
            m["ppo/update_varying_groups_frac"] = ro.update_informative_frac
        for d, name in enumerate(self.loader.names):
            rows = (gen.domain_index == d) & valid
            if rows.any():
                m[f"ppo/{name}/success"] = float(success[rows].mean())
        return m
