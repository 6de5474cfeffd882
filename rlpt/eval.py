"""Per-domain evaluation: greedy pass@1 and unbiased pass@k, with standard errors.

For every domain the evaluation draws a fixed held-out set (levels ``1..L`` where
``L`` is the highest level training may reach) and an out-of-distribution set at
level ``L + 1``. Each item is decoded greedily once (pass@1) and sampled ``n >= k``
times at temperature 1 (pass@k by the unbiased estimator of Chen et al. 2021):

    pass@k = E_items[1 - C(n - c, k) / C(n, k)],  c = correct samples of the item,

computed as the stable product ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``. Standard
errors are the sample standard deviation of the per-item values over sqrt(items).
Samples the sandbox failed to run (``VerifyResult.valid`` False) are excluded: they
say nothing about the policy.

The trainer calls the same ``Evaluator`` during training. On the command line::

    python -m rlpt.eval --workdir=DIR [--adapter=NAME]   # a run's latest checkpoint
    python -m rlpt.eval --workdir=DIR --seed=7          # ... on a second held-out draw
    python -m rlpt.eval --hf=DIR [--adapter=NAME]        # an HF directory or interop ckpt

print a table on standard error and the JSON result as the last line of standard
output. ``--adapter`` picks one of several LoRA adapters trained over the same base.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from rlpt import policy as policy_lib
from rlpt.config import PostTrainConfig, parse_config
from rlpt.roles.multiturn import context_generate_fn, run_episodes
from rlpt.runfiles import atomic_write_json
from rlpt.sampling import (
    DEFAULT_BUCKETS,
    GREEDY,
    SampleOutput,
    Sampler,
    SamplingParams,
    make_sampler,
)
from rlpt.tasks import Domain, Task, VerifyResult
from rlpt.tasks.verifier import Verifier
from rlpt.tokenizers import Tokenizer, decode_response

# "train" (off unless asked for) scores training-partition items the same way: its gap to
# "heldout" shows how much of a domain the policy has memorised rather than learnt.
SPLITS = ("heldout", "ood", "train")
# What the set named "heldout" may be drawn from (``eval.heldout_split``).
HELDOUT_SPLITS = ("heldout", "validation", "test")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct (Chen et al. 2021).

    ``1 - C(n - c, k) / C(n, k)`` as the product ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``,
    which never forms the huge binomials.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if k < 1 or k > n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error (sample std / sqrt(n)); NaN mean for no values."""
    x = np.asarray(values, np.float64)
    if x.size == 0:
        return float("nan"), float("nan")
    if x.size == 1:
        return float(x[0]), 0.0
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))


def complete(
    sampler: Sampler,
    params: Any,
    tokenizer: Tokenizer,
    tasks: Sequence[Task],
    key: jax.Array,
    *,
    sampling: SamplingParams,
    max_new_tokens: int,
    chunk_size: int,
    add_bos: bool = True,
) -> tuple[list[str], np.ndarray]:
    """Completions (decoded text) and truncation flags for ``tasks``, ``chunk_size`` at a time.

    The last chunk is filled up by repeating its last prompt, so every call has the
    same batch shape and the sampler compiles once per prompt bucket.
    """
    _, out = complete_ids(
        sampler, params, tokenizer, tasks, key, sampling=sampling,
        max_new_tokens=max_new_tokens, chunk_size=chunk_size, add_bos=add_bos,
    )  # fmt: skip
    texts = [decode_response(tokenizer, out.tokens[i, : out.lengths[i]]) for i in range(len(tasks))]
    return texts, np.asarray(out.truncated, bool)


