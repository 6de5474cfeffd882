"""Learned rewards inside PPO: reward-model and process-reward scores of a rollout batch,
assembled with the verifier's reward into one per-token reward tensor.

``LearnedRewards.apply`` scores each rollout batch with whichever models were trained
and replaces the batch's per-token rewards with
``rlpt.rewards.composite.assemble_rewards``: the verifier and rule terms on the last
token, the reward-model score there too, and process rewards at every step's last
token (aggregated by ``rewards.process_aggregation``), the learned terms under running
normalisation and clipping. With ``process_reward.kind="implicit"`` the process rewards
are PRIME's instead (``rlpt.rewards.implicit``): each step's summed
``beta * log pi_phi / pi_ref``, where ``pi_phi`` and its frozen reference share the
policy's graph and are both checkpointed. A ``RewardMonitor`` tracks, per domain, how often the
learned verdict agrees with the verifier; that agreement is the curriculum's
per-domain confidence and its collapse flags reward hacking.

With ``reward_model.refresh_every`` > 0 the reward model follows the policy: every
rollout's verdicts join a buffer of the newest ``refresh_buffer`` traces, and every
``refresh_every`` PPO steps ``refresh_steps`` Bradley-Terry steps train it on pairs of
one prompt's right and wrong completions (``RewardModelRefresher``). Its optimiser
state and the buffer are checkpointed, so a resumed run refreshes as an uninterrupted
one would.

With ``process_reward.online_learning_rate`` > 0 the implicit PRM is updated online, as
PRIME does: each rollout batch is scored by the current ``pi_phi``, then ``pi_phi`` takes
one cross-entropy step on that batch's outcome labels (``rollout_implicit_examples``;
no samples beyond the rollouts). Its optimiser state is checkpointed with it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlpt.models import ProcessRewardModel, RewardModel, create_model
from rlpt.parallel import batch_sharding, replicated, state_shardings
from rlpt.parallel.multihost import to_device
from rlpt.rewards.composite import NormState, RewardConfig, assemble_rewards, init_norm_state
from rlpt.rewards.implicit import (
    ImplicitPRM,
    implicit_prm_trainer,
    rollout_implicit_examples,
    rollout_implicit_rewards,
    row_log_probs,
)
from rlpt.rewards.monitor import MonitorConfig, RewardMonitor, _DomainStats
from rlpt.rewards.preferences import Trace, traces_from_results
from rlpt.rewards.scoring import RewardModelRefresher, rollout_process_scores, rollout_rm_scores
from rlpt.rewards.train import TrainConfig, rm_trainer

RM_KEY, PRM_KEY, NORM_KEY = "reward_model", "process_reward_model", "reward_norm"
RM_STATE_KEY = "reward_model_state"  # parameters and optimiser state, when refreshing
# The implicit PRM: pi_phi and its frozen reference (the policy it started from, which
# PPO moves away from, so it is stored rather than read back from the learner).
IMPLICIT_KEY, IMPLICIT_REF_KEY = "implicit_prm", "implicit_prm_ref"
IMPLICIT_STATE_KEY = "implicit_prm_state"  # pi_phi and its optimiser, when updated online


def reward_model_trainer(c, graph, mesh=None):
    """The reward model's trainer: the ``rm`` stage's, continued by refreshes in PPO."""
    return rm_trainer(
        TrainConfig(learning_rate=c.learning_rate, warmup_steps=c.warmup_steps), graph,
        margin=c.margin, mesh=mesh,
    )  # fmt: skip


@dataclasses.dataclass
class LearnedRewards:
    """The learned reward models of a run and their use on PPO batches."""

    reward_config: RewardConfig
    monitor: RewardMonitor
    step_id: int
    answer_id: int
    rm_graph: Any = None
    rm_params: Any = None
    prm_graph: Any = None
    prm_params: Any = None
    norm: NormState = dataclasses.field(default_factory=init_norm_state)
    rm_likelihood: bool = False  # the reward model adds the policy's log-likelihood
    rm_config: Any = None  # the config's reward_model section (refresh settings)
    tokenizer: Any = None
    rm_state: Any = None  # ModelTrainState while refreshing
    refresher: RewardModelRefresher | None = None
    prm_likelihood: bool = False  # the process reward model adds each step's log-likelihood
    mesh: Any = None  # the run's mesh: scoring runs sharded on it
    prm_kind: str = "math_shepherd"  # process_reward.kind
    implicit: ImplicitPRM | None = None  # the trained implicit PRM (prm_kind "implicit")
    implicit_beta: float = 0.05  # process_reward.beta
    # The policy's graph and a template of its full state: what restores the implicit PRM.
    policy_graph: Any = None
    policy_template: Any = None
    implicit_online_lr: float = 0.0  # process_reward.online_learning_rate
    implicit_trainer: Any = None  # SupervisedTrainer of the online update
    implicit_state: Any = None  # its state (pi_phi and optimiser) while updating online

    @classmethod
    def from_config(cls, config, tokenizer) -> LearnedRewards:
        """From a run config's ``rewards``, ``reward_model`` and ``process_reward``."""
        r = config.rewards
        cfg = RewardConfig(
            outcome=1.0, reward_model=r.reward_model, process=r.process,
            process_aggregation=r.process_aggregation, clip=r.learned_clip,
        )  # fmt: skip
        return cls(
            cfg, RewardMonitor(MonitorConfig()), tokenizer.step_id, tokenizer.answer_id,
            rm_likelihood=bool(config.reward_model.likelihood),
            prm_likelihood=bool(config.process_reward.likelihood),
            rm_config=config.reward_model, tokenizer=tokenizer,
            prm_kind=str(config.process_reward.kind),
            implicit_beta=float(config.process_reward.beta),
            implicit_online_lr=float(config.process_reward.online_learning_rate),
        )  # fmt: skip

    @property
    def refreshing(self) -> bool:
        """Whether the reward model is retrained on the newest traces during PPO."""
        return bool(self.rm_config is not None and int(self.rm_config.refresh_every))

    def start_refresh(self, trainer, state, max_len: int) -> None:
        """Keep the reward model's trainer and state (parameters and optimiser) to refresh."""
        c = self.rm_config
        self.rm_state = state
        self.refresher = RewardModelRefresher(
            trainer, self.tokenizer, max_len=max_len,
            every=int(c.refresh_every), steps=int(c.refresh_steps),
            batch_size=int(c.refresh_batch_size), buffer_size=int(c.refresh_buffer),
        )  # fmt: skip

    def observe(self, step: int, tasks, texts, results, key) -> dict[str, float]:
        """Add a rollout's verdicts to the trace buffer; refresh the reward model when due."""
        if self.refresher is None:
            return {}
        self.refresher.add(traces_from_results(tasks, texts, results))
        self.rm_state, metrics = self.refresher.maybe_refresh(step, self.rm_state, key)
        self.rm_params = self.rm_state.params
        metrics["rm/refresh_buffer"] = float(len(self.refresher.traces))
        return metrics

    def trace_state(self) -> list[dict[str, str]]:
        """The refresh buffer as JSON-ready records (for the checkpoint's metadata)."""
        if self.refresher is None:
            return []
        return [dataclasses.asdict(t) for t in self.refresher.traces]

    def set_trace_state(self, records) -> None:
        if self.refresher is not None:
            self.refresher.traces = [Trace(**r) for r in records]

    @property
    def active(self) -> bool:
        """Whether PPO's rewards include a learned term."""
        return (self.rm_params is not None and self.reward_config.reward_model != 0) or (
            self.has_prm and self.reward_config.process != 0
        )

    @property
    def has_prm(self) -> bool:
        """Whether a process reward model (either kind) is trained."""
        return self.prm_params is not None or self.implicit is not None

    def _place(self) -> None:
        """Models and normaliser on the run's mesh (a no-op for what already is), so the
        scoring steps see one set of devices however the arrays were made or restored."""
        params = lambda tree: None if tree is None else to_device(
            tree, state_shardings(tree, self.mesh)
        )  # fmt: skip
        self.rm_params = params(self.rm_params)
        self.prm_params = params(self.prm_params)
        if self.implicit is not None:
            self.implicit.params = params(self.implicit.params)
            self.implicit.ref_params = params(self.implicit.ref_params)
        self.norm = to_device(self.norm, replicated(self.mesh))

    def set_rm(self, graph, params) -> None:
        self.rm_graph, self.rm_params = graph, params

    def set_prm(self, graph, params) -> None:
        self.prm_graph, self.prm_params = graph, params

    def set_implicit_prm(self, prm: ImplicitPRM) -> None:
        self.implicit = prm
        if self.implicit_online_lr:
            self.implicit_trainer = self._implicit_trainer(prm.graphdef, prm.frozen)
            self.implicit_state = self.implicit_trainer.init(jax.tree.map(jnp.copy, prm.params))
            prm.params = self.implicit_state.params

    def _implicit_trainer(self, graph, frozen=None):
        """The online update's trainer: a constant rate, PRIME's cross-entropy."""
        return implicit_prm_trainer(
            TrainConfig(learning_rate=self.implicit_online_lr), graph, beta=self.implicit_beta,
            frozen=frozen, mesh=self.mesh,
        )  # fmt: skip

    def update_implicit(self, batch, success, valid) -> dict[str, float]:
        """PRIME's online step on a scored rollout batch: ``prm/online_*`` metrics."""
        prm = self.implicit
        data = _online_examples(
            prm.graphdef, prm.ref_params, prm.frozen, batch, jnp.asarray(success, jnp.float32),
            jnp.asarray(valid, jnp.float32),
        )  # fmt: skip
        self.implicit_state, metrics = self.implicit_trainer.step(self.implicit_state, data)
        prm.params = self.implicit_state.params
        return {f"prm/online_{k}": float(v) for k, v in jax.device_get(metrics).items()}

    def set_policy(self, graph, template) -> None:
        """The policy's graph and a template of its full state (for restoring pi_phi)."""
        self.policy_graph, self.policy_template = graph, template

    # Checkpointed arrays and their restore templates.
    def items(self) -> dict[str, Any]:
        out: dict[str, Any] = {NORM_KEY: self.norm}
        if self.rm_state is not None:
            out[RM_STATE_KEY] = self.rm_state
        elif self.rm_params is not None:
            out[RM_KEY] = self.rm_params
        if self.prm_params is not None:
            out[PRM_KEY] = self.prm_params
        if self.implicit_state is not None:
            out[IMPLICIT_STATE_KEY] = self.implicit_state
            out[IMPLICIT_REF_KEY] = self.implicit.ref_params
        elif self.implicit is not None:
            out[IMPLICIT_KEY] = self.implicit.params
            out[IMPLICIT_REF_KEY] = self.implicit.ref_params
        return out

    def templates(self, names, model_cfg, step_id: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if NORM_KEY in names:
            out[NORM_KEY] = init_norm_state()
        if RM_KEY in names or RM_STATE_KEY in names:
            self.rm_graph, params = create_model(
                lambda rngs: RewardModel(model_cfg, likelihood=self.rm_likelihood, rngs=rngs),
                jax.random.key(0),
            )
            if RM_KEY in names:
                out[RM_KEY] = params
            else:
                trainer = reward_model_trainer(self.rm_config, self.rm_graph, self.mesh)
                out[RM_STATE_KEY] = jax.eval_shape(trainer.init, params)
                self.start_refresh(trainer, None, model_cfg.max_seq_len)
        if PRM_KEY in names:
            self.prm_graph, params = create_model(
                lambda rngs: ProcessRewardModel(
                    model_cfg,
                    step_id,
                    likelihood=self.prm_likelihood,
                    answer_token_id=self.answer_id,
                    rngs=rngs,
                ),
                jax.random.key(0),
            )
            out[PRM_KEY] = params
        if IMPLICIT_KEY in names or IMPLICIT_STATE_KEY in names:
            if self.policy_template is None:
                raise ValueError("restoring an implicit PRM needs set_policy() first")
            out[IMPLICIT_REF_KEY] = self.policy_template
            if IMPLICIT_KEY in names:
                out[IMPLICIT_KEY] = self.policy_template
            else:
                self.implicit_trainer = self._implicit_trainer(self.policy_graph)
                out[IMPLICIT_STATE_KEY] = jax.eval_shape(
                    self.implicit_trainer.init, self.policy_template
                )
        return out

    def set_items(self, items: Mapping[str, Any]) -> None:
        self.norm = items.get(NORM_KEY, self.norm)
        self.rm_params = items.get(RM_KEY, self.rm_params)
        if RM_STATE_KEY in items:
            self.rm_state = items[RM_STATE_KEY]
            self.rm_params = self.rm_state.params
        self.prm_params = items.get(PRM_KEY, self.prm_params)
        if IMPLICIT_STATE_KEY in items:
            self.implicit_state = items[IMPLICIT_STATE_KEY]
            self.implicit = ImplicitPRM(
                self.policy_graph, self.implicit_state.params, items[IMPLICIT_REF_KEY],
                beta=self.implicit_beta,
            )  # fmt: skip
        elif IMPLICIT_KEY in items:
            self.implicit = ImplicitPRM(
                self.policy_graph, items[IMPLICIT_KEY], items[IMPLICIT_REF_KEY],
                beta=self.implicit_beta,
            )  # fmt: skip

    def monitor_state(self) -> dict[str, Any]:
        return {name: dataclasses.asdict(s) for name, s in self.monitor.stats.items()}

    def set_monitor_state(self, state: Mapping[str, Any]) -> None:
        self.monitor.stats = {name: _DomainStats(**s) for name, s in state.items()}

    def apply(self, batch, domain_names, success, valid):
        """The batch with learned terms in its rewards, ``reward/*`` and ``monitor/*``
        metrics, and the per-domain confidence for the curriculum."""
        if self.mesh is not None:
            self._place()
            batch = to_device(batch, jax.tree.map(lambda x: batch_sharding(self.mesh, x.ndim),
                                                  batch))  # fmt: skip
        rm_scores = process = steps = None
        if self.rm_params is not None and self.reward_config.reward_model:
            rm_scores = _rm_scores(self.rm_graph, self.rm_params, batch)
        if self.implicit is not None and self.reward_config.process:
            prm = self.implicit
            process, steps = _implicit_scores(
                prm.graphdef, prm.beta, self.step_id, self.answer_id, prm.params,
                prm.ref_params, prm.frozen, batch,
            )  # fmt: skip
        elif self.prm_params is not None and self.reward_config.process:
            process, steps = _process_scores(
                self.prm_graph, self.prm_params, batch, self.step_id, self.answer_id
            )
        outcome = jnp.sum(batch.rewards, axis=1)  # [B] verifier and rule terms, already weighted
        total, self.norm, metrics = _assemble(
            self.reward_config, self.norm, batch.response_mask, outcome, rm_scores, process, steps
        )
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        # The monitor compares the learned verdict with the verifier's: the RM score, the
        # implicit PRM's outcome logit (its step rewards summed), or the weakest step's
        # PRM probability (centred so 0.5 is the threshold).
        if rm_scores is not None:
            learned = np.asarray(rm_scores)
        elif self.implicit is not None:
            learned = np.sum(np.asarray(process) * np.asarray(steps), axis=1)
        else:
            p = np.where(np.asarray(steps) > 0, np.asarray(process), np.inf).min(axis=1)
            learned = np.where(np.isfinite(p), p, 0.0) - 0.5
        metrics.update(self.monitor.update(domain_names, learned, success, valid > 0))
        if self.implicit_state is not None and self.reward_config.process:
            # PRIME's order: the batch was scored by pi_phi before this step moves it.
            metrics.update(self.update_implicit(batch, success, valid))
        return batch.replace(rewards=total), metrics, dict(self.monitor.confidence())


@functools.partial(jax.jit, static_argnums=0)
def _rm_scores(graph, params, batch):
    return rollout_rm_scores(graph, params, batch)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _process_scores(graph, params, batch, step_id, answer_id):
    return rollout_process_scores(graph, params, batch, step_id=step_id, answer_id=answer_id)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _implicit_scores(graph, beta, step_id, answer_id, params, ref_params, frozen, batch):
    return rollout_implicit_rewards(
        graph, params, ref_params, batch, beta=beta, step_id=step_id, answer_id=answer_id,
        frozen=frozen,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnums=0)
def _online_examples(graph, ref_params, frozen, batch, success, valid):
    data = rollout_implicit_examples(batch, success, valid)
    data["ref_logp"] = row_log_probs(graph, ref_params, data["tokens"], data["mask"], frozen)
    return data


@functools.partial(jax.jit, static_argnums=0)
def _assemble(cfg, norm, response_mask, outcome, rm_scores, process, steps):
    return assemble_rewards(
        cfg, norm, response_mask, outcome=outcome, reward_model=rm_scores, process=process,
        step_mask=steps,
    )  # fmt: skip
