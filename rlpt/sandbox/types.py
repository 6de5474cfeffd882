"""The data that crosses the sandbox boundary: what to run and what happened.

These types are the contract between the sandbox pool and its users (task
domains, rewards, the trainer). They are plain, picklable and JSON-friendly.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class Status(enum.StrEnum):
    """Outcome of one program run. Only ``PASSED`` counts as a pass."""

    PASSED = "passed"
    FAILED = "failed"  # a test or assertion failed, or stdout did not match
    SYNTAX_ERROR = "syntax_error"
    RUNTIME_ERROR = "runtime_error"  # uncaught exception or death by signal
    TIMEOUT = "timeout"  # wall-clock or CPU time exhausted
    MEMORY_LIMIT = "memory_limit"  # MemoryError or address-space limit hit
    OUTPUT_LIMIT = "output_limit"  # stdout/stderr passed the byte cap
    SANDBOX_ERROR = "sandbox_error"  # the sandbox itself failed: not the program's fault


@dataclasses.dataclass(frozen=True)
class IOCase:
    """One stdin/stdout case for competitive-programming style judging."""

    stdin: str
    expected_stdout: str
    # "exact" compares bytes; "whitespace" compares whitespace-separated tokens.
    match: str = "whitespace"


@dataclasses.dataclass(frozen=True)
class ExecutionRequest:
    """A program to run in isolation.

    ``code`` runs first; ``tests`` (Python source, assertions) run after it in
    the same interpreter. A run passes only if execution reaches a secret
    sentinel placed after the last statement. With ``io_cases`` the program is
    run once per case with that stdin and its stdout compared in the parent.
    ``timeout_s`` / ``memory_mb`` of None take the pool's defaults.
    """

    code: str
    tests: str | None = None
    io_cases: tuple[IOCase, ...] = ()
    id: str = ""
    timeout_s: float | None = None
    memory_mb: int | None = None


@dataclasses.dataclass
class ExecutionResult:
    """What happened to one ``ExecutionRequest``."""

    id: str
    status: Status
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    signal: int | None = None
    duration_s: float = 0.0
    peak_memory_mb: float | None = None
    exception: str | None = None  # uncaught exception type name, when known
    isolation: str = ""  # e.g. "full" or a list of the protections missing
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == Status.PASSED

    @property
    def valid(self) -> bool:
        """False when the sandbox failed, so the sample is excluded, not scored 0."""
        return self.status != Status.SANDBOX_ERROR

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["status"] = self.status.value
        return out
