"""The ``ppo`` stage with ``async_rl.enabled``: actors and the learner overlap.

The rollout engine runs on its own sub-mesh (``async_rl.actor_devices`` of the devices), the
learner on the rest (or the engine in another JAX process or on a Ray actor:
``async_rl.engine``); ``rlpt.asyncrl.AsyncRunner`` drives both (see its module doc). This
stage adapts the trainer's roles to it: prompts come from the curriculum loader one group
at a time (``LoaderPrompts``), the reward role judges each group as it finishes, and the
learner lays a pool draw out as its batch (token in, token out, behaviour log-probs per
token), scores it with its current parameters (the proximal policy), updates, and publishes
the new weights. Metrics, periodic evaluation and checkpoints are those of the synchronous
stage; a checkpoint also holds the runner's state (the pool, the prompts in flight and the
loader's position), so a resumed run loses no prompt and sees none twice.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlpt.asyncrl import AsyncConfig, AsyncRunner, Group, GroupReward, Prompt
from rlpt.asyncrl.remote import ProcessEngine, actor_processes
from rlpt.asyncrl.replicated import ReplicatedEngine
from rlpt.asyncrl.runtime import rewards_vary
from rlpt.data import CurriculumLoader, Feedback
from rlpt.parallel import make_mesh
from rlpt.parallel.multihost import to_host
from rlpt.roles import PPOLearner, RewardRole, Trajectories
from rlpt.roles.rollout import Verdicts, decode_response
from rlpt.sampling import Engine, RequestParams
from rlpt.tasks.base import Task
from rlpt.trainers.context import RunEvaluation, StageContext

ASYNC_STATE = "async"  # the checkpoint record's key for the runner's state


class LoaderPrompts:
    """The curriculum loader's batches as one prompt (group) at a time.

    A prompt's key is its position in this stream. The state is the position, the prompts
    of the current loader batch not yet handed out, and the loader's own state."""

    def __init__(self, loader: CurriculumLoader, group_size: int):
        self.loader = loader
        self.group_size = group_size
        self.position = 0
        self.buffer: list[Prompt] = []

    def next(self) -> Prompt:
        if not self.buffer:
            batch = self.loader.next()
            for row in range(0, len(batch.tasks), self.group_size):
                ids = batch.tokens[row][np.asarray(batch.mask[row], bool)]
                info = {
                    "task": dataclasses.asdict(batch.tasks[row]),
                    "difficulty": int(batch.difficulty[row]),
                    "loss_weight": float(batch.loss_weight[row]),
                }
                self.buffer.append(Prompt(
                    self.position, tuple(int(t) for t in ids), info,
                    domain=int(batch.domain_index[row]),
                ))  # fmt: skip
                self.position += 1
        return self.buffer.pop(0)

    def state_dict(self) -> dict:
        return {
            "position": self.position, "buffer": [p.to_json() for p in self.buffer],
            "loader": self.loader.get_state(),
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self.buffer = [Prompt.from_json(p) for p in state["buffer"]]
        self.loader.set_state(state["loader"])


def _task(info: dict) -> Task:
    return Task(**info["task"])


class AsyncPPOStage:
    """The RL stage on ``AsyncRunner``."""

    def __init__(
        self,
        config,
        *,
        loader: CurriculumLoader,
        tokenizer,
        reward: RewardRole,
        learner: PPOLearner,
        evaluation: RunEvaluation,
        make_batch_kwargs: dict[str, Any],
        policy_graph,
        model_cfg,
        actor_mesh,
    ):
        self.config = config
        self.loader = loader
        self.tokenizer = tokenizer
        self.reward = reward
        self.learner = learner
        self.evaluation = evaluation
        self.make_batch_kwargs = make_batch_kwargs
        self.policy_graph = policy_graph
        self.model_cfg = model_cfg
        self.actor_mesh = actor_mesh
        # async_rl.engine = "process", once built: the actor processes' engine(s).
        self._remote: ProcessEngine | ReplicatedEngine | None = None
        self.names = loader.names
        a, r = config.async_rl, config.rollout
        self.async_cfg = AsyncConfig(
            max_staleness=a.max_staleness, batch_groups=r.batch_size // r.group_size,
            group_size=r.group_size, pool_capacity_tokens=a.pool_capacity_tokens,
            priority=a.priority, alpha=a.alpha, beta=a.beta, max_reuse=a.max_reuse,
            reward_threads=a.reward_threads, in_flight=a.in_flight, mode=a.mode,
            token_budget=a.token_budget or None,
            max_batch_groups=config.learner_groups if a.token_budget else None,
            filter_groups=r.filter_groups, filter_max_rounds=r.filter_max_rounds,
        )  # fmt: skip
        # Every learner batch is laid out with this many groups (see _learn).
        self.learner_groups = config.learner_groups

    # -- the runner's parts --------------------------------------------------------------------

    def _group_trajectories(self, groups: list[Group], version_of=None) -> Trajectories:
        """Rows of ``groups`` as the roles' ``Trajectories``, prompts left-padded to the
        loader's bucket for their length, responses to ``rollout.max_new_tokens``."""
        width = self.config.rollout.max_new_tokens
        buckets = self.make_batch_kwargs["prompt_buckets"]
        longest = max(len(g.prompt.tokens) for g in groups)
        p = next((b for b in buckets if b >= longest), longest)
        rows = [(g, i) for g in groups for i in range(len(g.tokens))]
        n = len(rows)
        pad = self.tokenizer.pad_id
        prompt = np.full((n, p), pad, np.int32)
        prompt_mask = np.zeros((n, p), bool)
        tokens = np.full((n, width), pad, np.int32)
        logprobs = np.zeros((n, width), np.float32)
        mask = np.zeros((n, width), np.float32)
        lengths = np.zeros(n, np.int32)
        for row, (g, i) in enumerate(rows):
            ids = g.prompt.tokens
            prompt[row, p - len(ids) :] = ids
            prompt_mask[row, p - len(ids) :] = True
            k = len(g.tokens[i])
            tokens[row, :k] = g.tokens[i]
            logprobs[row, :k] = g.logprobs[i]
            mask[row, :k] = 1.0
            lengths[row] = k
        tasks = [_task(g.prompt.info) for g, _ in rows]
        return Trajectories(
            prompt_tokens=prompt, prompt_mask=prompt_mask, tasks=tasks,
            names=[self.names[g.prompt.domain] for g, _ in rows],
            texts=[decode_response(self.tokenizer, tokens[r, : lengths[r]]) for r in range(n)],
            tokens=tokens, logprobs=logprobs, mask=mask, lengths=lengths,
            truncated=np.array([g.finish[i] == "length" for g, i in rows]),
            loss_weight=np.array([g.prompt.info["loss_weight"] for g, _ in rows], np.float32),
            domain_index=np.array([g.prompt.domain for g, _ in rows], np.int32),
            difficulty=np.array([g.prompt.info["difficulty"] for g, _ in rows], np.int32),
            policy_version=np.array(
                [int(g.versions[i].min()) if len(g.versions[i]) else 0 for g, i in rows], np.int32
            ),
        )  # fmt: skip

    def _judge(self, prompt: Prompt, completions) -> GroupReward:
        group = Group(
            prompt=prompt, tokens=[c.tokens for c in completions],
            logprobs=[c.logprobs for c in completions],
            versions=[c.versions for c in completions],
            finish=[c.finish_reason for c in completions],
            rewards=np.zeros(len(completions), np.float32),
            success=np.zeros(len(completions), np.float32),
        )  # fmt: skip
        v = self.reward.judge(self._group_trajectories([group])).verdicts
        return GroupReward(
            rewards=v.rewards, success=v.success,
            extra={"weight": v.weight.tolist(), "valid": v.valid.tolist()},
        )  # fmt: skip

    @staticmethod
    def _varies(reward: GroupReward) -> bool:
        """Dynamic sampling's test, as the synchronous stage's: valid rewards that differ."""
        return rewards_vary(reward, valid=reward.extra["valid"])

    def _with_filtered(self, feedback: Feedback, groups: list[Group]) -> Feedback:
        """``feedback`` and the groups dynamic sampling left out (zero advantage): the
        curriculum hears of every valid sample, trained or not."""
        if not groups:
            return feedback
        domain = np.concatenate([np.full(len(g.tokens), g.prompt.domain) for g in groups])
        valid = np.concatenate([np.asarray(g.extra["valid"], np.float32) for g in groups]) > 0
        difficulty = np.concatenate(
            [np.full(len(g.tokens), g.prompt.info["difficulty"]) for g in groups]
        )

        def cat(mine, theirs):
            return np.concatenate([np.asarray(mine), np.asarray(theirs)[valid]])

        return dataclasses.replace(
            feedback,
            domain_index=cat(feedback.domain_index, domain).astype(np.int32),
            success=cat(feedback.success, np.concatenate([g.success for g in groups])),
            reward=cat(feedback.reward, np.concatenate([g.rewards for g in groups])),
            abs_advantage=cat(feedback.abs_advantage, np.zeros(valid.size)),
            difficulty=cat(feedback.difficulty, difficulty).astype(np.int32),
        )

    def _learn(self, draw, version: int):
        order = sorted(range(len(draw.items)), key=lambda i: draw.items[i].key)
        groups = [draw.items[i].payload for i in order]
        weights = np.asarray(draw.weights, np.float32)[order]
        real = len(groups)
        if real < self.learner_groups:
            # A token-budget draw of fewer groups: the rest of the layout are copies of the
            # last group with zero loss weight and invalid verdicts (out of every loss,
            # denominator and statistic), so the update keeps one shape.
            missing = self.learner_groups - real
            groups = groups + [dataclasses.replace(
                groups[-1], extra={**groups[-1].extra,
                                   "valid": [0.0] * len(groups[-1].tokens)},
            )] * missing  # fmt: skip
            weights = np.concatenate([weights, np.zeros(missing, np.float32)])
        traj = self._group_trajectories(groups)
        g = self.config.rollout.group_size
        verdicts = Verdicts(
            results=[None] * len(traj),
            rewards=np.concatenate([x.rewards for x in groups]).astype(np.float32),
            weight=np.concatenate([np.asarray(x.extra["weight"], np.float32) for x in groups]),
            success=np.concatenate([x.success for x in groups]).astype(np.float32),
            valid=np.concatenate([np.asarray(x.extra["valid"], np.float32) for x in groups]),
        )  # fmt: skip
        # The pool's priority weights (1 under uniform priority) scale the rows' loss.
        traj = dataclasses.replace(
            traj, verdicts=verdicts, loss_weight=traj.loss_weight * np.repeat(weights, g)
        )
        group_id = np.repeat(np.arange(len(groups)), g).astype(np.int32)
        batch, _ = self.learner.make_batch(traj, group_id, **self.make_batch_kwargs)
        # Learned terms (reward model, process rewards) score the batch as the learner lays
        # it out, with the learner's mesh; filler rows are invalid and count nowhere.
        batch, learned_metrics, confidence = self.reward.assemble(batch, traj)
        batch = self.learner.score(batch)
        scored = batch
        if real < self.learner_groups:  # the layout's filler rows are not the sampler's
            filler = jnp.arange(batch.response_mask.shape[0]) >= real * g
            scored = batch.replace(response_mask=jnp.where(filler[:, None], 0.0,
                                                           batch.response_mask))  # fmt: skip
        mismatch = self.learner.trainer.mismatch(scored)
        batch = self.learner.advantages(batch)
        metrics = {**mismatch, **self.learner.update(batch)}
        adv, mask = to_host((batch.advantages, batch.response_mask))
        abs_adv = np.abs(adv * mask).sum(1) / np.maximum(mask.sum(1), 1.0)
        keep = verdicts.valid > 0
        self._feedback = Feedback(
            domain_index=traj.domain_index[keep], success=verdicts.success[keep],
            reward=verdicts.rewards[keep], abs_advantage=abs_adv[keep],
            difficulty=traj.difficulty[keep], confidence=confidence,
        )  # fmt: skip
        self._traj = traj
        self._real_rows = real * g
        weights_out = jax.tree.map(jnp.copy, self.learner.policy_params())
        out = {f"ppo/{k}": v for k, v in to_host(metrics).items()}
        return weights_out, {**out, **learned_metrics}

    # -- the stage -----------------------------------------------------------------------------

    def run(self, ctx: StageContext) -> bool:
        """PPO to ``ppo_steps``; False if ``stop_after_step`` stopped it first."""
        c = self.config
        total = c.ppo_steps
        if ctx.stage_step >= total:
            return True
        engine = self._engine(ctx.stage_step)
        prompts = LoaderPrompts(self.loader, c.rollout.group_size)
        runner = AsyncRunner(
            self.async_cfg, engine, prompts, self._judge, self._learn,
            RequestParams(
                max_tokens=c.rollout.max_new_tokens, temperature=c.rollout.temperature,
                stop_ids=(self.tokenizer.eos_id,),
            ),
            seed=c.seed, version=ctx.stage_step, varies=self._varies,
        )  # fmt: skip
        state = ctx.meta.get(ASYNC_STATE)
        if state is not None and int(state["version"]) == ctx.stage_step:
            runner.load_state_dict(state, self.learner.policy_params())
        progress = ctx.progress(total, "ppo")
        stopped = {"early": False}
        t_last = [time.perf_counter()]

        def on_step(version: int, metrics: dict) -> bool:
            with runner.paused():  # the actor leaves the loader and the pool alone meanwhile
                filtered = runner.take_filtered()
                metrics = {**metrics, "ppo/filtered_groups": len(filtered)}
                self.loader.update(self._with_filtered(self._feedback, filtered))
                last, m = self._after_step(ctx, runner, metrics, t_last, total)
            progress.update({k: m[k] for k in ("ppo/success",) if k in m})
            if ctx.should_stop(last):
                stopped["early"] = True
                return True
            return False

        try:
            runner.run(total - ctx.stage_step, on_step=on_step)
        finally:
            progress.close()
            if c.async_rl.engine == "ray":
                engine.close()  # the replicas' actors end with the stage
        return not stopped["early"]

    def _engine(self, version: int):
        """The rollout engine where ``async_rl.engine`` places it, holding the learner's
        weights as ``version``."""
        c = self.config
        params = self.learner.policy_params()
        kwargs = dict(
            eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id,
            num_slots=c.rollout.slots, version=version,
            max_seq_len=max(self.make_batch_kwargs["prompt_buckets"]) + c.rollout.max_new_tokens,
        )  # fmt: skip
        replicas = c.async_rl.engines
        if c.async_rl.engine == "process":
            if self._remote is None:
                # One engine per actor process; several are driven as replicas.
                engines = [
                    ProcessEngine.build(p, self.policy_graph, params, self.model_cfg, **kwargs)
                    for p in actor_processes()
                ]
                self._remote = engines[0] if len(engines) == 1 else ReplicatedEngine(engines)
            else:
                self._remote.update_weights(params, version)
            return self._remote
        if c.async_rl.engine == "ray":
            import ray

            from rlpt.asyncrl.ray_engine import RayEngine

            if not ray.is_initialized():
                ray.init()  # RAY_ADDRESS's cluster, else a local one
            options = {"num_gpus": c.async_rl.ray_num_gpus} if c.async_rl.ray_num_gpus else None
            engines = [
                RayEngine(
                    self.policy_graph, params, self.model_cfg, actor_options=options, **kwargs
                )
                for _ in range(replicas)
            ]
        else:
            devices = list(self.actor_mesh.devices.flat)
            size = len(devices) // replicas
            meshes = [self.actor_mesh] if replicas == 1 else [
                make_mesh(devices=devices[i * size : (i + 1) * size]) for i in range(replicas)
            ]  # fmt: skip
            engines = [
                Engine(self.policy_graph, params, self.model_cfg, mesh=mesh, **kwargs)
                for mesh in meshes
            ]
        return engines[0] if replicas == 1 else ReplicatedEngine(engines)

    def close(self) -> None:
        """Ends the rollout engine's process (``async_rl.engine = "process"``), also when
        this run never needed it."""
        if self.config.async_rl.engine == "process":
            if self._remote is not None:
                self._remote.close()  # the replicas' threads too
            for process in actor_processes():  # those not closed above
                ProcessEngine.release(process)
            self._remote = None

    def _after_step(self, ctx, runner, metrics, t_last, total):
        traj = self._traj
        now = time.perf_counter()
        ctx.advance()
        step = ctx.step
        m = dict(metrics)
        valid = self._feedback.success.size > 0
        m["ppo/success"] = float(self._feedback.success.mean()) if valid else float("nan")
        m["ppo/score"] = float(np.mean(self._feedback.reward)) if valid else float("nan")
        real = self._real_rows
        m["ppo/truncated_frac"] = float(np.mean(traj.truncated[:real]))
        counters = self.reward.counters
        m["ppo/sandbox_failures"] = counters["sandbox_failures"]
        m["ppo/nonfinite_rewards"] = counters["nonfinite_rewards"]
        for d, name in enumerate(self.names):
            rows = self._feedback.domain_index == d
            if rows.any():
                m[f"ppo/{name}/success"] = float(self._feedback.success[rows].mean())
        m.update(self.loader.metrics())
        m["time/step_s"] = now - t_last[0]
        m["time/tokens_per_s"] = float(traj.lengths[:real].sum()) / max(now - t_last[0], 1e-9)
        t_last[0] = now
        last = ctx.stage_step == total
        m.update(self.evaluation.after_rl_step(
            self.learner.policy_params, step, ctx.stage_step, total, ctx.meta["eval"]
        ))  # fmt: skip
        ctx.write(m, "ppo")
        if last or ctx.checkpoint_due(step) or ctx.should_stop(last):
            ctx.meta[ASYNC_STATE] = runner.state_dict()
            ctx.save()
        return last, m
