"""Chunked reasoning (Delethink): context resets, stopping, traces, training rows, advantages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlpt.rl import grpo_advantages, rloo_advantages, trace_advantages
from rlpt.sampling import SampleOutput, chunk_rows, chunk_spans, chunked_generate

EOS = 99
PAD = 0


class FakeGenerate:
    """Deterministic stand-in for a sampler: row i writes the next integers after the
    last token of its context (counting on from the context), and writes EOS once
    the value reaches ``stop_at[prompt id]``. Records every context it was given."""

    def __init__(self, stop_at):
        self.stop_at = stop_at
        self.calls = []

    def __call__(self, contexts, key, max_new_tokens):
        del key
        self.calls.append([list(c) for c in contexts])
        n = len(contexts)
        tokens = np.full((n, max_new_tokens), PAD, np.int32)
        logprobs = np.zeros((n, max_new_tokens), np.float32)
        mask = np.zeros((n, max_new_tokens), np.float32)
        lengths = np.zeros(n, np.int32)
        truncated = np.ones(n, bool)
        for i, c in enumerate(contexts):
            pid, value = c[0], c[-1] if len(c) > 1 else 10
            for t in range(max_new_tokens):
                value += 1
                tok = EOS if value >= self.stop_at[pid] else value
                tokens[i, t], logprobs[i, t], mask[i, t] = tok, -0.01 * tok, 1.0
                lengths[i] = t + 1
                if tok == EOS:
                    truncated[i] = False
                    break
        return SampleOutput(tokens, logprobs, mask, lengths, truncated)


def test_context_resets_to_prompt_plus_last_m_tokens_and_trace_concatenates():
    # Each prompt counts on from its last token: [1, 5] writes 6, 7, 8, ...; no EOS here.
    fake = FakeGenerate({1: 20, 2: 100})
    traces = chunked_generate(
        fake, [[1, 5], [2, 7]], jax.random.key(0), chunk_tokens=4, carry_tokens=2, max_chunks=3
    )
    # Chunk 0 from the prompts; then the prompt plus the last 2 generated tokens.
    assert fake.calls[0] == [[1, 5], [2, 7]]
    assert fake.calls[1] == [[1, 5, 8, 9], [2, 7, 10, 11]]
    assert fake.calls[2] == [[1, 5, 12, 13], [2, 7, 14, 15]]
    a, b = traces
    assert a.tokens.tolist() == [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    assert b.tokens.tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    assert not a.finished and not b.finished  # budget of 3 chunks used up
    assert [s.context.tolist() for s in a.segments] == fake_contexts(fake, 0)
    assert np.allclose(a.logprobs, -0.01 * a.tokens)


def fake_contexts(fake, row):
    return [call[row] for call in fake.calls]


def test_stops_at_eos_and_only_running_traces_are_generated():
    fake = FakeGenerate({1: 13, 2: 100})  # prompt 1 reaches EOS in its second chunk
    traces = chunked_generate(
        fake, [[1, 5], [2, 7]], jax.random.key(0), chunk_tokens=4, carry_tokens=3, max_chunks=5
    )
    a, b = traces
    assert a.tokens.tolist() == [6, 7, 8, 9, 10, 11, 12, EOS]
    assert a.finished and len(a.segments) == 2
    assert b.truncated and len(b.segments) == 5 and len(b.tokens) == 20
    assert [len(c) for c in fake.calls] == [2, 2, 1, 1, 1]
    # Every context is the prompt plus at most m carried tokens: one window per call.
    assert max(len(ctx) for call in fake.calls for ctx in call) == 2 + 3


def test_zero_carry_restarts_from_the_prompt_alone():
    fake = FakeGenerate({1: 100})
    chunked_generate(fake, [[1, 5]], jax.random.key(0), chunk_tokens=3, carry_tokens=0,
                     max_chunks=3)  # fmt: skip
    assert fake.calls == [[[1, 5]]] * 3


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_generate(FakeGenerate({}), [[1]], jax.random.key(0), chunk_tokens=0,
                         carry_tokens=0, max_chunks=1)  # fmt: skip


def test_chunk_spans_hand_worked():
    assert chunk_spans(10, 4, 2) == [(0, 0, 4), (2, 4, 8), (6, 8, 10)]
    assert chunk_spans(8, 4, 2) == [(0, 0, 4), (2, 4, 8)]
    assert chunk_spans(1, 4, 2) == [(0, 0, 1)]


def test_chunk_rows_rebuild_exactly_the_generated_chunks():
    fake = FakeGenerate({1: 13, 2: 100})
    prompts = [[1, 5], [2, 7]]
    traces = chunked_generate(fake, prompts, jax.random.key(0), chunk_tokens=4,
                              carry_tokens=3, max_chunks=3)  # fmt: skip
    width = 12
    tokens = np.zeros((2, width), np.int32)
    logprobs = np.zeros((2, width), np.float32)
    for i, t in enumerate(traces):
        tokens[i, : len(t.tokens)], logprobs[i, : len(t.tokens)] = t.tokens, t.logprobs
    lengths = np.array([len(t.tokens) for t in traces])
    rows = chunk_rows(prompts, tokens, logprobs, lengths, chunk_tokens=4, carry_tokens=3,
                      max_chunks=3, buckets=(8, 16), pad_id=PAD)  # fmt: skip
    assert rows.context_tokens.shape == (6, 8) and rows.tokens.shape == (6, 4)
    assert rows.row_trace.tolist() == [0, 0, 1, 1, 1, -1]
    assert rows.last.tolist() == [False, True, False, False, True, False]
    real = 0
    for t in traces:
        for seg in t.segments:
            ctx = rows.context_tokens[real][rows.context_mask[real]]
            assert ctx.tolist() == seg.context.tolist()  # the context it was generated from
            n = int(rows.mask[real].sum())
            assert rows.tokens[real, :n].tolist() == seg.tokens.tolist()
            assert np.allclose(rows.logprobs[real, :n], seg.logprobs)
            real += 1
    assert rows.mask[5].sum() == 0  # filler row
    with pytest.raises(ValueError, match="max_chunks"):
        chunk_rows(prompts, tokens, logprobs, lengths, chunk_tokens=4, carry_tokens=3,
                   max_chunks=2, buckets=(8,), pad_id=PAD)  # fmt: skip


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_trace_advantages_equal_the_estimator_over_traces(estimator):
    # 4 traces in 2 groups; trace rewards 1, 0 | 0.5, 0.5+0.25; traces have 1-3 chunks.
    row_trace = np.array([0, 1, 1, 1, 2, 3, 3, -1])
    trace_group = np.array([0, 0, 1, 1])
    mask = np.ones((8, 3), np.float32)
    mask[2, 2:] = 0
    rewards = np.zeros((8, 3), np.float32)
    rewards[0, 2] = 1.0  # trace 0: outcome 1 on its only chunk
    rewards[4, 1] = 0.5
    rewards[5, 0] = 0.25  # a per-token term on trace 3's first chunk
    rewards[6, 2] = 0.5
    rewards[7, 0] = 5.0  # filler row: ignored
    valid = np.array([1, 1, 1, 1, 1, 1, 1, 0], np.float32)
    got = trace_advantages(
        jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(row_trace),
        jnp.asarray(trace_group), jnp.asarray(valid), num_groups=2, estimator=estimator,
    )  # fmt: skip
    trace_r = jnp.asarray([1.0, 0.0, 0.5, 0.75])
    if estimator == "rloo":
        want = rloo_advantages(trace_r, jnp.asarray(trace_group), num_groups=2)
    else:
        want = grpo_advantages(trace_r, jnp.asarray(trace_group), num_groups=2,
                               scale_by_std=estimator == "grpo")  # fmt: skip
    want_rows = np.where(row_trace >= 0, np.asarray(want)[np.maximum(row_trace, 0)], 0.0)
    np.testing.assert_allclose(np.asarray(got), want_rows[:, None] * mask, atol=1e-6)
    # A trace with one invalid row is out of its group's statistics; its rows get 0.
    valid[3] = 0
    got = trace_advantages(
        jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(row_trace),
        jnp.asarray(trace_group), jnp.asarray(valid), num_groups=2, estimator=estimator,
    )  # fmt: skip
    assert np.all(np.asarray(got)[1:4] == 0) and np.all(np.asarray(got)[0] == 0)  # alone
