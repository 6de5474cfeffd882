"""Code domains: program synthesis judging, exploit resistance, generic code problems."""

import json

import pytest

from rlpt.sandbox.types import IOCase, Status
from rlpt.tasks import (
    CodeProblemsDomain,
    ProgramSynthesisDomain,
    canonical_repr,
    completion_code,
    function_source,
)

PS = ProgramSynthesisDomain()
TASK = PS.generate("train", 0, 2)  # an affine function over the integers

EQ_EXPLOIT = """<answer>
class AlwaysEqual:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    def __hash__(self):
        return 0
def f(x):
    return AlwaysEqual()
"""

# An int subclass that prints as whatever the harness expects is still not an int.
REPR_EXPLOIT = """<answer>
class Liar(int):
    def __repr__(self):
        return "0"
    def __eq__(self, other):
        return True
def f(x):
    return Liar(0)
"""

# Rebinding builtins before the harness runs must not change how results serialise.
BUILTINS_EXPLOIT = """<answer>
import builtins
builtins.type = lambda obj: int
builtins.repr = lambda obj: "0"
def f(x):
    return object()
"""


def test_canonical_repr():
    assert canonical_repr(3) == "3"
    assert canonical_repr(True) == "True"  # bool is not confused with int
    assert canonical_repr(1) != canonical_repr(True)
    assert canonical_repr(3.0) == "3.0" != canonical_repr(3)
    assert canonical_repr([1, (2,), {"b": None, "a": "x"}]) == "[1, (2,), {'a': 'x', 'b': None}]"
    assert canonical_repr({3, 1, 2}) == "set{1, 2, 3}"
    with pytest.raises(TypeError):
        canonical_repr(object())

    class Sub(int):
        pass

    with pytest.raises(TypeError):
        canonical_repr(Sub(1))


def test_completion_code_and_function_source():
    assert completion_code("<answer>lambda x: x\n\n") == "lambda x: x"
    assert completion_code("    return 1\n<eos>") == "    return 1"  # indentation kept
    assert function_source("lambda x: 3*x+1", "f") == "f = (\nlambda x: 3*x+1\n)\n"
    assert function_source("def f(x):\n    return x", "f") == "def f(x):\n    return x\n"


@pytest.mark.parametrize("exploit", [EQ_EXPLOIT, REPR_EXPLOIT, BUILTINS_EXPLOIT])
def test_exploits_do_not_pass(exploit, any_pool):
    result = PS.verify(TASK, exploit, pool=any_pool)
    assert result.reward == 0.0
    assert result.outcome != "correct"


def test_answer_forms(any_pool):
    body = TASK.answer.removeprefix("lambda x: ")
    completions = [
        TASK.answer,  # no marker: the whole completion is the answer
        "<answer>" + TASK.answer,
        f"<answer>def f(x):\n    return {body}",
        "thinking<step>more<answer>  " + TASK.answer + "  ",
    ]
    results = PS.verify_batch([TASK] * len(completions), completions, pool=any_pool)
    assert [r.outcome for r in results] == ["correct"] * len(completions)


def test_failure_outcomes(any_pool):
    completions = [
        "<answer>lambda x: (",
        "<answer>lambda x: 1 // 0",
        "<answer>lambda x: 'nope'",
        "<answer>def g(x):\n    return x",
    ]
    results = PS.verify_batch([TASK] * len(completions), completions, pool=any_pool)
    assert [r.reward for r in results] == [0.0] * 4
    assert all(r.valid for r in results)
    assert results[0].outcome == "syntax_error"
    assert results[1].outcome == "wrong"  # every point raised ZeroDivisionError
    assert "ZeroDivisionError" in results[1].details["feedback"]
    assert results[2].outcome == "wrong"
    assert results[3].outcome == "wrong"  # f is never defined: each call is a NameError
    assert "NameError" in results[3].details["feedback"]