def complete_ids(
    sampler: Sampler,
    params: Any,
    tokenizer: Tokenizer,
    tasks: Sequence[Task],
    key: jax.Array,
    *,
    sampling: SamplingParams,
    max_new_tokens: int,
    chunk_size: int,
    add_bos: bool = True,
) -> tuple[list[list[int]], SampleOutput]:
    """``complete``'s prompts (token ids) and its samples, one numpy ``SampleOutput`` row
    per task, for callers that go on from the sampled ids (multi-turn evaluation)."""
    prompts = [tokenizer.encode(t.prompt, add_bos=add_bos) for t in tasks]
    parts = []
    for c, start in enumerate(range(0, len(prompts), chunk_size)):
        chunk = prompts[start : start + chunk_size]
        n = len(chunk)
        chunk = chunk + [chunk[-1]] * (chunk_size - n)
        out = sampler.generate(
            params, chunk, jax.random.fold_in(key, c), max_new_tokens=max_new_tokens,
            sampling=sampling,
        )  # fmt: skip
        parts.append(jax.tree.map(lambda x, n=n: np.asarray(x)[:n], out))
    return prompts, jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


def make_eval_sets(
    domains: Mapping[str, Domain],
    train_max_level: Mapping[str, int],
    *,
    heldout_items: int,
    ood_items: int,
    seed: int,
    train_items: int = 0,
    heldout_split: str = "heldout",
) -> dict[str, dict[str, list[Task]]]:
    """``{split: {domain: tasks}}``: held-out items spread evenly over levels
    ``1..train_max_level[d]``; OOD items at ``train_max_level[d] + 1`` (omitted where
    the domain has no such level); with ``train_items > 0``, training-partition items
    spread over the same levels as the held-out ones. Prompts are distinct within a
    level where its partition allows (``_distinct``).

    ``heldout_split`` is where the set named ``heldout`` draws from: the whole held-out
    partition, or one of its halves (``validation`` while settings are being chosen,
    ``test`` once, for the result). A domain's own out-of-distribution splits
    (``Domain.extra_splits``: held-out compositions, longer programs) get ``ood_items``
    each, over the training levels."""
    counts = {"heldout_items": heldout_items, "ood_items": ood_items, "train_items": train_items}
    for field, count in counts.items():
        if count < 0:
            raise ValueError(f"eval.{field} must be >= 0, got {count}")
    if heldout_split not in HELDOUT_SPLITS:
        raise ValueError(
            f"eval.heldout_split must be one of {HELDOUT_SPLITS}, got {heldout_split!r}"
        )
    sets: dict[str, dict[str, list[Task]]] = {"heldout": {}, "ood": {}}
    if train_items > 0:
        sets["train"] = {}
    for name, domain in domains.items():
        top = int(train_max_level[name])
        sets["heldout"][name] = _over_levels(domain, heldout_split, heldout_items, top, seed)
        if ood_items > 0 and top + 1 <= domain.max_difficulty:
            sets["ood"][name] = _distinct(domain, "ood", ood_items, top + 1, seed)
        if train_items > 0:
            sets["train"][name] = _over_levels(domain, "train", train_items, top, seed)
        for split in domain.extra_splits if ood_items > 0 else ():
            sets.setdefault(split, {})[name] = _over_levels(domain, split, ood_items, top, seed)
    return sets


# Candidates drawn per item wanted when collecting distinct prompts for an evaluation set.
_CANDIDATES_PER_ITEM = 8


