"""The supervised warm start (masks, data order, token budget) and the per-sample reward rule."""

import json

import jax
import numpy as np
import pytest

from rlpt import sft
from rlpt.models import CausalLM, create_model, get_preset
from rlpt.sampling import SampleOutput, chunked_generate
from rlpt.tasks import get_domain, partition_of
from rlpt.tokenizers import ByteTokenizer

TOK = ByteTokenizer()


def test_loss_mask_covers_the_completion_and_eos_only():
    tokens, mask = sft.encode_example(TOK, "1+2=", "<answer>3", max_len=16)
    prompt = TOK.encode("1+2=", add_bos=True)
    completion = TOK.encode("<answer>3", add_eos=True)
    n = len(prompt) + len(completion)
    assert tokens[:n].tolist() == prompt + completion
    assert (tokens[n:] == TOK.pad_id).all()
    assert mask.tolist() == [0] * len(prompt) + [1] * len(completion) + [0] * (16 - n)
    assert sft.encode_example(TOK, "1+2=", "<answer>3", max_len=n - 1) is None


def test_jsonl_examples_and_schema_errors(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n\n")
    assert sft.read_jsonl_examples(str(path)) == [("a", "b")]
    path.write_text(json.dumps({"prompt": "a"}) + "\n")
    with pytest.raises(ValueError, match="completion"):
        sft.read_jsonl_examples(str(path))


def test_demonstration_stream_is_fixed_by_seed_and_resumes_by_position():
    domains = {"arithmetic": get_domain("arithmetic"), "stepwise_math": get_domain("stepwise_math")}
    levels = {"arithmetic": 2, "stepwise_math": 1}
    make = lambda position=0: sft.ExampleStream(
        TOK, batch_size=4, max_len=64, domains=domains, levels=levels, seed=3, position=position
    )
    a = make()
    first, second = a.next_batch(), a.next_batch()
    b = make(position=4)
    np.testing.assert_array_equal(b.next_batch()[0], second[0])
    assert not np.array_equal(first[0], second[0])
    # The token budget buys whole batches until it is spent.
    tokens_per_batch = first[2]
    assert sft.steps_for_budget(make(), tokens_per_batch) == 1
    assert sft.steps_for_budget(make(), tokens_per_batch + 1) == 2


def test_a_few_steps_lower_the_loss_on_a_fixed_batch():
    cfg = get_preset("tiny")
    graph, params = create_model(lambda rngs: CausalLM(cfg, rngs=rngs), jax.random.key(0))
    trainer = sft.sft_trainer(sft.train_config(3e-3, warmup_steps=1), graph)
    rows = [sft.encode_example(TOK, f"{i}+1=", f"<answer>{i + 1}", 32) for i in range(8)]
    batch = {"tokens": np.stack([r[0] for r in rows]), "loss_mask": np.stack([r[1] for r in rows])}
    before = float(trainer.evaluate(params, batch)["loss"])
    state = trainer.init(params)
    for _ in range(20):
        state, metrics = trainer.step(state, batch)
    assert float(trainer.evaluate(state.params, batch)["loss"]) < before - 1.0
    assert int(state.step) == 20


def test_chunked_vocabulary_gives_the_same_loss_accuracy_and_gradients():
    rows = [sft.encode_example(TOK, f"{i}*3=", f"<answer>{3 * i}", 24) for i in range(4)]
    batch = {"tokens": np.stack([r[0] for r in rows]), "loss_mask": np.stack([r[1] for r in rows])}

    def objective(vocab_chunk):
        cfg = get_preset("tiny", vocab_chunk=vocab_chunk)
        graph, params = create_model(lambda rngs: CausalLM(cfg, rngs=rngs), jax.random.key(0))
        fn = jax.value_and_grad(lambda p: sft.sft_objective(graph, p, batch), has_aux=True)
        return jax.jit(fn)(params)

    (dense_loss, dense_metrics), dense_grads = objective(0)
    (loss, metrics), grads = objective(5)  # 23 targets a row: four chunks and a ragged one
    np.testing.assert_allclose(loss, dense_loss, rtol=1e-6)
    assert float(metrics["token_accuracy"]) == float(dense_metrics["token_accuracy"])
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(dense_grads)):
        assert float(jax.numpy.abs(a - b).max()) <= 1e-5


class ReplayGenerate:
    """A sampler stand-in that writes fixed completions: the row whose context starts
    with ``prompt`` writes the next tokens of ``completions[prompt]`` (which ends in
    EOS) from where its previous call stopped."""

    def __init__(self, completions):
        self.completions = {tuple(p): list(c) for p, c in completions.items()}
        self.written = dict.fromkeys(self.completions, 0)

    def __call__(self, contexts, key, max_new_tokens):
        del key
        n = len(contexts)
        out = SampleOutput(
            np.full((n, max_new_tokens), TOK.pad_id, np.int32),
            np.zeros((n, max_new_tokens), np.float32),
            np.zeros((n, max_new_tokens), np.float32),
            np.zeros(n, np.int32),
            np.ones(n, bool),
        )
        for i, context in enumerate(contexts):
            (prompt,) = [p for p in self.completions if tuple(context[: len(p)]) == p]
            done = self.written[prompt]
            new = self.completions[prompt][done : done + max_new_tokens]
            self.written[prompt] = done + len(new)
            out.tokens[i, : len(new)], out.mask[i, : len(new)] = new, 1.0
            out.lengths[i] = len(new)
            out.truncated[i] = new[-1] != TOK.eos_id
        return out


