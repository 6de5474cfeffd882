"""Fixtures shared by the RL maths tests."""

import functools

import jax
import pytest


@pytest.fixture(params=[False, True], ids=["nojit", "jit"])
def variant(request):
    """Binds keyword config with functools.partial, then jits or not."""

    def wrap(fn, **static):
        bound = functools.partial(fn, **static)
        return jax.jit(bound) if request.param else bound

    return wrap
