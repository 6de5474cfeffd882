"""End-to-end post-training of a language model: supervised warm start, then RL.

Stages, run in ``config.stages`` order with one global ``step`` across them:

1. ``sft`` (``rlpt.trainers.sft_stage``): the policy learns from demonstrations for a
   fixed budget of completion tokens; then the full evaluation (held-out greedy
   pass@1, sampled pass@k, OOD) runs and the policy is frozen as the reference.
2. ``rm`` / ``prm`` (``rlpt.trainers.learned_rewards``): a reward model and a process
   reward model, both started from the warm-started trunk.
3. ``ppo`` (``rlpt.trainers.ppo_stage``): rollouts from the curriculum loader, rewards,
   PPO with a critic (``ppo.estimator='gae'``) or critic-free GRPO/RLOO, KL to the
   reference, periodic held-out evaluation, curriculum feedback every step.
   ``sft_continued`` instead keeps training SFT for ``sft.continued_wall_s`` seconds
   (the control that gets RL's wall clock as more supervision).
4. The final evaluation, merged into the last step's metrics line; ``summary.json``.

This module only wires the roles (``rlpt.roles``: rollout, reward, learner; the
evaluator; checkpointing) into stages and runs them; each stage receives a small
``StageContext`` (step counter, named keys, metrics sink, ``save``), never the run.

One line per step goes to ``metrics.jsonl``; evaluations at a step join that step's
line, so no step appears twice. ``samples.jsonl`` gets greedy completions with their
rewards and outcomes at every evaluation. Checkpoints (``rlpt.checkpoint``) hold
everything the run needs to continue exactly: rerunning the same command resumes.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from rlpt import checkpoint as ckpt_lib
from rlpt import policy as policy_lib
from rlpt import sft as sft_lib
from rlpt.config import RUN_CONTROL_FIELDS, ConfigError, PostTrainConfig, parse_config
from rlpt.data import Curriculum, CurriculumLoader, make_source
from rlpt.eval import Evaluator, make_eval_data
from rlpt.metrics import (
    METRICS_FILE,
    PROFILE_DIR,
    MetricWriter,
    StepProfiler,
    drop_lines_after,
    matmul_peak_flops,
    to_json_value,
)
from rlpt.parallel import make_mesh
from rlpt.parallel.multihost import to_global, trainer_process_count
from rlpt.policy import RUN_CONFIG_FILE, full_policy
from rlpt.rewards.learned import LearnedRewards
from rlpt.roles import (
    COUNTERS,
    ChunkedRolloutWorker,
    MultiTurnRolloutWorker,
    PPOLearner,
    RewardRole,
    RolloutWorker,
    make_rule_reward,
)
from rlpt.runfiles import atomic_write_json, check_workdir, read_json, set_aside_run_files
from rlpt.sampling import ChunkedSampler, SamplingParams, make_sampler
from rlpt.sandbox import pool_from_config
from rlpt.tasks import Verifier
from rlpt.trainers import learned_rewards, outputs
from rlpt.trainers.async_stage import AsyncPPOStage
from rlpt.trainers.context import SAMPLES_FILE, RunEvaluation, StageContext
from rlpt.trainers.outputs import SUMMARY_FILE
from rlpt.trainers.ppo_stage import PPOStage
from rlpt.trainers.sft_stage import SFTStage

KEY_NAMES = ("init", "value_init", "rollout", "eval", "ppo", "rm_refresh")


def train_and_evaluate(config: PostTrainConfig | Any, workdir: str) -> dict[str, Any]:
    """Runs (or resumes) the post-training run ``config`` in ``workdir``; returns the summary."""
    run = PostTrainRun(config, workdir)
    try:
        return run.run()
    finally:
        run.close()


def run_identity(config: PostTrainConfig) -> dict[str, Any]:
    """The config as JSON-able data without the run-control fields."""
    data = config.to_dict()
    for name in RUN_CONTROL_FIELDS:
        data.pop(name, None)
    return data


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _diff_keys(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


class PostTrainRun:
    """One post-training run: its roles, stages, checkpoint and files; ``run()`` executes
    or resumes it."""

    def __init__(self, config: PostTrainConfig | Any, workdir: str):
        # Parsed (and so checked) once, before the workdir is claimed; a typed config
        # passes through as it is.
        config = parse_config(config)
        if config.async_rl.enabled and trainer_process_count() > 1:
            # Each process would run its own schedule, which follows timing.
            raise ConfigError(
                "async_rl.enabled trains in one process: with several JAX processes, use "
                "async_rl.engine 'process' (a learner over several processes: not yet)"
            )
        self.config = config
        self.workdir = os.path.abspath(workdir)
        self.start_time = time.perf_counter()
        self._elapsed_before = 0.0
        rule_reward = make_rule_reward(config.rewards)
        self.lora = config.model.lora.lora_config()
        self.ppo_cfg = config.ppo  # derived fields (num_groups, total_steps) filled in
        self.model_cfg = policy_lib.model_config(config)
        self._check_turns_fit()
        self.domains = policy_lib.make_domains(config)
        self._check_workdir()

        self.tokenizer = policy_lib.make_tokenizer(config, self.model_cfg)
        self.levels = policy_lib.train_levels(config, self.domains)
        key = jax.random.key(config.seed)
        self.keys = {name: jax.random.fold_in(key, i) for i, name in enumerate(KEY_NAMES)}
        # What the checkpoint's JSON record carries besides arrays.
        self.meta: dict[str, Any] = {
            "step": 0, "stage": "", "stage_index": 0, "stage_step": 0, "sft_position": 0,
            "counters": dict.fromkeys(COUNTERS, 0), "eval": {}, "elapsed_s": 0.0,
        }  # fmt: skip

        # The policy: `init_params` is what trains (the adapters under LoRA),
        # `base_params` the frozen rest.
        self.policy_graph, self.init_params, self.base_params = policy_lib.build_policy(
            config, self.model_cfg, self.keys["init"]
        )
        self.n_policy_params = sum(
            int(np.prod(x.shape))
            for x in jax.tree.leaves(full_policy(self.init_params, self.base_params))
        )
        self._peak: float | None = None
        # One mesh for every role: sampling, scoring and the update are sharded by the
        # logical-axis rules over it.
        self.mesh = make_mesh(
            config.mesh.data, config.mesh.fsdp, config.mesh.tensor, config.mesh.sequence
        )
        buckets = tuple(config.rollout.buckets)
        self.sampler = make_sampler(
            config.rollout.sampler, self.policy_graph, self.model_cfg,
            slots=config.rollout.slots, eos_id=self.tokenizer.eos_id,
            pad_id=self.tokenizer.pad_id, buckets=buckets, mesh=self.mesh,
        )  # fmt: skip

        # Reward: verifiers (sandboxed domains in the pool), rule terms, learned terms.
        # Each process runs its own share of the model-written code in its own pool.
        self.pool = pool_from_config(config.sandbox) if any(
            d.needs_sandbox for d in self.domains.values()
        ) else None  # fmt: skip
        verifier = Verifier(self.domains, self.pool)
        self.learned = LearnedRewards.from_config(config, self.tokenizer)
        self.learned.mesh = self.mesh
        # An implicit PRM is a copy of the policy: its checkpoint restores into this shape.
        self.learned.set_policy(
            self.policy_graph, jax.eval_shape(full_policy, self.init_params, self.base_params)
        )
        self.reward = RewardRole(verifier, rule_reward, self.learned, self.meta["counters"],
                                 turn_discount=config.rollout.turn_discount)  # fmt: skip

        # Chunked reasoning (Delethink): rollouts and evaluation reason in chunks, each call
        # one window of prompt + carry + chunk; evaluation uses the full budget.
        chunking = config.rollout.chunked_reasoning
        eval_sampler, eval_max_new = self.sampler, config.rollout.max_new_tokens
        if chunking.enabled:
            window = max(buckets) + chunking.chunk_tokens
            if window > self.model_cfg.max_seq_len:
                raise ConfigError(
                    f"rollout.chunked_reasoning.chunk_tokens ({chunking.chunk_tokens}) plus the "
                    f"largest of rollout.buckets ({max(buckets)}, prompt + carry) must fit "
                    f"model.max_seq_len ({self.model_cfg.max_seq_len}), got {window}"
                )
            eval_sampler = ChunkedSampler(
                self.sampler, chunk_tokens=chunking.chunk_tokens,
                carry_tokens=chunking.carry_tokens,
            )  # fmt: skip
            eval_max_new = chunking.chunk_tokens * chunking.max_chunks
        turns = config.rollout.turns

        # Evaluation (with turns > 1 also the greedy pass@1 within the turns).
        evaluator = Evaluator(
            eval_sampler, self.tokenizer, verifier,
            max_new_tokens=eval_max_new, chunk_size=config.eval.batch_size, turns=turns,
            feedback_tokens=config.rollout.feedback_tokens,
        )  # fmt: skip
        self.eval_sets = make_eval_data(config, self.domains)
        self.evaluation = RunEvaluation(
            evaluator, self.eval_sets, config.eval, self.keys["eval"], self.workdir,
            writes=jax.process_index() == 0,
        )  # fmt: skip

        # SFT: demonstrations and their fixed length (the token budget decides the steps).
        # With chunked reasoning a demonstration becomes the rows chunked generation makes
        # of it, so SFT trains the same windows as PPO and can warm-start a chunked run.
        s = config.sft
        examples = sft_lib.read_jsonl_examples(s.jsonl) if s.jsonl else None
        heldout_from_eval = examples is None
        if s.demonstrations:
            examples = sft_lib.fixed_demonstrations(
                self.domains, self.levels, config.seed, s.demonstrations
            )
        chunk_kw = {}
        if chunking.enabled:
            chunk_kw = {"chunk_tokens": chunking.chunk_tokens,
                        "carry_tokens": chunking.carry_tokens}  # fmt: skip
        stream = sft_lib.ExampleStream(
            self.tokenizer, batch_size=s.batch_size, max_len=s.max_len, domains=self.domains,
            levels=self.levels, examples=examples, seed=config.seed, **chunk_kw,
        )  # fmt: skip
        heldout_pairs = [
            (t.prompt, self.domains[t.domain].demonstration(t))
            for tasks in self.eval_sets["heldout"].values()
            for t in tasks[: s.heldout_items]
        ] if heldout_from_eval else examples[: s.heldout_items]  # fmt: skip
        self.sft = SFTStage(
            s, stream, init_params=self.init_params, base_params=self.base_params,
            policy_graph=self.policy_graph, evaluation=self.evaluation,
            heldout=sft_lib.heldout_batch(self.tokenizer, heldout_pairs, s.max_len, **chunk_kw),
            mesh=self.mesh,
        )  # fmt: skip

        # RL: the learner, the curriculum loader and the rollout worker. Asynchronous runs
        # put the rollout engine and the learner on disjoint sub-meshes.
        actor_mesh, learner_mesh = None, self.mesh
        if config.async_rl.enabled:
            actor_mesh, learner_mesh = self._role_meshes()
            # Learned rewards score the learner's batches, on the learner's devices.
            self.learned.mesh = learner_mesh
        self.learner = PPOLearner(
            self.ppo_cfg, self.policy_graph, self.model_cfg, value_key=self.keys["value_init"],
            base_params=self.base_params, lora=self.lora, mesh=learner_mesh,
        )  # fmt: skip
        self.loader = self._make_loader()
        sampling = SamplingParams(temperature=config.rollout.temperature)
        if chunking.enabled:
            rollout = ChunkedRolloutWorker(
                self.sampler, self.tokenizer, domain_names=self.loader.names,
                chunk_tokens=chunking.chunk_tokens, carry_tokens=chunking.carry_tokens,
                max_chunks=chunking.budget(0), sampling=sampling,
            )  # fmt: skip
        elif turns > 1:
            rollout = MultiTurnRolloutWorker(
                self.sampler, self.tokenizer, verifier, domain_names=self.loader.names,
                max_new_tokens=config.rollout.max_new_tokens, sampling=sampling, turns=turns,
                feedback_tokens=config.rollout.feedback_tokens,
            )  # fmt: skip
        else:
            rollout = RolloutWorker(
                self.sampler, self.tokenizer, domain_names=self.loader.names,
                max_new_tokens=config.rollout.max_new_tokens, sampling=sampling,
            )  # fmt: skip
        make_batch_kwargs = dict(
            prompt_buckets=self.sampler.buckets, pad_id=self.tokenizer.pad_id,
            step_id=self.tokenizer.step_id, max_new_tokens=config.rollout.response_width,
        )  # fmt: skip
        if config.async_rl.enabled:
            self.ppo = AsyncPPOStage(
                config, loader=self.loader, tokenizer=self.tokenizer, reward=self.reward,
                learner=self.learner, evaluation=self.evaluation,
                make_batch_kwargs=make_batch_kwargs, policy_graph=self.policy_graph,
                model_cfg=self.model_cfg, actor_mesh=actor_mesh,
            )  # fmt: skip
        else:
            self.ppo = PPOStage(
                config, loader=self.loader, rollout=rollout, reward=self.reward,
                learner=self.learner, evaluation=self.evaluation,
                make_batch_kwargs=make_batch_kwargs, n_policy_params=self.n_policy_params,
                peak_flops=self._peak_flops,
            )  # fmt: skip

        self.ckpt = ckpt_lib.Checkpointer(
            os.path.join(self.workdir, ckpt_lib.CHECKPOINT_DIR),
            keep=config.checkpoint.keep, async_save=config.checkpoint.async_save,
        )  # fmt: skip
        self.writer = self._metric_writer()
        self.profiler = StepProfiler(
            config.profile.steps, config.profile.dir or os.path.join(self.workdir, PROFILE_DIR)
        )

    def _check_turns_fit(self) -> None:
        """A multi-turn row (prompt, every completion, the feedback between) fits the model."""
        r = self.config.rollout
        if r.turns == 1:
            return
        window = max(r.buckets) + r.response_width
        if window > self.model_cfg.max_seq_len:
            raise ConfigError(
                f"rollout.turns ({r.turns}) completions of rollout.max_new_tokens "
                f"({r.max_new_tokens}) with rollout.feedback_tokens ({r.feedback_tokens}) "
                f"between them, after the largest of rollout.buckets ({max(r.buckets)}), must "
                f"fit model.max_seq_len ({self.model_cfg.max_seq_len}), got {window}"
            )

    def _role_meshes(self):
        """(actor mesh, learner mesh): the first ``async_rl.actor_devices`` devices (-1: half)
        for the rollout engine, the rest for the learner, each data-parallel."""
        if self.config.async_rl.engine != "local":
            # The engine lives in another process or on a Ray actor: the learner takes
            # every device of the run's mesh.
            return None, self.mesh
        devices = jax.devices()
        n = self.config.async_rl.actor_devices
        if len(devices) == 1 and n in (-1, 1) and self.config.async_rl.engines == 1:
            # One device: both roles share it; the threads still overlap sandbox waits and
            # host work with device work.
            logging.info("async: one device, shared by the rollout engine and the learner")
            return self.mesh, self.mesh
        n = max(1, len(devices) // 2) if n == -1 else n
        if not 1 <= n < len(devices):
            raise ValueError(
                f"async_rl.actor_devices must leave the learner at least one of the "
                f"{len(devices)} devices, got {n}"
            )
        if n % self.config.async_rl.engines:
            raise ValueError(
                f"async_rl.engines ({self.config.async_rl.engines}) must divide the actor "
                f"devices ({n}, async_rl.actor_devices)"
            )
        return make_mesh(devices=devices[:n]), make_mesh(devices=devices[n:])

    def context(self) -> StageContext:
        """What a stage receives."""
        return StageContext(
            meta=self.meta, keys=self.keys, writer=self._write, save=self.save,
            elapsed=self._elapsed, profiler=self.profiler,
            checkpoint_every=self.config.checkpoint.every,
            progress_enabled=self.config.logging.progress_bar,
            stop_after_step=self.config.stop_after_step,
        )  # fmt: skip

    # -- workdir: refuse a different run, resume the same one -------------------------------

    def _check_workdir(self) -> None:
        """Claims the workdir for this config, or refuses a different run found there.

        Only process 0 writes; nothing is ever deleted: an overwritten run's files are
        moved aside under names that say so."""
        check_workdir(self.workdir)
        path = os.path.join(self.workdir, RUN_CONFIG_FILE)
        identity = run_identity(self.config)
        writes = jax.process_index() == 0
        if os.path.exists(path):
            stored = read_json(path)
            if stored != identity:
                if not self.config.overwrite:
                    if writes:
                        # train.py already wrote the new config.json; put the run's own back.
                        atomic_write_json(os.path.join(self.workdir, "config.json"), stored,
                                          indent=2, sort_keys=True)  # fmt: skip
                    raise ValueError(
                        f"workdir {self.workdir} holds a run with a different config "
                        f"(differs in {_diff_keys(stored, identity)[:10]}); use another workdir "
                        "or pass --config.overwrite=True to replace it"
                    )
                logging.warning("Overwriting the run in %s (config.overwrite)", self.workdir)
                if writes:
                    set_aside_run_files(
                        self.workdir,
                        (ckpt_lib.CHECKPOINT_DIR, METRICS_FILE, SAMPLES_FILE, SUMMARY_FILE),
                        "overwritten",
                    )
        if writes:
            os.makedirs(self.workdir, exist_ok=True)
            atomic_write_json(path, identity, indent=2, sort_keys=True)

    def _make_loader(self) -> CurriculumLoader:
        c = self.config
        # A domain's prompts come from its configured source (ArrayRecord, TFDS, JSONL)
        # or are generated from the run's seed.
        sources = {
            name: make_source(name, c.data.sources.get(name) or {"kind": "procedural",
                                                                 "seed": c.seed})
            for name in c.domains
        }  # fmt: skip
        curriculum = Curriculum(
            list(sources), c.curriculum, max_levels=[self.levels[n] for n in sources],
            sizes=[s.size for s in sources.values()],
        )  # fmt: skip
        return CurriculumLoader(
            sources, curriculum, self.tokenizer, batch_size=c.rollout.batch_size,
            group_size=c.rollout.group_size, buckets=self.sampler.buckets, seed=c.seed,
            # Every process draws the whole batch: host logic (curriculum, group filtering,
            # packing plans) stays identical across processes; device work is sharded.
            shard_index=0, shard_count=1,
        )  # fmt: skip

    def _peak_flops(self) -> float:
        """FLOP/s that ``time/mfu`` divides by: ``logging.peak_flops`` (per device,
        times the devices) if set, else a matmul rate measured once on this device."""
        if self._peak is None:
            per_device = self.config.logging.peak_flops or 0.0
            self._peak = (
                per_device * jax.device_count() if per_device
                # Host "devices" of the CPU backend share the same cores: count them once.
                else matmul_peak_flops()
                * (1 if jax.default_backend() == "cpu" else jax.local_device_count())
            )  # fmt: skip
        return self._peak

    def _metric_writer(self) -> MetricWriter:
        log = self.config.logging
        return MetricWriter(
            self.workdir, tensorboard=log.tensorboard, wandb_project=log.wandb_project,
            run_config=run_identity(self.config),
        )  # fmt: skip

    # -- checkpoints --------------------------------------------------------------------------

    def _in_sft(self) -> bool:
        return self.meta["stage"] in ("sft", "sft_continued")

    def _items(self) -> dict[str, Any]:
        if self._in_sft():
            items = {"sft": self.sft.state}
            if self.sft.best_params is not None:
                items["sft_best"] = self.sft.best_params
            return items
        items = {"ppo": self.learner.state, **self.learned.items()}
        if self.learner.ref_params is not None:
            items["ref"] = self.learner.ref_params
        return items

    def save(self) -> None:
        self.meta["loader"] = self.loader.get_state()
        self.meta["sft_position"] = self.sft.stream.position
        self.meta["sft_chunk_offset"] = self.sft.stream.chunk_offset
        self.meta["elapsed_s"] = self._elapsed()
        self.meta["config"] = run_identity(self.config)
        self.meta["reward_monitor"] = self.learned.monitor_state()
        self.meta["reward_model_traces"] = self.learned.trace_state()
        self.ckpt.save(self.meta["step"], to_global(self._items(), self.mesh), self.meta)

    def _elapsed(self) -> float:
        return self._elapsed_before + (time.perf_counter() - self.start_time)

    def _restore_targets(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Templates for the items a checkpoint step holds."""
        names = meta["items"]
        targets = {}
        if "sft" in names:
            targets["sft"] = self.sft.state_template()
        if "sft_best" in names:
            targets["sft_best"] = self.sft.state_template().params
        if "ppo" in names:
            targets["ppo"] = self.learner.state_template(
                self.init_params, jax.random.key_data(self.keys["ppo"])
            )
        if "ref" in names:
            targets["ref"] = self.init_params
        targets.update(self.learned.templates(names, self.model_cfg, self.tokenizer.step_id))
        return to_global(targets, self.mesh)

    def restore(self) -> bool:
        """Resumes from the newest checkpoint that restores (damaged ones are skipped,
        named and set aside); without one, earlier run files are set aside."""
        restored = self.ckpt.restore_latest(
            self._restore_targets, set_aside_damaged=jax.process_index() == 0
        )
        for step, error in self.ckpt.skipped_steps.items():
            print(f"Checkpoint at step {step} does not restore ({error}); skipped.", flush=True)
        if restored is None:
            # A run that died before its first checkpoint starts over; what it logged is
            # kept under a name that says why.
            self.writer.close()
            if jax.process_index() == 0:
                # An empty file is what a fresh run's writer opened: nothing to keep.
                logged = [
                    name for name in (METRICS_FILE, SAMPLES_FILE, SUMMARY_FILE)
                    if os.path.isfile(path := os.path.join(self.workdir, name))
                    and os.path.getsize(path) > 0
                ]  # fmt: skip
                set_aside_run_files(self.workdir, logged, "no-checkpoint")
            self.writer = self._metric_writer()
            return False
        step, items, meta = restored
        self.learned.set_items(items)
        self.learned.set_monitor_state(meta.get("reward_monitor", {}))
        self.learned.set_trace_state(meta.get("reward_model_traces", []))
        self.meta.clear()
        self.meta.update(meta)
        # The reward role counts into the restored record.
        self.reward.counters = self.meta["counters"]
        self.sft.state = items.get("sft")
        self.sft.best_params = items.get("sft_best")
        self.learner.state = items.get("ppo")
        self.learner.ref_params = items.get("ref")
        if self.learner.state is not None:
            self.learner.place()
        self.loader.set_state(meta["loader"])
        # Checkpoints from before chunked SFT have no chunk offset: whole examples only.
        self.sft.stream.seek(int(meta["sft_position"]), int(meta.get("sft_chunk_offset", 0)))
        self._elapsed_before = float(meta["elapsed_s"])
        self.writer.resume(step)
        if jax.process_index() == 0:
            drop_lines_after(os.path.join(self.workdir, SAMPLES_FILE), step)
        print(f"Resumed from checkpoint at step {step} (stage {meta['stage']}).", flush=True)
        return True

    # -- stages -------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.restore()
        ctx = self.context()
        stages = list(self.config.stages)
        stop = self.config.stop_after_step
        while self.meta["stage_index"] < len(stages):
            stage = stages[self.meta["stage_index"]]
            step_at_start = self.meta["step"]
            if self.meta["stage"] != stage:
                self._enter_stage(stage)
            if stage in ("sft", "sft_continued"):
                finished = self.sft.run(ctx, continued=stage == "sft_continued")
            elif stage == "ppo":
                finished = self.ppo.run(ctx)
            else:
                stage_fn = {"rm": learned_rewards.rm_stage, "prm": learned_rewards.prm_stage}
                stage_fn[stage](ctx, self._reward_stage_inputs())
                finished = True
            if not finished:
                logging.info("Stopping after step %d (config.stop_after_step).", stop)
                self.ckpt.wait()
                return {"stopped_at_step": self.meta["step"]}
            self.meta["stage_index"] += 1
            more = self.meta["stage_index"] < len(stages)
            if more and stop is not None and step_at_start < stop <= self.meta["step"]:
                # The stage ended on the requested step (its last step is checkpointed):
                # stop at the boundary rather than one step into the next stage.
                logging.info("Stopping after step %d (config.stop_after_step).", stop)
                self.ckpt.wait()
                return {"stopped_at_step": self.meta["step"]}
        self.ckpt.wait()
        if jax.process_index() == 0:
            outputs.save_model_outputs(
                self.config, self.workdir, self.model_cfg, self.lora, self._trained_params(),
                self.base_params,
            )  # fmt: skip
        summary = self._summary()
        if self.config.logging.plots and jax.process_index() == 0:
            outputs.write_plots(self.workdir)
        return summary

    def _reward_stage_inputs(self) -> learned_rewards.RewardStageInputs:
        return learned_rewards.RewardStageInputs(
            config=self.config, policy_params=self._policy_params(), model_cfg=self.model_cfg,
            tokenizer=self.tokenizer, domains=self.domains, levels=self.levels,
            sampler=self.sampler, learned=self.learned, mesh=self.mesh,
            policy_graph=self.policy_graph,
        )  # fmt: skip

    def _policy_params(self):
        """The policy's full state (adapters merged with the base under LoRA)."""
        if self.learner.state is not None and not self._in_sft():
            return self.learner.policy_params()
        return self.sft.policy_params()

    def _trained_params(self):
        if self.learner.state is not None and not self._in_sft():
            return self.learner.trained_params()
        return self.sft.state.params

    def _enter_stage(self, stage: str) -> None:
        self.meta["stage"] = stage
        self.meta["stage_step"] = 0
        self.meta["stage_done"] = False
        self.meta["stage_elapsed_s"] = 0.0
        if stage in ("sft", "sft_continued") and self.sft.state is None:
            # sft_continued alone continues a warm start from model.init_from, with a
            # fresh optimiser state.
            self.sft.start()
        elif stage == "ppo":
            # After SFT (and any rm/prm stage) the policy is SFT's; a run without SFT
            # starts from the initial (or Hugging Face) weights.
            params = self.sft.state.params if self.sft.state is not None else self.init_params
            self.learner.start(params, jax.random.key_data(self.keys["ppo"]))
            # The update donates those buffers: the SFT state is spent.
            self.sft.state = None
            self.meta["rl_start_elapsed_s"] = self._elapsed()

    def _write(self, step: int, metrics, stage: str) -> None:
        self.writer.write(step, {k: to_json_value(v) for k, v in metrics.items()}, stage=stage)

    # -- the end ------------------------------------------------------------------------------

    def _summary(self) -> dict[str, Any]:
        return outputs.write_summary(
            self.workdir, self.meta, self.config.eval.k, self.levels, self.loader.curriculum
        )

    def close(self) -> None:
        if isinstance(self.ppo, AsyncPPOStage):
            self.ppo.close()
        self.profiler.close()
        self.ckpt.close()
        self.writer.close()
        self.loader.close()
        if self.pool is not None:
            self.pool.close()


__all__ = [
    "PostTrainRun",
    "RUN_CONTROL_FIELDS",
    "run_identity",
    "train_and_evaluate",
]
