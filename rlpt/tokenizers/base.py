"""The tokenizer interface shared by the built-in byte tokenizer and Hugging Face tokenizers."""

from __future__ import annotations

import abc
from collections.abc import Sequence

# Roles of the special tokens. `step` separates reasoning steps (process rewards
# read there); `answer` introduces the final answer.
SPECIAL_ROLES = ("pad", "bos", "eos", "step", "answer")


class Tokenizer(abc.ABC):
    """Text to ids and back, plus the ids of the special-token roles.

    Code asks the tokenizer for special ids (``tokenizer.eos_id``), never hard-codes them.
    """

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (the model's vocab must be at least this)."""

    @abc.abstractmethod
    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of ``text``; marker strings of special roles become their single ids."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``. ``skip_special`` drops pad/bos/eos; step and answer
        markers are always written out, since verifiers parse them."""

    @abc.abstractmethod
    def special_id(self, role: str) -> int:
        """Id of a special role in ``SPECIAL_ROLES``."""

    @property
    def pad_id(self) -> int:
        return self.special_id("pad")

    @property
    def bos_id(self) -> int:
        return self.special_id("bos")

    @property
    def eos_id(self) -> int:
        return self.special_id("eos")

    @property
    def step_id(self) -> int:
        return self.special_id("step")

    @property
    def answer_id(self) -> int:
        return self.special_id("answer")