def _over_levels(domain: Domain, split: str, n: int, top: int, seed: int) -> list[Task]:
    """``n`` tasks of ``split`` spread evenly over levels ``1..top``, in level order.

    Each level's prompts are distinct (``_distinct``): drawn independently, the demo's
    100 level-1 program_synthesis items were 6 functions, drawn 11 to 20 times each.
    """
    per_level = [n // top + (lvl < n % top) for lvl in range(top)]
    tasks: list[Task] = []
    for lvl, count in enumerate(per_level, start=1):
        tasks += _distinct(domain, split, count, lvl, seed)
    return tasks


def _distinct(domain: Domain, split: str, count: int, level: int, seed: int) -> list[Task]:
    """``count`` tasks of ``split`` at ``level`` with distinct prompts, in the order of
    ``domain.task_stream``; where fewer exist, every one found repeats equally often.

    Repeats sit next to each other (a a b b c c, not a b c a b c): the periodic
    evaluation takes evenly spaced items (``_spread``), and a stride sharing a factor
    with a cyclic period would see only some prompts (every second item of six
    prompts cycled: three of them).
    """
    distinct: dict[str, Task] = {}
    stream = domain.task_stream(split, level, seed)
    for task in itertools.islice(stream, count * _CANDIDATES_PER_ITEM):
        distinct.setdefault(task.prompt, task)
        if len(distinct) == count:
            break
    unique = list(distinct.values())
    if not unique:
        return []
    repeats = [count // len(unique) + (j < count % len(unique)) for j in range(len(unique))]
    return [task for task, r in zip(unique, repeats) for _ in range(r)]


def _by_level(tasks: Sequence[Task], results: Sequence[VerifyResult]) -> dict[str, Any]:
    """Greedy pass@1 per difficulty level: where a domain's score comes from."""
    out: dict[str, Any] = {}
    for level in sorted({t.difficulty for t in tasks}):
        rows = [(t, r) for t, r in zip(tasks, results) if t.difficulty == level]
        ok = [float(r.correct) for _, r in rows if r.valid]
        out[str(level)] = {
            "pass@1": mean_and_stderr(ok)[0],
            "items": len(rows),
            "distinct_items": len({t.prompt for t, _ in rows}),
        }
    return out


def _spread(items: list, n: int) -> list:
    """``n`` items evenly spaced through ``items`` (all of them if there are fewer)."""
    if n >= len(items):
        return items
    return [items[i] for i in np.linspace(0, len(items) - 1, n).round().astype(int)]


class Evaluator:
    """Greedy pass@1 and sampled pass@k per domain and split, plus logged samples.

    With ``turns > 1`` (multi-turn rollouts, ``rlpt.roles.multiturn``) the greedy
    completions of every split but ``train`` also go on for up to ``turns`` turns with
    the verifier's feedback between them: ``pass@1_turns`` is the fraction solved
    within the turns (its first turn is ``pass@1``'s completion), ``mean_turns`` the
    completions sampled per item.
    """

    def __init__(
        self,
        sampler: Sampler,
        tokenizer: Tokenizer,
        verifier: Verifier,
        *,
        max_new_tokens: int,
        chunk_size: int,
        temperature: float = 1.0,
        turns: int = 1,
        feedback_tokens: int = 64,
    ):
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.verifier = verifier
        self.max_new_tokens = max_new_tokens
        self.chunk_size = chunk_size
        self.temperature = temperature
        self.turns = turns
        self.feedback_tokens = feedback_tokens

    def _run(self, params, tasks, key, sampling):
        prompts, out = complete_ids(
            self.sampler, params, self.tokenizer, tasks, key, sampling=sampling,
            max_new_tokens=self.max_new_tokens, chunk_size=self.chunk_size,
        )  # fmt: skip
        texts = [decode_response(self.tokenizer, out.tokens[i, : out.lengths[i]])
                 for i in range(len(tasks))]  # fmt: skip
        results = self.verifier.verify([t.domain for t in tasks], tasks, texts)
        return texts, np.asarray(out.truncated, bool), results, (prompts, out)

    def _run_turns(self, params, tasks, first, first_results, key) -> dict[str, Any]:
        """Greedy multi-turn episodes that start from ``first`` (turn 1's prompts and
        samples) and its verdicts: ``pass@1_turns`` (with its standard error) and
        ``mean_turns``."""
        prompts, out = first
        generate = context_generate_fn(
            self.sampler, params, GREEDY, max_new_tokens=self.max_new_tokens,
            batch_size=self.chunk_size,
        )  # fmt: skip

        def verify(rows, texts):
            picked = [tasks[i] for i in rows]
            return self.verifier.verify([t.domain for t in picked], picked, texts)

        ep = run_episodes(
            generate, verify, self.tokenizer, prompts, key, turns=self.turns,
            max_new_tokens=self.max_new_tokens, feedback_tokens=self.feedback_tokens,
            first=out, first_results=first_results,
        )  # fmt: skip
        ok = [float(s) for s, r in zip(ep.success, ep.results) if r.valid]
        mean, se = mean_and_stderr(ok)
        return {"pass@1_turns": mean, "pass@1_turns_se": se,
                "mean_turns": float(np.mean(ep.turns))}  # fmt: skip

    def evaluate(
        self,
        params: Any,
        eval_sets: Mapping[str, Mapping[str, Sequence[Task]]],
        key: jax.Array,
        *,
        n_samples: int = 0,
        k: int = 1,
        max_items: int | None = None,
        log_samples: int = 0,
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Returns ``(results, samples)``.

        ``results[split][domain]`` has ``pass@1`` (greedy), ``pass@1_se``, ``items``,
        ``sandbox_failures`` and, with ``n_samples >= k``, ``pass@K``, ``pass@K_se``
        and ``sample_pass@1``. ``samples`` holds the first ``log_samples`` greedy
        completions per domain and split with their rewards and outcomes.
        ``max_items`` evaluates that many items of each set, evenly spaced through it
        (the periodic evaluation): sets are ordered by level, so a prefix would see
        only the easiest levels.
        """
        check_sampling(n_samples, k)
        results: dict[str, Any] = {}
        samples: list[dict[str, Any]] = []
        greedy = SamplingParams(greedy=True)
        sampled = SamplingParams(temperature=self.temperature)
        # Domains' own OOD splits come after the common ones, so the common ones keep
        # their keys (and samples) whatever else is evaluated.
        extra = sorted(set(eval_sets) - set(SPLITS))
        for s, split in enumerate((*SPLITS, *extra)):
            results[split] = {}
            for d, (name, tasks) in enumerate(sorted(eval_sets.get(split, {}).items())):
                tasks = _spread(list(tasks), max_items) if max_items else list(tasks)
                if not tasks:
                    continue
                sub = jax.random.fold_in(jax.random.fold_in(key, s), d)
                texts, truncated, res, first = self._run(
                    params, tasks, jax.random.fold_in(sub, 0), greedy
                )
                valid = [r.valid for r in res]
                ok = [float(r.correct) for r in res if r.valid]
                p1, p1_se = mean_and_stderr(ok)
                out: dict[str, Any] = {
                    "pass@1": p1,
                    "pass@1_se": p1_se,
                    "items": len(tasks),
                    # Small levels (one-digit sums, ~10 held-out level-1 functions) repeat
                    # prompts: items are drawn from the held-out partition with replacement.
                    "distinct_items": len({t.prompt for t in tasks}),
                    "sandbox_failures": int(len(valid) - sum(valid)),
                    "truncated": float(np.mean(truncated)),
                    "by_level": _by_level(tasks, res),
                }
                if self.turns > 1 and split != "train":
                    out.update(self._run_turns(
                        params, tasks, first, res, jax.random.fold_in(sub, 2)
                    ))  # fmt: skip
                # Training items only measure the memorisation gap: greedy is enough.
                if n_samples and split != "train":
                    reps = [t for t in tasks for _ in range(n_samples)]
                    _, _, sres, _ = self._run(params, reps, jax.random.fold_in(sub, 1), sampled)
                    per_item, sample_ok = [], []
                    for i in range(len(tasks)):
                        rows = sres[i * n_samples : (i + 1) * n_samples]
                        good = [r for r in rows if r.valid]
                        if len(good) < k:
                            continue
                        c = sum(r.correct for r in good)
                        per_item.append(pass_at_k(len(good), c, k))
                        sample_ok.append(c / len(good))
                    pk, pk_se = mean_and_stderr(per_item)
                    out[f"pass@{k}"] = pk
                    out[f"pass@{k}_se"] = pk_se
                    out["sample_pass@1"] = mean_and_stderr(sample_ok)[0]
                    out["sandbox_failures"] += sum(not r.valid for r in sres)
                results[split][name] = out
                for t, text, r in list(zip(tasks, texts, res))[:log_samples]:
                    samples.append(
                        {
                            "split": split, "domain": name, "task_id": t.id, "prompt": t.prompt,
                            "completion": text, "reward": r.reward, "outcome": r.outcome,
                            "valid": r.valid,
                        }
                    )  # fmt: skip
        return results, samples


def check_sampling(n_samples: int, k: int) -> None:
    """Errors in ``eval.n_samples`` / ``eval.k``.

    ``pass@1`` is the greedy score; with samples, a ``k`` of 1 would report the sampled
    estimate under the same name (it is ``sample_pass@1``), so ``k`` must be at least 2.
    """
    if n_samples < 0:
        raise ValueError(f"eval.n_samples must be >= 0, got {n_samples}")
    if n_samples and k < 2:
        raise ValueError(
            f"eval.k must be >= 2 when eval.n_samples > 0, got {k}: pass@1 is the greedy "
            "score and the sampled pass@1 is reported as sample_pass@1"
        )
    if n_samples and n_samples < k:
        raise ValueError(f"eval.n_samples ({n_samples}) must be >= eval.k ({k})")


def flatten_results(results: Mapping[str, Any], k: int) -> dict[str, float]:
    """``eval/DOMAIN/pass@1``, ``eval/DOMAIN/pass@K`` (held-out), ``eval/DOMAIN/ood/...`` and
    ``eval/DOMAIN/train/...``; multi-turn evaluations add ``.../pass@1_turns`` and
    ``.../mean_turns``."""
    out: dict[str, float] = {}
    for split, by_domain in results.items():
        for name, r in by_domain.items():
            prefix = f"eval/{name}/" if split == "heldout" else f"eval/{name}/{split}/"
            for key in ("pass@1", "pass@1_se", f"pass@{k}", f"pass@{k}_se", "sample_pass@1",
                        "pass@1_turns", "pass@1_turns_se", "mean_turns"):  # fmt: skip
                if key in r:
                    out[prefix + key] = r[key]
            out[prefix + "sandbox_failures"] = r["sandbox_failures"]
    return out


def format_table(results: Mapping[str, Any], k: int) -> str:
    """A readable table: one row per (split, domain)."""
    header = (
        f"{'split':8} {'domain':20} {'items':>5} {'uniq':>5} {'pass@1':>15} {f'pass@{k}':>15} "
        f"{'fail':>4}  pass@1 by level"
    )
    lines = [header, "-" * len(header)]
    for split, by_domain in results.items():
        for name, r in sorted(by_domain.items()):
            p1 = f"{r['pass@1']:.3f}±{r['pass@1_se']:.3f}"
            pk = f"{r[f'pass@{k}']:.3f}±{r[f'pass@{k}_se']:.3f}" if f"pass@{k}" in r else "-"
            by_level = r.get("by_level", {}).items()
            levels = " ".join(f"{lvl}:{v['pass@1']:.2f}" for lvl, v in by_level)
            lines.append(
                f"{split:8} {name:20} {r['items']:>5} {r.get('distinct_items', r['items']):>5} "
                f"{p1:>15} {pk:>15} {r['sandbox_failures']:>4}  {levels}"
            )
    return "\n".join(lines)


def evaluate_hf(
    path: str,
    *,
    adapter: str | None = None,
    domains: Sequence[str],
    max_level: int,
    heldout_items: int,
    ood_items: int,
    n_samples: int,
    k: int,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    train_items: int = 0,
    heldout_split: str = "heldout",
) -> dict[str, Any]:
    """Evaluates a Hugging Face directory or an rlpt interop checkpoint (with ``adapter``)."""
    from rlpt.interop.checkpoint import load_for_sampling

    config = parse_config({
        "trainer": "post_train", "seed": seed, "domains": tuple(domains),
        "train_max_level": {"default": max_level},
        "rollout": {"max_new_tokens": max_new_tokens, "buckets": DEFAULT_BUCKETS},
        "eval": {"heldout_items": heldout_items, "ood_items": ood_items, "train_items": train_items,
                 "n_samples": n_samples, "k": k, "batch_size": batch_size, "seed": seed,
                 "heldout_split": heldout_split},
    })  # fmt: skip
    domain_objs = policy_lib.make_domains(config)
    mcfg, graph, state, tokenizer = load_for_sampling(path, adapter=adapter)
    results = evaluate_policy(config, domain_objs, mcfg, tokenizer, graph, state)
    return {"hf": path, "adapter": adapter, "k": k, "results": results,
            **flatten_results(results, k)}  # fmt: skip


def make_eval_data(config, domains):
    return make_eval_sets(
        domains, policy_lib.train_levels(config, domains), heldout_items=config.eval.heldout_items,
        ood_items=config.eval.ood_items, seed=config.eval.seed,
        train_items=config.eval.train_items, heldout_split=config.eval.heldout_split,
    )  # fmt: skip


# What `evaluate_checkpoint(eval_overrides=...)` may change: the item draw and how each
# item is scored, never which domains or levels (those are the run's own).
EVAL_OVERRIDES = (
    "heldout_split",
    "seed",
    "heldout_items",
    "ood_items",
    "train_items",
    "n_samples",
    "k",
    "batch_size",
)


def evaluate_checkpoint(
    workdir: str, *, adapter: str | None = None, eval_overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Evaluates the policy in ``workdir``'s latest checkpoint with the run's own eval config.

    ``adapter``: a LoRA adapter name (``workdir/adapters/NAME``) or an adapter directory,
    evaluated over the run's frozen base (over its trained policy if the run trained
    full weights) in place of the checkpoint's own adapter.
    ``eval_overrides``: ``config.eval`` fields (of ``EVAL_OVERRIDES``) to change, e.g.
    ``{"seed": 7}`` for a second draw of held-out items.
    """
    overrides = dict(eval_overrides or {})
    unknown = sorted(set(overrides) - set(EVAL_OVERRIDES))
    if unknown:
        raise ValueError(f"eval_overrides: unknown field(s) {unknown}; allowed: {EVAL_OVERRIDES}")
    run = policy_lib.restore_policy(workdir)
    config, mcfg = run.config, run.model_cfg
    if overrides:  # checked as the run's own eval section is
        config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, **overrides))
    graph, params = run.graph, run.params
    if adapter is not None:
        from rlpt.interop.checkpoint import load_adapter

        _, graph, adapter_state = load_adapter(workdir, adapter, mcfg)
        base = run.base if run.base is not None else run.trained
        params = policy_lib.full_policy(adapter_state, base)
    results = evaluate_policy(config, policy_lib.make_domains(config), mcfg, run.tokenizer, graph,
                              params, run.step)  # fmt: skip
    return {"step": run.step, "stage": run.stage, "adapter": adapter, "k": config.eval.k,
            "results": results, **flatten_results(results, config.eval.k)}  # fmt: skip


def evaluate_policy(
    config: PostTrainConfig,
    domains: Mapping[str, Domain],
    model_cfg,
    tokenizer: Tokenizer,
    graph,
    state,
    step: int = 0,
) -> dict[str, Any]:
    """Held-out and OOD results of the policy ``(graph, state)`` under ``config.eval``."""
    pool = None
    if any(d.needs_sandbox for d in domains.values()):
        from rlpt.sandbox import pool_from_config

        pool = pool_from_config(config.sandbox)
    try:
        buckets = tuple(config.rollout.buckets)
        sampler = make_sampler(
            config.rollout.sampler, graph, model_cfg, slots=config.rollout.slots,
            eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, buckets=buckets,
        )  # fmt: skip
        evaluator = Evaluator(sampler, tokenizer, Verifier(domains, pool),
                              max_new_tokens=config.rollout.max_new_tokens,
                              chunk_size=config.eval.batch_size, turns=config.rollout.turns,
                              feedback_tokens=config.rollout.feedback_tokens)  # fmt: skip
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed), 3), step)
        results, _ = evaluator.evaluate(
            state, make_eval_data(config, domains), key, n_samples=config.eval.n_samples,
            k=config.eval.k,
        )  # fmt: skip
    finally:
        if pool is not None:
            pool.close()
    return results