def _state_tracking_pairs(n):
    domain = get_domain("state_tracking")
    return [(t.prompt, domain.demonstration(t)) for t in domain.tasks("train", n, 2)]


@pytest.mark.parametrize("chunk_tokens, carry_tokens", [(8, 5), (16, 0), (6, 5)])
def test_chunked_sft_rows_are_the_windows_chunked_generation_makes(chunk_tokens, carry_tokens):
    # Two demonstrations of different lengths, and one whose completion (with EOS) is
    # exactly two chunks long, so its last chunk ends at a boundary.
    pairs = _state_tracking_pairs(2) + [("p", "a" * (2 * chunk_tokens - 1))]
    prompt_ids = [TOK.encode(p, add_bos=True) for p, _ in pairs]
    completion_ids = [TOK.encode(c, add_eos=True) for _, c in pairs]
    replay = ReplayGenerate(dict(zip(map(tuple, prompt_ids), completion_ids)))
    traces = chunked_generate(
        replay, prompt_ids, jax.random.key(0), chunk_tokens=chunk_tokens,
        carry_tokens=carry_tokens, max_chunks=100,
    )  # fmt: skip
    for (prompt, completion), trace, ids in zip(pairs, traces, completion_ids):
        assert trace.finished and trace.tokens.tolist() == ids  # the replay is faithful
        windows = [(s.context.tolist(), s.tokens.tolist()) for s in trace.segments]
        assert sft.chunked_examples(trace.prompt, ids, chunk_tokens, carry_tokens) == windows
        rows = sft.encode_chunked_example(
            TOK, prompt, completion, 64, chunk_tokens=chunk_tokens, carry_tokens=carry_tokens
        )
        assert len(rows) == len(windows)
        for (tokens, mask), (context, chunk) in zip(rows, windows):
            n = len(context) + len(chunk)
            assert tokens[:n].tolist() == context + chunk
            assert (tokens[n:] == TOK.pad_id).all()
            assert mask.tolist() == [0] * len(context) + [1] * len(chunk) + [0] * (64 - n)
    # The exact-boundary demonstration: two full chunks, the second ending in EOS.
    assert [len(s.tokens) for s in traces[2].segments] == [chunk_tokens, chunk_tokens]


def test_a_chunked_row_longer_than_max_len_drops_the_example():
    prompt, completion = _state_tracking_pairs(1)[0]
    widest = len(TOK.encode(prompt, add_bos=True)) + 4 + 8
    kw = dict(chunk_tokens=8, carry_tokens=4)
    assert sft.encode_chunked_example(TOK, prompt, completion, widest, **kw) is not None
    assert sft.encode_chunked_example(TOK, prompt, completion, widest - 1, **kw) is None


def test_chunked_stream_splits_examples_across_batches_and_resumes_inside_one():
    domains = {"state_tracking": get_domain("state_tracking")}
    kw = dict(batch_size=5, max_len=64, domains=domains, levels={"state_tracking": 2}, seed=3,
              chunk_tokens=8, carry_tokens=5)  # fmt: skip
    stream = sft.ExampleStream(TOK, **kw)
    batches = [stream.next_batch() for _ in range(6)]
    # The batches are every example's chunk rows in order, cut every 5 rows.
    expected = [
        row
        for i in range(stream.position)
        for row in sft.encode_chunked_example(
            TOK, *sft.demonstration(domains, {"state_tracking": 2}, 3, i), 64,
            chunk_tokens=8, carry_tokens=5,
        )
    ][:30]  # fmt: skip
    assert np.array_equal(np.concatenate([b[0] for b in batches]), [r[0] for r in expected])
    assert np.array_equal(np.concatenate([b[1] for b in batches]), [r[1] for r in expected])
    assert [b[2] for b in batches] == [int(b[1].sum()) for b in batches]
    # Resume from batch 3's state: the same next batches, even from inside an example.
    stream = sft.ExampleStream(TOK, **kw)
    for _ in range(3):
        stream.next_batch()
    assert stream.chunk_offset not in (0, len(stream.rows(stream.position - 1)))
    resumed = sft.ExampleStream(TOK, **kw)
    resumed.seek(stream.position, stream.chunk_offset)
    for b in batches[3:]:
        assert np.array_equal(resumed.next_batch()[0], b[0])


def test_fixed_demonstrations_are_a_fixed_training_set_per_domain():
    domains = {n: get_domain(n) for n in ("arithmetic", "fractions")}
    levels = {"arithmetic": 2, "fractions": 2}
    pairs = sft.fixed_demonstrations(domains, levels, seed=3, per_domain=6)
    assert len(pairs) == 12
    assert pairs == sft.fixed_demonstrations(domains, levels, seed=3, per_domain=6)
    # Six per domain (fraction prompts are the ones with a '/'), all from training items.
    assert sum("/" in p for p, _ in pairs) == 6
    for name, domain in domains.items():
        own = [p for p, _ in pairs if ("/" in p) == (name == "fractions")]
        for prompt in own:
            assert partition_of(prompt, domain.heldout_fraction) == "train"
    # A stream over them cycles the same twelve examples, epoch after epoch.
    stream = sft.ExampleStream(ByteTokenizer(), batch_size=4, max_len=64, examples=pairs, seed=0)
    seen = [stream._example(i) for i in range(36)]
    assert sorted(seen[:12]) == sorted(seen[12:24]) == sorted(seen[24:]) == sorted(pairs)
