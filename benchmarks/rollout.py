"""The rollout engine against the static sampler, on long-tailed response lengths.

    python benchmarks/rollout.py                       # defaults below
    python benchmarks/rollout.py --groups=8 --slots=32 --dtype=bfloat16

Workload: ``--groups`` prompts of ``--prompt_len`` random tokens, each sampled ``--group``
(G) times at temperature 1, with response lengths drawn from a log-normal distribution
(median ``--median``, p99 near ``--p99``, at most ``--p99`` tokens). Both generators get
the same model, the same settings and the same parallelism (``--slots`` rows decoding at once):

* the engine: continuous batching over ``--slots`` slots, the G samples of a prompt sharing
  its KV blocks;
* the static sampler: batches of ``--slots`` rows (G copies of a prompt each prefilled for
  itself), each batch decoding until its longest row is done.

The lengths stand for EOS: a random model's EOS comes at random, so each response's drawn
length is enforced instead. The engine gets it as the request's ``max_tokens``, one request
per sample (so this figure leaves out what sharing a group's prompt saves: a prefill of
``--prompt_len`` tokens per sample, small beside the responses); the static
sampler runs exactly the steps it would run if every row emitted EOS at its drawn length (to
the batch's longest), with a KV cache sized to that longest rather than to the cap, which
favours it. Compilation is excluded: each generator does the whole workload once to warm up,
then the timed pass. Throughput counts the generated tokens of the drawn lengths only.

Final JSON keys: ``speedup_vs_static`` (generated tokens per second, engine over static;
target >= 3), ``greedy_identical`` (on greedy decoding with EOS, the engine's outputs equal
the static sampler's), ``kv_bytes_ratio_shared_prefix`` (peak KV bytes of prompt-heavy groups
with prefix sharing over the same requests without; target <= 0.3),
``logprob_max_abs_diff_fp32`` (engine log-probs against the learner's recomputation from a full
forward pass, float32; target <= 1e-5), and ``logprob_mean_abs_diff_bf16`` /
``logprob_max_abs_diff_bf16`` (the same in bfloat16: the train/inference mismatch that
off-policy corrections see).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from rlpt.models import CausalLM, ModelConfig, create_model  # noqa: E402
from rlpt.rl.ppo import response_log_probs  # noqa: E402
from rlpt.sampling import Engine, Request, RequestParams, Sampler, SamplingParams  # noqa: E402

_VOCAB = flags.DEFINE_integer("vocab", 2048, "Vocabulary size.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Transformer blocks.")
_D_MODEL = flags.DEFINE_integer("d_model", 256, "Model width.")
_HEADS = flags.DEFINE_integer("heads", 4, "Attention heads.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 2, "Key/value heads.")
_FFN = flags.DEFINE_integer("ffn", 768, "SwiGLU hidden width.")
_GROUPS = flags.DEFINE_integer("groups", 16, "Prompts.")
_GROUP = flags.DEFINE_integer("group", 8, "Samples per prompt (G).")
_SLOTS = flags.DEFINE_integer("slots", 32, "Rows decoding at once, for both generators.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 48, "Prompt tokens.")
_MEDIAN = flags.DEFINE_integer("median", 64, "Median response length.")
_P99 = flags.DEFINE_integer("p99", 1024, "99th percentile (and cap) of the response length.")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 8, "Engine tokens per decode call.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of prompts and lengths.")

EOS, PAD = 1, 0


def _config(dtype: str, max_seq_len: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=_VOCAB.value, d_model=_D_MODEL.value, n_layers=_LAYERS.value,
        n_heads=_HEADS.value, n_kv_heads=_KV_HEADS.value, ffn_dim=_FFN.value,
        max_seq_len=max_seq_len, dtype=dtype,
    )  # fmt: skip


def _lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    """Log-normal lengths with the given median and 99th percentile, capped at the p99."""
    sigma = math.log(_P99.value / _MEDIAN.value) / 2.3263  # z of the 99th percentile
    draws = np.exp(math.log(_MEDIAN.value) + sigma * rng.standard_normal(n))
    return np.clip(np.round(draws), 1, _P99.value).astype(int)


def _engine(graphdef, state, cfg, **kw) -> Engine:
    options = dict(
        eos_id=EOS, num_slots=_SLOTS.value, block_size=16, decode_steps=_DECODE_STEPS.value
    )
    options.update(kw)
    return Engine(graphdef, state, cfg, pad_id=PAD, **options)


def _throughput(graphdef, state, cfg, prompts, lengths) -> dict:
    """Generated tokens per second of the engine and of the static sampler."""
    g = _GROUP.value
    # One request per sample, so each sample's drawn length can stand for its own EOS.
    requests = [
        Request((i, j), p, RequestParams(max_tokens=int(lengths[i][j]), seed=1000 * i + j))
        for i, p in enumerate(prompts)
        for j in range(g)
    ]
    # No stop id (-1 never occurs): the drawn lengths alone end the responses.
    engine = _engine(graphdef, state, cfg, eos_id=-1)
    engine.generate(requests)  # warm-up: compiles every bucket it will use
    engine.stats = type(engine.stats)()
    t0 = time.perf_counter()
    out = engine.generate(requests)
    engine_s = time.perf_counter() - t0
    produced = sum(len(c.tokens) for c in out)
    assert produced == int(lengths.sum()), (produced, int(lengths.sum()))

    sampler = Sampler(graphdef, cfg, eos_id=-1, pad_id=PAD, buckets=(len(prompts[0]),))
    rows = [(p, int(lengths[i][j])) for i, p in enumerate(prompts) for j in range(g)]
    batches = [rows[k : k + _SLOTS.value] for k in range(0, len(rows), _SLOTS.value)]

    def static_pass():
        for k, batch in enumerate(batches):
            longest = max(n for _, n in batch)
            res = sampler.generate(
                state, [p for p, _ in batch], jax.random.key(k), max_new_tokens=longest,
                sampling=SamplingParams(),
            )  # fmt: skip
            jax.block_until_ready(res.tokens)

    static_pass()  # warm-up
    t0 = time.perf_counter()
    static_pass()
    static_s = time.perf_counter() - t0
    return {
        "generated_tokens": produced,
        "engine_s": round(engine_s, 3),
        "static_s": round(static_s, 3),
        "engine_tokens_per_s": round(produced / engine_s, 1),
        "static_tokens_per_s": round(produced / static_s, 1),
        "speedup_vs_static": round(static_s / engine_s, 2),
        "engine_decode_calls": engine.stats.decode_calls,
        "engine_prefill_calls": engine.stats.prefill_calls,
        "engine_decode_s": round(engine.stats.decode_s, 3),
        "engine_prefill_s": round(engine.stats.prefill_s, 3),
        "static_decode_steps": sum(max(n for _, n in b) for b in batches),
    }


def _greedy_identical(graphdef, state, cfg, prompts) -> bool:
    """Greedy with EOS, one sample per prompt: the engine's ids equal the static sampler's."""
    n = 96
    sampler = Sampler(graphdef, cfg, eos_id=EOS, pad_id=PAD, buckets=(len(prompts[0]),))
    ref = sampler.generate(state, prompts, jax.random.key(0), max_new_tokens=n)
    out = _engine(graphdef, state, cfg).generate(
        [Request(i, p, RequestParams(max_tokens=n, greedy=True)) for i, p in enumerate(prompts)]
    )
    return all(
        c.tokens.tolist() == ref.tokens[i, : int(ref.lengths[i])].tolist()
        for i, c in enumerate(out)
    )


def _kv_ratio(graphdef, state, cfg, rng) -> dict:
    """Peak KV blocks of prompt-heavy groups, shared prompt blocks against none."""
    g, prompt_len, response = _GROUP.value, 512, 32
    prompts = rng.integers(2, cfg.vocab_size, (2, prompt_len)).tolist()
    shared = _engine(graphdef, state, cfg, num_slots=2 * g)
    shared.generate(
        [Request(i, p, RequestParams(max_tokens=response, n=g)) for i, p in enumerate(prompts)]
    )
    alone = _engine(graphdef, state, cfg, num_slots=2 * g)
    alone.generate(
        [
            Request((i, j), p, RequestParams(max_tokens=response))
            for i, p in enumerate(prompts)
            for j in range(g)
        ]
    )
    return {
        "kv_peak_bytes_shared": shared.stats.peak_blocks * shared.block_bytes,
        "kv_peak_bytes_unshared": alone.stats.peak_blocks * alone.block_bytes,
        "kv_bytes_ratio_shared_prefix": round(
            shared.stats.peak_blocks / alone.stats.peak_blocks, 3
        ),
    }


def _logprob_gap(dtype: str, prompts, max_seq_len: int) -> tuple[float, float]:
    """Engine log-probs against the learner's, from a full forward pass: (mean, max) |diff|."""
    cfg = _config(dtype, max_seq_len)
    graphdef, state = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(0))
    out = _engine(graphdef, state, cfg).generate(
        [Request(i, p, RequestParams(max_tokens=64, seed=i)) for i, p in enumerate(prompts)]
    )
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])
    gaps = []
    for c in out:
        seq = np.array([c.prompt + c.tokens.tolist()])
        learner = np.asarray(response_log_probs(forward(state, seq), seq, len(c.prompt))[0])[0]
        gaps.append(np.abs(learner - c.logprobs))
    gaps = np.concatenate(gaps)
    return float(gaps.mean()), float(gaps.max())


