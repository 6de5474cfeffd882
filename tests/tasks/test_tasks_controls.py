"""The curriculum's control domains: labels that are noise, and a task already mastered."""

import collections

from rlpt.tasks import EchoDomain, RandomLabelsDomain
from rlpt.tasks.controls import level_sizes


def test_random_labels_ignore_the_expression():
    domain = RandomLabelsDomain()
    tasks = [t for d in (1, 2, 3) for t in domain.tasks("train", 400, d)]
    labels = collections.Counter(t.answer for t in tasks)
    assert set(labels) == {str(i) for i in range(10)}
    # Close to uniform: 1200 draws over 10 labels, 120 expected each (sd about 10).
    assert all(70 < n < 170 for n in labels.values())
    # The expression's true value is the label about as often as chance allows.
    hits = sum(str(eval(t.prompt[:-1])) == t.answer for t in tasks)
    assert hits < 0.15 * len(tasks)
    # The label is fixed by the prompt: the same prompt always gets the same one.
    again = [t for d in (1, 2, 3) for t in domain.tasks("train", 400, d)]
    assert [t.answer for t in again] == [t.answer for t in tasks]


def test_echo_is_the_digits_back():
    domain = EchoDomain()
    task = domain.generate("train", 3, 2)
    assert task.prompt == f"echo {task.answer}=" and len(task.answer) == 9
    assert domain.verify(task, "<answer>" + task.answer).correct
    assert not domain.verify(task, "<answer>" + task.answer[:-1]).correct


def test_every_level_has_over_a_million_prompts():
    for domain in (RandomLabelsDomain(), EchoDomain()):
        for level in range(1, domain.max_difficulty + 1):
            assert level_sizes(domain, level) >= 10**6
