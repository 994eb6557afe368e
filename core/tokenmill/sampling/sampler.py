"""Turning logits into tokens: penalties, plugin processors, warpers, and the choice.

The order follows TGI: repetition penalty, frequency penalty (and OpenAI's presence
and frequency penalties), OpenAI's logit bias, the request's processors (watermark, plugins),
the grammar mask, the tokens held back until ``min_tokens`` (vLLM's rule), then (when sampling)
temperature, min-p, top-k, top-p and typical-p; greedy takes the argmax. Log-probabilities
are those of the processed distribution.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.sampling.params import SamplingParams, uses_sampling

if TYPE_CHECKING:
    from tokenmill.sampling.grammar import TokenMatcher

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]

FLOAT32_MAX = torch.finfo(torch.float32).max


def new_seed() -> int:
    return random.SystemRandom().randrange(1, 2**63 - 1)


@dataclass
class Choice:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class SequenceSampler:
    """The sampling state of one sequence: its generator and extra processors."""

    def __init__(
        self, params: SamplingParams, seed: int | None, processors: list[LogitsProcessor], top_n: int,
        matcher: TokenMatcher | None = None, prompt_len: int = 0, min_tokens: int = 0,
        end_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.params = params
        self.sampling = uses_sampling(params)
        self.processors = processors
        self.matcher = matcher
        """The grammar the output must follow, or None."""
        self.prompt_len = prompt_len
        """Where the generated tokens start in the history (OpenAI's penalties count only those)."""
        self.needs_history = bool(
            processors or params.frequency_penalty or params.repetition_penalty not in (None, 1.0)
            or params.presence_penalty or params.occurrence_penalty
        )
        """Whether ``process`` reads the token history (else callers may pass an empty list)."""
        self.min_tokens = min_tokens
        """Until this many tokens are chosen, none of ``end_ids`` (EOS, stop token ids) may be."""
        self.end_ids = torch.tensor(sorted(end_ids), dtype=torch.long) if min_tokens and end_ids else None
        self.chosen = 0
        """Tokens chosen so far (the sampler lives as long as its sequence, preemptions included)."""
        self.bias_ids = torch.tensor([i for i, _ in params.logit_bias], dtype=torch.long)
        self.bias_values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
        self.top_n = top_n
        self.generator: torch.Generator | None = None
        if self.sampling:
            self.generator = torch.Generator().manual_seed(seed if seed is not None else new_seed())

    def process(self, token_ids: list[int], logits: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The processed scores of one row ``[vocab]`` (float32). ``allowed`` is the grammar's mask
        when the caller computed it (the engine does, for the whole batch at once)."""
        scores = logits.float()
        p = self.params
        if (p.repetition_penalty not in (None, 1.0)) or p.frequency_penalty:
            history = torch.tensor(token_ids, dtype=torch.long, device=scores.device)
            if p.repetition_penalty not in (None, 1.0):
                seen = torch.unique(history)
                picked = scores[seen]
                scores = scores.clone()
                # In float64 and clamped to float32's range: a penalty as small as 5e-324 (0 in float32)
                # must not turn a score into inf or 0 / 0 (NaN), which no token can be sampled from.
                wide = picked.double()
                penalized = torch.where(wide < 0, wide * p.repetition_penalty, wide / p.repetition_penalty)
                scores[seen] = penalized.clamp(-FLOAT32_MAX, FLOAT32_MAX).to(scores.dtype)
            if p.frequency_penalty:
                # TGI's rule: the penalty scales each token's share of the sequence so far.
                counts = torch.bincount(history, minlength=scores.shape[-1]).to(scores.dtype)
                scores = scores - p.frequency_penalty * counts / len(token_ids)
        if p.presence_penalty or p.occurrence_penalty:
            scores = self._openai_penalties(token_ids[self.prompt_len:], scores)
        if p.logit_bias:
            scores = scores.index_add(0, self.bias_ids.to(scores.device), self.bias_values.to(scores.device))
        for processor in self.processors:
            scores = processor(token_ids, scores)
        if self.matcher is not None:
            scores = torch.where(self.matcher.allowed() if allowed is None else allowed, scores, -math.inf)
        if self.end_ids is not None and self.chosen < self.min_tokens:
            held = scores.index_fill(0, self.end_ids.to(scores.device), -math.inf)
            if bool(torch.isfinite(held).any()):  # a grammar that can only end here still ends
                scores = held
        if self.sampling:
            scores = warp(scores, p)
        return scores

    def _openai_penalties(self, generated: list[int], scores: torch.Tensor) -> torch.Tensor:
        """OpenAI's rule: each token generated so far loses ``presence_penalty`` once and
        ``frequency_penalty`` (here ``occurrence_penalty``) per occurrence."""
        if not generated:
            return scores
        p = self.params
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=scores.shape[-1])
        counts = counts[: scores.shape[-1]].to(scores.dtype)
        return (scores - (p.occurrence_penalty or 0.0) * counts
                - (p.presence_penalty or 0.0) * (counts > 0).to(scores.dtype))

    def choose(self, token_ids: list[int], logits: torch.Tensor, allowed: torch.Tensor | None = None) -> Choice:
        scores = self.process(token_ids, logits, allowed)
        logprobs = torch.log_softmax(scores, dim=-1)
        if self.sampling:
            probs = logprobs.exp()
            token_id = int(torch.multinomial(probs, 1, generator=self.generator).item())
        else:
            token_id = int(torch.argmax(scores).item())
        logprob = float(logprobs[token_id])
        if not math.isfinite(logprob):
            raise FloatingPointError(f"the chosen token's log-probability is {logprob} (non-finite logits)")
        if self.matcher is not None:
            self.matcher.accept(token_id)
        self.chosen += 1
        return Choice(token_id, logprob, top_logprobs(logprobs, self.top_n))


def top_logprobs(logprobs: torch.Tensor, n: int) -> list[tuple[int, float]]:
    if n <= 0:
        return []
    values, ids = torch.topk(logprobs, n)
    return [(int(i), float(v)) for i, v in zip(ids, values) if math.isfinite(float(v))]


def warp(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p, top-k, top-p and typical-p truncation (removed tokens get -inf)."""
    if p.temperature is not None and p.temperature != 1.0:
        # Relative to the best score and in float64 (the same softmax): no valid temperature, from
        # 5e-324 (0 in float32) to 1e308, overflows the scores into inf - inf or 0 / 0 (NaN).
        scores = ((scores.double() - scores.max()) / p.temperature).to(scores.dtype)
    if p.min_p:
        # p / p_max < min_p, compared as log-probability gaps: exact at min_p 1 (only the best stay).
        scores = scores.masked_fill(scores - scores.max() < math.log(p.min_p), -math.inf)
    if p.top_k:
        k = min(p.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if p.top_p is not None and p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_scores.softmax(-1) >= p.top_p
        drop_sorted[0] = False
        scores = scores.masked_fill(drop_sorted.scatter(0, order, drop_sorted), -math.inf)
    if p.typical_p is not None and p.typical_p < 1.0:
        logprobs = scores.log_softmax(-1)
        probs = logprobs.exp()
        entropy = -(torch.nan_to_num(probs * logprobs)).sum()
        deviation = (-logprobs - entropy).abs()
        sorted_dev, order = torch.sort(deviation)
        cumulative = probs[order].cumsum(-1)
        keep_count = int((cumulative < p.typical_p).sum().item()) + 1
        drop_sorted = torch.ones_like(sorted_dev, dtype=torch.bool)
        drop_sorted[:keep_count] = False
        scores = scores.masked_fill(drop_sorted.scatter(0, order, drop_sorted), -math.inf)
    return scores


def prompt_logprobs(prompt_ids: list[int], logits: torch.Tensor) -> list[float | None]:
    """Log-probability of each prompt token given the ones before it; None for the first."""
    return prompt_scores(prompt_ids, logits, 0)[0]


def prompt_scores(prompt_ids: list[int], logits: torch.Tensor,
                  top_n: int) -> tuple[list[float | None], list[list[tuple[int, float]]]]:
    """Each prompt token's log-probability (None for the first) and the ``top_n`` likeliest tokens at
    its position (none for the first), from one softmax: a scorer that asks whether the prompt was
    the greedy choice compares the two, so they must be the very same numbers."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    targets = torch.tensor(prompt_ids[1:], dtype=torch.long)
    picked = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1) if len(prompt_ids) > 1 else []
    tops: list[list[tuple[int, float]]] = [[]]
    if top_n > 0 and len(prompt_ids) > 1:
        values, ids = torch.topk(logprobs, min(top_n, logprobs.shape[-1]), dim=-1)
        tops += [[(int(i), float(v)) for i, v in zip(row_ids, row_values) if math.isfinite(float(v))]
                 for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    else:
        tops += [[] for _ in prompt_ids[1:]]
    return [None] + [float(v) for v in picked], tops
