"""PPO update throughput against this machine's matmul peak.

    python benchmarks/ppo_step.py [--d_model=512 --layers=8 --heads=8 --seq=512 --batch=8]

One PPO update (one epoch, one minibatch: forward and backward of the policy
and of a separate value network of the same shape) on a mid-size model. Model
FLOPs are counted the standard way: 6 x non-embedding parameters x tokens
(the output projection included), plus causal attention at half of full
attention (12 x layers x seq^2 x d_model per sequence for forward + backward,
halved), for both networks. The matmul peak is the best jitted square
``jnp.dot`` from 1024 to 4096 in the same process, with bfloat16 inputs when
the model computes in bfloat16. Compile time is reported separately. The last
line is one JSON object.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _common import matmul_peak_gflops, timed  # noqa: E402
from absl import app, flags  # noqa: E402

from rlpt.models import BYTE_VOCAB_SIZE, CausalLM, ModelConfig, ValueModel, create_model  # noqa: E402
from rlpt.rl import PPOConfig, PPOTrainer, init_train_state, new_rollout_batch  # noqa: E402

_D_MODEL = flags.DEFINE_integer("d_model", 512, "Model width.")
_LAYERS = flags.DEFINE_integer("layers", 8, "Transformer blocks.")
_HEADS = flags.DEFINE_integer("heads", 8, "Attention heads (and kv heads).")
_FFN = flags.DEFINE_integer("ffn", 1536, "SwiGLU hidden width.")
_SEQ = flags.DEFINE_integer("seq", 512, "Sequence length (prompt + response).")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per update.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "Compute dtype.")
_REMAT = flags.DEFINE_bool("remat", False, "Rematerialise each block in the backward pass.")
_ATTENTION = flags.DEFINE_enum(
    "attention", "dense", ["dense", "blockwise", "dot_product", "auto"], "Attention kernel."
)
_ATTENTION_BLOCK = flags.DEFINE_integer("attention_block", 512, "Blockwise attention block.")
_GRAD_ACCUM = flags.DEFINE_integer("grad_accum", 1, "Microbatches per minibatch.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed updates.")


def non_embedding_params(cfg: ModelConfig, output_dim: int) -> int:
    d, h = cfg.d_model, cfg.resolved_head_dim
    attn = d * h * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    mlp = 3 * d * cfg.ffn_dim
    return cfg.n_layers * (attn + mlp) + d * output_dim


def main(argv):
    del argv
    cfg = ModelConfig(
        vocab_size=BYTE_VOCAB_SIZE, d_model=_D_MODEL.value, n_layers=_LAYERS.value,
        n_heads=_HEADS.value, n_kv_heads=_HEADS.value, ffn_dim=_FFN.value,
        max_seq_len=_SEQ.value, dtype=_DTYPE.value, remat=_REMAT.value,
        attention=_ATTENTION.value, attention_block=_ATTENTION_BLOCK.value,
    )  # fmt: skip
    batch, seq = _BATCH.value, _SEQ.value
    prompt_len = seq // 4
    response_len = seq - prompt_len
    policy_graph, policy = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(0))
    value_graph, value = create_model(lambda r: ValueModel(cfg, rngs=r), jax.random.key(1))
    ppo = PPOConfig(epochs=1, num_minibatches=1, grad_accum=_GRAD_ACCUM.value)
    trainer = PPOTrainer(ppo, policy_graph, value_graph)

    rng = np.random.default_rng(0)
    rollout = new_rollout_batch(
        rng.integers(5, 250, (batch, prompt_len)), np.ones((batch, prompt_len), bool),
        rng.integers(5, 250, (batch, response_len)), np.ones((batch, response_len), np.float32),
        sequence_rewards=rng.normal(size=batch),
    )  # fmt: skip
    state = init_train_state(ppo, policy, value, jax.random.key(2))
    rollout = trainer.advantages(state, trainer.score(state, policy, rollout))

    holder = {"state": state}

    def step():
        holder["state"], metrics = trainer.update(holder["state"], rollout)
        return metrics

    first_s, step_s = timed(step, repeats=_REPEATS.value)
    tokens = batch * seq
    flops = 0.0
    for out_dim in (cfg.vocab_size, 1):  # policy, then value network
        flops += 6 * non_embedding_params(cfg, out_dim) * tokens
        flops += 0.5 * 12 * cfg.n_layers * seq**2 * cfg.d_model * batch
    gflops = flops / step_s / 1e9
    peak = matmul_peak_gflops(_DTYPE.value)
    print(
        json.dumps(
            {
                "d_model": cfg.d_model, "layers": cfg.n_layers, "heads": cfg.n_heads,
                "ffn": cfg.ffn_dim, "seq": seq, "batch": batch, "dtype": cfg.dtype,
                "remat": cfg.remat, "grad_accum": ppo.grad_accum, "attention": cfg.attention,
                "model_gflop_per_step": round(flops / 1e9, 1),
                "compile_s": round(first_s - step_s, 2),
                "step_s": round(step_s, 3),
                "model_gflops_per_s": round(gflops, 1),
                "matmul_peak_gflops_per_s": round(peak, 1),
                "mfu_vs_matmul_peak": round(gflops / peak, 3),
                "backend": jax.default_backend(),
            }
        )
    )  # fmt: skip


if __name__ == "__main__":
    app.run(main)