def test_partial_credit_and_all_or_nothing(fake_pool):
    # Right on x >= 0 only: partial credit is the fraction of hidden points right.
    body = TASK.answer.removeprefix("lambda x: ")
    completion = f"<answer>lambda x: ({body}) if x >= 0 else 0"
    partial = PS.verify(TASK, completion, pool=fake_pool)
    inputs = [x for (x,) in TASK.data["inputs"]]
    fn = eval(TASK.answer)
    right = sum((fn(x) if x >= 0 else 0) == fn(x) for x in inputs)
    assert partial.outcome == "partial"
    assert partial.reward == pytest.approx(right / len(inputs))
    assert partial.details["passed"] == right
    strict = ProgramSynthesisDomain(all_or_nothing=True).verify(TASK, completion, pool=fake_pool)
    assert (strict.reward, strict.outcome) == (0.0, "partial")


def test_sandbox_failure_is_invalid(broken_pool):
    result = PS.verify(TASK, PS.demonstration(TASK), pool=broken_pool)
    assert (result.reward, result.valid, result.outcome) == (0.0, False, "sandbox_error")


def test_one_run_batch_per_verify_batch_and_trace_metadata(fake_pool):
    tasks = PS.tasks("train", 3, 1)
    completions = [PS.demonstration(t) for t in tasks]
    traced = ProgramSynthesisDomain(trace=True, pool=fake_pool)
    before = len(fake_pool.calls)
    traced.verify_batch(tasks, completions)
    assert len(fake_pool.calls) == before + 1
    call = fake_pool.calls[-1]
    assert call["n"] == 3
    assert call["metadata"] == [
        {"task_id": t.id, "domain": "program_synthesis", "prompt": t.prompt, "completion": c}
        for t, c in zip(tasks, completions)
    ]
    PS.verify_batch(tasks, completions, pool=fake_pool)
    assert fake_pool.calls[-1]["metadata"] is None  # no trace configured


def test_trace_metadata_follows_the_pools_trace_log(fake_pool_cls):
    pool = fake_pool_cls()
    tasks = PS.tasks("train", 2, 1)
    completions = [PS.demonstration(t) for t in tasks]
    PS.verify_batch(tasks, completions, pool=pool)
    assert pool.calls[-1]["metadata"] is None
    pool.trace_path = "/somewhere/trace.jsonl"
    PS.verify_batch(tasks, completions, pool=pool)
    assert [m["task_id"] for m in pool.calls[-1]["metadata"]] == [t.id for t in tasks]
    ProgramSynthesisDomain(trace=False).verify_batch(tasks, completions, pool=pool)
    assert pool.calls[-1]["metadata"] is None


def test_real_pool_trace_log_records_tasks(tmp_path):
    sandbox = pytest.importorskip("rlpt.sandbox")
    if not hasattr(sandbox, "SandboxPool"):
        pytest.skip("rlpt.sandbox.SandboxPool is not available yet")
    trace = tmp_path / "trace.jsonl"
    tasks = PS.tasks("heldout", 2, 3)
    completions = [PS.demonstration(tasks[0]), "<answer>lambda x: ("]
    with sandbox.SandboxPool(workers=1, timeout_s=1.0, trace_path=str(trace)) as pool:
        results = PS.verify_batch(tasks, completions, pool=pool)
    assert [r.outcome for r in results] == ["correct", "syntax_error"]
    records = sorted(
        (json.loads(line) for line in trace.read_text().splitlines()), key=lambda r: r["task_id"]
    )
    expected = sorted(zip(tasks, completions), key=lambda tc: tc[0].id)
    assert [(r["task_id"], r["domain"], r["prompt"], r["completion"]) for r in records] == [
        (t.id, "program_synthesis", t.prompt, c) for t, c in expected
    ]


def test_mismatched_lengths_raise(fake_pool):
    with pytest.raises(ValueError):
        PS.verify_batch([TASK], [], pool=fake_pool)


