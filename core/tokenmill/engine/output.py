"""Output processing: a chosen token becomes text, is checked against the stop criteria, and
goes to the sequence's stream; a finished sequence gets its final result."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import pluggy
import torch

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.sequence import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    ErrorEvent,
    Event,
    FinalResult,
    Sequence,
    TokenEvent,
    TokenInfo,
)
from tokenmill.engine.speculation import draft_state
from tokenmill.engine.stops import StopMatcher
from tokenmill.sampling.grammar import batch_allowed
from tokenmill.sampling.sampler import SequenceSampler, prompt_scores
from tokenmill.sampling.setup import new_sampler

log = logging.getLogger(__name__)


@dataclass
class SequenceState:
    """What the engine keeps per admitted sequence."""

    sampler: SequenceSampler
    detokenizer: IncrementalDetokenizer
    stops: StopMatcher
    """The request's stop sequences, matched against the output text (special tokens included)."""


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """The ids that end a sequence: the model's generation config's and the tokenizer's."""
    return eos_ids_of(getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer)


def eos_ids_of(generation_eos: int | list[int] | None, tokenizer: Any) -> set[int]:
    """``generation_eos`` (an id or a list of them, from a generation config) and the tokenizer's eos id."""
    ids: set[int] = set()
    for value in (generation_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def emit(seq: Sequence, event: Event) -> None:
    """Push ``event`` to the sequence's stream, unless the sequence has ended already (its last event
    is its first final token or error); a stream that fails must not stop the engine."""
    if seq.ended:
        return
    seq.ended = isinstance(event, ErrorEvent) or event.final is not None
    try:
        seq.stream.push(seq.choice, event)
    except Exception:  # noqa: BLE001 - a closed stream must not stop the engine
        log.exception("could not deliver an event to sequence %d", seq.id)


class Output:
    """Turns the tokens chosen for sequences into their events and final results."""

    def __init__(self, tokenizer: Any, eos_ids: set[int], pm: pluggy.PluginManager | None,
                 watermark: tuple[float, float]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.pm = pm
        self.watermark = watermark
        """Green-list share and logit bias for requests that ask for a watermark."""

    def start(self, seq: Sequence) -> SequenceState:
        """A new sequence's sampler (its processors, grammar and seed) and detokenizer."""
        sampler = new_sampler(seq.request, seq.seed, seq.prompt_len, frozenset(self.eos_ids), self.watermark, self.pm)
        return SequenceState(sampler, IncrementalDetokenizer(self.tokenizer), StopMatcher(seq.request.stop))

    def token_info(self, token_id: int, logprob: float | None) -> TokenInfo:
        """One token as the API reports it, its text decoded alone."""
        return TokenInfo(token_id, self.tokenizer.decode([token_id]), logprob, token_id in self.special_ids)

    def prompt_token_infos(self, prompt_ids: list[int], logprobs: list[float | None]) -> list[TokenInfo]:
        """The prompt's tokens with their log-probabilities, as ``decoder_input_details`` reports them."""
        return [self.token_info(i, lp) for i, lp in zip(prompt_ids, logprobs)]

    def prompt_details(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Fill ``seq``'s prompt details from its prompt's ``logits``: each token's log-probability and,
        when the request asks for top tokens, the likeliest ones at each prompt position (echo scoring)."""
        logprobs, tops = prompt_scores(seq.prompt_ids, logits, seq.request.top_n_tokens)
        seq.prefill_tokens = self.prompt_token_infos(seq.prompt_ids, logprobs)
        seq.prefill_top_tokens = [[self.token_info(i, lp) for i, lp in top] for top in tops]

    def sample(self, seqs: list[Sequence], logits: torch.Tensor, drafts: list[tuple[int, ...]] | None = None,
               draft_logits: list[torch.Tensor] | None = None) -> list[Sequence]:
        """Choose each sequence's next token from its row of ``logits`` and hand it on; the
        sequences that finished (or failed, or were cancelled) are returned.

        A sequence with a draft (``drafts[row]``, and ``draft_logits[row]`` the logits after each of its
        tokens) goes on choosing from those while each token chosen equals the draft's: its tokens
        are the very ones single steps would have chosen, greedy or sampled (see :meth:`_choose_through`)."""
        finished = []
        masks = self.grammar_masks(seqs)
        for row, seq in enumerate(seqs):
            if seq.cancelled:
                finished.append(seq)
                continue
            try:
                draft = drafts[row] if drafts else ()
                rows = draft_logits[row] if draft else None
                if self._choose_through(seq, logits[row], masks.get(seq.id), draft, rows):
                    finished.append(seq)
            except Exception as error:  # noqa: BLE001 - one request's failure stays its own
                log.exception("sequence %d failed", seq.id)
                emit(seq, ErrorEvent(f"generation failed: {type(error).__name__}: {error}"))
                finished.append(seq)
        return finished

    def _choose_through(self, seq: Sequence, logits: torch.Tensor, mask: torch.Tensor | None,
                        draft: tuple[int, ...], draft_logits: torch.Tensor | None) -> bool:
        """Choose ``seq``'s token from ``logits``; while it equals the draft's next token, choose the one
        after it from the logits after that draft token. True when the sequence finished.

        Each choice is the sampler's own, one draw of its generator per token, with the penalties,
        grammar, stops and limits of the tokens before it. A draft token is kept exactly when the choice
        equals it: that is the speculative-sampling rule for a draft that proposes one token for sure
        (kept with probability p(token), else the choice follows p without it), so outputs keep their
        distribution, and a seeded request gets the same tokens with and without speculation."""
        sampler = seq.state.sampler
        if draft:
            draft_state(seq).drafted += len(draft)
        for position in range(len(draft) + 1):
            if position:  # the draft's token before this position was the choice
                seq.speculation.accepted += 1
            row = logits if position == 0 else draft_logits[position - 1]  # type: ignore[index]
            history = seq.token_ids if sampler.needs_history else []
            choice = sampler.choose(history, row, mask if position == 0 else None)
            if self.accept_token(seq, choice.token_id, choice.logprob, choice.top):
                return True
            if position == len(draft) or choice.token_id != draft[position]:
                return False
        return False

    @staticmethod
    def grammar_masks(seqs: list[Sequence]) -> dict[int, torch.Tensor]:
        """The next-token mask of each constrained sequence, by id, computed for all of them at once."""
        constrained = [s for s in seqs if not s.cancelled and s.state.sampler.matcher is not None]
        if not constrained:
            return {}
        try:
            allowed = batch_allowed([s.state.sampler.matcher for s in constrained])
        except Exception:  # noqa: BLE001 - each sampler then computes its own mask, and fails alone if it must
            log.exception("computing the grammar masks of the batch failed")
            return {}
        return {seq.id: allowed[i] for i, seq in enumerate(constrained)}

    def accept_token(self, seq: Sequence, token_id: int, logprob: float | None,
                     top: list[tuple[int, float]] | None = None) -> bool:
        """Append a chosen token to ``seq``: detokenize it, check the stop criteria and send its event.
        True when the sequence has finished (its final event is sent; the caller releases it)."""
        state: SequenceState = seq.state
        seq.generated_ids.append(token_id)
        special = token_id in self.special_ids
        text = state.detokenizer.push(token_id)
        if special:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        reason = self.finish_reason(seq, token_id, text)
        if reason is not None and not special:
            text += state.detokenizer.finish()
        token = TokenInfo(token_id, text, logprob, special)
        top_tokens = [self.token_info(i, lp) for i, lp in top or ()]
        seq.tokens.append(token)
        seq.top_tokens.append(top_tokens)
        final = None
        if reason is not None:
            seq.finish_reason = reason
            final = self.final(seq, reason)
        emit(seq, TokenEvent(index=len(seq.generated_ids), token=token, top_tokens=top_tokens, final=final,
                             held=state.stops.held))
        return reason is not None

    def finish_reason(self, seq: Sequence, token_id: int, new_text: str) -> str | None:
        """The length limit first; before ``min_tokens`` nothing else ends it (vLLM's rule: the stop
        matcher still reads the text, so a stop sequence that ends later is found)."""
        request = seq.request
        if len(seq.generated_ids) >= request.max_new_tokens:
            return FINISH_LENGTH
        stopped = bool(request.stop) and seq.state.stops.feed(new_text)
        if len(seq.generated_ids) < request.min_tokens:
            return None
        if token_id in self.eos_ids and not request.ignore_eos:
            return FINISH_EOS
        if stopped or token_id in request.stop_token_ids:
            return FINISH_STOP
        return None

    @staticmethod
    def final(seq: Sequence, reason: str) -> FinalResult:
        state: SequenceState = seq.state
        now = time.monotonic()
        admitted = seq.admitted_at or now
        text = state.detokenizer.text
        if seq.request.return_full_text:
            text = seq.request.inputs + text
        return FinalResult(
            generated_text=text,
            finish_reason=reason,
            tokens=list(seq.tokens),
            top_tokens=list(seq.top_tokens),
            prefill=list(seq.prefill_tokens),
            prefill_top=list(seq.prefill_top_tokens),
            seed=seq.seed if state.sampler.sampling else None,
            input_length=seq.prompt_len,
            queue_seconds=admitted - seq.arrived_at,
            inference_seconds=now - admitted,
            cached_tokens=seq.cached_tokens,
            draft_tokens=seq.speculation.drafted if seq.speculation is not None else 0,
            accepted_tokens=seq.speculation.accepted if seq.speculation is not None else 0,
        )
