"""The rollout engine: the static sampler's greedy outputs, slot refill, shared prefixes,
versions, per-request reproducibility, exact log-probs, per-request settings, sharding."""

import jax
import numpy as np
import pytest
from flax import nnx

from rlpt.models import CausalLM, create_model, get_preset
from rlpt.parallel import make_mesh
from rlpt.rl.ppo import response_log_probs
from rlpt.sampling import Sampler, SamplingParams, sampling_log_probs
from rlpt.sampling.engine import Engine, Request, RequestParams
from rlpt.sampling.methods import sample_rows

CFG = get_preset("tiny")
EOS, PAD = 2, 0
PROMPTS = [[1, 40, 41, 42], [1, 77], [1, 9, 8, 7, 6, 5, 4], list(range(3, 40)), [5] * 17]


@pytest.fixture(scope="module")
def model():
    return create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0))


@pytest.fixture(scope="module")
def other_weights():
    return create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(1))[1]


def _engine(model, **kw):
    options = dict(num_slots=4, block_size=8, prefill_chunk=16, decode_steps=4, max_seq_len=128)
    options.update(kw)
    return Engine(model[0], model[1], CFG, eos_id=EOS, pad_id=PAD, **options)


@pytest.fixture(scope="module")
def engine(model):
    return _engine(model)


def _greedy(n=1, max_tokens=20, **kw):
    return RequestParams(max_tokens=max_tokens, n=n, greedy=True, **kw)


def test_greedy_equals_the_static_sampler(model, engine):
    ref = Sampler(model[0], CFG, eos_id=EOS, pad_id=PAD).generate(
        model[1], PROMPTS, jax.random.key(0), max_new_tokens=20
    )
    out = engine.generate([Request(i, p, _greedy(n=2)) for i, p in enumerate(PROMPTS)])
    assert [(c.request_id, c.index) for c in out] == [(i, j) for i in range(5) for j in range(2)]
    for c in out:
        n = int(ref.lengths[c.request_id])
        np.testing.assert_array_equal(c.tokens, ref.tokens[c.request_id, :n])
        np.testing.assert_allclose(c.logprobs, ref.logprobs[c.request_id, :n], atol=1e-5)
        assert c.finish_reason == ("stop" if c.tokens[-1] == EOS else "length")
    assert engine.refcounts.sum() == 0 and engine.blocks_in_use() == 0


def test_finished_slots_take_waiting_requests_at_once(model):
    """Eight requests through two slots: short ones free their slot for the next."""
    eng = _engine(model, num_slots=2, decode_steps=2)
    lengths = [3, 17, 2, 4, 9, 1, 5, 2]
    requests = [Request(i, [1, 10 + i], _greedy(max_tokens=n)) for i, n in enumerate(lengths)]
    finished_at, step = {}, 0
    eng.submit(requests)
    while eng.has_work():
        for c in eng.step():
            finished_at[c.request_id] = step
            assert len(c.tokens) <= lengths[c.request_id]
        step += 1
    assert sorted(finished_at) == list(range(8))
    # Request 1 (17 tokens) holds one slot throughout while the other slot serves 0, 2, 3
    # (3 + 2 + 4 tokens) one after another: they are done before it is.
    assert max(finished_at[i] for i in (0, 2, 3)) < finished_at[1]
    # Fewer decode calls than a static batch of two run to its longest member would need.
    static_calls = sum(max(lengths[i : i + 2]) for i in range(0, 8, 2)) / 2
    assert eng.stats.decode_calls < static_calls
    assert eng.blocks_in_use() == 0


