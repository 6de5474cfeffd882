"""Generation: sampling methods, the static KV-cache sampler and the rollout engine."""

from rlpt.sampling.chunked import (
    ChunkedSampler,
    ChunkedTrace,
    ChunkRows,
    ChunkSegment,
    chunk_rows,
    chunk_spans,
    chunked_generate,
    sampler_generate_fn,
    traces_output,
)
from rlpt.sampling.engine import Completion, Engine, Request, RequestParams
from rlpt.sampling.engine_sampler import SAMPLERS, EngineSampler, make_sampler
from rlpt.sampling.methods import GREEDY, SamplingParams, sample_tokens, sampling_log_probs
from rlpt.sampling.sampler import (
    DEFAULT_BUCKETS,
    SampleOutput,
    Sampler,
    bucket_length,
    generate,
    left_pad,
)

__all__ = [
    "ChunkRows",
    "ChunkSegment",
    "ChunkedSampler",
    "ChunkedTrace",
    "chunk_rows",
    "chunk_spans",
    "chunked_generate",
    "sampler_generate_fn",
    "traces_output",
    "SAMPLERS",
    "EngineSampler",
    "make_sampler",
    "Completion",
    "Engine",
    "Request",
    "RequestParams",
    "DEFAULT_BUCKETS",
    "GREEDY",
    "SampleOutput",
    "Sampler",
    "SamplingParams",
    "bucket_length",
    "generate",
    "left_pad",
    "sample_tokens",
    "sampling_log_probs",
]
