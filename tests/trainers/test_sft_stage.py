"""The SFT stage's choice of its best periodic evaluation (``sft.keep_best``)."""

import json
import types

import jax.numpy as jnp
import pytest

from rlpt.config import ConfigError, parse_config
from rlpt.supervised import SupervisedState
from rlpt.trainers.sft_stage import SFTStage, mean_pass_at_1


def test_mean_pass_at_1_reads_the_heldout_entries_only():
    metrics = {"eval/a/pass@1": 0.2, "eval/b/pass@1": 0.6, "eval/a/ood/pass@1": 1.0,
               "eval/a/pass@1_se": 0.1, "sft/loss": 3.0}  # fmt: skip
    assert mean_pass_at_1(metrics) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="no eval/DOMAIN/pass@1"):
        mean_pass_at_1({"sft/loss": 1.0})


class _ScriptedEvaluation:
    """Periodic scores by the parameter's value: the 'policy' is one number."""

    def __init__(self, score_of):
        self.score_of = score_of

    def periodic(self, params, step):
        return {"eval/d/pass@1": self.score_of[float(params["w"])]}


def _state(w):
    return SupervisedState(step=jnp.zeros((), jnp.int32), params={"w": jnp.float32(w)},
                           opt_state=(), skipped=jnp.zeros((), jnp.int32))  # fmt: skip


@pytest.mark.parametrize(
    "scores,final,best_step,kept",
    [
        ([0.1, 0.5, 0.3], 0.2, 4, 2.0),  # the middle evaluation wins
        ([0.1, 0.5, 0.3], 0.7, 8, 4.0),  # the last step itself wins
        ([0.4, 0.4, 0.4], 0.4, 2, 1.0),  # ties keep the earliest
    ],
)
def test_keep_best_leaves_the_best_parameters(scores, final, best_step, kept):
    """Periodic evaluations at steps 2, 4, 6 of parameters w = 1, 2, 3; the stage ends at
    step 8 with w = 4. The state must end on the parameters with the best score."""
    score_of = {1.0: scores[0], 2.0: scores[1], 3.0: scores[2], 4.0: final}
    stage = SFTStage.__new__(SFTStage)
    stage.evaluation = _ScriptedEvaluation(score_of)
    stage.best_params = None
    stage.base_params = None
    ctx = types.SimpleNamespace(meta={})
    for step, w in [(2, 1.0), (4, 2.0), (6, 3.0)]:
        stage.state = _state(w)
        stage._consider(ctx, step, stage.evaluation.periodic(stage.state.params, step))
        # The copy must survive the next step donating (here: replacing) the state.
        stage.state = _state(-1.0)
    stage.state = _state(4.0)
    out = stage._take_best(ctx, 8)
    assert out == {"sft/best_step": best_step, "sft/best_pass@1": max([*scores, final])}
    assert float(stage.state.params["w"]) == kept
    assert stage.best_params is None  # spent: the state holds it now


def test_a_run_warm_starts_from_its_best_validation_checkpoint_across_a_resume(tmp_path):
    """The demo's runlocal SFT on a fixed demonstration set with validation-based
    selection, stopped after its first periodic evaluation and resumed: the kept copy
    travels in the checkpoint, and the ``sft`` evaluation (greedy, the same validation
    items as the periodic ones) scores exactly the kept parameters' pass@1."""
    from rlpt import train
    from tests.trainers.experiment_configs import experiment_config

    overrides = {
        "stages": ("sft",), "sft.demonstrations": 3, "sft.token_budget": 1500,
        "sft.eval_every": 2, "sft.keep_best": True, "eval.heldout_split": "validation",
        "eval.periodic_items": 0, "eval.n_samples": 0, "eval.ood_items": 0,
        "eval.train_items": 0, "checkpoint.every": 2, "domains": ("arithmetic", "fractions"),
    }  # fmt: skip
    config = experiment_config("demo", **overrides, stop_after_step=3)
    config.lock()
    assert train.train_and_evaluate(config, str(tmp_path)) == {"stopped_at_step": 3}
    config = experiment_config("demo", **overrides)
    config.lock()
    train.train_and_evaluate(config, str(tmp_path))
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    periodic = {r["step"]: mean_pass_at_1(r) for r in records
                if "eval/arithmetic/pass@1" in r and "sft/best_step" not in r}  # fmt: skip
    last = records[-1]
    assert sorted(periodic) == list(range(2, last["step"], 2))
    assert last["sft/best_pass@1"] >= max(periodic.values())
    assert last["sft/best_step"] in (*periodic, last["step"])
    if last["sft/best_step"] in periodic:
        assert last["sft/best_pass@1"] == periodic[last["sft/best_step"]]
    assert mean_pass_at_1(last) == pytest.approx(last["sft/best_pass@1"])

    # Another arm starts from this run's kept parameters (model.init_from): its initial
    # policy is exactly them, and a continued-SFT stage alone runs from it.
    import jax
    import numpy as np

    from rlpt import policy as policy_lib
    from rlpt.trainers import post_train

    kept = policy_lib.restore_policy(str(tmp_path)).trained
    arm = experiment_config("demo", **{
        **overrides, "model.init_from": str(tmp_path), "stages": ("sft_continued",),
        "sft.keep_best": False, "sft.continued_wall_s": 0.5,
    })  # fmt: skip
    arm.lock()
    run = post_train.PostTrainRun(arm, str(tmp_path / "arm"))
    try:
        got = run.init_params
    finally:
        run.close()
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    summary = train.train_and_evaluate(arm, str(tmp_path / "arm2"))
    assert set(summary["eval"]["final"]) == {"arithmetic", "fractions"}
    with pytest.raises(ConfigError, match="model.init_from .* is not a run directory"):
        parse_config(experiment_config("demo", **{"model.init_from": str(tmp_path / "none")}))
