"""Sample from a model on the command line.

    python -m rlpt.sample --preset=tiny --prompt_ids=1,2,3 --max_new_tokens=8 --greedy
    python -m rlpt.sample --preset=mini --prompt="12+7=" --temperature=0.8 --seed=1
    python -m rlpt.sample --hf=HF_DIR_OR_CKPT --prompt="Hello" --greedy [--adapter=NAME] [--chat]

The last line of standard output is JSON: ``{"ids": [[...]], "text": [...]}``,
the new tokens only, one list per prompt. Logs go to standard error.
"""

from __future__ import annotations

import json

import jax
from absl import app, flags, logging

from rlpt.models import CausalLM, create_model, get_preset
from rlpt.sampling import SAMPLERS, SamplingParams, make_sampler
from rlpt.tokenizers import get_tokenizer

_PRESET = flags.DEFINE_string("preset", "tiny", "Model size preset (random initialisation).")
_PROMPT_IDS = flags.DEFINE_list("prompt_ids", None, "Comma-separated prompt token ids.")
_PROMPT = flags.DEFINE_multi_string("prompt", None, "Prompt text (repeat for a batch).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate.")
_GREEDY = flags.DEFINE_bool("greedy", False, "Greedy decoding.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_TOP_K = flags.DEFINE_integer("top_k", None, "Keep only the k most likely tokens.")
_TOP_P = flags.DEFINE_float("top_p", None, "Nucleus sampling mass.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for initialisation and sampling.")
_HF = flags.DEFINE_string(
    "hf", None, "A Hugging Face model directory or an imported rlpt checkpoint (not --preset)."
)
_ADAPTER = flags.DEFINE_string("adapter", None, "With --hf: the LoRA adapter to sample with.")
_CHAT = flags.DEFINE_bool("chat", False, "With --hf: format --prompt with the chat template.")
_SAMPLER = flags.DEFINE_enum(
    "sampler", "engine", list(SAMPLERS), "The rollout engine, or the static batch sampler."
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    init_key, sample_key = jax.random.split(jax.random.key(_SEED.value))
    if _HF.value is not None:
        from rlpt.interop import load_for_sampling

        config, graphdef, state, tokenizer = load_for_sampling(_HF.value, adapter=_ADAPTER.value)
        logging.info("model %s (adapter %s)", _HF.value, _ADAPTER.value)
    elif _ADAPTER.value is not None or _CHAT.value:
        raise app.UsageError("--adapter and --chat need --hf")
    else:
        tokenizer = get_tokenizer()
        config = get_preset(_PRESET.value)
        if tokenizer.vocab_size > config.vocab_size:
            raise app.UsageError(
                f"the tokenizer has {tokenizer.vocab_size} ids but preset {_PRESET.value!r} has "
                f"model.vocab_size={config.vocab_size}"
            )
        graphdef, state = create_model(lambda rngs: CausalLM(config, rngs=rngs), init_key)
        logging.info("model %s: random initialisation, seed %d", _PRESET.value, _SEED.value)
    if (_PROMPT_IDS.value is None) == (_PROMPT.value is None):
        raise app.UsageError("give exactly one of --prompt_ids or --prompt")
    if _PROMPT_IDS.value is not None:
        try:
            prompts = [[int(t) for t in _PROMPT_IDS.value]]
        except ValueError as e:
            raise app.UsageError(f"--prompt_ids must be comma-separated integers: {e}") from e
    elif _CHAT.value:
        prompts = [
            tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
            for text in _PROMPT.value
        ]
    else:
        prompts = [tokenizer.encode(text, add_bos=True) for text in _PROMPT.value]
    sampling = SamplingParams(
        greedy=_GREEDY.value, temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
        top_p=_TOP_P.value,
    )  # fmt: skip
    sampler = make_sampler(
        _SAMPLER.value, graphdef, config, slots=max(8, len(prompts)), eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id, stop_ids=getattr(tokenizer, "stop_ids", ()),
    )  # fmt: skip
    out = sampler.generate(
        state, prompts, sample_key, max_new_tokens=_MAX_NEW_TOKENS.value, sampling=sampling
    )
    ids = [[int(t) for t in row[: int(n)]] for row, n in zip(out.tokens, out.lengths)]
    text = [tokenizer.decode([t for t in row if t < tokenizer.vocab_size]) for row in ids]
    print(json.dumps({"ids": ids, "text": text}))


if __name__ == "__main__":
    app.run(main)
