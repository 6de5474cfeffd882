"""Hugging Face tokenizers behind rlpt's Tokenizer interface, and their chat templates."""

import pytest

from rlpt.interop import HFTokenizer

MESSAGES = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"}]


@pytest.fixture(scope="module")
def tokenizer_dirs(torch_and_transformers, hf_helpers, tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    hf_helpers.write_tokenizer(str(root / "with_bos"), bos=True)
    hf_helpers.write_tokenizer(str(root / "no_bos"), bos=False)
    return str(root / "with_bos"), str(root / "no_bos")


def test_roles_map_to_single_ids_and_step_answer_are_added(tokenizer_dirs):
    tok = HFTokenizer(tokenizer_dirs[0], model_vocab_size=300)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (1, 2, 3)
    assert (tok.step_id, tok.answer_id) == (288, 289)  # added past the 288 original ids
    assert tok.vocab_size == 290
    ids = tok.encode("w5 <step> w7 <answer> w9", add_bos=True, add_eos=True)
    assert ids == [2, 9, 288, 11, 289, 13, 3]
    assert tok.decode(ids) == "w5 <step> w7 <answer> w9"
    assert tok.decode([1, 1, *ids], skip_special=False).startswith("<pad> <pad> <s> w5")
    assert tok.stop_ids == (3,)


def test_configured_role_strings_override_the_defaults(tokenizer_dirs):
    tok = HFTokenizer(tokenizer_dirs[0], roles={"step": "w100", "answer": "w101"})
    assert (tok.step_id, tok.answer_id, tok.vocab_size) == (104, 105, 288)


def test_without_a_bos_token_prompts_get_none(tokenizer_dirs):
    tok = HFTokenizer(tokenizer_dirs[1])
    assert not tok.has_bos and tok.bos_id == tok.eos_id
    assert tok.encode("w5", add_bos=True) == [9]


@pytest.mark.parametrize("which", [0, 1])
def test_chat_template_renders_like_transformers(tokenizer_dirs, which):
    from transformers import AutoTokenizer

    path = tokenizer_dirs[which]
    ours = HFTokenizer(path).apply_chat_template(MESSAGES, add_generation_prompt=True)
    theirs = AutoTokenizer.from_pretrained(path).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert ours.endswith("w7 </s> w1 ")
