"""The rollout engine on a Ray actor (a local ``ray.init``): the same samples as a local
engine, and an asynchronous run driven through it keeps its staleness bound."""

import os
import sys

import jax
import numpy as np
import pytest

from rlpt.models import CausalLM, create_model, get_preset
from rlpt.sampling import Engine

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_helpers import requests, run_async_and_check  # noqa: E402

ray = pytest.importorskip("ray", reason="RayEngine needs: pip install 'rlpt[ray]'")
from rlpt.asyncrl.ray_engine import RayEngine  # noqa: E402

CFG = get_preset("tiny")


@pytest.fixture(scope="module")
def ray_session():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def test_ray_engine_samples_what_a_local_engine_samples(ray_session):
    graph, params = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0))
    local = Engine(graph, params, CFG, eos_id=2, num_slots=4)
    remote = RayEngine(graph, params, CFG, eos_id=2, num_slots=4, actor_options={"num_cpus": 0})
    try:
        want = local.generate(requests())
        got = remote.generate(requests())
        assert [(c.request_id, c.index) for c in got] == [(c.request_id, c.index) for c in want]
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
        # New weights reach the actor with their version; every later token carries it.
        remote.update_weights(jax.tree.map(lambda x: x * 0.5, params), version=3)
        assert remote.version == 3
        assert all((c.versions == 3).all() for c in remote.generate(requests(n=1)))
    finally:
        remote.close()


def test_an_async_run_through_a_ray_engine_keeps_its_bound(ray_session):
    graph, params = create_model(lambda r: CausalLM(CFG, rngs=r), jax.random.key(0))
    remote = RayEngine(graph, params, CFG, eos_id=2, num_slots=8, actor_options={"num_cpus": 0})
    try:
        run_async_and_check(remote, params)
    finally:
        remote.close()
