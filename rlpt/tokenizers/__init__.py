"""Tokenizers behind one interface."""

from rlpt.tokenizers.base import SPECIAL_ROLES, Tokenizer
from rlpt.tokenizers.byte import SPECIAL_STRINGS, ByteTokenizer

__all__ = ["SPECIAL_ROLES", "SPECIAL_STRINGS", "ByteTokenizer", "Tokenizer", "get_tokenizer"]


def get_tokenizer(name_or_path: str | None = None) -> Tokenizer:
    """The built-in byte tokenizer (``None`` or ``"byte"``)."""
    if name_or_path in (None, "byte"):
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer {name_or_path!r}; allowed: 'byte'")
