"""The ``sft`` and ``sft_continued`` stages: supervised steps on demonstrations.

``sft`` runs the fixed warm-start budget (``sft.token_budget`` completion tokens, so
a step count) and closes with the held-out loss and the full evaluation (``sft``);
``sft_continued`` keeps going for ``sft.continued_wall_s`` seconds (the control that
gets RL's wall clock as more supervision) and closes with the ``final`` evaluation.
With ``sft.keep_best`` the ``sft`` stage ends on the parameters of its best periodic
evaluation (early stopping on the validation split, as a supervised baseline should).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from rlpt import sft as sft_lib
from rlpt.parallel import data_parallel_size
from rlpt.parallel.multihost import abstract_on, to_host
from rlpt.policy import full_policy
from rlpt.trainers.context import RunEvaluation, StageContext


def mean_pass_at_1(metrics) -> float:
    """Mean greedy pass@1 over domains from flattened evaluation metrics
    (``eval/DOMAIN/pass@1``; OOD and train entries have a split in the name)."""
    values = [
        float(v) for k, v in metrics.items()
        if k.startswith("eval/") and k.endswith("/pass@1") and k.count("/") == 2
    ]  # fmt: skip
    if not values:
        raise ValueError("no eval/DOMAIN/pass@1 in the evaluation's metrics")
    return float(np.mean(values))


class SFTStage:
    """Supervised fine-tuning of the policy; ``state`` is the stage's train state."""

    def __init__(
        self,
        sft_config,
        stream: sft_lib.ExampleStream,
        *,
        init_params,
        base_params,
        policy_graph,
        evaluation: RunEvaluation,
        heldout,
        mesh=None,
    ):
        self.config = sft_config
        self.stream = stream
        self.base_params = base_params
        self.evaluation = evaluation
        tokens, mask = heldout
        if mesh is not None:
            # Rows with an empty loss mask add nothing to the masked mean; they only let
            # the batch split evenly over the data-parallel devices.
            extra = -len(tokens) % data_parallel_size(mesh)
            tokens = np.pad(tokens, ((0, extra), (0, 0)))
            mask = np.pad(mask, ((0, extra), (0, 0)))
        self.heldout = tokens, mask
        self.init_params = init_params
        self.steps = sft_lib.steps_for_budget(stream, sft_config.token_budget)
        c = sft_config
        self.trainer = sft_lib.sft_trainer(
            sft_lib.train_config(c.learning_rate, c.warmup_steps, c.weight_decay), policy_graph,
            frozen=base_params, mesh=mesh,
        )  # fmt: skip
        self.state: Any = None  # rlpt.supervised.SupervisedState
        # sft.keep_best: a copy of the parameters of the best periodic evaluation so far
        # (checkpointed with the state; its step and score are in the run's meta).
        self.best_params: Any = None

    def start(self) -> None:
        self.state = self.trainer.init(self.init_params)

    def state_template(self):
        template = jax.eval_shape(self.trainer.init, self.init_params)
        return abstract_on(template, self.trainer.state_shardings(template))

    def policy_params(self):
        return full_policy(self.state.params, self.base_params)

    def heldout_loss(self):
        tokens, mask = self.heldout
        return self.trainer.evaluate(self.state.params, {"tokens": tokens, "loss_mask": mask})[
            "loss"
        ]

    def _consider(self, ctx: StageContext, step: int, metrics) -> None:
        """Keeps the current parameters if their periodic evaluation is the best yet."""
        score = mean_pass_at_1(metrics)
        best = ctx.meta.get("sft_best")
        if best is None or score > best["pass@1"]:
            # The next step donates the state's buffers: keep a copy, not a reference.
            self.best_params = jax.tree.map(lambda x: x.copy(), self.state.params)
            ctx.meta["sft_best"] = {"step": step, "pass@1": score}

    def _take_best(self, ctx: StageContext, step: int) -> dict[str, Any]:
        """At the end of SFT: the last step competes too; the best parameters stay."""
        metrics = self.evaluation.periodic(self.policy_params(), step)
        self._consider(ctx, step, metrics)
        best = ctx.meta["sft_best"]
        if best["step"] != step:
            self.state = self.state.replace(params=self.best_params)
        self.best_params = None
        return {"sft/best_step": best["step"], "sft/best_pass@1": best["pass@1"]}

    def run(self, ctx: StageContext, *, continued: bool) -> bool:
        """SFT to the end of the stage; False if ``stop_after_step`` stopped it first."""
        c = self.config
        total = None if continued else self.steps
        # A wall-clock budget counts the time spent before an interruption too.
        began = time.perf_counter() - ctx.meta.get("stage_elapsed_s", 0.0)
        window = time.perf_counter()
        window_steps = window_tokens = 0
        progress = ctx.progress(total, "sft_continued" if continued else "sft")
        try:
            while not ctx.meta.get("stage_done", False):
                if total is not None and ctx.stage_step >= total:
                    break
                tokens, mask, n_tokens = self.stream.next_batch()
                window_steps += 1
                window_tokens += n_tokens
                ctx.profiler.start(ctx.step + 1)
                self.state, m = self.trainer.step(self.state, {"tokens": tokens,
                                                               "loss_mask": mask})  # fmt: skip
                ctx.profiler.stop(ctx.step + 1, m)
                step = ctx.advance()
                if continued:
                    ctx.meta["stage_elapsed_s"] = time.perf_counter() - began
                    last = ctx.meta["stage_elapsed_s"] >= c.continued_wall_s
                else:
                    last = ctx.stage_step >= total
                metrics: dict[str, Any] = {}
                if last or ctx.stage_step % c.log_every == 0:
                    m = to_host(m)
                    metrics.update({f"sft/{k}": v for k, v in m.items()})
                    metrics["sft/lr"] = self.trainer.learning_rate_at(
                        int(to_host(self.state.step)) - 1
                    )
                    metrics["sft/examples"] = self.stream.position
                    # Steps are dispatched asynchronously: only a window's average is meaningful.
                    now = time.perf_counter()
                    metrics["time/step_s"] = (now - window) / window_steps
                    metrics["time/tokens_per_s"] = window_tokens / (now - window)
                    window, window_steps, window_tokens = now, 0, 0
                if last:
                    ctx.meta["stage_done"] = True
                    if c.keep_best and not continued:
                        metrics.update(self._take_best(ctx, step))
                    metrics["sft/heldout_loss"] = self.heldout_loss()
                    metrics.update(self.evaluation.full(
                        self.policy_params(), step, "final" if continued else "sft",
                        ctx.meta["eval"],
                    ))  # fmt: skip
                elif c.eval_every and ctx.stage_step % c.eval_every == 0:
                    # The held-out learning curve of supervised training, comparable with RL's.
                    metrics["sft/heldout_loss"] = self.heldout_loss()
                    metrics.update(self.evaluation.periodic(self.policy_params(), step))
                    if c.keep_best and not continued:
                        self._consider(ctx, step, metrics)
                if metrics:
                    ctx.write(metrics, "sft")
                progress.update({k: metrics[k] for k in ("sft/loss",) if k in metrics})
                if last or ctx.checkpoint_due(step):
                    ctx.save()
                if ctx.should_stop(last):
                    return False
            return True
        finally:
            progress.close()
