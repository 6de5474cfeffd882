"""Evaluation data: correctness-only preference pairs and solutions with planted wrong steps.

Both sides of an evaluation pair are well-formed solutions in rlpt's format and
differ only in correctness (one number wrong, carried forward), so a reward
model can only rank them by checking the working, not the format or length.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from rlpt.rewards.preferences import PreferencePair
from rlpt.tasks.base import ANSWER, Task

_LAST_NUMBER = re.compile(r"-?\d+(?!.*\d)", re.S)


def wrong_variant(domain: Any, task: Task, completion: str, rng: random.Random) -> str:
    """A well-formed wrong version of a correct ``completion``.

    Uses the domain's ``corrupt_step`` when it has one (a wrong step carried
    forward); otherwise shifts the last step's result and the final answer by
    the same small nonzero amount.
    """
    if hasattr(domain, "corrupt_step"):
        return domain.corrupt_step(task, completion, rng)
    pos = completion.rfind(ANSWER)
    if pos < 0:
        raise ValueError(f"{completion!r} has no {ANSWER}")
    body, answer = completion[:pos], completion[pos + len(ANSWER) :]
    value = int(answer.strip())
    shift = rng.randint(1, 3) * rng.choice((-1, 1))
    m = _LAST_NUMBER.search(body)
    if m is not None and int(m.group()) == value:
        body = body[: m.start()] + str(value + shift) + body[m.end() :]
    return body + ANSWER + str(value + shift)


def correctness_pairs(domain: Any, tasks: Sequence[Task], seed: int = 0) -> list[PreferencePair]:
    """One pair per task: its demonstration (chosen) and a ``wrong_variant`` (rejected).

    Every rejected completion is checked by the verifier to be wrong.
    """
    rng = random.Random(seed)
    pairs = []
    for task in tasks:
        good = domain.demonstration(task)
        bad = wrong_variant(domain, task, good, rng)
        results = domain.verify_batch([task, task], [good, bad])
        if not results[0].correct or results[1].correct:
            raise AssertionError(f"{domain.name}: pair for {task.id} is not right/wrong")
        pairs.append(PreferencePair(task.prompt, good, bad, 0.0, domain.name))
    return pairs


def planted_error_solutions(
    domain: Any, tasks: Sequence[Task], seed: int = 0
) -> tuple[list[str], list[list[float]]]:
    """For each task its demonstration and a copy with one planted wrong step.

    Returns ``(completions, step_labels)`` with labels from ``domain.check_steps``
    (1 for a right step), two completions per task.
    """
    rng = random.Random(seed)
    completions, labels = [], []
    for task in tasks:
        good = domain.demonstration(task)
        for text in (good, domain.corrupt_step(task, good, rng)):
            completions.append(text)
            labels.append([float(x) for x in domain.check_steps(task, text)])
    return completions, labels
