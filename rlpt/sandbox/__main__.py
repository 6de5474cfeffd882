"""Command line: ``python -m rlpt.sandbox run-jsonl IN.jsonl [--workers=N] [--timeout_s=S]``.

Reads lines ``{"id": ..., "code": ..., "tests": optional, "io_cases": optional}`` and writes
one JSON result per line to stdout, in input order, as soon as each one and all before it
are done. Logs go to stderr.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from absl import app, flags, logging

from rlpt.sandbox.pool import SandboxPool
from rlpt.sandbox.types import ExecutionRequest, IOCase

_WORKERS = flags.DEFINE_integer("workers", 4, "Programs run at once.")
_TIMEOUT_S = flags.DEFINE_float("timeout_s", 2.0, "Wall-clock limit per run, seconds.")
_MEMORY_MB = flags.DEFINE_integer("memory_mb", 256, "Address-space limit per run, MiB.")
_OUTPUT_LIMIT = flags.DEFINE_integer("output_limit_bytes", 64_000, "Cap on stdout and stderr.")
_TRACE = flags.DEFINE_string("trace_path", None, "Append execution traces to this JSONL file.")

_USAGE = "usage: python -m rlpt.sandbox run-jsonl IN.jsonl [--workers=N] [--timeout_s=S]"


def _request(line: dict) -> ExecutionRequest:
    cases = tuple(IOCase(**c) for c in line.get("io_cases") or ())
    return ExecutionRequest(
        code=line["code"],
        tests=line.get("tests"),
        io_cases=cases,
        id=str(line.get("id", "")),
        timeout_s=line.get("timeout_s"),
        memory_mb=line.get("memory_mb"),
    )


def run_jsonl(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(s) for s in f if s.strip()]
    requests = [_request(line) for line in lines]
    with SandboxPool(
        workers=_WORKERS.value,
        timeout_s=_TIMEOUT_S.value,
        memory_mb=_MEMORY_MB.value,
        output_limit_bytes=_OUTPUT_LIMIT.value,
        trace_path=_TRACE.value,
    ) as pool:
        logging.info(
            "running %d programs on %d workers (isolation: %s)",
            len(requests),
            _WORKERS.value,
            pool.isolation,
        )
        done, next_out = {}, 0
        for res in pool.as_completed(requests):
            done[res.details["index"]] = res
            while next_out in done:
                sys.stdout.write(json.dumps(done.pop(next_out).to_json()) + "\n")
                sys.stdout.flush()
                next_out += 1


def main(argv: Sequence[str]) -> None:
    args = list(argv[1:])
    if len(args) != 2 or args[0] != "run-jsonl":
        raise app.UsageError(_USAGE)
    run_jsonl(args[1])


if __name__ == "__main__":
    app.run(main)
