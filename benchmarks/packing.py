"""Packed against padded rows: PPO scoring and update time on a mixed-length batch.

    python benchmarks/packing.py [--preset=mini --batch=64 --repeats=3]

A GRPO batch shaped like the demo's: groups of 8 drawn from three length
profiles (short arithmetic prompts and answers, mid-length step-by-step
answers, long program specifications), prompts left-padded to 64 and
responses right-padded to 40. The same batch is scored (policy and reference
forward) and updated (two epochs of two minibatches) with padded rows, the
baseline, and with ``ppo.pack_sequences``; the packed run's losses are checked
against the baseline's. The last line is one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _common import timed  # noqa: E402
from absl import app, flags  # noqa: E402

from rlpt.models import CausalLM, create_model, get_preset  # noqa: E402
from rlpt.rl import PPOConfig, PPOTrainer, init_train_state, new_rollout_batch  # noqa: E402
from rlpt.rl.packing import pack_batch  # noqa: E402

_PRESET = flags.DEFINE_string("preset", "mini", "Model preset.")
_BATCH = flags.DEFINE_integer("batch", 64, "Sequences per update (groups of 8).")
_PROMPT = flags.DEFINE_integer("prompt_len", 64, "Padded prompt width.")
_RESPONSE = flags.DEFINE_integer("response_len", 40, "Padded response width.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls of each.")

# (share of groups, prompt length range, response length range), in tokens.
PROFILES = ((0.72, (5, 10), (6, 16)), (0.14, (17, 37), (20, 41)), (0.14, (32, 46), (20, 41)))


def mixed_batch(batch: int, prompt_width: int, response_width: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    groups = batch // 8
    shares = np.array([p[0] for p in PROFILES])
    kinds = np.repeat(rng.choice(len(PROFILES), groups, p=shares / shares.sum()), 8)
    kinds[:8] = 2  # at least one long group, as in most demo updates
    prompt_len = np.array([rng.integers(*PROFILES[k][1]) for k in kinds])
    response_len = np.array([rng.integers(*PROFILES[k][2]) for k in kinds])
    prompt_len = np.minimum(prompt_len, prompt_width)
    response_len = np.minimum(response_len, response_width)
    prompt_mask = np.arange(prompt_width)[None] >= (prompt_width - prompt_len)[:, None]
    prompt = np.where(prompt_mask, rng.integers(5, 250, (batch, prompt_width)), 0)
    response_mask = (np.arange(response_width)[None] < response_len[:, None]).astype(np.float32)
    response = np.where(response_mask > 0, rng.integers(5, 250, (batch, response_width)), 0)
    return new_rollout_batch(
        prompt, prompt_mask, response, response_mask, sequence_rewards=rng.normal(size=batch),
        group_id=np.repeat(np.arange(groups), 8).astype(np.int32),
    )  # fmt: skip


def measure(cfg: PPOConfig, graph, policy, ref, batch):
    trainer = PPOTrainer(cfg, graph)
    fresh = lambda: init_train_state(cfg, jax.tree.map(lambda x: x.copy(), policy), None,
                                     jax.random.key(2))  # fmt: skip
    state = fresh()
    scored = trainer.advantages(state, trainer.score(state, ref, batch))
    score_first, score_s = timed(lambda: trainer.score(state, ref, batch), _REPEATS.value)
    # Every timed update starts from the same fresh state (the update donates it): the
    # same shuffles, so the same packed shape, compiled once.
    states = [fresh() for _ in range(_REPEATS.value + 1)]

    def update():
        return trainer.update(states.pop(), scored)[1]

    first_metrics = jax.device_get(trainer.update(fresh(), scored)[1])
    update_first, update_s = timed(update, _REPEATS.value)
    return {
        "score_s": score_s, "update_s": update_s,
        "compile_s": score_first - score_s + update_first - update_s,
        "loss": float(first_metrics["loss"]), "kl": float(first_metrics["kl"]),
    }  # fmt: skip


def main(argv):
    del argv
    model_cfg = get_preset(_PRESET.value)
    graph, policy = create_model(lambda r: CausalLM(model_cfg, rngs=r), jax.random.key(0))
    _, ref = create_model(lambda r: CausalLM(model_cfg, rngs=r), jax.random.key(1))
    batch = mixed_batch(_BATCH.value, _PROMPT.value, _RESPONSE.value)
    base = PPOConfig(
        epochs=2, num_minibatches=2, estimator="grpo", kl_placement="loss",
        num_groups=_BATCH.value // 8, learning_rate=2e-4, sampling_temperature=1.4,
    )  # fmt: skip
    padded = measure(base, graph, policy, ref, batch)
    packed = measure(dataclasses.replace(base, pack_sequences=True), graph, policy, ref, batch)
    real_tokens = int(np.asarray(batch.input_mask).sum())
    rows = pack_batch(batch).tokens.shape[0]
    padded_step = padded["score_s"] + padded["update_s"]
    packed_step = packed["score_s"] + packed["update_s"]
    print(
        json.dumps(
            {
                "preset": _PRESET.value, "batch": _BATCH.value,
                "padded_width": _PROMPT.value + _RESPONSE.value,
                "real_token_fraction": round(real_tokens / batch.input_mask.size, 3),
                "packed_rows_scoring": rows,
                "padded_score_s": round(padded["score_s"], 3),
                "packed_score_s": round(packed["score_s"], 3),
                "padded_update_s": round(padded["update_s"], 3),
                "packed_update_s": round(packed["update_s"], 3),
                "speedup": round(padded_step / packed_step, 2),
                "loss_abs_diff": abs(padded["loss"] - packed["loss"]),
                "kl_abs_diff": abs(padded["kl"] - packed["kl"]),
                "backend": jax.default_backend(),
            }
        )
    )  # fmt: skip


if __name__ == "__main__":
    app.run(main)
