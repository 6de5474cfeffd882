"""Code domains: completions are programs judged in the sandbox.

Three ways to judge a program, each one ``ExecutionRequest``:

- assertion tests (``tests=``): passes if every assertion holds;
- stdin/stdout cases (``io_cases=``): competitive-programming style;
- returned values (``output_request``): a harness calls the function on hidden
  inputs and prints a canonical serialisation of each result; the parent
  compares those strings with its own.

Assertion tests and the harness run in the sandbox's checker process, never in
the program's interpreter (see ``rlpt.sandbox.ExecutionRequest``): the
program's functions are called across a pipe and only values of exact built-in
types come back, so an object whose ``__eq__`` always says True, a patched
builtin or a forged exit cannot pass.

``CodeDomain.verify_batch`` sends all completions of a batch to the pool in one
``run_batch``. When the pool keeps a trace log (``trace_path`` set) or
``trace=True``, it passes per-request metadata (task id, domain, prompt,
completion) for that log.
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rlpt.sandbox.types import ExecutionRequest, ExecutionResult, IOCase, Status
from rlpt.tasks.base import (
    ANSWER,
    Domain,
    Task,
    VerifyResult,
    _check_lengths,
    _cut_end_markers,
    check_split,
    heldout_half,
    partition_of,
)

_FEEDBACK_CHARS = 400


def canonical_repr(
    value: Any,
    _type=type,
    _bool=bool,
    _int=int,
    _float=float,
    _str=str,
    _none=None.__class__,
    _list=list,
    _tuple=tuple,
    _dict=dict,
    _set=set,
    _frozenset=frozenset,
    _int_repr=int.__repr__,
    _float_repr=float.__repr__,
    _str_repr=str.__repr__,
    _sorted=sorted,
    _len=len,
) -> str:
    """A canonical string for a value made only of exact built-in types.

    Runs inside the sandbox too (its source is sent with the harness), where the
    defaults bind the real built-ins before the untrusted program can rebind
    them. Exact type checks (``type(v) is int``) reject subclasses, so a
    program cannot smuggle in its own ``__eq__``, ``__repr__`` or ``__iter__``.
    """
    t = _type(value)
    if t is _bool:
        return "True" if value else "False"
    if t is _int:
        return _int_repr(value)
    if t is _float:
        return _float_repr(value)
    if t is _str:
        return _str_repr(value)
    if t is _none:
        return "None"
    if t is _list:
        return "[" + ", ".join([canonical_repr(v) for v in value]) + "]"
    if t is _tuple:
        items = [canonical_repr(v) for v in value]
        return "(" + ", ".join(items) + ("," if _len(items) == 1 else "") + ")"
    if t is _set or t is _frozenset:
        return t.__name__ + "{" + ", ".join(_sorted([canonical_repr(v) for v in value])) + "}"
    if t is _dict:
        pairs = [canonical_repr(k) + ": " + canonical_repr(v) for k, v in value.items()]
        return "{" + ", ".join(_sorted(pairs)) + "}"
    raise TypeError("cannot serialise a value of type " + t.__name__)


def completion_code(completion: str) -> str:
    """The program in a completion: the text after the last ``<answer>``, else all of it.

    Only trailing whitespace is stripped: leading indentation is code.
    """
    pos = completion.rfind(ANSWER)
    code = completion if pos < 0 else completion[pos + len(ANSWER) :]
    return _cut_end_markers(code).rstrip()


def function_source(answer: str, entry_point: str) -> str:
    """Source defining ``entry_point`` from an answer that is an expression or statements.

    An expression (``lambda x: 3*x+1``) is bound to the name; anything else is
    run as written and must define it (``def f(x): ...``). Compiling here only
    parses, it runs nothing.
    """
    answer = answer.strip()
    try:
        compile(answer, "<answer>", "eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return answer + "\n"
    return f"{entry_point} = (\n{answer}\n)\n"


def assert_request(
    code: str, tests: str, *, id: str = "", timeout_s: float | None = None
) -> ExecutionRequest:
    """A request that runs ``code`` then assertion ``tests``; passes if all hold."""
    return ExecutionRequest(code=code, tests=tests, id=id, timeout_s=timeout_s)


def io_request(
    code: str,
    cases: Sequence[IOCase | Mapping[str, str] | tuple[str, str]],
    *,
    id: str = "",
    timeout_s: float | None = None,
    match: str = "whitespace",
) -> ExecutionRequest:
    """A request that runs ``code`` once per stdin/stdout case."""
    return ExecutionRequest(
        code=code, io_cases=tuple(_io_case(c, match) for c in cases), id=id, timeout_s=timeout_s
    )


def _io_case(case: IOCase | Mapping[str, str] | tuple[str, str], match: str) -> IOCase:
    if isinstance(case, IOCase):
        return case
    if isinstance(case, Mapping):
        return IOCase(case["stdin"], case["expected_stdout"], case.get("match", match))
    stdin, expected = case
    return IOCase(stdin, expected, match)


def output_request(
    code: str,
    entry_point: str,
    inputs: Sequence[Sequence[Any]],
    *,
    id: str = "",
    timeout_s: float | None = None,
    seed: int = 0,
) -> tuple[ExecutionRequest, str]:
    """A request that calls ``entry_point(*args)`` per input and prints canonical results.

    Returns the request and the marker that starts the harness's result line
    (pass both to ``read_outputs``). ``inputs`` must be JSON-serialisable. The
    harness is the request's ``tests``, so it runs in the sandbox's checker
    process: the program sees only the arguments of each call, never the marker,
    and its results reach ``canonical_repr`` as plain values.
    """
    marker = f"@@rlpt-results-{random.Random(seed).getrandbits(64):016x}@@"
    tests = (
        "import json as _rlpt_json\n"
        "from typing import Any\n" + inspect.getsource(canonical_repr) + "_rlpt_out = []\n"
        f"for _rlpt_args in _rlpt_json.loads({json.dumps(json.dumps(list(inputs)))}):\n"
        "    try:\n"
        f"        _rlpt_out.append(['ok', canonical_repr({entry_point}(*_rlpt_args))])\n"
        "    except Exception as _rlpt_e:\n"
        "        _rlpt_out.append(['error', type(_rlpt_e).__name__])\n"
        f"print('\\n{marker}' + _rlpt_json.dumps(_rlpt_out), flush=True)\n"
    )
    return ExecutionRequest(code=code, tests=tests, id=id, timeout_s=timeout_s), marker


def read_outputs(result: ExecutionResult, marker: str) -> list[list[str]] | None:
    """The harness's ``[["ok", repr] | ["error", type], ...]`` from stdout, or None."""
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith(marker)]
    if not lines:
        return None
    try:
        out = json.loads(lines[-1][len(marker) :])
    except json.JSONDecodeError:
        return None
    if not isinstance(out, list) or not all(
        isinstance(o, list) and len(o) == 2 and all(isinstance(s, str) for s in o) for o in out
    ):
        return None
    return out


