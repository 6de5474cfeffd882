"""The data that crosses the sandbox boundary: what to run and what happened.

These types are the contract between the sandbox pool and its users (task
domains, rewards, the trainer). They are plain, picklable and JSON-friendly.
"""

from __future__ import annotations

import dataclasses
import enum
import math
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

    def __post_init__(self) -> None:
        for name in ("stdin", "expected_stdout"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"io_cases.{name} must be a string, got {getattr(self, name)!r}")
        if self.match not in ("exact", "whitespace"):
            raise ValueError(f"io_cases.match must be 'exact' or 'whitespace', got {self.match!r}")


@dataclasses.dataclass(frozen=True)
class ExecutionRequest:
    """A program to run in isolation.

    ``code`` runs first; ``tests`` (Python source, assertions) run after it, and
    a run with tests passes only if they all hold. With ``io_cases`` the program
    is run once per case with that stdin and its stdout compared in the parent.
    With neither, a run passes if the program runs to its end.
    ``timeout_s`` / ``memory_mb`` of None take the pool's limits; the pool's limits are
    ceilings, so a request may ask for less, never more. Invalid values raise at once, naming
    the field.

    With ``tests``, the tests run in a separate checker process that the program cannot
    reach: they see the program's global functions as stubs that call into it and bring back
    plain values (None, bool, int, float, complex, str, bytes, and lists, tuples, sets,
    frozensets and dicts of them), its plain global values as copies, and the modules it
    imported. A function that returns anything else fails the test that called it.
    """

    code: str
    tests: str | None = None
    io_cases: tuple[IOCase, ...] = ()
    id: str = ""
    timeout_s: float | None = None
    memory_mb: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.code, str):
            raise TypeError(f"code must be a string, got {type(self.code).__name__}")
        if self.tests is not None and not isinstance(self.tests, str):
            raise TypeError(f"tests must be a string or None, got {type(self.tests).__name__}")
        cases = tuple(self.io_cases)
        if not all(isinstance(c, IOCase) for c in cases):
            raise TypeError("io_cases must hold IOCase values")
        object.__setattr__(self, "io_cases", cases)
        if self.timeout_s is not None:
            t = self.timeout_s
            if (
                isinstance(t, bool)
                or not isinstance(t, int | float)
                or not math.isfinite(t)
                or t <= 0
            ):
                raise ValueError(f"timeout_s must be a positive number of seconds, got {t!r}")
        if self.memory_mb is not None:
            m = self.memory_mb
            if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
                raise ValueError(f"memory_mb must be a positive integer, got {m!r}")


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
