"""Choosing tokens: sampling parameters, the per-sequence sampler, grammars and the watermark."""

from tokenmill.sampling.params import SamplingParams, uses_sampling
from tokenmill.sampling.sampler import (
    Choice,
    LogitsProcessor,
    SequenceSampler,
    new_seed,
    prompt_logprobs,
    top_logprobs,
    warp,
)

__all__ = ["Choice", "LogitsProcessor", "SamplingParams", "SequenceSampler", "new_seed", "prompt_logprobs",
           "top_logprobs", "uses_sampling", "warp"]