def sandbox_result(result: ExecutionResult, **details: Any) -> VerifyResult | None:
    """The VerifyResult for a run that did not pass, or None if it passed.

    A sandbox failure is invalid (the sample is dropped); any other failure
    scores zero, with ``wrong`` for failed tests and otherwise the status as
    outcome, and the error output as feedback.
    """
    if result.status == Status.PASSED:
        return None
    info = {
        "status": result.status.value,
        "exception": result.exception,
        "feedback": _feedback(result),
        "pass_rate": 0.0,
        **details,
    }
    # A failed test is an ordinary wrong answer; other statuses name what went wrong.
    outcome = "wrong" if result.status == Status.FAILED else result.status.value
    return VerifyResult(0.0, outcome, result.valid, info)


def _feedback(result: ExecutionResult) -> str:
    reason = result.details.get("message") or result.details.get("reason") or ""
    text = (result.stderr or result.stdout or reason or "").strip()
    if len(text) > _FEEDBACK_CHARS:
        text = "..." + text[-_FEEDBACK_CHARS:]
    return f"{result.status.value}: {text}" if text else result.status.value


class CodeDomain(Domain):
    """A domain whose completions run in the sandbox.

    Subclasses implement ``build_request`` and ``score``; this class batches the
    requests into one ``run_batch``. ``pool`` (here or per call) is anything
    with ``run_batch(requests, deadline_s=None, metadata=None)``; without one a
    default ``rlpt.sandbox.SandboxPool`` is made for the call. ``trace`` None
    sends trace metadata exactly when the pool has a ``trace_path``.
    """

    needs_sandbox = True

    def __init__(
        self,
        pool: Any = None,
        trace: bool | None = None,
        timeout_s: float | None = None,
        deadline_s: float | None = None,
    ):
        self.pool = pool
        self.trace = trace
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s

    @abc.abstractmethod
    def build_request(self, task: Task, completion: str, request_id: str) -> Any:
        """The ``ExecutionRequest`` for a completion, with anything ``score`` needs.

        Returns ``(request, context)``; ``context`` is handed back to ``score``.
        """

    @abc.abstractmethod
    def score(
        self, task: Task, completion: str, result: ExecutionResult, context: Any
    ) -> VerifyResult:
        """Turn the sandbox's result into a VerifyResult."""

    def verify_batch(
        self, tasks: Sequence[Task], completions: Sequence[str], pool: Any = None
    ) -> list[VerifyResult]:
        _check_lengths(tasks, completions)
        if not tasks:
            return []
        built = [
            self.build_request(t, c, f"{t.id}#{i}")
            for i, (t, c) in enumerate(zip(tasks, completions))
        ]
        requests = [b[0] for b in built]
        with self._pool(pool) as p:
            trace = self.trace if self.trace is not None else bool(getattr(p, "trace_path", None))
            if trace:
                metadata = [
                    {"task_id": t.id, "domain": t.domain, "prompt": t.prompt, "completion": c}
                    for t, c in zip(tasks, completions)
                ]
                results = p.run_batch(requests, deadline_s=self.deadline_s, metadata=metadata)
            else:
                results = p.run_batch(requests, deadline_s=self.deadline_s)
        if len(results) != len(requests):
            raise RuntimeError(f"pool returned {len(results)} results for {len(requests)}")
        return [self.score(t, c, r, b[1]) for t, c, r, b in zip(tasks, completions, results, built)]

    @contextlib.contextmanager
    def _pool(self, pool: Any) -> Iterator[Any]:
        if pool is not None or self.pool is not None:
            yield pool if pool is not None else self.pool
            return
        from rlpt.sandbox import SandboxPool

        with SandboxPool() as default_pool:
            yield default_pool


