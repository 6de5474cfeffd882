"""The task interface shared by every domain: tasks, verification results, domains.

A domain turns ``(split, seed, difficulty)`` into a ``Task`` deterministically and
scores completions for it. Completions follow rlpt's fixed format: reasoning
steps separated by ``<step>``, the final answer after ``<answer>``, e.g.
``"12+7=19<step>19*2=38<answer>38"``.

Train and held-out tasks never share a problem: each candidate is put in one
partition by a hash of its partition key (the prompt, unless the domain keys it by
what a policy could memorise, such as the function a program computes), and
``generate`` samples candidates until one lands in the requested partition. The
held-out partition is cut in two by a second hash: ``validation`` (where every
setting is chosen) and ``test`` (which only reports); ``heldout`` is their union.
The ``ood`` split draws from the held-out partition, so an out-of-distribution
prompt is never a training prompt either. A domain may add splits of its own
(``extra_splits``, e.g. held-out compositions), also drawn from the held-out
partition.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import itertools
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

STEP = "<step>"
ANSWER = "<answer>"
SPLITS = ("train", "heldout", "validation", "test", "ood")
# The held-out partition's halves: settings are chosen on one, results reported on the other.
PROTOCOL_SPLITS = ("train", "validation", "test")

# Tokens a decoder may leave in decoded text; nothing after them is part of the answer.
_END_MARKERS = ("<eos>", "<pad>")


@dataclasses.dataclass(frozen=True)
class Task:
    """One problem: the prompt a policy sees and what its verifier needs.

    ``answer`` is the reference final answer where one exists (None for code
    judged only by tests); ``data`` holds verifier inputs such as hidden tests.
    """

    id: str
    domain: str
    prompt: str
    difficulty: int
    answer: str | None = None
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    split: str = ""
    # What decided the partition (``Problem.key``); empty means the prompt did.
    key: str = ""

    @property
    def partition_key(self) -> str:
        return self.key or self.prompt


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """How one completion scored.

    ``outcome`` is one of ``correct``, ``partial``, ``wrong``, ``no_answer`` or a
    sandbox status (``syntax_error``, ``timeout``, ...). ``valid`` is False only
    when the sandbox itself failed: the trainer drops such samples rather than
    scoring them zero, since the policy did nothing wrong.
    """

    reward: float
    outcome: str
    valid: bool = True
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)

    @property
    def correct(self) -> bool:
        return self.outcome == "correct"


def _cut_end_markers(text: str) -> str:
    for marker in _END_MARKERS:
        cut = text.find(marker)
        if cut >= 0:
            text = text[:cut]
    return text


def extract_answer(completion: str) -> str | None:
    """The text after the last ``<answer>``, stripped; None without the marker."""
    pos = completion.rfind(ANSWER)
    if pos < 0:
        return None
    return _cut_end_markers(completion[pos + len(ANSWER) :]).strip()


def split_steps(completion: str) -> list[str]:
    """The reasoning steps before the last ``<answer>``, each stripped.

    One entry per segment, empty ones included, so entry ``i`` is the text ended
    by the ``i``-th separator (``<step>`` or the final ``<answer>``): this is
    how a process reward lines labels up with separator tokens.
    """
    pos = completion.rfind(ANSWER)
    body = completion if pos < 0 else completion[:pos]
    body = _cut_end_markers(body)
    if not body.strip():
        return []
    return [s.strip() for s in body.split(STEP)]


def randint_inclusive(rng: Any, lo: int, hi: int) -> int:
    """An integer in ``[lo, hi]`` from a ``random.Random`` or a ``numpy.random.Generator``
    (step corruption takes either)."""
    if hasattr(rng, "integers"):
        return int(rng.integers(lo, hi + 1))
    return rng.randint(lo, hi)


def stable_hash(*parts: object) -> int:
    """A 64-bit hash of ``parts`` that, unlike ``hash``, is the same in every process."""
    text = "\x1f".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")


def partition_of(prompt: str, heldout_fraction: float) -> str:
    """``train`` or ``heldout`` for a prompt (or any partition key), by a hash of its text."""
    bucket = stable_hash("rlpt-partition", prompt) % 1_000_000
    return "heldout" if bucket < heldout_fraction * 1_000_000 else "train"


def heldout_half(key: str) -> str:
    """``validation`` or ``test`` for a held-out key, by a second, independent hash."""
    return "validation" if stable_hash("rlpt-protocol", key) % 2 == 0 else "test"


def check_split(split: str, extra: Sequence[str] = ()) -> None:
    if split not in SPLITS and split not in extra:
        raise ValueError(f"split must be one of {(*SPLITS, *extra)}, got {split!r}")


def _in_split(key: str, split: str, heldout_fraction: float) -> bool:
    """Whether a problem with partition key ``key`` belongs to ``split``."""
    partition = partition_of(key, heldout_fraction)
    if split == "train":
        return partition == "train"
    if partition != "heldout":
        return False
    if split in ("validation", "test"):
        return heldout_half(key) == split
    return True  # heldout, ood and a domain's own held-out splits


@dataclasses.dataclass(frozen=True)
class Problem:
    """What a procedural domain's sampler returns; ``generate`` wraps it in a Task.

    ``key`` decides the partition (the prompt when None): problems that differ in
    their prompt but not in what must be learnt (the same function shown on other
    inputs) share a key, so they never straddle train and test.
    """

    prompt: str
    answer: str | None
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    key: str | None = None

    @property
    def partition_key(self) -> str:
        return self.prompt if self.key is None else self.key


class Domain(abc.ABC):
    """A family of verifiable tasks.

    Subclasses set ``name``, ``max_difficulty`` and ``needs_sandbox`` and either
    implement ``_sample`` (procedural domains; ``generate`` handles seeding and
    the split partition) or override ``generate`` (fixed problem lists). A domain
    with out-of-distribution splits of its own names them in ``extra_splits`` and
    implements ``_sample_split``, which gets every split's name.
    """

    name: str = ""
    max_difficulty: int = 1
    needs_sandbox: bool = False
    heldout_fraction: float = 0.2
    extra_splits: tuple[str, ...] = ()
    # Rejection sampling for the partition needs about 1 / fraction tries; this
    # bound only turns a broken sampler into an error instead of a hang.
    _max_attempts: int = 10_000

    def _sample(self, rng: random.Random, difficulty: int) -> Problem:
        raise NotImplementedError(f"{type(self).__name__} must implement _sample or generate")

    def _sample_split(self, rng: random.Random, difficulty: int, split: str) -> Problem:
        """A candidate for ``split``; only domains with ``extra_splits`` need more than this."""
        del split
        return self._sample(rng, difficulty)

    @property
    def splits(self) -> tuple[str, ...]:
        return (*SPLITS, *self.extra_splits)

    def check_difficulty(self, difficulty: int) -> None:
        if not 1 <= difficulty <= self.max_difficulty:
            raise ValueError(
                f"{self.name}: difficulty must be in 1..{self.max_difficulty}, got {difficulty}"
            )

    def generate(self, split: str, seed: int, difficulty: int) -> Task:
        """The task for ``(split, seed, difficulty)``: always the same one."""
        check_split(split, self.extra_splits)
        self.check_difficulty(difficulty)
        for attempt in range(self._max_attempts):
            rng = random.Random(stable_hash(self.name, split, difficulty, seed, attempt))
            problem = self._sample_split(rng, difficulty, split)
            if _in_split(problem.partition_key, split, self.heldout_fraction):
                return Task(
                    id=f"{self.name}/{split}/d{difficulty}/{seed}",
                    domain=self.name,
                    prompt=problem.prompt,
                    difficulty=difficulty,
                    answer=problem.answer,
                    data=problem.data,
                    split=split,
                    key="" if problem.key is None else problem.key,
                )
        raise RuntimeError(
            f"{self.name}: no {split} problem at difficulty {difficulty} after "
            f"{self._max_attempts} samples; the problem space is too small"
        )

    def task_stream(self, split: str, difficulty: int, seed: int = 0) -> Iterator[Task]:
        """Task ``i`` is ``generate(split, seed * 2**32 + i, difficulty)``, without end.

        The stride keeps the streams of different ``seed`` values apart.
        """
        for i in itertools.count():
            yield self.generate(split, seed * 2**32 + i, difficulty)

    def tasks(self, split: str, n: int, difficulty: int, seed: int = 0) -> list[Task]:
        """The first ``n`` tasks of ``task_stream``."""
        return list(itertools.islice(self.task_stream(split, difficulty, seed), n))

    @abc.abstractmethod
    def demonstration(self, task: Task) -> str:
        """A correct completion in rlpt's format, for supervised warm starts."""

    @abc.abstractmethod
    def verify_batch(
        self, tasks: Sequence[Task], completions: Sequence[str], pool: Any = None
    ) -> list[VerifyResult]:
        """Score ``completions[i]`` for ``tasks[i]``; sandbox domains use one ``run_batch``."""

    def verify(self, task: Task, completion: str, pool: Any = None) -> VerifyResult:
        return self.verify_batch([task], [completion], pool=pool)[0]


