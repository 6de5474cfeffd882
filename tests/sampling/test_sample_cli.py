"""`python -m rlpt.sample`: JSON on the last line, the same tokens as the library."""

import json
import subprocess
import sys

import jax

from rlpt.models import CausalLM, create_model, get_preset
from rlpt.sampling import GREEDY, Sampler
from rlpt.tokenizers import ByteTokenizer


def _sample(*flags):
    return subprocess.run(
        [sys.executable, "-m", "rlpt.sample", *flags], capture_output=True, text=True, timeout=300
    )


def test_greedy_ids_match_the_library():
    out = _sample(
        "--preset", "tiny", "--prompt_ids", "1,40,41", "--max_new_tokens", "6", "--greedy"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    config = get_preset("tiny")
    # The command splits its seed into (init, sample) keys; rebuild the same model here.
    init_key, sample_key = jax.random.split(jax.random.key(0))
    graphdef, state = create_model(lambda r: CausalLM(config, rngs=r), init_key)
    tok = ByteTokenizer()
    expected = Sampler(graphdef, config, eos_id=tok.eos_id, pad_id=tok.pad_id).generate(
        state, [[1, 40, 41]], sample_key, max_new_tokens=6, sampling=GREEDY
    )
    n = int(expected.lengths[0])
    assert result["ids"] == [expected.tokens[0, :n].tolist()]
    # Ids the model has but the tokenizer does not (its vocabulary is padded) decode to nothing.
    assert result["text"] == [tok.decode([t for t in expected.tokens[0, :n] if t < tok.vocab_size])]


def test_text_prompts_and_bad_flags():
    out = _sample("--preset=tiny", "--prompt=12+7=", "--max_new_tokens=3", "--temperature=0.8")
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(json.loads(out.stdout.strip().splitlines()[-1])["ids"][0]) <= 3
    out = _sample("--preset=huge", "--prompt_ids=1,2")
    assert out.returncode != 0 and "allowed" in out.stderr
    out = _sample("--preset=tiny", "--prompt_ids=1,2", "--max_new_tokens=1000")
    assert out.returncode != 0 and "max_seq_len" in out.stderr