class CodeProblemsDomain(CodeDomain):
    """A fixed list of code problems judged by assertion tests or stdin/stdout cases.

    Each problem is a mapping with ``id``, ``prompt``, optional ``solution``
    (the demonstration), optional ``code_prefix`` (prepended to the completion,
    e.g. a HumanEval signature) and either ``tests`` (Python assertions run
    after the code) or ``io_cases`` (``IOCase`` or ``{"stdin", "expected_stdout"}``).
    Problems split into train / held-out by a hash of the prompt; ``generate``
    with seed ``s`` gives problem ``s mod len`` of the split, so ``tasks(split,
    n=len)`` lists each once. All problems have difficulty 1.
    """

    max_difficulty = 1

    def __init__(
        self,
        problems: Sequence[Mapping[str, Any]],
        name: str = "code_problems",
        heldout_fraction: float = 0.2,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.name = name
        self.heldout_fraction = heldout_fraction
        self._split: dict[str, list[Mapping[str, Any]]] = {"train": [], "heldout": []}
        for p in problems:
            if ("tests" in p) == ("io_cases" in p):
                raise ValueError(f"problem {p.get('id')!r} needs exactly one of tests / io_cases")
            self._split[partition_of(p["prompt"], heldout_fraction)].append(p)

    def problems(self, split: str) -> list[Mapping[str, Any]]:
        check_split(split)
        if split == "train":
            return list(self._split["train"])
        held = self._split["heldout"]
        if split in ("validation", "test"):
            return [p for p in held if heldout_half(p["prompt"]) == split]
        return list(held)

    def generate(self, split: str, seed: int, difficulty: int = 1) -> Task:
        self.check_difficulty(difficulty)
        problems = self.problems(split)
        if not problems:
            raise ValueError(f"{self.name} has no {split} problems")
        p = problems[seed % len(problems)]
        data: dict[str, Any] = {"code_prefix": p.get("code_prefix", ""), "answer_format": "code"}
        if "tests" in p:
            data["tests"] = p["tests"]
        else:
            data["io_cases"] = tuple(
                _io_case(c, p.get("match", "whitespace")) for c in p["io_cases"]
            )
        for key in ("entry_point", "solution"):
            if key in p:
                data[key] = p[key]
        return Task(
            id=str(p["id"]),
            domain=self.name,
            prompt=p["prompt"],
            difficulty=1,
            answer=p.get("solution"),
            data=data,
            split=split,
        )

    def demonstration(self, task: Task) -> str:
        if task.data.get("solution") is None:
            raise ValueError(f"{task.id} has no reference solution")
        return task.data["solution"]

    def build_request(self, task: Task, completion: str, request_id: str) -> Any:
        code = task.data.get("code_prefix", "") + completion_code(completion) + "\n"
        if "tests" in task.data:
            req = assert_request(code, task.data["tests"], id=request_id, timeout_s=self.timeout_s)
        else:
            req = io_request(code, task.data["io_cases"], id=request_id, timeout_s=self.timeout_s)
        return req, None

    def score(
        self, task: Task, completion: str, result: ExecutionResult, context: Any
    ) -> VerifyResult:
        del task, completion, context
        failed = sandbox_result(result)
        if failed is not None:
            return failed
        return VerifyResult(1.0, "correct", True, {"status": "passed", "pass_rate": 1.0})
