"""Blockwise against dense attention: forward plus backward time and compiled memory.

    python benchmarks/attention.py [--lengths=2048,8192 --block=512 --window=0 --repeats=3]
    python benchmarks/attention.py --moba_top_k=2 --moba_block=512   # MoBA, both kernels

One row of causal self-attention with tiny heads (2 key/value heads, 2 query heads each,
head dim 16) at each length: the gradient of a sum of the output with respect to q, k and v,
jitted, with the dense kernel (materialised [T, S] scores, the baseline) and the blockwise
kernel (``rlpt.models.blockwise.blockwise_attention``). Reports median seconds and the
compiled temporary bytes of each. The last line is one JSON object.

With ``--moba_top_k`` > 0 both kernels attend under MoBA's selection (each query's own block
of ``--moba_block`` keys and the top-k earlier ones): the dense kernel with the reference
selection (``moba_select``, [T, S] gate scores and a per-head mask), the blockwise kernel
with the memory-linear one (``moba_blocks``), the pair a ``sparse_attention="moba"`` model
runs with ``attention="dense"`` and ``"blockwise"``.
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
from absl import app, flags  # noqa: E402

from rlpt.models import attention as A  # noqa: E402
from rlpt.models import blockwise as BW  # noqa: E402

flags.DEFINE_list("lengths", ["2048", "8192"], "Sequence lengths.")
flags.DEFINE_integer("block", 512, "Blockwise query and key block length.")
flags.DEFINE_integer("window", 0, "Sliding window (0: full causal).")
flags.DEFINE_integer("repeats", 3, "Timed runs per setting.")
flags.DEFINE_integer("moba_top_k", 0, "MoBA: earlier key blocks each query selects (0: off).")
flags.DEFINE_integer("moba_block", 512, "MoBA's key block length.")
FLAGS = flags.FLAGS


def _grad_fn(kernel: str, info, block: int):
    top_k, moba_block = FLAGS.moba_top_k, FLAGS.moba_block

    def attend(q, k, v):
        t = q.shape[1]
        if kernel == "dense":
            if top_k:
                allowed = A.moba_select(q, k, info, block=moba_block, top_k=top_k, max_len=t)
                return A.dense_attention(q, k, v, allowed)
            return A.dense_attention(q, k, v, A.visible(info))
        sparse = info
        if top_k:
            sparse = A.moba_blocks(q, k, info, block=moba_block, top_k=top_k, max_len=t)
        return BW.blockwise_attention(q, k, v, sparse, block_q=block, block_k=block)

    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)), argnums=(0, 1, 2)))


def main(argv):
    del argv
    heads, groups, dim = 2, 2, 16
    results = {"seconds": {}, "temp_mb": {}, "speedup": {}, "compile_s": {}}
    for t in map(int, FLAGS.lengths):
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (1, t, heads, groups, dim)) * dim**-0.5
        k = jax.random.normal(keys[1], (1, t, heads, dim))
        v = jax.random.normal(keys[2], (1, t, heads, dim))
        info = A.self_attention_info(
            jnp.arange(t)[None], jnp.ones((1, t), bool), window=FLAGS.window
        )
        row = {}
        for kernel in ("dense", "blockwise"):
            fn = _grad_fn(kernel, info, FLAGS.block)
            start = time.perf_counter()
            compiled = fn.lower(q, k, v).compile()
            compile_s = time.perf_counter() - start
            temp = compiled.memory_analysis().temp_size_in_bytes
            _, median = timed(functools.partial(compiled, q, k, v), FLAGS.repeats)
            row[kernel] = median
            results["seconds"].setdefault(kernel, {})[str(t)] = round(median, 4)
            results["temp_mb"].setdefault(kernel, {})[str(t)] = round(temp / 2**20, 2)
            results["compile_s"].setdefault(kernel, {})[str(t)] = round(compile_s, 2)
            print(f"T={t} {kernel}: {median:.3f} s, temp {temp / 2**20:.1f} MiB", file=sys.stderr)
        results["speedup"][str(t)] = round(row["dense"] / row["blockwise"], 3)
    results.update(block=FLAGS.block, window=FLAGS.window, moba_top_k=FLAGS.moba_top_k,
                   moba_block=FLAGS.moba_block, device=jax.devices()[0].device_kind)  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    app.run(main)
