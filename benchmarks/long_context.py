"""Memory and speed of the long-context paths against the dense ones.

    python benchmarks/long_context.py [--lengths=1024,2048,4096,8192,16384,32768]
        [--plot=long_context_memory.png]

- ``update_peak_bytes``: one PPO update (policy and a value network of the same shape,
  GAE, one epoch, one minibatch) on one row of each length at the ``small`` preset,
  compiled for this machine's first device: XLA's buffer assignment (arguments + outputs +
  temporaries - aliased, ``compiled.memory_analysis()``), the memory the update needs;
  compiled, not run (an update at 32k tokens takes many minutes on two cores).
  ``linear``: blockwise attention, the chunked vocabulary, every block rematerialised;
  ``dense``: materialised [T, S] attention and [B, T, V] logits, the same remat. The prompt
  is 256 tokens, the rest is response. ``longest_update_that_fits_24gib`` doubles the
  length past the sweep until the linear update's peak passes 24 GiB.
- ``logprob_peak_bytes_16k_vocab152k``: the gradient of the summed log-probs and entropy
  of 16,384 tokens at the Qwen2-1.5B head (vocabulary 151,936, width 1,536, tied), the
  temporaries the computation holds beyond its inputs and the gradients it returns;
  chunked (``--logprob_chunks``, the first is the headline) against dense. A chunk holds
  a few [chunk, V] float32 arrays at once (logits, softmax, their cotangents): 512 tokens
  keep 16k tokens under 2 GiB at this vocabulary, 1024 do not.
- ``grad_max_abs_diff_chunked_vs_dense``: float32 gradients of the same loss through the
  chunked and dense heads (2,048 tokens, vocabulary 32,768), max abs difference over the
  hidden states and the projection.
- ``blockwise_vs_dense_speed_8k``: forward plus backward of causal self-attention on one
  row of 8,192 tokens with the small preset's heads (8 query heads, 4 key/value heads,
  head dim 64), dense time over blockwise time (medians after a warm-up; compile apart).
  Attention only: the projections and MLP around it cost the same on both paths.

The last line is one JSON object.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import timed  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from rlpt.aot import compile_ppo_step  # noqa: E402
from rlpt.models import attention as attn_lib  # noqa: E402
from rlpt.models import blockwise as blockwise_lib  # noqa: E402
from rlpt.models import get_preset  # noqa: E402
from rlpt.models.vocab import token_log_probs  # noqa: E402

_LENGTHS = flags.DEFINE_list(
    "lengths", ["1024", "2048", "4096", "8192", "16384", "32768"], "Update lengths."
)
_DENSE_MAX = flags.DEFINE_integer(
    "dense_max", 32768, "Longest length compiled on the dense path (its compile is slow)."
)
_VOCAB_CHUNK = flags.DEFINE_integer("vocab_chunk", 1024, "Tokens per vocabulary chunk.")
_LOGPROB_CHUNKS = flags.DEFINE_list(
    "logprob_chunks",
    ["512", "1024"],
    "Vocabulary chunks of the 16k x 152k log-prob measurement; the first is the headline.",
)
_BLOCK = flags.DEFINE_integer("block", 512, "Blockwise attention block.")
_SPEED_LENGTH = flags.DEFINE_integer("speed_length", 8192, "Length of the speed comparison.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs of the speed comparison.")
_PLOT = flags.DEFINE_string("plot", "", "Write a PNG of memory against length here.")

GIB = 1024**3
PROMPT = 256


def _update_bytes(length: int, linear: bool) -> int:
    overrides = (
        {"attention": "blockwise", "vocab_chunk": _VOCAB_CHUNK.value,
         "attention_block": _BLOCK.value}
        if linear else {"attention": "dense", "vocab_chunk": 0}
    )  # fmt: skip
    start = time.perf_counter()
    report = compile_ppo_step(
        "small", mesh_shape=(1, 1, 1, 1), batch=1, prompt_len=PROMPT, gen_len=length - PROMPT,
        remat=True, model_overrides=overrides,
    )  # fmt: skip
    logging.info(
        "update %s T=%d: %.2f GiB (compile %.0f s)", "linear" if linear else "dense", length,
        report["total_bytes_per_device"] / GIB, time.perf_counter() - start,
    )  # fmt: skip
    return report["total_bytes_per_device"]


def _logprob_grad(chunk: int):
    def loss(hidden, table, targets):
        stats = token_log_probs(
            hidden, table, targets, tied=True, dtype=jnp.float32, chunk=chunk,
            with_entropy=True,
        )  # fmt: skip
        return jnp.sum(stats.log_probs) + jnp.sum(stats.entropy)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _logprob_temp_bytes(chunk: int, tokens: int, vocab: int, width: int) -> int:
    hidden = jax.ShapeDtypeStruct((1, tokens, width), jnp.float32)
    table = jax.ShapeDtypeStruct((vocab, width), jnp.float32)
    targets = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    compiled = _logprob_grad(chunk).lower(hidden, table, targets).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _grad_diff(tokens: int = 2048, vocab: int = 32768, width: int = 128) -> float:
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (1, tokens, width), jnp.float32)
    table = jax.random.normal(keys[1], (vocab, width), jnp.float32) * width**-0.5
    targets = jax.random.randint(keys[2], (1, tokens), 0, vocab)
    dense = _logprob_grad(0)(hidden, table, targets)
    chunked = _logprob_grad(_VOCAB_CHUNK.value)(hidden, table, targets)
    return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(dense, chunked))


def _attention_speed(length: int) -> dict:
    cfg = get_preset("small")
    kv, groups, dim = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.resolved_head_dim
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (1, length, kv, groups, dim)) * dim**-0.5
    k = jax.random.normal(keys[1], (1, length, kv, dim))
    v = jax.random.normal(keys[2], (1, length, kv, dim))
    info = attn_lib.self_attention_info(jnp.arange(length)[None], jnp.ones((1, length), bool))
    block = _BLOCK.value

    def attend(kernel, q, k, v):
        if kernel == "dense":
            return attn_lib.dense_attention(q, k, v, attn_lib.visible(info))
        return blockwise_lib.blockwise_attention(q, k, v, info, block_q=block, block_k=block)

    out = {}
    for kernel in ("dense", "blockwise"):
        fn = jax.jit(jax.grad(lambda q, k, v, kernel=kernel: jnp.sum(attend(kernel, q, k, v)),
                              argnums=(0, 1, 2)))  # fmt: skip
        compiled = fn.lower(q, k, v).compile()
        first, median = timed(functools.partial(compiled, q, k, v), _REPEATS.value)
        out[kernel] = median
        logging.info("attention %s T=%d: %.2f s (first %.2f s)", kernel, length, median, first)
    return out


def _plot(path: str, linear: dict, dense: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, series in (("linear (blockwise, chunked vocab)", linear), ("dense", dense)):
        xs = sorted(int(t) for t in series)
        ax.plot(xs, [series[str(t)] / GIB for t in xs], marker="o", label=name)
    ax.axhline(24, color="grey", linestyle="--", label="24 GiB")
    ax.set(xscale="log", yscale="log", xlabel="tokens per row", ylabel="GiB",
           title="PPO update memory, small preset (policy + value)")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv):
    del argv
    lengths = [int(t) for t in _LENGTHS.value]
    linear = {str(t): _update_bytes(t, True) for t in lengths}
    dense = {str(t): _update_bytes(t, False) for t in lengths if t <= _DENSE_MAX.value}
    longest, t = 0, lengths[0]
    while True:
        peak = linear.get(str(t)) or _update_bytes(t, True)
        if peak > 24 * GIB:
            break
        longest = t
        if t >= 1 << 20:
            break
        t *= 2

    def ratio(series):
        if "32768" in series and "4096" in series:
            return round(series["32768"] / series["4096"], 2)
        return None

    qwen = get_preset("qwen2-1.5b")
    logprob = {
        chunk: _logprob_temp_bytes(int(chunk), 16384, qwen.vocab_size, qwen.d_model)
        for chunk in _LOGPROB_CHUNKS.value + ["0"]
    }
    speed = _attention_speed(_SPEED_LENGTH.value)
    if _PLOT.value:
        _plot(_PLOT.value, linear, dense)
    print(
        json.dumps(
            {
                "update_peak_bytes": {"linear": linear, "dense": dense},
                "memory_ratio_32k_over_4k": ratio(linear),
                "dense_memory_ratio_32k_over_4k": ratio(dense),
                "longest_update_that_fits_24gib": longest,
                "logprob_peak_bytes_16k_vocab152k": logprob[_LOGPROB_CHUNKS.value[0]],
                "logprob_peak_bytes_by_chunk": {k: v for k, v in logprob.items() if k != "0"},
                "dense_logprob_peak_bytes_16k_vocab152k": logprob["0"],
                "grad_max_abs_diff_chunked_vs_dense": _grad_diff(),
                "blockwise_vs_dense_speed_8k": round(speed["dense"] / speed["blockwise"], 3),
                "attention_8k_s": {k: round(v, 3) for k, v in speed.items()},
                "vocab_chunk": _VOCAB_CHUNK.value,
                "block": _BLOCK.value,
                "backend": jax.default_backend(),
            }
        )
    )


if __name__ == "__main__":
    app.run(main)
