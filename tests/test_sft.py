"""The supervised warm start (masks, data order, token budget) and the per-sample reward rule."""

import json

import jax
import numpy as np
import pytest

from rlpt import sft
from rlpt.models import CausalLM, create_model, get_preset
from rlpt.tasks import get_domain
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