def test_group_samples_share_the_prompt_blocks(model):
    eng = _engine(model, num_slots=4, block_size=8)
    prompt = list(range(3, 3 + 8 * 3 + 5))  # 29 tokens: 28 prefilled = 3 full blocks + 4
    eng.submit([Request("g", prompt, RequestParams(max_tokens=6, n=4, seed=3))])
    eng.step()  # admits and prefills (one chunk of 16, then the rest), may start decoding
    while eng._prefilling:
        eng.step()
    shared = [s.blocks[:3] for s in eng._running if s is not None]
    assert len(shared) == 4 and all(b == shared[0] for b in shared)
    assert all(eng.refcounts[0, b] == 4 for b in shared[0])
    # Private blocks: one copy of the partial block per sample, nothing else shared.
    private = [b for s in eng._running for b in s.blocks[3:]]
    assert len(set(private)) == len(private) and all(eng.refcounts[0, b] == 1 for b in private)
    # In use: 3 shared + 4 private, where copies of the prompt would take 4 * 4 = 16.
    assert eng.blocks_in_use() <= 3 + 4 * 2
    while eng.has_work():
        eng.step()
    assert eng.refcounts.sum() == 0 and eng.blocks_in_use() == 0


def test_samples_of_a_group_differ_and_are_reproducible_alone_or_in_a_crowd(model):
    params = RequestParams(max_tokens=16, n=3, temperature=1.0, top_k=50, top_p=0.9, seed=7)
    alone = _engine(model).generate([Request("x", PROMPTS[0], params)])
    crowd = [
        Request(i, p, RequestParams(max_tokens=12, n=2, seed=i)) for i, p in enumerate(PROMPTS)
    ]
    mixed = _engine(model, num_slots=8).generate(
        crowd[:2] + [Request("x", PROMPTS[0], params)] + crowd[2:]
    )
    again = [c for c in mixed if c.request_id == "x"]
    assert len({tuple(c.tokens) for c in alone}) > 1  # the samples of a group differ
    for a, b in zip(alone, again):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)


def test_logprobs_equal_the_learners_in_float32(model):
    temperature = 0.7
    out = _engine(model).generate(
        [
            Request(i, p, RequestParams(max_tokens=12, temperature=temperature, seed=i))
            for i, p in enumerate(PROMPTS)
        ]
    )
    graphdef, state = model
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])
    worst = 0.0
    for c in out:
        seq = np.array([c.prompt + c.tokens.tolist()])
        logits = forward(state, seq)
        learner = np.asarray(response_log_probs(logits, seq, len(c.prompt), temperature)[0])[0]
        worst = max(worst, float(np.abs(learner - c.logprobs).max()))
    assert worst <= 1e-5


def test_per_row_settings_match_the_single_setting_rule():
    """Each row's sampling distribution is what sampling_log_probs gives for its settings."""
    logits = jax.random.normal(jax.random.key(0), (4, 64)) * 3
    settings = [
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(greedy=True),
    ]
    params = np.array(
        [[s.greedy, s.temperature, s.top_k or 0, s.top_p or 1.0] for s in settings], np.float32
    )
    keys = np.stack([np.asarray(jax.random.PRNGKey(i), np.uint32) for i in range(4)])
    tokens, lps = sample_rows(logits, keys, params, filtered=True)
    for row, s in enumerate(settings):
        expected = np.asarray(sampling_log_probs(logits[row : row + 1], s))[0]
        assert np.isfinite(expected[tokens[row]])  # drawn from the kept tokens
        np.testing.assert_allclose(lps[row], expected[tokens[row]], atol=1e-6)
    assert tokens[3] == int(np.argmax(logits[3]))


def test_stop_ids_stop_strings_and_max_tokens(model):
    decode = lambda ids: "".join(chr(97 + t % 26) for t in ids)  # noqa: E731
    eng = _engine(model, decode_fn=decode)
    free = eng.generate([Request("free", PROMPTS[2], _greedy(max_tokens=30))])[0]
    assert len(free.tokens) >= 4
    stop_id = int(free.tokens[2])
    text = decode(free.tokens.tolist())
    out = eng.generate(
        [
            Request("id", PROMPTS[2], _greedy(max_tokens=30, stop_ids=(stop_id,))),
            Request("string", PROMPTS[2], _greedy(max_tokens=30, stop_strings=(text[1:3],))),
            Request("length", PROMPTS[2], _greedy(max_tokens=3)),
        ]
    )
    by = {c.request_id: c for c in out}
    first = free.tokens.tolist().index(stop_id)
    assert by["id"].tokens.tolist() == free.tokens[: first + 1].tolist()
    assert by["id"].finish_reason == "stop"
    assert by["string"].tokens.tolist() == free.tokens[:3].tolist()
    assert by["string"].finish_reason == "stop_string"
    assert by["length"].tokens.tolist() == free.tokens[:3].tolist()
    assert by["length"].finish_reason == "length"


