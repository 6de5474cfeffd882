"""The Tunix side of a side-by-side RL-iteration benchmark (see ``rl_iteration.py``).

Runs one synchronous PPO iteration per step with Tunix's own public API: a Llama3 actor,
a reference copy of it, a critic made by ``tunix.rl.utils.create_critic_model`` (the actor's
trunk with ``lm_head`` replaced by a scalar score head), an ``RLCluster`` with every role on
one device, Tunix's vanilla rollout (its ``Sampler``), a rule reward (the fraction of even
token ids in the completion) and ``PPOLearner.train``. It imports nothing from rlpt, so it
runs in an environment of its own:

    python -m venv /path/venv && /path/venv/bin/pip install google-tunix==0.1.7 jax==0.10.2
    /path/venv/bin/python benchmarks/tunix_rl_iteration.py --preset=tiny --steps=5
    /path/venv/bin/python benchmarks/tunix_rl_iteration.py --preset=medium --steps=5

and the same shapes on rlpt's side:

    python benchmarks/rl_iteration.py --vocab=512 --layers=2 --d_model=128 --heads=4 \
        --kv_heads=2 --ffn=384 --batch=8 --prompt_len=32 --gen_len=32 --steps=5     # tiny
    python benchmarks/rl_iteration.py --vocab=2048 --layers=4 --d_model=256 --heads=4 \
        --kv_heads=2 --ffn=768 --batch=16 --prompt_len=64 --gen_len=128 --steps=5   # medium

The presets set those shapes (flags given explicitly still win). Each iteration generates
``batch`` responses of exactly ``gen_len`` tokens at temperature 1 from ``batch`` fixed
random prompts of exactly ``prompt_len`` tokens, recomputes the old-policy and reference
log-probabilities and the values, scores the responses, runs GAE (gamma 1, lambda 0.95,
KL penalty 0.05 folded into the reward, as rlpt does) and one PPO update of actor and
critic (one epoch, one minibatch = the whole batch, Adam at lr 1e-5 after clipping the
gradient norm to 1, as rlpt's defaults do).

How the inputs are fed. Tunix takes text prompts and a tokenizer, so the prompts are
space-separated decimal token ids and ``IdTokenizer`` maps them straight through (no BOS
is added: its ``bos_id()`` is None), so a prompt is exactly ``prompt_len`` tokens and no
padding is needed; the pad id is 0 and prompt ids are drawn from [5, vocab) as in rlpt.
Generation never stops early: the EOS id is ``vocab``, one past the last id the model can
sample, so every response is ``gen_len`` tokens (the JSON reports the shortest seen as
``min_completion_len``). The reward function receives Tunix's decoded completion text and
parses the ids back out of it.

Timing. ``s_per_iter`` is the median, over ``--steps`` iterations after one warm-up
iteration (compilation), of the wall-clock time between successive requests the training
loop makes to the prompt iterator, that is one whole iteration of Tunix's loop including
its bookkeeping. Per-phase times come from Tunix's own tracer (``PerfMetricsConfig``):
``generate_s`` (its ``rollout`` span), ``actor_update_s`` and ``critic_update_s`` (its
``actor_training`` and ``critic_training`` groups, ``update_s`` their sum) and
``tunix_global_step_s`` (its ``global_step`` group); ``rest_s`` is the iteration minus
generation and both updates: old and reference log-probabilities, values, reward, GAE
and Tunix's bookkeeping, which its tracer does not time apart.

What differs from rlpt's iteration, and what could not be switched off:
- Off here: evaluation (no eval set), checkpointing (no checkpoint directory), metric
  backends (no ``MetricsLoggerOptions``, so no TensorBoard or W&B files) and Tunix's info
  logging (absl verbosity WARNING); weight sync is a no-op since actor and rollout share
  one mesh and the same weights.
- Not switchable: Tunix buffers its metrics every iteration (several host copies of
  advantages, returns and values for masked statistics), keeps an in-memory metric
  history, shows a tqdm progress bar (``max_steps`` must be set), round-trips the
  completions through text for the reward function, runs data preparation on a worker
  thread handing over through a queue, and its tracer adds a waiter thread per traced
  device span.
- Tunix's sampler attends over a dense KV cache of prompt_len + gen_len slots (the
  smallest it accepts); rlpt's default engine uses a paged cache.
- Tunix's Llama3 initialises its MLP weights to zero and has no compute-dtype setting:
  ``--dtype=bfloat16`` casts all weights (and so the optimiser state) to bfloat16,
  whereas rlpt keeps float32 weights and computes in bfloat16. Values do not change the
  cost of any step here, since generation never ends early.
- A sampled id 0 counts as padding in Tunix's masks (rlpt masks by length), and Tunix
  0.1.7's PPO adds the sequence score into an int32 array (``zeros_like`` of the token
  ids; JAX warns), so the fractional reward is truncated. Both change values, not work.
- The critic's values are cast to float32 (Tunix's PPO metrics fail on bfloat16 ones).
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx
from tunix.models.llama3 import model as llama3_lib
from tunix.perf import metrics as perf_metrics
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl import utils as rl_utils
from tunix.rl.ppo import ppo_learner as ppo_lib
from tunix.rl.rollout import base_rollout

_PRESETS = {
    "tiny": dict(vocab=512, layers=2, d_model=128, heads=4, kv_heads=2, ffn=384, batch=8,
                 prompt_len=32, gen_len=32),
    "medium": dict(vocab=2048, layers=4, d_model=256, heads=4, kv_heads=2, ffn=768, batch=16,
                   prompt_len=64, gen_len=128),
}  # fmt: skip

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
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weight dtype.")
_PRESET = flags.DEFINE_enum(
    "preset", None, list(_PRESETS), "Shapes of a named config; explicit flags still win."
)

_PAD_ID = 0
_FIRST_PROMPT_ID = 5  # as rl_iteration.py: prompt ids are drawn from [5, vocab)


class IdTokenizer:
    """Text is space-separated decimal token ids; ids pass straight through.

    Has the five methods Tunix's ``TokenizerAdapter`` asks of a custom tokenizer. No BOS
    (``bos_id()`` is None, so Tunix's sampler prepends nothing).
    """

    def __init__(self, pad_id: int, eos_id: int):
        self._pad_id, self._eos_id = pad_id, eos_id

    def encode(self, text: str, **kwargs) -> list[int]:
        del kwargs
        return [int(piece) for piece in text.split()]

    def decode(self, ids: Sequence[int], **kwargs) -> str:
        del kwargs
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self) -> None:
        return None

    def eos_id(self) -> int:
        return self._eos_id

    def pad_id(self) -> int:
        return self._pad_id


class _Critic(nnx.Module):
    """Calls the critic trunk without ``segment_ids`` and returns float32 values.

    Tunix's ``compute_score`` always passes ``segment_ids``, which its Llama3 does not
    accept (padding is already masked through ``attention_mask``), and its PPO metrics
    (numpy masked arrays) fail on bfloat16 values.
    """

    def __init__(self, trunk: nnx.Module):
        self.trunk = trunk

    def __call__(self, tokens, positions, cache, attention_mask, segment_ids=None):
        del segment_ids
        values, cache = self.trunk(tokens, positions, cache, attention_mask)
        return values.astype(jnp.float32), cache


def _apply_preset() -> None:
    if _PRESET.value is None:
        return
    for name, value in _PRESETS[_PRESET.value].items():
        if not flags.FLAGS[name].present:
            flags.FLAGS[name].value = value


def _check_flags() -> None:
    for holder in (_VOCAB, _LAYERS, _D_MODEL, _HEADS, _KV_HEADS, _FFN, _BATCH, _PROMPT_LEN,
                   _GEN_LEN, _STEPS):  # fmt: skip
        if holder.value <= 0:
            raise app.UsageError(f"--{holder.name} must be positive, got {holder.value}", 2)
    if _VOCAB.value <= _FIRST_PROMPT_ID:
        raise app.UsageError(f"--vocab must exceed {_FIRST_PROMPT_ID}, got {_VOCAB.value}", 2)
    if _D_MODEL.value % _HEADS.value:
        raise app.UsageError(
            f"--d_model ({_D_MODEL.value}) must be divisible by --heads ({_HEADS.value})", 2
        )
    if _HEADS.value % _KV_HEADS.value:
        raise app.UsageError(
            f"--heads ({_HEADS.value}) must be a multiple of --kv_heads ({_KV_HEADS.value})", 2
        )
    if (_D_MODEL.value // _HEADS.value) % 2:
        raise app.UsageError("--d_model // --heads must be even for rotary embeddings", 2)


def _model_config() -> llama3_lib.ModelConfig:
    return llama3_lib.ModelConfig(
        num_layers=_LAYERS.value, vocab_size=_VOCAB.value, embed_dim=_D_MODEL.value,
        hidden_dim=_FFN.value, num_heads=_HEADS.value, head_dim=_D_MODEL.value // _HEADS.value,
        num_kv_heads=_KV_HEADS.value, rope_theta=10_000, norm_eps=1e-6, weight_tying=False,
    )  # fmt: skip


def _cast(model: nnx.Module, dtype: str) -> nnx.Module:
    if dtype != "float32":
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), params))
    return model


def _optimizer() -> optax.GradientTransformation:
    # rlpt's PPO defaults: gradient norm clipped to 1, Adam without weight decay.
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5, weight_decay=0.0))


def _walk(node, name: str) -> float:
    """Seconds spent in spans or groups called ``name`` anywhere under ``node``."""
    total = 0.0
    for item in getattr(node, "inner", ()):
        if item.name == name:
            total += item.duration
        else:
            total += _walk(item, name)
    return total


def _phases(query: perf_metrics.PerfSpanQuery, iterations: int) -> dict[str, list[float]]:
    """Per-iteration phase seconds from Tunix's tracer, one list entry per iteration."""
    out = {"generate": [], "actor_update": [], "critic_update": [], "tunix_global_step": []}
    steps = {
        tid: query().timeline(tid).all_groups("global_step").get()
        for tid in query.get_timeline_ids()
        if tid.startswith("thread-")
    }
    main = steps[query.get_main_thread_id()]
    for i in range(iterations):
        out["generate"].append(sum(_walk(g[i], "rollout") for g in steps.values() if len(g) > i))
        out["actor_update"].append(_walk(main[i], "actor_training"))
        out["critic_update"].append(_walk(main[i], "critic_training"))
        out["tunix_global_step"].append(main[i].duration)
    return out


def main(argv):
    del argv
    _apply_preset()
    _check_flags()
    logging.set_verbosity(logging.WARNING)  # Tunix logs every step at INFO
    vocab, batch = _VOCAB.value, _BATCH.value
    prompt_len, gen_len, steps = _PROMPT_LEN.value, _GEN_LEN.value, _STEPS.value

    cfg = _model_config()
    actor = _cast(llama3_lib.Llama3(cfg, rngs=nnx.Rngs(0)), _DTYPE.value)
    reference = _cast(llama3_lib.Llama3(cfg, rngs=nnx.Rngs(0)), _DTYPE.value)  # same weights
    critic = _Critic(_cast(rl_utils.create_critic_model(actor, seed=1), _DTYPE.value))

    # One device for every role: rlpt's benchmark runs on the default single device too.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=gen_len, max_prompt_length=prompt_len,
        kv_cache_size=prompt_len + gen_len, temperature=1.0, top_p=1.0, top_k=None,
    )  # fmt: skip
    training_config = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=_optimizer(), critic_optimizer=_optimizer(),
        mini_batch_size=batch, eval_every_n_steps=10**9,
        max_steps=steps + 10,  # the prompt iterator ends the run; this only has to be set
    )  # fmt: skip
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={role: mesh for role in rl_cluster_lib.Role},
        rollout_engine="vanilla", offload_to_cpu=False,
        training_config=training_config, rollout_config=rollout_config,
    )  # fmt: skip
    trace = {}

    def keep_query(query: perf_metrics.PerfSpanQuery) -> perf_metrics.MetricsT:
        trace["query"] = query
        return {}  # read once at the end, nothing to log

    cluster = rl_cluster_lib.RLCluster(
        actor=actor, critic=critic, reference=reference,
        tokenizer=IdTokenizer(_PAD_ID, eos_id=vocab),  # vocab itself can never be sampled
        cluster_config=cluster_config,
        perf_config=perf_metrics.PerfMetricsConfig(custom_export_fn=keep_query),
    )  # fmt: skip
    lengths = []

    def even_fraction(prompts, completions, **kwargs) -> list[float]:
        """Fraction of even token ids in each completion."""
        del prompts, kwargs
        rewards = []
        for text in completions:
            ids = np.array(text.split(), dtype=np.int64)
            lengths.append(ids.size)
            rewards.append(float(np.mean(ids % 2 == 0)) if ids.size else 0.0)
        return rewards

    ppo = ppo_lib.PPOConfig(num_iterations=1, beta=0.05, gamma=1.0, gae_lambda=0.95)
    learner = ppo_lib.PPOLearner(rl_cluster=cluster, ppo_config=ppo, reward_fns=even_fraction)

    rng = np.random.default_rng(0)
    ids = rng.integers(_FIRST_PROMPT_ID, vocab, (batch, prompt_len))
    prompts = np.array([" ".join(map(str, row)) for row in ids])
    pulls = []

    def prompt_batches() -> Iterator[dict[str, np.ndarray]]:
        # Each request for the next batch marks the start of an iteration; the request
        # after the last batch (which ends training) marks the end of the last one.
        for _ in range(steps + 1):
            pulls.append(time.perf_counter())
            yield {"prompts": prompts}
        pulls.append(time.perf_counter())

    learner.train(prompt_batches())
    if len(pulls) != steps + 2:
        raise RuntimeError(f"expected {steps + 1} iterations, saw {len(pulls) - 1}")
    per_iter = np.diff(pulls)
    for i, seconds in enumerate(per_iter):
        print(f"iteration {i}: {seconds:.3f} s", file=sys.stderr)
    timed = per_iter[1:]
    s_per_iter = statistics.median(timed)
    phases = _phases(trace["query"], steps + 1)
    phases["update"] = [a + c for a, c in zip(phases["actor_update"], phases["critic_update"])]
    phases["rest"] = [t - g - u for t, g, u in zip(per_iter, phases["generate"], phases["update"])]
    print(
        json.dumps(
            {
                "vocab": vocab, "layers": cfg.num_layers, "d_model": cfg.embed_dim,
                "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "ffn": cfg.hidden_dim,
                "batch": batch, "prompt_len": prompt_len, "gen_len": gen_len,
                "dtype": _DTYPE.value, "preset": _PRESET.value,
                "compile_s": round(per_iter[0] - s_per_iter, 2),
                "s_per_iter": round(s_per_iter, 4),
                "tokens_per_s": round(batch * (prompt_len + gen_len) / s_per_iter, 1),
                **{
                    f"{k}_s": round(statistics.median(v[1:]), 4)
                    for k, v in phases.items()
                },
                "min_completion_len": int(min(lengths)),
                "backend": jax.default_backend(),
                "framework": "tunix",
                "tunix_version": importlib.metadata.version("google-tunix"),
            }
        )
    )  # fmt: skip


if __name__ == "__main__":
    app.run(main)