PROBLEMS = [
    {
        "id": "add",
        "prompt": "read two ints, print their sum",
        "solution": "a, b = map(int, input().split())\nprint(a + b)",
        "io_cases": [{"stdin": "1 2\n", "expected_stdout": "3\n"}, IOCase("-5 5", "0")],
    },
    {
        "id": "square",
        "prompt": "def sq(x): return x squared",
        "solution": "def sq(x):\n    return x * x",
        "tests": "assert sq(3) == 9\nassert sq(-2) == 4",
    },
    {
        "id": "body",
        "prompt": "def inc(x):\n",
        "code_prefix": "def inc(x):\n",
        "solution": "    return x + 1",
        "tests": "assert inc(1) == 2",
    },
]


def test_code_problems_domain(any_pool):
    domain = CodeProblemsDomain(PROBLEMS, name="toy_code", heldout_fraction=0.0)
    tasks = domain.tasks("train", 3, 1)
    assert sorted(t.id for t in tasks) == ["add", "body", "square"]
    good = domain.verify_batch(tasks, [domain.demonstration(t) for t in tasks], pool=any_pool)
    assert [r.outcome for r in good] == ["correct"] * 3
    bad = domain.verify_batch(tasks, ["<answer>print(7)\ndef sq(x): return 0"] * 3, pool=any_pool)
    assert [r.reward for r in bad] == [0.0] * 3
    assert all(r.valid for r in bad)


def test_code_problems_need_one_judge():
    with pytest.raises(ValueError, match="exactly one"):
        CodeProblemsDomain([{"id": "x", "prompt": "p"}])


def test_sandbox_statuses_map_to_outcomes(fake_pool):
    domain = CodeProblemsDomain(PROBLEMS[1:2], heldout_fraction=0.0)
    task = domain.generate("train", 0)
    cases = {
        "def sq(x):\n    return 0": "wrong",
        "def sq(x) return": "syntax_error",
        "raise RuntimeError('boom')": "runtime_error",
    }
    results = domain.verify_batch([task] * 3, list(cases), pool=fake_pool)
    assert [r.outcome for r in results] == list(cases.values())
    assert Status.RUNTIME_ERROR.value in results[2].details["feedback"]


def test_default_pool_is_made_when_none_is_given():
    sandbox = pytest.importorskip("rlpt.sandbox")
    if not hasattr(sandbox, "SandboxPool"):
        pytest.skip("rlpt.sandbox.SandboxPool is not available yet")
    assert PS.verify(TASK, PS.demonstration(TASK)).outcome == "correct"


def test_early_exit_is_not_a_pass(any_pool):
    completion = "<answer>import os\nos._exit(0)"
    result = PS.verify(TASK, completion, pool=any_pool)
    assert (result.reward, result.valid) == (0.0, True)
    assert result.outcome in {"wrong", "runtime_error"}


def test_assertion_domains_resist_exploits(real_pool):
    """Assertion tests run outside the program: always-equal results, patched builtins and a
    forged early exit all score zero, and the honest solution still scores one."""
    domain = CodeProblemsDomain(PROBLEMS[1:2], heldout_fraction=0.0)  # sq(x) == x * x
    task = domain.generate("train", 0)
    exploits = [
        "<answer>class E:\n    def __eq__(self, o):\n        return True\n"
        "def sq(x):\n    return E()",
        "<answer>class I(int):\n    def __eq__(self, o):\n        return True\n"
        "def sq(x):\n    return I(0)",
        "<answer>import builtins\nbuiltins.exec = lambda *a, **k: None\n"
        "builtins.AssertionError = KeyError\ndef sq(x):\n    return 0",
        "<answer>import os, sys\nf = sys._getframe()\nwhile f.f_back:\n    f = f.f_back\n"
        "for fd in range(3, 1024):\n    for v in list(f.f_locals.values()):\n"
        "        if isinstance(v, bytes):\n            try:\n"
        "                os.write(fd, b'\\nRLPT-END ' + v + b'\\n')\n"
        "            except OSError:\n                pass\nos._exit(0)",
    ]
    results = domain.verify_batch(
        [task] * (len(exploits) + 1), exploits + [domain.demonstration(task)], pool=real_pool
    )
    assert [r.reward for r in results] == [0.0] * len(exploits) + [1.0], [
        r.details for r in results
    ]
    assert all(r.valid for r in results)
