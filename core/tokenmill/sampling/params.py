"""How a request wants its tokens chosen: the sampling parameters, validated."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    """TGI's rule: scaled by each token's share of the whole sequence (prompt included)."""
    presence_penalty: float | None = None
    """OpenAI's: subtracted once from every token already generated."""
    occurrence_penalty: float | None = None
    """OpenAI's ``frequency_penalty``: subtracted per occurrence in the generated tokens."""
    seed: int | None = None
    watermark: bool = False
    """Bias each step towards a green list seeded by the previous token (``--watermark-gamma``/``-delta``)."""
    min_p: float | None = None
    """vLLM's: when sampling, drop tokens less likely than ``min_p`` times the likeliest one."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI's (token id, bias) pairs, added to the logits before any choice, greedy or sampled."""


def uses_sampling(params: SamplingParams) -> bool:
    """Sampling is on when asked for, or implied by any warper (as in TGI). ``min_p`` is not one: as
    in vLLM it only narrows a choice that is sampled already, so alone it leaves a request greedy."""
    return (
        params.do_sample
        or (params.temperature is not None and params.temperature != 1.0)
        or bool(params.top_k)
        or (params.top_p is not None and params.top_p < 1.0)
        or (params.typical_p is not None and params.typical_p < 1.0)
    )
