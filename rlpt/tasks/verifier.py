"""Verdicts on completions: each domain's verifier, with sandboxed domains run in a pool.

Training (the reward role) and evaluation both score completions through this one
class, so a completion is judged the same way wherever it comes from.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

from rlpt.tasks.base import Domain, Task, VerifyResult


class Verifier:
    """Scores completions with their domains' verifiers, one batch call per domain.

    Sandbox domains get ``pool``; their results are cached by (domain, prompt,
    completion), since greedy decoding and repeated prompts resubmit the same
    program, and a program's verdict on fixed tests does not change.
    """

    def __init__(self, domains: Mapping[str, Domain], pool: Any = None, cache_size: int = 200_000):
        self.domains = dict(domains)
        self.pool = pool
        self.cache_size = cache_size
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self.sandbox_calls = 0

    def verify(
        self, domain_names: Sequence[str], tasks: Sequence[Task], completions: Sequence[str]
    ) -> list[VerifyResult]:
        """``VerifyResult`` per (task, completion); ``domain_names[i]`` picks the verifier.

        In a multi-process run every process passes the same rows, verifies its own
        contiguous share of them (its own sandbox pool runs that share's code) and
        receives the others' verdicts.
        """
        from rlpt.parallel.multihost import allgather_json, process_rows, trainer_process_count

        if trainer_process_count() == 1:
            return self._verify(domain_names, tasks, completions)
        from rlpt.metrics import to_json_value

        rows = process_rows(len(tasks))
        mine = self._verify(
            [domain_names[i] for i in rows], [tasks[i] for i in rows],
            [completions[i] for i in rows],
        )  # fmt: skip
        gathered = allgather_json([
            {"reward": float(r.reward), "outcome": r.outcome, "valid": bool(r.valid),
             "details": to_json_value(r.details)}
            for r in mine
        ])  # fmt: skip
        return [VerifyResult(**r) for r in gathered]

    def _verify(self, domain_names, tasks, completions) -> list[VerifyResult]:
        results: list[VerifyResult | None] = [None] * len(tasks)
        by_domain: dict[str, list[int]] = collections.defaultdict(list)
        for i, name in enumerate(domain_names):
            by_domain[name].append(i)
        for name, rows in by_domain.items():
            domain = self.domains[name]
            if not domain.needs_sandbox:
                out = domain.verify_batch([tasks[i] for i in rows], [completions[i] for i in rows])
                for i, r in zip(rows, out):
                    results[i] = r
                continue
            todo: dict[tuple, list[int]] = {}
            for i in rows:
                key = (name, tasks[i].prompt, completions[i])
                if key in self._cache:
                    results[i] = self._cache[key]
                else:
                    todo.setdefault(key, []).append(i)
            if todo:
                first = [idx[0] for idx in todo.values()]
                out = domain.verify_batch(
                    [tasks[i] for i in first], [completions[i] for i in first], pool=self.pool
                )
                self.sandbox_calls += len(first)
                for (key, idx), r in zip(todo.items(), out):
                    for i in idx:
                        results[i] = r
                    if r.valid:  # a sandbox failure may not recur: never cache it
                        self._cache[key] = r
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return results
