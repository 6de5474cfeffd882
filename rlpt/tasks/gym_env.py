"""A gymnasium environment around any task domain.

``reset()`` draws a task and returns its prompt; ``step(completion)`` verifies
the completion and returns its reward, with ``outcome`` and ``valid`` in
``info``. With ``max_turns > 1`` a wrong answer is not final: the next
observation is the transcript so far plus the verifier's feedback (for code,
the sandbox's error output), and the policy may try again, up to ``max_turns``
turns in all.
"""

from __future__ import annotations

import string
from typing import Any

import gymnasium as gym
from gymnasium import spaces

from rlpt.tasks.base import Domain, Task, VerifyResult
from rlpt.tasks.registry import get_domain

MAX_TEXT = 1 << 16
# Text spaces reject characters outside their charset; prompts and code use all of ASCII.
_CHARSET = string.printable


class TaskEnv(gym.Env):
    """One task per episode; the action is the completion text.

    ``pool`` serves sandbox domains; if a sandbox domain gets none, one
    ``rlpt.sandbox.SandboxPool`` is made lazily and closed by ``close()``.
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        domain: Domain | str,
        split: str = "train",
        difficulty: int = 1,
        max_turns: int = 1,
        pool: Any = None,
        feedback_prefix: str = "\nfeedback: ",
    ):
        if max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        self.domain = get_domain(domain)
        self.split = split
        self.difficulty = difficulty
        self.max_turns = max_turns
        self.feedback_prefix = feedback_prefix
        self._pool = pool
        self._owned_pool: Any = None
        self.observation_space = spaces.Text(max_length=MAX_TEXT, charset=_CHARSET)
        self.action_space = spaces.Text(max_length=MAX_TEXT, charset=_CHARSET)
        self.task: Task | None = None
        self._transcript = ""
        self._turn = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """``options`` may give a ``task`` to pose or a ``difficulty`` for the draw."""
        super().reset(seed=seed)
        options = options or {}
        if "task" in options:
            self.task = options["task"]
        else:
            difficulty = options.get("difficulty", self.difficulty)
            task_seed = int(self.np_random.integers(0, 2**62))
            self.task = self.domain.generate(self.split, task_seed, difficulty)
        self._transcript = self.task.prompt
        self._turn = 0
        return self._transcript, {"task_id": self.task.id, "turn": 0}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.task is None:
            raise RuntimeError("call reset() before step()")
        result = self._verify(action)
        self._turn += 1
        solved = result.outcome == "correct"
        # An invalid sample (sandbox failure) ends the episode: retrying would
        # train on the sandbox's fault, not the policy's.
        terminated = solved or not result.valid
        truncated = not terminated and self._turn >= self.max_turns
        feedback = str(result.details.get("feedback", result.outcome))
        self._transcript += action
        if not (terminated or truncated):
            self._transcript += self.feedback_prefix + feedback + "\n"
        info = {
            "task_id": self.task.id,
            "turn": self._turn,
            "outcome": result.outcome,
            "valid": result.valid,
            "feedback": feedback,
            "details": dict(result.details),
        }
        return self._transcript, float(result.reward), terminated, truncated, info

    def _verify(self, completion: str) -> VerifyResult:
        pool = self._pool
        if pool is None and self.domain.needs_sandbox:
            if self._owned_pool is None:
                from rlpt.sandbox import SandboxPool

                self._owned_pool = SandboxPool()
                self._owned_pool.__enter__()
            pool = self._owned_pool
        return self.domain.verify_batch([self.task], [completion], pool=pool)[0]

    def close(self) -> None:
        if self._owned_pool is not None:
            self._owned_pool.__exit__(None, None, None)
            self._owned_pool = None
        super().close()
