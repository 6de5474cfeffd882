"""Isolated execution of untrusted programs: the pool, its request and result types.

``SandboxPool`` imports nothing heavy, and its workers are fresh interpreters, so the pool is
safe to create from a process that has already imported JAX.
"""

from rlpt.sandbox.backends import BACKENDS, RayPool, make_pool, pool_from_config
from rlpt.sandbox.pool import IsolationUnavailable, SandboxPool, outputs_match
from rlpt.sandbox.types import ExecutionRequest, ExecutionResult, IOCase, Status

__all__ = [
    "BACKENDS",
    "ExecutionRequest",
    "ExecutionResult",
    "IOCase",
    "IsolationUnavailable",
    "RayPool",
    "SandboxPool",
    "Status",
    "make_pool",
    "pool_from_config",
    "outputs_match",
]
