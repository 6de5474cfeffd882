"""Command line: ``python -m rlpt.sandbox run-jsonl IN.jsonl [--workers=N] [--timeout_s=S]``.

Reads lines ``{"id": ..., "code": ..., "tests": optional, "io_cases": optional, "timeout_s":
optional, "memory_mb": optional}`` and writes one JSON result per line to stdout, in input
order, as soon as each one and all before it are done. ``--timeout_s`` and ``--memory_mb`` are
ceilings: a line may ask for less, never more. A line that is not a valid request is answered
with ``{"id": ..., "line": N, "status": "error", "error": "line N: ..."}`` and the rest still
run. Logs go to stderr.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from absl import app, flags, logging

from rlpt.sandbox.pool import SandboxPool
from rlpt.sandbox.types import ExecutionRequest, IOCase

_WORKERS = flags.DEFINE_integer("workers", 4, "Programs run at once.")
_TIMEOUT_S = flags.DEFINE_float("timeout_s", 2.0, "Ceiling on a run's wall-clock time, seconds.")
_MEMORY_MB = flags.DEFINE_integer("memory_mb", 256, "Ceiling on a run's memory, MiB.")
_OUTPUT_LIMIT = flags.DEFINE_integer("output_limit_bytes", 64_000, "Cap on stdout and stderr.")
_TRACE = flags.DEFINE_string("trace_path", None, "Append execution traces to this JSONL file.")
_ALLOW_UNISOLATED = flags.DEFINE_bool(
    "allow_unisolated", False, "Run even where the machine cannot isolate programs fully."
)

_USAGE = "usage: python -m rlpt.sandbox run-jsonl IN.jsonl [--workers=N] [--timeout_s=S]"
_FIELDS = {"id", "code", "tests", "io_cases", "timeout_s", "memory_mb"}


def _request(line: Any) -> ExecutionRequest:
    """The request on one input line; ValueError or TypeError naming the bad field."""
    if not isinstance(line, dict):
        raise ValueError(f"expected a JSON object, got {type(line).__name__}")
    unknown = sorted(set(line) - _FIELDS)
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} (known: {', '.join(sorted(_FIELDS))})")
    if "code" not in line:
        raise ValueError("missing field 'code'")
    cases = line.get("io_cases") or []
    if not isinstance(cases, list):
        raise ValueError("io_cases must be a list of objects")
    parsed = []
    for i, c in enumerate(cases):
        if not isinstance(c, dict):
            raise ValueError(f"io_cases[{i}] must be an object")
        extra = sorted(set(c) - {"stdin", "expected_stdout", "match"})
        if extra or not {"stdin", "expected_stdout"} <= set(c):
            bad = extra[0] if extra else sorted({"stdin", "expected_stdout"} - set(c))[0]
            raise ValueError(f"io_cases[{i}]: bad or missing key {bad!r}")
        parsed.append(IOCase(**c))
    return ExecutionRequest(
        code=line["code"],
        tests=line.get("tests"),
        io_cases=tuple(parsed),
        id=str(line.get("id", "")),
        timeout_s=line.get("timeout_s"),
        memory_mb=line.get("memory_mb"),
    )


def _error(number: int, line_id: Any, why: str) -> dict[str, Any]:
    return {"id": line_id, "line": number, "status": "error", "error": f"line {number}: {why}"}


def run_jsonl(path: str) -> None:
    requests: list[ExecutionRequest] = []
    # Output slot i holds either a request's position in ``requests`` or a finished error.
    slots: list[int | dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            line_id = None
            try:
                line = json.loads(text)
                if isinstance(line, dict) and "id" in line:
                    line_id = str(line["id"])
                req = _request(line)
            except (ValueError, TypeError) as e:
                logging.warning("line %d: %s", number, e)
                slots.append(_error(number, line_id, str(e)))
                continue
            slots.append(len(requests))
            requests.append(req)
    with SandboxPool(
        workers=_WORKERS.value,
        timeout_s=_TIMEOUT_S.value,
        memory_mb=_MEMORY_MB.value,
        output_limit_bytes=_OUTPUT_LIMIT.value,
        trace_path=_TRACE.value,
        require_isolation=not _ALLOW_UNISOLATED.value,
    ) as pool:
        logging.info(
            "running %d programs on %d workers (isolation: %s)",
            len(requests),
            _WORKERS.value,
            pool.isolation,
        )
        done: dict[int, dict[str, Any]] = {}
        next_out = 0

        def flush() -> None:
            nonlocal next_out
            while next_out < len(slots):
                slot = slots[next_out]
                if isinstance(slot, int):
                    if slot not in done:
                        return
                    slot = done.pop(slot)
                sys.stdout.write(json.dumps(slot) + "\n")
                sys.stdout.flush()
                next_out += 1

        flush()
        for res in pool.as_completed(requests):
            done[res.details["index"]] = res.to_json()
            flush()


def main(argv: Sequence[str]) -> None:
    args = list(argv[1:])
    if len(args) != 2 or args[0] != "run-jsonl":
        raise app.UsageError(_USAGE)
    run_jsonl(args[1])


if __name__ == "__main__":
    app.run(main)
