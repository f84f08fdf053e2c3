"""Token choice for a decoding step: per-request generators, batch-invariant sampling, raw logprobs."""

from engine.sampling.logprobs import raw_logprobs
from engine.sampling.sampler import (
    GREEDY_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    SampleResult,
    make_generator,
    sample,
    seed_step,
    validate_sampling_params,
)

__all__ = [
    "GREEDY_TEMPERATURE",
    "MAX_TOP_LOGPROBS",
    "SampleResult",
    "make_generator",
    "raw_logprobs",
    "sample",
    "seed_step",
    "validate_sampling_params",
]
