"""The demo with the long-context paths on: memory linear in length, sparse attention.

Launch:

    nice python -m rlpt.train --config=experiments/long_context.py --workdir=/tmp/rlpt_long_context

Smoke run:

    python -m rlpt.train --config=experiments/long_context.py:runlocal \\
        --workdir=/tmp/rlpt_long_context_smoke

Everything is ``experiments/demo.py`` except the model options:
- ``attention="auto"``: blockwise online-softmax attention on CPU (never a [T, S] score
  matrix, forward or backward), ``jax.nn.dot_product_attention`` on GPU, the Pallas splash
  kernel on TPU; ``attention_block`` its block length.
- ``vocab_chunk``: log-probs, entropy and token accuracy over the vocabulary in chunks of
  tokens, in scoring, the PPO update and SFT (never [B, T, V] logits).
- ``remat`` with ``remat_policy``: every block rematerialised in a scan over layers.
- ``sliding_window`` with ``attention_sinks``: each token sees the last W positions and the
  first S of its sequence; sampling keeps a ring of S + W cache slots, and the rollout
  engine gives back the KV blocks behind the window.
Variants: ``--config.model.overrides.sparse_attention=moba`` (each query reads its own block
and the top ``sparse_top_k`` earlier blocks); context parallelism splits every row over a
``sequence`` mesh axis (``--config.mesh.sequence=4`` on four or more devices; for example
eight host CPU devices with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
Reasoning past the window: ``experiments/long_reasoning.py``.
"""

from __future__ import annotations

import ml_collections

from experiments import demo


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = demo.get_config(arg)
    small = arg == "runlocal"
    config.model.overrides = {
        "attention": "auto",
        "attention_block": 16 if small else 64,
        "vocab_chunk": 16 if small else 64,
        "remat": True,
        "remat_policy": "full",
        "sliding_window": 32 if small else 128,
        "attention_sinks": 4,
    }
    return config
