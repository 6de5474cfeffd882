"""Decode throughput of the KV-cache sampler against re-running the full prefix per token.

    python benchmarks/sampler.py [--preset=small --batch=8 --new_tokens=256 --prompt_len=16]

Both paths use the same model and the same greedy decoding. The baseline is a
jitted full forward pass over the whole (prompt + new tokens) buffer, padded
to its final length and compiled once, run once per new token; it is timed
over a prefix of the new tokens (every step costs the same, since the buffer
shape is fixed) and scaled to the full count. Compile time is reported
separately. The last line of output is one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from rlpt.models import CausalLM, count_params, create_model, get_preset  # noqa: E402
from rlpt.sampling import GREEDY, Sampler  # noqa: E402

_PRESET = flags.DEFINE_string("preset", "small", "Model preset.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences decoded together.")
_NEW = flags.DEFINE_integer("new_tokens", 256, "Tokens generated per sequence.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt length.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats of the cached decode.")
_BASELINE_STEPS = flags.DEFINE_integer("baseline_steps", 12, "Timed baseline steps.")


def main(argv):
    del argv
    config = get_preset(_PRESET.value)
    batch, new, plen = _BATCH.value, _NEW.value, _PROMPT_LEN.value
    graphdef, state = create_model(lambda r: CausalLM(config, rngs=r), jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = rng.integers(5, 250, size=(batch, plen)).tolist()
    # No stop token can occur (-1), so every row decodes all `new` tokens.
    sampler = Sampler(graphdef, config, eos_id=-1, pad_id=0, buckets=(plen,))
    key = jax.random.key(1)

    start = time.perf_counter()
    out = sampler.generate(state, prompts, key, max_new_tokens=new, sampling=GREEDY)
    cache_first_s = time.perf_counter() - start
    cache_times = []
    for _ in range(_REPEATS.value):
        start = time.perf_counter()
        out = sampler.generate(state, prompts, key, max_new_tokens=new, sampling=GREEDY)
        cache_times.append(time.perf_counter() - start)
    cache_s = statistics.median(cache_times)
    assert int(out.lengths.min()) == new

    width = plen + new

    @jax.jit
    def next_token(state, tokens, length):
        logits = nnx.merge(graphdef, state)(tokens, mask=jnp.arange(width)[None] < length)[0]
        return jnp.argmax(logits[:, length - 1], axis=-1).astype(jnp.int32)

    buffer = np.zeros((batch, width), np.int32)
    buffer[:, :plen] = prompts
    start = time.perf_counter()
    jax.block_until_ready(next_token(state, buffer, plen))
    baseline_compile_s = time.perf_counter() - start
    step_times = []
    for i in range(_BASELINE_STEPS.value):
        start = time.perf_counter()
        tok = jax.block_until_ready(next_token(state, buffer, plen + i))
        step_times.append(time.perf_counter() - start)
        buffer[:, plen + i] = np.asarray(tok)
    # The baseline's greedy tokens must agree with the cached decode (a correctness check).
    agree = bool(
        np.array_equal(buffer[:, plen : plen + len(step_times)], out.tokens[:, : len(step_times)])
    )
    baseline_s = statistics.median(step_times) * new

    generated = batch * new
    result = {
        "preset": _PRESET.value,
        "params": count_params(state),
        "batch": batch,
        "new_tokens": new,
        "prompt_len": plen,
        "cache_decode_s": round(cache_s, 4),
        "cache_first_call_s_incl_compile": round(cache_first_s, 3),
        "compile_s": round(cache_first_s - cache_s, 3),
        "baseline_step_s": round(statistics.median(step_times), 5),
        "baseline_compile_s": round(baseline_compile_s - statistics.median(step_times), 3),
        "baseline_decode_s": round(baseline_s, 3),
        "baseline_tokens_per_s": round(generated / baseline_s, 1),
        "tokens_agree_with_baseline": agree,
        "tokens_per_s": round(generated / cache_s, 1),
        "cache_speedup": round(baseline_s / cache_s, 2),
        "backend": jax.default_backend(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
