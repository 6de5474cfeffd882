"""The gymnasium wrapper: single-turn episodes and multi-turn retries on feedback."""

import gymnasium as gym
import pytest

from rlpt.tasks import ProgramSynthesisDomain, TaskEnv


def test_reset_and_step_single_turn():
    env = TaskEnv("arithmetic", split="train", difficulty=2)
    assert isinstance(env.observation_space, gym.spaces.Text)
    obs, info = env.reset(seed=0)
    assert obs == env.task.prompt and obs.endswith("=")
    assert env.observation_space.contains(obs)
    assert info["task_id"] == env.task.id
    obs2, reward, terminated, truncated, info = env.step(env.domain.demonstration(env.task))
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["outcome"] == "correct" and info["valid"] is True

    env.reset(seed=1)
    _, reward, terminated, truncated, info = env.step("<answer>nonsense")
    assert (reward, terminated, truncated) == (0.0, False, True)
    assert info["outcome"] == "no_answer"


def test_reset_is_seeded():
    env = TaskEnv("stepwise_math", difficulty=3)
    first, _ = env.reset(seed=42)
    again, _ = env.reset(seed=42)
    assert first == again
    task = env.domain.generate("heldout", 0, 1)
    obs, _ = env.reset(options={"task": task})
    assert obs == task.prompt


def test_multi_turn_retry_with_sandbox_feedback(fake_pool):
    domain = ProgramSynthesisDomain()
    env = TaskEnv(domain, max_turns=3, pool=fake_pool)
    obs, _ = env.reset(seed=0)
    prompt = obs

    obs, reward, terminated, truncated, info = env.step("<answer>lambda x: (")
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["outcome"] == "syntax_error" and info["turn"] == 1
    assert "SyntaxError" in info["feedback"]
    assert obs.startswith(prompt + "<answer>lambda x: (") and info["feedback"] in obs

    obs, reward, terminated, truncated, info = env.step("<answer>lambda x: 0")
    assert (terminated, truncated, info["turn"]) == (False, False, 2)
    assert "expected" in info["feedback"]

    _, reward, terminated, truncated, info = env.step(domain.demonstration(env.task))
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["turn"] == 3


def test_multi_turn_stops_after_k_turns(fake_pool):
    env = TaskEnv("program_synthesis", max_turns=2, pool=fake_pool)
    env.reset(seed=3)
    assert env.step("<answer>lambda x: 0")[2:4] == (False, False)
    assert env.step("<answer>lambda x: 0")[2:4] == (False, True)


def test_invalid_sample_ends_the_episode(broken_pool):
    env = TaskEnv("program_synthesis", max_turns=3, pool=broken_pool)
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("<answer>lambda x: x")
    assert (reward, terminated, info["valid"]) == (0.0, True, False)


def test_step_before_reset_raises():
    with pytest.raises(RuntimeError):
        TaskEnv("arithmetic").step("<answer>1")