def test_new_weights_between_steps_tag_every_token(model, other_weights):
    requests = [
        Request(i, p, RequestParams(max_tokens=24, seed=i)) for i, p in enumerate(PROMPTS[:2])
    ]
    # Partial rollouts: tokens before the update are version 0, after it version 1.
    eng = _engine(model)
    eng.submit(requests)
    done = eng.step() + eng.step()
    eng.update_weights(other_weights, version=1)
    while eng.has_work():
        done += eng.step()
    for c in done:
        v = c.versions.tolist()
        assert v[0] == 0 and v[-1] == 1 and v == sorted(v), v
    # Requeued: the same requests start over and every token is version 1, as if the new
    # weights had been there from the start.
    eng = _engine(model)
    eng.submit(requests)
    eng.step()
    eng.step()
    eng.update_weights(other_weights, version=1, in_flight="requeue")
    requeued = []
    while eng.has_work():
        requeued += eng.step()
    fresh = _engine((model[0], other_weights)).generate(requests)
    for a, b in zip(sorted(requeued, key=lambda c: c.request_id), fresh):
        assert set(a.versions.tolist()) == {1}
        np.testing.assert_array_equal(a.tokens, b.tokens)


def test_preemption_when_blocks_run_out_keeps_results(model, engine):
    requests = [Request(i, p, _greedy(n=2, max_tokens=40)) for i, p in enumerate(PROMPTS)]
    roomy = engine.generate(requests)
    tight = _engine(model, max_seq_len=80, num_blocks=18)  # 4 slots at 40+ tokens need more
    squeezed = tight.generate(requests)
    assert tight.stats.preemptions > 0
    for a, b in zip(roomy, squeezed):
        np.testing.assert_array_equal(a.tokens, b.tokens)
    assert tight.blocks_in_use() == 0


def test_sharded_over_the_mesh_gives_the_same_tokens(model, engine):
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded = _engine(model, num_slots=4, mesh=mesh)
    assert sharded.shards == 4
    requests = [Request(i, p, RequestParams(max_tokens=16, seed=i)) for i, p in enumerate(PROMPTS)]
    for a, b in zip(engine.generate(requests), sharded.generate(requests)):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_bad_requests_are_refused_before_any_compilation(model):
    eng = _engine(model)
    with pytest.raises(ValueError, match="empty"):
        eng.submit([Request("e", [], _greedy())])
    with pytest.raises(ValueError, match="vocabulary"):
        eng.submit([Request("v", [CFG.vocab_size], _greedy())])
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.submit([Request("l", [1] * 100, _greedy(max_tokens=40))])
    with pytest.raises(ValueError, match="slots of one shard"):
        eng.submit([Request("n", [1], _greedy(n=5))])
    with pytest.raises(ValueError, match="KV blocks"):
        _engine(model, num_blocks=20).submit([Request("b", [1] * 30, _greedy(n=4, max_tokens=90))])
    with pytest.raises(ValueError, match="decode_fn"):
        eng.submit([Request("s", [1], _greedy(stop_strings=("x",)))])
    with pytest.raises(ValueError, match="temperature"):
        RequestParams(max_tokens=3, temperature=0)
    assert eng.trace_count == 0