def main(argv: Sequence[str]) -> None:
    from absl import flags, logging

    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    if (_WORKDIR.value is None) == (_HF.value is None):
        raise ValueError("pass exactly one of --workdir and --hf")
    start = time.perf_counter()
    if _WORKDIR.value is not None:
        workdir = _WORKDIR.value
        hf_only = [f"--{n}" for n in ("domains", "max_level", "max_new_tokens", "output")
                   if flags.FLAGS[n].present]  # fmt: skip
        if hf_only:
            raise ValueError(f"{', '.join(hf_only)}: only with --hf (a run keeps its own)")
        # Only the flags given on the command line replace the run's own eval config.
        overrides = {n: flags.FLAGS[n].value for n in EVAL_OVERRIDES
                     if flags.FLAGS[n].present}  # fmt: skip
        result = evaluate_checkpoint(workdir, adapter=_ADAPTER.value, eval_overrides=overrides)
        tag = f"step_{result['step']}" + (f"_{_ADAPTER.value}" if _ADAPTER.value else "")
        tag += "".join(f"_{n}{v}" for n, v in sorted(overrides.items()))
        path = os.path.join(workdir, f"eval_{tag.replace(os.sep, '_')}.json")
    else:
        result = evaluate_hf(
            _HF.value, adapter=_ADAPTER.value, domains=_DOMAINS.value, max_level=_MAX_LEVEL.value,
            heldout_items=_HELDOUT.value, ood_items=_OOD.value, n_samples=_N_SAMPLES.value,
            k=_K.value, max_new_tokens=_MAX_NEW.value, batch_size=_BATCH.value, seed=_SEED.value,
            train_items=_TRAIN.value, heldout_split=_HELDOUT_SPLIT.value,
        )  # fmt: skip
        path = _OUTPUT.value
    k = result["k"]
    print(format_table(result["results"], k), file=sys.stderr, flush=True)
    result["time/eval_s"] = time.perf_counter() - start
    if path:
        atomic_write_json(path, result, indent=2, sort_keys=True)
        logging.info("Wrote %s", path)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    from absl import app, flags

    _WORKDIR = flags.DEFINE_string("workdir", None, "A post_train run directory.")
    _HF = flags.DEFINE_string(
        "hf", None, "A Hugging Face model directory or an rlpt interop checkpoint."
    )
    _ADAPTER = flags.DEFINE_string(
        "adapter", None,
        "A LoRA adapter by name (DIR/adapters/NAME) or an adapter directory.",
    )  # fmt: skip
    # With --hf these set the evaluation; with --workdir the run's own config does, and
    # --heldout_split, --seed, --heldout_items, --ood_items, --train_items, --n_samples, --k,
    # --batch_size replace it where given (the rest are --hf only).
    _DOMAINS = flags.DEFINE_list(
        "domains", ["arithmetic", "stepwise_math", "program_synthesis"], "Domains to evaluate."
    )
    _MAX_LEVEL = flags.DEFINE_integer("max_level", 2, "Held-out levels 1..N; OOD at N + 1.")
    _HELDOUT = flags.DEFINE_integer("heldout_items", 200, "Held-out items per domain.")
    _HELDOUT_SPLIT = flags.DEFINE_enum(
        "heldout_split", "heldout", list(HELDOUT_SPLITS),
        "Draw the held-out items from the whole held-out partition or from one half: "
        "'validation' (where settings are chosen) or 'test' (the reported result).",
    )  # fmt: skip
    _OOD = flags.DEFINE_integer("ood_items", 100, "OOD items per domain.")
    _TRAIN = flags.DEFINE_integer(
        "train_items", 0,
        "Training-partition items per domain, scored greedily beside the held-out ones: the "
        "gap between the two is what the policy memorised.",
    )  # fmt: skip
    _N_SAMPLES = flags.DEFINE_integer("n_samples", 4, "Samples per item for pass@k.")
    _K = flags.DEFINE_integer(
        "k", 4, "k of pass@k, at least 2 (the sampled pass@1 is reported as sample_pass@1)."
    )
    _MAX_NEW = flags.DEFINE_integer("max_new_tokens", 40, "Generation length.")
    _BATCH = flags.DEFINE_integer("batch_size", 200, "Sequences per generate call.")
    _SEED = flags.DEFINE_integer(
        "seed", 1234, "Seed of the item draw (with --hf, of the samples too)."
    )
    _OUTPUT = flags.DEFINE_string("output", None, "With --hf: also write the JSON here.")
    app.run(main)
