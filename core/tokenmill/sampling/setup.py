"""A sequence's sampler, set up from its request: watermark, plugins' processors, grammar, seed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

from tokenmill.sampling.sampler import LogitsProcessor, SequenceSampler
from tokenmill.sampling.watermark import WatermarkProcessor

if TYPE_CHECKING:
    from tokenmill.engine.sequence import GenerationRequest


def new_sampler(request: GenerationRequest, seed: int | None, prompt_len: int, eos_ids: frozenset[int],
                watermark: tuple[float, float], pm: pluggy.PluginManager | None) -> SequenceSampler:
    """The sampler of one sequence of ``request``: the watermark (green-list share and bias) when it
    asks for one, then every processor the plugins' ``tokenmill_logits_processors`` give for its
    parameters, and a matcher of its grammar, which may end only at one of ``eos_ids``. Until
    ``min_tokens`` are out, the tokens that would end it (its stop token ids, and ``eos_ids`` unless
    it ignores them) are held back."""
    processors: list[LogitsProcessor | Any] = []
    if request.sampling.watermark:
        processors.append(WatermarkProcessor(*watermark))
    if pm is not None:
        for offered in pm.hook.tokenmill_logits_processors(parameters=request.parameters):
            processors.extend(offered or [])
    matcher = request.grammar.new_matcher(eos_ids) if request.grammar is not None else None
    ending = frozenset(request.stop_token_ids) | (frozenset() if request.ignore_eos else eos_ids)
    return SequenceSampler(request.sampling, seed, processors, request.top_n_tokens, matcher, prompt_len,
                           min_tokens=request.min_tokens, end_ids=ending)
