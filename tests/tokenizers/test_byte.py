"""The byte tokenizer and its special tokens."""

import pytest

from rlpt.models import BYTE_VOCAB_SIZE
from rlpt.tokenizers import SPECIAL_ROLES, ByteTokenizer


def test_round_trip_with_markers_and_unicode():
    tok = ByteTokenizer()
    text = "5+3=8<step>8*2=16<answer>16 ✓"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert ids.count(tok.step_id) == 1 and ids.count(tok.answer_id) == 1
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=False) == "<bos>" + text + "<eos>"


def test_special_ids_are_distinct_single_tokens():
    tok = ByteTokenizer()
    ids = [tok.special_id(role) for role in SPECIAL_ROLES]
    assert len(set(ids)) == len(SPECIAL_ROLES)
    assert tok.encode("<step>") == [tok.step_id]
    # Plain bytes never collide with special ids.
    assert not set(tok.encode("<ste p>abc")) & set(ids)
    assert tok.vocab_size <= BYTE_VOCAB_SIZE


def test_bad_inputs_are_refused():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="allowed"):
        tok.special_id("sep")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([10_000])