def main(argv):
    del argv
    rng = np.random.default_rng(_SEED.value)
    max_seq_len = max(_PROMPT_LEN.value + _P99.value, 512 + 64)
    cfg = _config(_DTYPE.value, max_seq_len)
    graphdef, state = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(0))
    prompts = rng.integers(2, cfg.vocab_size, (_GROUPS.value, _PROMPT_LEN.value)).tolist()
    lengths = _lengths(rng, _GROUPS.value * _GROUP.value).reshape(_GROUPS.value, _GROUP.value)
    out: dict = {
        "vocab": cfg.vocab_size, "layers": cfg.n_layers, "d_model": cfg.d_model,
        "groups": _GROUPS.value, "group": _GROUP.value, "slots": _SLOTS.value,
        "prompt_len": _PROMPT_LEN.value, "dtype": cfg.dtype,
        "length_median": float(np.median(lengths)), "length_p99": float(np.percentile(lengths, 99)),
        "length_max": int(lengths.max()),
    }  # fmt: skip
    out.update(_throughput(graphdef, state, cfg, prompts, lengths))
    out["greedy_identical"] = _greedy_identical(graphdef, state, cfg, prompts[:8])
    out.update(_kv_ratio(graphdef, state, cfg, rng))
    few = prompts[:8]
    out["logprob_max_abs_diff_fp32"] = _logprob_gap("float32", few, max_seq_len)[1]
    mean_bf16, max_bf16 = _logprob_gap("bfloat16", few, max_seq_len)
    out["logprob_mean_abs_diff_bf16"] = mean_bf16
    out["logprob_max_abs_diff_bf16"] = max_bf16
    out["backend"] = jax.default_backend()
    print(json.dumps(out))


if __name__ == "__main__":
    app.run(main)
