"""A byte-level tokenizer with rlpt's reserved special tokens."""

from __future__ import annotations

import re
from collections.abc import Sequence

from rlpt.tokenizers.base import SPECIAL_ROLES, Tokenizer

SPECIAL_STRINGS = {role: f"<{role}>" for role in SPECIAL_ROLES}


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes shifted past the special ids; ``<step>`` and ``<answer>`` in text
    (and the other special strings) encode to their single special ids."""

    def __init__(self):
        self._role_to_id = {role: i for i, role in enumerate(SPECIAL_ROLES)}
        self._id_to_string = {i: SPECIAL_STRINGS[role] for role, i in self._role_to_id.items()}
        self._string_to_id = {s: i for i, s in self._id_to_string.items()}
        self._offset = len(SPECIAL_ROLES)
        self._pattern = re.compile("|".join(re.escape(s) for s in self._string_to_id))

    @property
    def vocab_size(self) -> int:
        return self._offset + 256

    def special_id(self, role: str) -> int:
        if role not in self._role_to_id:
            raise ValueError(f"unknown special role {role!r}; allowed: {list(SPECIAL_ROLES)}")
        return self._role_to_id[role]

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        pos = 0
        for match in self._pattern.finditer(text):
            ids.extend(b + self._offset for b in text[pos : match.start()].encode("utf-8"))
            ids.append(self._string_to_id[match.group()])
            pos = match.end()
        ids.extend(b + self._offset for b in text[pos:].encode("utf-8"))
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        hidden = {self.pad_id, self.bos_id, self.eos_id} if skip_special else set()
        pieces: list[str] = []
        buffer = bytearray()
        for token in ids:
            token = int(token)
            if token >= self._offset:
                if token >= self.vocab_size:
                    raise ValueError(
                        f"id {token} outside the byte vocabulary [0, {self.vocab_size})"
                    )
                buffer.append(token - self._offset)
                continue
            if token < 0:
                raise ValueError(f"negative token id {token}")
            pieces.append(buffer.decode("utf-8", errors="replace"))
            buffer.clear()
            if token not in hidden:
                pieces.append(self._id_to_string[token])
        pieces.append(buffer.decode("utf-8", errors="replace"))
        return "".join(pieces)
