"""``ReplicatedEngine``: two engines on disjoint device pairs sample what one engine samples,
spread the requests, stop and requeue what they are asked to, take new weights together
and carry an asynchronous run."""

import os
import sys

import jax
import numpy as np
import pytest

from rlpt.asyncrl.replicated import ReplicatedEngine
from rlpt.models import CausalLM, create_model, get_preset
from rlpt.parallel import make_mesh
from rlpt.sampling import Engine, Request, RequestParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_helpers import requests, run_async_and_check  # noqa: E402

CFG = get_preset("tiny")


@pytest.fixture(scope="module")
def model():
    return create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0))


def _engine(model, devices, **kwargs):
    graph, params = model
    return Engine(graph, params, CFG, eos_id=2, num_slots=4, mesh=make_mesh(devices=devices),
                  **kwargs)  # fmt: skip


def _replicas(model):
    devices = jax.devices()
    return ReplicatedEngine([_engine(model, devices[0:2]), _engine(model, devices[2:4])])


def test_replicas_sample_what_one_engine_samples(model):
    one = _engine(model, jax.devices()[4:6])
    replicas = _replicas(model)
    want = one.generate(requests(n=6))
    got = replicas.generate(requests(n=6))
    assert [(c.request_id, c.index) for c in got] == [(c.request_id, c.index) for c in want]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
    # Both replicas sampled: 6 groups of 2 went 3 and 3 by outstanding samples.
    per_replica = [e.stats.generated_tokens for e in replicas.engines]
    assert all(t > 0 for t in per_replica)
    assert replicas.stats.generated_tokens == sum(per_replica) == one.stats.generated_tokens
    assert not replicas.has_work()
    # New weights reach every replica; later tokens carry their version.
    graph, params = model
    replicas.update_weights(jax.tree.map(lambda x: x * 0.5, params), 3)
    assert replicas.version == 3 and [e.version for e in replicas.engines] == [3, 3]
    assert all((c.versions == 3).all() for c in replicas.generate(requests(n=2)))


def test_abort_stops_or_requeues_on_the_request_replica(model):
    replicas = _replicas(model)
    long = RequestParams(max_tokens=12, n=2, seed=0)
    replicas.submit([Request(k, [5, 9, 11], long) for k in ("a", "b", "c")])
    replicas.step()
    replicas.abort("b")  # stopped: its samples come back as aborted
    replicas.abort("c", requeue=True)  # started again from its prompt
    replicas.abort("unknown")  # nothing to stop, as for one engine
    done = []
    while replicas.has_work():
        done += replicas.step()
    reasons = {(c.request_id, c.index): c.finish_reason for c in done}
    assert sorted(reasons) == [(k, i) for k in "abc" for i in (0, 1)]
    assert reasons[("b", 0)] == reasons[("b", 1)] == "aborted"
    assert all(reasons[(k, i)] != "aborted" for k in "ac" for i in (0, 1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        replicas.submit([Request("ok", [5, 9], long), Request("bad", [10**6], long)])
    # The request before the bad one was queued and runs; the bad one left no trace.
    done = replicas.generate([])
    while replicas.has_work():
        done += replicas.step()
    assert {c.request_id for c in done} == {"ok"}


def test_an_async_run_through_replicas_keeps_its_bound(model):
    replicas = _replicas(model)
    run_async_and_check(replicas, model[1])
    assert all(e.stats.generated_tokens > 0 for e in replicas.engines)
