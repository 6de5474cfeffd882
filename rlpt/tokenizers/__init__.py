"""Tokenizers behind one interface."""

from collections.abc import Sequence

from rlpt.tokenizers.base import SPECIAL_ROLES, Tokenizer
from rlpt.tokenizers.byte import SPECIAL_STRINGS, ByteTokenizer

__all__ = [
    "SPECIAL_ROLES",
    "SPECIAL_STRINGS",
    "ByteTokenizer",
    "Tokenizer",
    "decode_response",
    "get_tokenizer",
]


def get_tokenizer(name_or_path: str | None = None) -> Tokenizer:
    """The built-in byte tokenizer (``None`` or ``"byte"``)."""
    if name_or_path in (None, "byte"):
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer {name_or_path!r}; allowed: 'byte'")


def decode_response(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """Text of generated ``ids``; ids past the tokenizer's vocabulary (the model's
    vocabulary is rounded up) have no text and read as U+FFFD, so they never match."""
    pieces, start = [], 0
    ids = [int(t) for t in ids]
    for i, t in enumerate(ids):
        if t >= tokenizer.vocab_size:
            pieces.append(tokenizer.decode(ids[start:i]) + "\ufffd")
            start = i + 1
    pieces.append(tokenizer.decode(ids[start:]))
    return "".join(pieces)