def test_the_sampler_interface_on_the_engine(model):
    """EngineSampler: the static sampler's calls and output layout, groups sharing prompts."""
    from rlpt.sampling import EngineSampler, Sampler

    rows = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 2 + [PROMPTS[3]]
    static = Sampler(model[0], CFG, eos_id=EOS, pad_id=PAD)
    facade = EngineSampler(model[0], CFG, eos_id=EOS, pad_id=PAD, num_slots=8, block_size=8)
    tokens, mask = static.prepare(rows, 12)
    greedy_ref = static.generate_padded(
        model[1], tokens, mask, jax.random.key(0), max_new_tokens=12
    )
    greedy = facade.generate_padded(model[1], tokens, mask, jax.random.key(0), max_new_tokens=12)
    for field in ("tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(greedy, field), getattr(greedy_ref, field), field)
    np.testing.assert_allclose(greedy.logprobs, greedy_ref.logprobs, atol=1e-5)
    # Sampled: reproducible from the key, the rows of a group differ, identical prompts were
    # one request each (3 + 2 + 1 rows: three prefills).
    hot = SamplingParams(temperature=1.5)
    groups, generate = [], facade.engine.generate
    facade.engine.generate = lambda reqs: generate(groups.extend(r.params.n for r in reqs) or reqs)
    a = facade.generate(model[1], rows, jax.random.key(5), max_new_tokens=12, sampling=hot)
    b = facade.generate(model[1], rows, jax.random.key(5), max_new_tokens=12, sampling=hot)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert len({tuple(r) for r in a.tokens[:3]}) > 1
    assert groups == [3, 2, 1] * 2
    assert facade.engine.refcounts.sum() == 0
    # New weights reach the engine as a new version.
    facade.generate(jax.tree.map(lambda x: x * 1.0, model[1]), rows, jax.random.key(1),
                    max_new_tokens=4)  # fmt: skip
    assert facade.engine.version == 1


def test_warm_up_compiles_everything_a_run_needs_and_changes_nothing(model):
    """After warm_up(), long-tailed groups that share prompt blocks (copies), grow through
    every context bucket and finish at different times trace no new program, and give the
    same samples as an engine that compiled as it went."""
    requests = [
        Request(i, PROMPTS[i % len(PROMPTS)], RequestParams(max_tokens=5 + 23 * (i % 3), n=2,
                                                            seed=i))
        for i in range(6)
    ]  # fmt: skip
    cold = _engine(model, max_seq_len=80).generate(requests)
    warm = _engine(model, max_seq_len=80)
    assert warm.warm_up() > 0
    traced = warm.trace_count
    got = warm.generate(requests)
    assert warm.trace_count == traced
    assert [(c.request_id, c.index) for c in got] == [(c.request_id, c.index) for c in cold]
    for a, b in zip(got, cold):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
    with pytest.raises(RuntimeError, match="before any request"):
        warm.submit(requests[:1])
        warm.warm_up()


def test_sliding_window_samples_hold_only_their_window_of_blocks():
    # S + W = 10 positions live; a block holds 4, so a 150-token response that keeps
    # every block would need 39 per sample, and 16 blocks hold two samples' windows.
    cfg = get_preset("tiny", sliding_window=8, attention_sinks=2)
    graphdef, state = create_model(lambda r: CausalLM(cfg, rngs=r), jax.random.key(2))
    prompt, new = [1, 40, 41, 42, 43], 150
    ref = Sampler(graphdef, cfg, eos_id=EOS, pad_id=PAD).generate(
        state, [prompt], jax.random.key(0), max_new_tokens=new
    )
    engine = Engine(graphdef, state, cfg, eos_id=EOS, pad_id=PAD, num_slots=2, block_size=4,
                    num_blocks=16, prefill_chunk=8, decode_steps=4, max_seq_len=160)  # fmt: skip
    out = engine.generate([Request(0, prompt, _greedy(n=2, max_tokens=new))])
    for c in out:
        assert c.finish_reason == "length"  # the whole response ran, well past the window
        np.testing.assert_array_equal(c.tokens, ref.tokens[0])
        np.testing.assert_allclose(c.logprobs, ref.logprobs[0], atol=1e-5)
    # Per sample: the sinks' block, (W - 1 + decode_steps) / 4 = 3 behind and written, one
    # for alignment and the prompt's partial block; one shared prompt block.
    assert engine.stats.peak_blocks <= 1 + 2 * 6, engine.stats.peak_blocks
    assert engine.stats.preemptions == 0
    assert engine.refcounts.sum() == 0 and engine.blocks_in_use() == 0
    # Full attention keeps every block: the same request does not fit.
    with pytest.raises(ValueError, match="raise num_blocks"):
        _engine(
            create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(2)), num_slots=2,
            block_size=4, num_blocks=41, prefill_chunk=8, max_seq_len=160,
        ).submit([Request(0, prompt, _greedy(n=2, max_tokens=new))])  # fmt: skip
