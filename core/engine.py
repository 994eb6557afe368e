"""The engine loop: one thread that owns the model and runs continuous batching.

Each step: take new and cancelled requests from the HTTP side, let the scheduler
admit waiting sequences, prefill them (they join the running batch), run one
decode step for the whole batch, sample a token per sequence, check its stop
criteria, push the token to its channel, and release what finished. The HTTP
event loop never runs model code; this thread never waits on a client.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import pluggy
import torch

from tokenmill.detokenizer import IncrementalDetokenizer
from tokenmill.interfaces import BackendRunner, SchedulerQueue
from tokenmill.sampling import SequenceSampler, new_seed, prompt_logprobs, uses_sampling
from tokenmill.sequence import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    ErrorEvent,
    Event,
    EventSink,
    FinalResult,
    GenerationRequest,
    SamplingParams,
    Sequence,
    TokenEvent,
    TokenInfo,
)

log = logging.getLogger(__name__)


@dataclass
class SequenceState:
    """What the engine keeps per admitted sequence."""

    sampler: SequenceSampler
    detokenizer: IncrementalDetokenizer


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (generation_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


class Engine:
    def __init__(
        self,
        runner: BackendRunner,
        queue: SchedulerQueue,
        tokenizer: Any,
        eos_ids: set[int],
        pm: pluggy.PluginManager | None = None,
    ) -> None:
        self.runner = runner
        self.queue = queue
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.pm = pm
        self.running: list[Sequence] = []
        self._incoming: list[Sequence] = []
        self._cancelled: dict[int, Sequence] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0

    # ---- called from the HTTP side -------------------------------------------------

    def submit(self, request: GenerationRequest, sink: EventSink, seed: int | None = None) -> Sequence:
        """Queue one sequence; its events go to ``sink`` (called from the engine thread)."""
        if seed is None and uses_sampling(request.sampling):
            seed = request.sampling.seed if request.sampling.seed is not None else new_seed()
        seq = Sequence(request, sink, seed)
        with self._wake:
            self._incoming.append(seq)
            self._wake.notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """The client went away: drop the sequence at the next step and free its KV memory."""
        with self._wake:
            seq.cancelled = True
            self._cancelled[seq.id] = seq
            self._wake.notify()

    @property
    def queue_size(self) -> int:
        return len(self.queue) + len(self._incoming)

    @property
    def batch_size(self) -> int:
        return len(self.running)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tokenmill-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        for seq in self.running + self._incoming:
            seq.sink(ErrorEvent("the server is shutting down", "unhealthy"))

    def warmup(self, prompt_tokens: int = 16, new_tokens: int = 2) -> None:
        """Run one small request through prefill and decode before serving."""
        prompt = torch.randint(0, len(self.tokenizer), (prompt_tokens,)).tolist()
        request = GenerationRequest("", prompt, new_tokens, SamplingParams())
        events: list[Event] = []
        self.queue.add(Sequence(request, events.append, None))
        while not any(isinstance(e, ErrorEvent) or (isinstance(e, TokenEvent) and e.final) for e in events):
            self.step()
        errors = [e.message for e in events if isinstance(e, ErrorEvent)]
        if errors:
            raise RuntimeError(errors[0])

    # ---- the engine thread ------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not (self._incoming or self._cancelled or self.running or len(self.queue)):
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 - the loop must survive anything a step raises
                log.exception("engine step failed")
                self._fail(self.running, "internal error in the engine step")
            if not self.running and len(self.queue):
                # Nothing runs and nothing fits: wait for a change rather than spin.
                with self._wake:
                    if not (self._incoming or self._cancelled or self._stopping):
                        self._wake.wait(0.05)

    def run_once(self) -> None:
        """Take the requests and cancellations the HTTP side handed over, then run one step."""
        with self._wake:
            incoming, self._incoming = self._incoming, []
            cancelled, self._cancelled = self._cancelled, {}
        for seq in incoming:
            if not seq.cancelled:
                self.queue.add(seq)
        self._drop(cancelled)
        self.step()

    def _drop(self, cancelled: dict[int, Sequence]) -> None:
        if not cancelled:
            return
        leaving = [s for s in self.running if s.id in cancelled]
        for seq in cancelled.values():
            if seq not in leaving:
                self.queue.remove(seq)
        self._release(leaving)

    def step(self) -> None:
        """One engine step: admit and prefill newcomers, then decode the batch."""
        newcomers = self.queue.admit(self.running)
        if newcomers:
            self._prefill(newcomers)
        if self.running:
            self._decode()
        self.steps += 1

    def _prefill(self, seqs: list[Sequence]) -> None:
        now = time.monotonic()
        ready = []
        for seq in seqs:
            try:
                seq.admitted_at = now
                seq.state = self._new_state(seq)
                ready.append(seq)
            except Exception as error:  # noqa: BLE001 - a bad plugin processor fails only its request
                self._fail([seq], f"could not start the request: {error}")
        if not ready:
            return
        try:
            out = self.runner.prefill(ready, [s.request.decoder_input_details for s in ready])
        except Exception as error:  # noqa: BLE001
            log.exception("prefill failed")
            self._fail(ready, f"prefill failed: {type(error).__name__}: {error}")
            return
        self.running.extend(ready)
        for seq, logits in zip(ready, out.prompt_logits):
            if logits is not None:
                seq.prefill_tokens = self._prompt_tokens(seq.prompt_ids, logits)
        self._advance(ready, out.last_logits)

    def _decode(self) -> None:
        batch = list(self.running)
        try:
            logits = self.runner.decode(batch)
        except Exception as error:  # noqa: BLE001
            log.exception("decode failed")
            self._fail(batch, f"decode failed: {type(error).__name__}: {error}")
            return
        self._advance(batch, logits)

    def _new_state(self, seq: Sequence) -> SequenceState:
        extra: list[Any] = []
        if self.pm is not None:
            for processors in self.pm.hook.tokenmill_logits_processors(parameters=seq.request.parameters):
                extra.extend(processors or [])
        sampler = SequenceSampler(seq.request.sampling, seq.seed, extra, seq.request.top_n_tokens)
        return SequenceState(sampler, IncrementalDetokenizer(self.tokenizer))

    def _prompt_tokens(self, prompt_ids: list[int], logits: torch.Tensor) -> list[TokenInfo]:
        logprobs = prompt_logprobs(prompt_ids, logits)
        return [
            TokenInfo(i, self.tokenizer.decode([i]), lp, i in self.special_ids)
            for i, lp in zip(prompt_ids, logprobs)
        ]

    def _advance(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        finished = []
        for row, seq in enumerate(seqs):
            if seq.cancelled:
                finished.append(seq)
                continue
            try:
                if self._append_token(seq, logits[row]):
                    finished.append(seq)
            except Exception as error:  # noqa: BLE001 - one request's failure stays its own
                log.exception("sequence %d failed", seq.id)
                seq.sink(ErrorEvent(f"generation failed: {type(error).__name__}: {error}"))
                finished.append(seq)
        self._release(finished)

    def _release(self, seqs: list[Sequence]) -> None:
        if not seqs:
            return
        leaving = {s.id for s in seqs}
        self.runner.release([s for s in self.running if s.id in leaving])
        self.running = [s for s in self.running if s.id not in leaving]

    def _fail(self, seqs: list[Sequence], message: str) -> None:
        for seq in seqs:
            seq.sink(ErrorEvent(message))
        self._release(list(seqs))

    def _append_token(self, seq: Sequence, logits: torch.Tensor) -> bool:
        state: SequenceState = seq.state
        choice = state.sampler.choose(seq.prompt_ids + seq.generated_ids, logits)
        token_id = choice.token_id
        seq.generated_ids.append(token_id)
        special = token_id in self.special_ids
        text_before = len(state.detokenizer.text)
        text = state.detokenizer.push(token_id)
        reason = self._finish_reason(seq, token_id, text_before)
        if reason is not None:
            text += state.detokenizer.finish()
        if special:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        token = TokenInfo(token_id, text, choice.logprob, special)
        top = [TokenInfo(i, self.tokenizer.decode([i]), lp, i in self.special_ids) for i, lp in choice.top]
        seq.tokens.append(token)
        seq.top_tokens.append(top)
        final = None
        if reason is not None:
            seq.finish_reason = reason
            final = self._final(seq, state, reason)
        seq.sink(TokenEvent(index=len(seq.generated_ids), token=token, top_tokens=top, final=final))
        return reason is not None

    def _finish_reason(self, seq: Sequence, token_id: int, text_before: int) -> str | None:
        if len(seq.generated_ids) >= seq.request.max_new_tokens:
            return FINISH_LENGTH
        if token_id in self.eos_ids:
            return FINISH_EOS
        text = seq.state.detokenizer.text
        for stop in seq.request.stop:
            if stop in text[max(0, text_before - len(stop) + 1) :]:
                return FINISH_STOP
        return None

    def _final(self, seq: Sequence, state: SequenceState, reason: str) -> FinalResult:
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
            seed=seq.seed if state.sampler.sampling else None,
            input_length=seq.prompt_len,
            queue_seconds=admitted - seq.arrived_at,
            inference_seconds=now - admitted,
        )
