"""Hugging Face tokenizers behind rlpt's Tokenizer interface, and their chat templates."""

import pytest

from rlpt.interop import HFTokenizer, load_for_sampling
from rlpt.interop.convert import ConversionError

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


def test_a_full_vocabulary_samples_without_role_tokens(
    torch_and_transformers, hf_helpers, tmp_path
):
    """No spare embedding rows (a Llama-3-style table): sampling loads, training is told why."""
    path = str(tmp_path / "full")
    hf_helpers.build_model("llama", path, vocab_size=288)  # exactly the tokenizer's 288 ids
    config, graphdef, state, tok = load_for_sampling(path)
    assert config.vocab_size == tok.vocab_size == 288
    assert tok.encode("w5 w6", add_bos=True) == [2, 9, 10]
    with pytest.raises(ValueError, match="role_tokens"):
        _ = tok.step_id
    with pytest.raises(ConversionError, match="roles"):
        HFTokenizer(path, model_vocab_size=288)  # training wants step/answer ids


def test_a_full_vocabulary_lends_reserved_tokens_to_the_roles(hf_helpers, tokenizer_dirs, tmp_path):
    path = str(tmp_path / "reserved")
    hf_helpers.write_tokenizer(path, reserved=3)  # ids 288..290 are reserved specials
    tok = HFTokenizer(path, model_vocab_size=291)
    assert (tok.step_id, tok.answer_id, tok.vocab_size) == (288, 289, 291)
    assert tok.encode(f"w5 {tok.role_strings['step']} w6") == [9, 288, 10]
    # With spare rows the roles are still added as their own tokens.
    roomy = HFTokenizer(path, model_vocab_size=300)
    assert (roomy.step_id, roomy.answer_id) == (291, 292)
