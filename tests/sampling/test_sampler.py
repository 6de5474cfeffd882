"""The KV-cache sampler: exactness against full forward passes, stopping, buckets, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlpt.models import CausalLM, create_model, get_preset
from rlpt.parallel import make_mesh
from rlpt.sampling import GREEDY, Sampler, SamplingParams, sampling_log_probs

CFG = get_preset("tiny")
EOS, PAD = 2, 0
PROMPTS = [[1, 40, 41, 42], [1, 77], [1, 9, 8, 7, 6, 5, 4]]


@pytest.fixture(scope="module")
def model():
    return create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0))


@pytest.fixture(scope="module")
def sampler(model):
    return Sampler(model[0], CFG, eos_id=EOS, pad_id=PAD)


def _greedy_by_full_forward(graphdef, state, prompt, n):
    """Reference: re-run the whole sequence through the model for every new token.

    The sequence is right-padded to a fixed width (causal attention never looks
    at the padding after it), so the reference compiles once.
    """
    width = 32
    forward = jax.jit(lambda s, t, m: nnx.merge(graphdef, s)(t, mask=m)[0])
    seq = list(prompt)
    for _ in range(n):
        tokens = np.array([seq + [PAD] * (width - len(seq))])
        logits = forward(state, tokens, tokens != PAD)
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt) :]


def test_greedy_matches_full_forward_recomputation(model, sampler):
    graphdef, state = model
    out = sampler.generate(state, PROMPTS, jax.random.key(0), max_new_tokens=8)
    for row, prompt in enumerate(PROMPTS):
        expected = _greedy_by_full_forward(graphdef, state, prompt, 8)
        n = int(out.lengths[row])
        assert out.tokens[row, :n].tolist() == expected[:n]
        if out.truncated[row]:
            assert n == 8
        else:
            assert expected[n - 1] == EOS


def test_sampling_log_probs_are_the_policy_log_probs_at_temperature_one(model, sampler):
    graphdef, state = model
    out = sampler.generate(
        state, PROMPTS[:2], jax.random.key(3), max_new_tokens=6, sampling=SamplingParams()
    )
    for row, prompt in enumerate(PROMPTS[:2]):
        n = int(out.lengths[row])
        seq = prompt + out.tokens[row, :n].tolist()
        tokens = np.array([seq + [PAD] * (16 - len(seq))])
        logits = jax.jit(lambda s, t, m: nnx.merge(graphdef, s)(t, mask=m)[0])(
            state, tokens, tokens != PAD
        )
        log_probs = jax.nn.log_softmax(logits[0], axis=-1)
        expected = [
            float(log_probs[len(prompt) - 1 + i, t]) for i, t in enumerate(out.tokens[row, :n])
        ]
        np.testing.assert_allclose(out.logprobs[row, :n], expected, atol=1e-4)


def test_same_key_same_output_and_keys_matter(model, sampler):
    _, state = model
    params = SamplingParams(temperature=1.5)
    a = sampler.generate(state, PROMPTS, jax.random.key(7), max_new_tokens=12, sampling=params)
    b = sampler.generate(state, PROMPTS, jax.random.key(7), max_new_tokens=12, sampling=params)
    c = sampler.generate(state, PROMPTS, jax.random.key(8), max_new_tokens=12, sampling=params)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)


def test_per_sequence_stop_tokens(model):
    graphdef, state = model
    free = Sampler(graphdef, CFG, eos_id=EOS, pad_id=PAD).generate(
        state, PROMPTS, jax.random.key(0), max_new_tokens=10
    )
    stop = int(free.tokens[0, 2])  # make the third token of row 0 a stop token
    stopped = Sampler(graphdef, CFG, eos_id=EOS, pad_id=PAD, stop_ids=[stop]).generate(
        state, PROMPTS, jax.random.key(0), max_new_tokens=10
    )
    for row in range(len(PROMPTS)):
        hits = np.flatnonzero(np.isin(free.tokens[row], [stop, EOS]))
        n = hits[0] + 1 if len(hits) else 10
        assert stopped.lengths[row] == n
        assert stopped.tokens[row, :n].tolist() == free.tokens[row, :n].tolist()
        assert (stopped.tokens[row, n:] == PAD).all()
        assert stopped.mask[row].tolist() == [1.0] * n + [0.0] * (10 - n)
        assert (stopped.logprobs[row, n:] == 0).all()
        assert bool(stopped.truncated[row]) == (len(hits) == 0)


def test_prompt_lengths_in_one_bucket_compile_once(model):
    graphdef, state = model
    sampler = Sampler(graphdef, CFG, eos_id=EOS, pad_id=PAD, buckets=(16, 32))
    for length in (3, 9, 15):
        sampler.generate(
            state, [list(range(5, 5 + length))] * 2, jax.random.key(0), max_new_tokens=4
        )
    assert sampler.trace_count == 1
    sampler.generate(state, [list(range(5, 25))] * 2, jax.random.key(0), max_new_tokens=4)
    assert sampler.trace_count == 2


def test_sharded_sampler_gives_the_same_greedy_tokens(model, sampler, devices):
    graphdef, state = model
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    _, sharded_state = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0), mesh)
    wq = sharded_state["trunk"]["blocks"][0]["attn"]["wq"][...]
    assert len({str(s.index) for s in wq.addressable_shards}) > 1  # really split
    sharded = Sampler(graphdef, CFG, eos_id=EOS, pad_id=PAD, mesh=mesh)
    a = sharded.generate(sharded_state, PROMPTS, jax.random.key(0), max_new_tokens=8)
    b = sampler.generate(state, PROMPTS, jax.random.key(0), max_new_tokens=8)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_top_k_and_top_p_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 11)).astype(np.float32) * 2
    for k, p, temp in [(3, None, 1.0), (None, 0.6, 0.7), (5, 0.9, 1.3)]:
        got = np.asarray(sampling_log_probs(jnp.asarray(logits), SamplingParams(False, temp, k, p)))
        for r, row in enumerate(logits / temp):
            keep = np.ones(11, bool)
            if k is not None:
                keep &= row >= np.sort(row)[-k]
            if p is not None:
                # Top-p applies to the distribution left after top-k (as in HF's warpers).
                probs = np.where(keep, np.exp(row - row.max()), 0.0)
                probs /= probs.sum()
                order = np.argsort(-probs)
                kept, mass = [], 0.0
                for idx in order:
                    if mass >= p:
                        break
                    kept.append(idx)
                    mass += probs[idx]
                nucleus = np.zeros(11, bool)
                nucleus[kept] = True
                keep &= nucleus
            expected = np.where(keep, row, -np.inf)
            expected = expected - np.log(np.exp(expected - row[keep].max()).sum()) - row[keep].max()
            np.testing.assert_allclose(np.exp(got[r]), np.exp(expected), atol=1e-6)


def test_bad_requests_fail_early_naming_the_field(model, sampler):
    _, state = model
    with pytest.raises(ValueError, match="max_seq_len"):
        sampler.generate(state, [[5] * 200], jax.random.key(0), max_new_tokens=100)
    with pytest.raises(ValueError, match="vocab_size"):
        sampler.generate(state, [[5, 10_000]], jax.random.key(0), max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0)
    assert GREEDY.greedy
