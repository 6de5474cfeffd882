"""Preference pairs: from users' JSONL files and from verifier or sandbox traces.

A user file holds one JSON object per line with string fields ``prompt``,
``chosen`` and ``rejected`` (optional: ``margin``, a number, and ``domain``).
A trace file holds one sampled completion per line with ``task_id``,
``domain``, ``prompt``, ``completion`` and ``outcome`` (a ``VerifyResult``
outcome) or ``status`` (a sandbox status); two completions of one prompt with
different outcomes make a pair, the correct one chosen.

Bad records (invalid JSON, missing or non-string fields, empty completions,
and at encoding time prompts longer than the context) raise a ``ValueError``
naming the file and line under ``on_error="raise"``, or are skipped and counted
by reason under ``on_error="skip"``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

ON_ERROR = ("raise", "skip")
# Outcomes that say the completion was right; "sandbox_error" says nothing about it.
_CORRECT = ("correct", "passed")
_UNJUDGED = ("sandbox_error",)


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str
    margin: float = 0.0
    domain: str = ""


@dataclasses.dataclass
class SkipCounts:
    """Records skipped under ``on_error="skip"``, by reason."""

    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, reason: str) -> None:
        self.counts[reason] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")


def _read_jsonl(path: str, on_error: str, skipped: SkipCounts) -> Iterable[tuple[int, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                if on_error == "raise":
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
                skipped.add("invalid_json")


def parse_preference(record: Any) -> PreferencePair:
    """One user record to a pair; raises ``ValueError`` saying what is wrong."""
    if not isinstance(record, Mapping):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
    if missing:
        raise ValueError(f"missing field(s) {missing}")
    for key in ("prompt", "chosen", "rejected"):
        if not isinstance(record[key], str):
            raise ValueError(f"field {key!r} must be a string, got {type(record[key]).__name__}")
    for key in ("chosen", "rejected"):
        if not record[key].strip():
            raise ValueError(f"field {key!r} is an empty completion")
    margin = record.get("margin", 0.0)
    if not isinstance(margin, int | float) or not np.isfinite(margin):
        raise ValueError(f"field 'margin' must be a finite number, got {margin!r}")
    return PreferencePair(
        record["prompt"], record["chosen"], record["rejected"], float(margin),
        str(record.get("domain", "")),
    )  # fmt: skip


def _reason(message: str) -> str:
    if message.startswith("missing"):
        return "missing_field"
    if "empty completion" in message:
        return "empty_completion"
    return "bad_field"


def load_preferences(
    path: str, *, on_error: str = "raise"
) -> tuple[list[PreferencePair], SkipCounts]:
    """Pairs from a user JSONL file, and what was skipped (see the module docstring)."""
    return _load_records(path, parse_preference, on_error)


@dataclasses.dataclass(frozen=True)
class Trace:
    """One judged completion: a verifier result or a sandbox run."""

    task_id: str
    domain: str
    prompt: str
    completion: str
    outcome: str

    @property
    def correct(self) -> bool:
        return self.outcome in _CORRECT


def parse_trace(record: Any) -> Trace:
    if not isinstance(record, Mapping):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("task_id", "prompt", "completion") if k not in record]
    if "outcome" not in record and "status" not in record:
        missing.append("outcome/status")
    if missing:
        raise ValueError(f"missing field(s) {missing}")
    outcome = record.get("outcome", record.get("status"))
    for key, value in (("prompt", record["prompt"]), ("completion", record["completion"])):
        if not isinstance(value, str):
            raise ValueError(f"field {key!r} must be a string, got {type(value).__name__}")
    if not record["completion"].strip():
        raise ValueError("field 'completion' is an empty completion")
    return Trace(
        str(record["task_id"]), str(record.get("domain", "")), record["prompt"],
        record["completion"], str(outcome),
    )  # fmt: skip


def load_traces(path: str, *, on_error: str = "raise") -> tuple[list[Trace], SkipCounts]:
    """Traces from a JSONL file (verifier or ``rlpt.sandbox`` output joined with its requests)."""
    return _load_records(path, parse_trace, on_error)


def _load_records(path: str, parse, on_error: str) -> tuple[list, SkipCounts]:
    """Parse every JSONL record; a bad one raises (naming file and line) or is skipped."""
    _check_on_error(on_error)
    skipped = SkipCounts()
    parsed = []
    for lineno, record in _read_jsonl(path, on_error, skipped):
        try:
            parsed.append(parse(record))
        except ValueError as e:
            if on_error == "raise":
                raise ValueError(f"{path}:{lineno}: {e}") from None
            skipped.add(_reason(str(e)))
    return parsed, skipped


def traces_from_results(tasks, completions: Sequence[str], results) -> list[Trace]:
    """Traces from ``Domain.verify_batch`` inputs and outputs (invalid results dropped)."""
    return [
        Trace(t.id, t.domain, t.prompt, c, r.outcome if r.valid else "sandbox_error")
        for t, c, r in zip(tasks, completions, results)
    ]


def pairs_from_traces(
    traces: Sequence[Trace], *, max_pairs_per_prompt: int = 4
) -> list[PreferencePair]:
    """Pairs of one prompt's completions with different outcomes, the correct one chosen.

    Completions of one task are grouped by ``(domain, task_id, prompt)``;
    duplicate texts and unjudged traces (sandbox failures) are dropped; pairs are
    taken in trace order, round-robin over the correct ones so a prompt with one
    right and many wrong answers contributes varied rejections, up to
    ``max_pairs_per_prompt`` per prompt.
    """
    groups: dict[tuple[str, str, str], tuple[list[str], list[str]]] = {}
    for tr in traces:
        if tr.outcome in _UNJUDGED:
            continue
        good, bad = groups.setdefault((tr.domain, tr.task_id, tr.prompt), ([], []))
        bucket = good if tr.correct else bad
        if tr.completion not in bucket:
            bucket.append(tr.completion)
    pairs = []
    for (domain, _, prompt), (good, bad) in groups.items():
        if not good or not bad:
            continue
        combos = [(good[i % len(good)], b) for i, b in enumerate(bad)]
        combos += [(g, b) for g, b in itertools.product(good, bad) if (g, b) not in combos]
        for g, b in combos[:max_pairs_per_prompt]:
            pairs.append(PreferencePair(prompt, g, b, 0.0, domain))
    return pairs


@dataclasses.dataclass(frozen=True)
class PairArrays:
    """Encoded pairs, right-padded: row i of ``chosen`` and ``rejected`` is pair i."""

    chosen: np.ndarray  # [N, L] int32
    chosen_mask: np.ndarray  # [N, L] bool
    rejected: np.ndarray  # [N, L] int32
    rejected_mask: np.ndarray  # [N, L] bool
    margin: np.ndarray  # [N] float32
    domains: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.margin)


def encode_sequence(tokenizer, prompt: str, completion: str) -> list[int]:
    """``<bos> prompt completion <eos>``: the layout policy, RM and PRM all read."""
    return tokenizer.encode(prompt, add_bos=True) + tokenizer.encode(completion, add_eos=True)


def pad_rows(rows: Sequence[Sequence[int]], length: int, pad_id: int):
    """Right-pad ``rows`` to ``length``: tokens [N, length] int32 and mask [N, length] bool."""
    tokens = np.full((len(rows), length), pad_id, np.int32)
    mask = np.zeros((len(rows), length), bool)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
        mask[i, : len(row)] = True
    return tokens, mask


def encode_pairs(
    pairs: Sequence[PreferencePair],
    tokenizer,
    max_len: int,
    *,
    on_error: str = "raise",
    pad_to: int | None = None,
) -> tuple[PairArrays, SkipCounts]:
    """Tokenise pairs; a pair longer than ``max_len`` (the model's context) raises or is skipped.

    ``pad_to`` fixes the padded length (a shape bucket, so jit compiles once).
    """
    _check_on_error(on_error)
    skipped = SkipCounts()
    chosen, rejected, margins, domains = [], [], [], []
    for i, p in enumerate(pairs):
        c = encode_sequence(tokenizer, p.prompt, p.chosen)
        r = encode_sequence(tokenizer, p.prompt, p.rejected)
        longest = max(len(c), len(r))
        if longest > max_len:
            if on_error == "raise":
                raise ValueError(
                    f"pair {i}: {longest} tokens exceed the model's context of {max_len} "
                    f"(model.max_seq_len); shorten it or use on_error='skip'"
                )
            skipped.add("too_long")
            continue
        chosen.append(c)
        rejected.append(r)
        margins.append(p.margin)
        domains.append(p.domain)
    length = pad_to or max([len(x) for x in chosen + rejected], default=1)
    if pad_to is not None and any(len(x) > pad_to for x in chosen + rejected):
        raise ValueError(f"pad_to={pad_to} is shorter than an encoded pair")
    c_tok, c_mask = pad_rows(chosen, length, tokenizer.pad_id)
    r_tok, r_mask = pad_rows(rejected, length, tokenizer.pad_id)
    arrays = PairArrays(
        c_tok, c_mask, r_tok, r_mask, np.asarray(margins, np.float32), tuple(domains)
    )
    return arrays, skipped
