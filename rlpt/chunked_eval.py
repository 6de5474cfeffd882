"""Greedy accuracy of a chunked-reasoning run per level and chunk size.

    python -m rlpt.chunked_eval --workdir=/tmp/rlpt_long --levels=5,6 --chunk_tokens=32,48,64

Restores the run's latest checkpoint and, for each chunk size C (the carry m stays the
run's ``rollout.chunked_reasoning.carry_tokens``) and each level, decodes held-out
items greedily with ``chunked_generate`` and a chunk budget that holds the level's
longest demonstration. Besides pass@1 it reports what each generation call cost in
memory, the widest context + chunk fed to the model (``window_max``), against the full
trace (``trace_len_max``), and how many leading steps of a trace were right on average
(``correct_prefix_frac``), which tells a slip in one addition from losing the thread;
for ``state_tracking``, ``counter_ok_frac`` is the share of the reference's steps whose
iteration counter the trace wrote right, whatever the value: whether the count survives
the context resets.

The last line of standard output is one JSON object; it is also written to
``WORKDIR/chunked_eval.json``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import app, flags

from rlpt.policy import restore_policy
from rlpt.runfiles import atomic_write_json
from rlpt.sampling import GREEDY, ChunkedSampler
from rlpt.tasks import get_domain, split_steps
from rlpt.tasks.state_tracking import parse_step
from rlpt.tokenizers import decode_response


def _leading_correct(labels: Sequence[bool]) -> int:
    n = 0
    for ok in labels:
        if not ok:
            break
        n += 1
    return n


def evaluate_chunked(
    workdir: str,
    *,
    levels: Sequence[int],
    chunk_sizes: Sequence[int],
    items: int,
    batch_size: int = 32,
    seed: int = 1234,
) -> dict[str, Any]:
    """``{"results": {C: {level: metrics}}, ...}`` for the run in ``workdir``."""
    policy = restore_policy(workdir)
    config = policy.config
    chunking = config.rollout.chunked_reasoning
    sampler = policy.sampler()
    tok = policy.tokenizer
    for c in chunk_sizes:
        window = max(sampler.buckets) + c
        if window > policy.model_cfg.max_seq_len:
            raise ValueError(
                f"--chunk_tokens={c} plus the largest prompt bucket ({max(sampler.buckets)}) "
                f"exceeds model.max_seq_len ({policy.model_cfg.max_seq_len})"
            )
    results: dict[str, dict[str, Any]] = {}
    for name in config.domains:
        domain = get_domain(name)
        for level in levels:
            tasks = domain.tasks("heldout", items, level, seed)
            prompts = [tok.encode(t.prompt, add_bos=True) for t in tasks]
            longest = max(len(tok.encode(domain.demonstration(t), add_eos=True)) for t in tasks)
            for c in chunk_sizes:
                chunked = ChunkedSampler(sampler, chunk_tokens=c,
                                         carry_tokens=chunking.carry_tokens)  # fmt: skip
                # One chunk of slack past the longest correct trace.
                max_chunks = math.ceil(longest / c) + 1
                traces = []
                for start in range(0, len(prompts), batch_size):
                    key = jax.random.fold_in(jax.random.key(seed), start)
                    traces += chunked.traces(
                        policy.params, prompts[start : start + batch_size], key,
                        max_chunks=max_chunks, sampling=GREEDY,
                    )  # fmt: skip
                correct, prefix, counters = [], [], []
                for task, trace in zip(tasks, traces):
                    text = decode_response(tok, trace.tokens)
                    correct.append(domain.verify(task, text).correct)
                    if hasattr(domain, "check_steps"):
                        steps = int(task.data.get("steps", 0)) or 1
                        labels = domain.check_steps(task, text)
                        prefix.append(_leading_correct(labels) / steps)
                    if name.split("/")[0] == "state_tracking":  # any modulus
                        parsed = [parse_step(x) for x in split_steps(text)][: task.data["steps"]]
                        ok = sum(p is not None and p[0] == i for i, p in enumerate(parsed, 1))
                        counters.append(ok / task.data["steps"])
                windows = [len(s.context) + len(s.tokens) for t in traces for s in t.segments]
                lengths = [len(t.tokens) for t in traces]
                results.setdefault(f"{name}/C{c}", {})[str(level)] = {
                    "pass@1": float(np.mean(correct)),
                    "items": len(tasks),
                    "correct_prefix_frac": float(np.mean(prefix)) if prefix else None,
                    "counter_ok_frac": float(np.mean(counters)) if counters else None,
                    "window_max": int(max(windows)),
                    "trace_len_mean": float(np.mean(lengths)),
                    "trace_len_max": int(max(lengths)),
                    "reference_len_max": longest,
                    "max_chunks": max_chunks,
                    "truncated_frac": float(np.mean([t.truncated for t in traces])),
                }
                print(f"{name} C={c} level={level}: {results[f'{name}/C{c}'][str(level)]}",
                      file=sys.stderr, flush=True)  # fmt: skip
    return {
        "step": policy.step,
        "stage": policy.stage,
        "carry_tokens": chunking.carry_tokens,
        "trained_chunk_tokens": chunking.chunk_tokens,
        "max_seq_len": policy.model_cfg.max_seq_len,
        "results": results,
    }


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required")
    sizes = [int(c) for c in _CHUNK_TOKENS.value] if _CHUNK_TOKENS.value else None
    if sizes is None:
        sizes = [restore_policy(_WORKDIR.value).config.rollout.chunked_reasoning.chunk_tokens]
    result = evaluate_chunked(
        _WORKDIR.value, levels=[int(x) for x in _LEVELS.value], chunk_sizes=sizes,
        items=_ITEMS.value, batch_size=_BATCH.value, seed=_SEED.value,
    )  # fmt: skip
    atomic_write_json(os.path.join(_WORKDIR.value, "chunked_eval.json"), result, indent=2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    # Flags only when run as a program: tests and notebooks import evaluate_chunked beside
    # modules that define the same flag names (rlpt.train's --workdir).
    _WORKDIR = flags.DEFINE_string("workdir", None, "A post_train run directory.", required=False)
    _LEVELS = flags.DEFINE_list("levels", ["5", "6"], "Levels to evaluate.")
    _CHUNK_TOKENS = flags.DEFINE_list("chunk_tokens", None, "Chunk sizes C (default: the run's).")
    _ITEMS = flags.DEFINE_integer("items", 40, "Held-out items per level.")
    _BATCH = flags.DEFINE_integer("batch_size", 32, "Traces per generation call.")
    _SEED = flags.DEFINE_integer("seed", 1234, "Seed of the item draw.")
    app.run(main)