def shared_items(
    domain: Domain, split_a: str, split_b: str, n: int, difficulties: Sequence[int], seed: int = 0
) -> dict[str, set[str]]:
    """What the first ``n`` tasks per level of two splits have in common.

    ``{"prompts": ..., "keys": ...}``; both are empty when no item of one split can be
    met in the other, which is what a train/test check asserts. Keys catch what prompts
    miss: the same function shown on other inputs.
    """
    found: dict[str, dict[str, set[str]]] = {}
    for split in (split_a, split_b):
        tasks = [t for d in difficulties for t in domain.tasks(split, n, d, seed=seed)]
        found[split] = {
            "prompts": {t.prompt for t in tasks},
            "keys": {t.partition_key for t in tasks},
        }
    return {kind: found[split_a][kind] & found[split_b][kind] for kind in ("prompts", "keys")}


class AnswerDomain(Domain):
    """A domain whose completions are judged in-process from the final answer alone."""

    def verify_batch(
        self, tasks: Sequence[Task], completions: Sequence[str], pool: Any = None
    ) -> list[VerifyResult]:
        del pool  # answers are checked in-process; nothing runs untrusted code
        _check_lengths(tasks, completions)
        return [self.verify_one(t, c) for t, c in zip(tasks, completions)]

    @abc.abstractmethod
    def verify_one(self, task: Task, completion: str) -> VerifyResult:
        """Score one completion."""


def _check_lengths(tasks: Sequence[Task], completions: Sequence[str]) -> None:
    if len(tasks) != len(completions):
        raise ValueError(f"{len(tasks)} tasks but {len(completions)} completions")
