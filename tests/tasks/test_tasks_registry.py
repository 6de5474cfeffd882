"""Registry: built-in names, user domains and rewards by name or import path."""

import sys
import textwrap

import pytest

from rlpt.tasks import (
    ArithmeticDomain,
    Domain,
    Task,
    VerifyResult,
    get_domain,
    get_reward,
    register_domain,
    register_reward,
    registered_domains,
    registered_rewards,
)

USER_MODULE = """
import random

from rlpt.tasks import AnswerDomain, Problem, VerifyResult, extract_answer


class EchoDomain(AnswerDomain):
    name = "echo"
    max_difficulty = 3

    def __init__(self, width=2):
        self.width = width

    def _sample(self, rng: random.Random, difficulty: int) -> Problem:
        word = str(rng.randrange(10 ** (self.width + difficulty)))
        return Problem(prompt="echo " + word, answer=word)

    def demonstration(self, task):
        return "<answer>" + task.answer

    def verify_one(self, task, completion):
        ok = extract_answer(completion) == task.answer
        return VerifyResult(float(ok), "correct" if ok else "wrong")


echo_instance = EchoDomain(width=1)


def shouting(task, completion, result):
    return float(completion.isupper())
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = "rlpt_user_tasks_for_test"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_builtins_are_registered():
    assert {"arithmetic", "stepwise_math", "program_synthesis", "humaneval"} <= set(
        registered_domains()
    )
    assert {"correct", "exact_match", "numeric_match", "format", "length", "code_pass_rate"} <= set(
        registered_rewards()
    )
    assert isinstance(get_domain("arithmetic"), ArithmeticDomain)


def test_domain_by_import_path(user_module):
    domain = get_domain(f"{user_module}:EchoDomain", width=3)
    assert isinstance(domain, Domain) and domain.width == 3
    task = domain.generate("train", 0, 1)
    assert task.prompt.startswith("echo ")
    assert domain.verify(task, domain.demonstration(task)).reward == 1.0
    assert get_domain(f"{user_module}:echo_instance").width == 1


def test_register_user_domain_and_reward_by_name(user_module, monkeypatch):
    import importlib

    from rlpt.tasks import registry

    # The registries are process-wide: other tests in this process (error messages that list
    # the registered names) must not see these entries.
    monkeypatch.setattr(registry, "_DOMAINS", dict(registry._DOMAINS))
    monkeypatch.setattr(registry, "_REWARDS", dict(registry._REWARDS))
    mod = importlib.import_module(user_module)
    register_domain("echo_for_test", mod.EchoDomain, overwrite=True)
    register_reward("shouting_for_test", mod.shouting, overwrite=True)
    assert get_domain("echo_for_test", width=1).width == 1
    task = Task("t", "echo", "p", 1, "x")
    assert get_reward("shouting_for_test")(task, "LOUD", None) == 1.0
    assert get_reward(f"{user_module}:shouting")(task, "quiet", None) == 0.0


def test_reward_classes_are_instantiated():
    penalty = get_reward("length", scale_bytes=10.0)
    assert penalty(Task("t", "d", "p", 1), "abcde", None) == -0.5
    assert get_reward("length")(Task("t", "d", "p", 1), "abcde", None) == -0.05


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(ValueError, match="arithmetic") as info:
        get_domain("no_such_domain")
    assert "program_synthesis" in str(info.value)
    with pytest.raises(ValueError, match="format"):
        get_reward("no_such_reward")
    with pytest.raises(ValueError, match="cannot import"):
        get_domain("no_such_module_xyz:Thing")
    with pytest.raises(ValueError, match="no attribute"):
        get_domain("rlpt.tasks:NoSuchDomain")


def test_registration_guards():
    with pytest.raises(ValueError, match="already registered"):
        register_domain("arithmetic", lambda: ArithmeticDomain())
    with pytest.raises(ValueError, match="invalid"):
        register_domain("a:b", ArithmeticDomain)


def test_factory_must_make_a_domain():
    with pytest.raises(TypeError, match="not a Domain"):
        get_domain("rlpt.tasks:VerifyResult", reward=1.0, outcome="x")
    assert isinstance(VerifyResult(1.0, "correct"), VerifyResult)
