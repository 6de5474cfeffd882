"""One full synchronous RL iteration, end to end.

    python benchmarks/rl_iteration.py --vocab=264 --layers=4 --d_model=256 --heads=4 \
        --kv_heads=2 --ffn=768 --batch=16 --prompt_len=32 --gen_len=64 --steps=5
    python benchmarks/rl_iteration.py --lengths=lognormal --gen_len=512   # long-tailed
    python benchmarks/rl_iteration.py --preset=tiny     # the side-by-side shapes of
    python benchmarks/rl_iteration.py --preset=medium   # benchmarks/tunix_rl_iteration.py

Each iteration: generate from the prompts (the rollout engine, or ``--sampler=static``,
temperature 1; with ``--lengths=lognormal`` each response ends (stands for EOS) at a length
drawn from a log-normal with median ``--median_len`` capped at ``--gen_len``: the engine gets
it as the request's max_tokens, the static sampler decodes to the batch's longest and masks
past each row's length), the old log-probabilities (by default the sampler's own, token
in and token out: ``--old_logprobs=recompute`` adds the policy's scoring pass), the
reference log-probabilities, value estimates, a rule reward (the fraction of even token
ids in the response, which needs no sandbox), GAE, and one PPO update (policy and
critic). Prints a
final JSON line with ``s_per_iter`` (median after warm-up; compile excluded and
reported separately), ``tokens_per_s`` (prompt plus generated tokens processed
per second) and the share of time in each phase.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# The side-by-side configurations against other frameworks (benchmarks/tunix_rl_iteration.py
# takes the same names): tiny is dispatch-bound, medium compute-bound on a CPU.
PRESETS = {
    "tiny": dict(vocab=512, layers=2, d_model=128, heads=4, kv_heads=2, ffn=384, batch=8,
                 prompt_len=32, gen_len=32),
    "medium": dict(vocab=2048, layers=4, d_model=256, heads=4, kv_heads=2, ffn=768, batch=16,
                   prompt_len=64, gen_len=128),
}  # fmt: skip

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from rlpt.models import CausalLM, ModelConfig, ValueModel, create_model  # noqa: E402
from rlpt.rl import PPOConfig, PPOTrainer, init_train_state, new_rollout_batch  # noqa: E402
from rlpt.sampling import Engine, Request, RequestParams, Sampler, SamplingParams  # noqa: E402

_VOCAB = flags.DEFINE_integer("vocab", 264, "Vocabulary size.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Transformer blocks.")
_D_MODEL = flags.DEFINE_integer("d_model", 256, "Model width.")
_HEADS = flags.DEFINE_integer("heads", 4, "Attention heads.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 2, "Key/value heads.")
_FFN = flags.DEFINE_integer("ffn", 768, "SwiGLU hidden width.")
_BATCH = flags.DEFINE_integer("batch", 16, "Sequences per iteration.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens.")
_GEN_LEN = flags.DEFINE_integer("gen_len", 64, "Generated tokens per sequence.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed iterations (after one warm-up).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
_SAMPLER = flags.DEFINE_enum("sampler", "engine", ["engine", "static"], "Generator.")
_LENGTHS = flags.DEFINE_enum(
    "lengths", "fixed", ["fixed", "lognormal"], "Every response gen_len tokens, or long-tailed."
)
_MEDIAN_LEN = flags.DEFINE_integer("median_len", None, "Median length (default gen_len // 4).")
_OLD_LOGPROBS = flags.DEFINE_enum(
    "old_logprobs", "behaviour", ["behaviour", "recompute"],
    "The ratio's anchor: the sampler's log-probs, or a scoring pass of the policy.",
)  # fmt: skip
_PRESET = flags.DEFINE_enum(
    "preset", None, list(PRESETS), "Model and batch shapes of a named comparison (overrides)."
)


def main(argv):
    del argv
    if _PRESET.value:
        for name, value in PRESETS[_PRESET.value].items():
            setattr(flags.FLAGS, name, value)
    cfg = ModelConfig(
        vocab_size=_VOCAB.value, d_model=_D_MODEL.value, n_layers=_LAYERS.value,
        n_heads=_HEADS.value, n_kv_heads=_KV_HEADS.value, ffn_dim=_FFN.value,
        max_seq_len=_PROMPT_LEN.value + _GEN_LEN.value, dtype=_DTYPE.value,
    )  # fmt: skip
    batch, prompt_len, gen_len = _BATCH.value, _PROMPT_LEN.value, _GEN_LEN.value
    policy_graph, policy = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(0))
    value_graph, value = create_model(lambda r: ValueModel(cfg, rngs=r), jax.random.key(1))
    reference = jax.tree.map(lambda x: x.copy(), policy)  # frozen, never donated
    ppo = PPOConfig(
        epochs=1, num_minibatches=1, kl_coef=0.05, learning_rate=1e-5,
        old_logprobs=_OLD_LOGPROBS.value,
    )  # fmt: skip
    trainer = PPOTrainer(ppo, policy_graph, value_graph)
    state = init_train_state(ppo, policy, value, jax.random.key(2))
    # No stop token (-1 never occurs): responses end at their length.
    sampler = Sampler(policy_graph, cfg, eos_id=-1, pad_id=0, buckets=(prompt_len,))
    engine = None
    if _SAMPLER.value == "engine":
        engine = Engine(
            policy_graph, policy, cfg, eos_id=-1, pad_id=0, num_slots=batch,
            block_size=16, decode_steps=8,
        )  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = rng.integers(5, _VOCAB.value, (batch, prompt_len)).tolist()
    prompt_tokens, prompt_mask = sampler.prepare(prompts, gen_len)
    median = _MEDIAN_LEN.value or max(1, gen_len // 4)

    def lengths_for(i: int) -> np.ndarray:
        if _LENGTHS.value == "fixed":
            return np.full(batch, gen_len)
        draw = np.random.default_rng(1000 + i).standard_normal(batch)
        sigma = math.log(gen_len / median) / 2.3263  # gen_len at the 99th percentile
        return np.clip(np.round(median * np.exp(sigma * draw)), 1, gen_len).astype(int)

    def generate(st, i: int):
        """(tokens, mask) [batch, gen_len] of iteration i's responses."""
        lengths = lengths_for(i)
        tokens = np.zeros((batch, gen_len), np.int32)
        mask = np.zeros((batch, gen_len), np.float32)
        logprobs = np.zeros((batch, gen_len), np.float32)
        if engine is not None:
            engine.update_weights(st.policy, version=i)
            done = engine.generate([
                Request(j, p, RequestParams(max_tokens=int(n), seed=100 * i + j))
                for j, (p, n) in enumerate(zip(prompts, lengths))
            ])  # fmt: skip
            for c in done:
                tokens[c.request_id, : len(c.tokens)] = c.tokens
                mask[c.request_id, : len(c.tokens)] = 1.0
                logprobs[c.request_id, : len(c.tokens)] = c.logprobs
            return tokens, mask, logprobs
        longest = int(lengths.max())
        out = sampler.generate(
            st.policy, prompts, jax.random.key(100 + i), max_new_tokens=longest,
            sampling=SamplingParams(),
        )  # fmt: skip
        tokens[:, :longest] = out.tokens
        mask[:, :longest] = np.arange(longest)[None, :] < lengths[:, None]
        logprobs[:, :longest] = np.asarray(out.logprobs)
        return tokens, mask, logprobs

    phases: dict[str, list[float]] = {"generate": [], "score": [], "advantages": [], "update": []}
    totals = []
    state_box = {"state": state}

    def iteration(i: int, record: bool):
        st = state_box["state"]
        t0 = time.perf_counter()
        tokens, mask, logprobs = generate(st, i)
        t1 = time.perf_counter()
        reward = ((tokens % 2 == 0) * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1.0)
        rollout = new_rollout_batch(
            prompt_tokens, prompt_mask, tokens, mask, sequence_rewards=reward,
            behaviour_logp=logprobs,
        )  # fmt: skip
        rollout = jax.block_until_ready(trainer.score(st, reference, rollout))
        t2 = time.perf_counter()
        rollout = jax.block_until_ready(trainer.advantages(st, rollout))
        t3 = time.perf_counter()
        st, metrics = trainer.update(st, rollout)
        jax.block_until_ready(metrics)
        t4 = time.perf_counter()
        state_box["state"] = st
        if record:
            for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[name].append(seconds)
            totals.append(t4 - t0)
        return t4 - t0

    first = iteration(0, record=False)
    for i in range(1, _STEPS.value + 1):
        iteration(i, record=True)
    s_per_iter = statistics.median(totals)
    tokens = batch * prompt_len + int(
        np.mean([lengths_for(i).sum() for i in range(1, _STEPS.value + 1)])
    )
    print(
        json.dumps(
            {
                "vocab": cfg.vocab_size, "layers": cfg.n_layers, "d_model": cfg.d_model,
                "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "ffn": cfg.ffn_dim,
                "batch": batch, "prompt_len": prompt_len, "gen_len": gen_len,
                "dtype": cfg.dtype, "sampler": _SAMPLER.value, "lengths": _LENGTHS.value,
                "old_logprobs": _OLD_LOGPROBS.value, "preset": _PRESET.value,
                "compile_s": round(first - s_per_iter, 2),
                "s_per_iter": round(s_per_iter, 4),
                "tokens_per_s": round(tokens / s_per_iter, 1),
                **{f"{k}_s": round(statistics.median(v), 4) for k, v in phases.items()},
                "backend": jax.default_backend(),
            }
        )
    )  # fmt: skip


if __name__ == "__main__":
    app.run(main)
