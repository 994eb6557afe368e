"""The engine loop: one thread that owns the model and runs continuous batching.

Each step: take new and cancelled requests from the HTTP side, preempt the newest
sequences if KV memory cannot hold the next token of each, let the scheduler admit
waiting sequences, then one backend call prefills the newcomers (long prompts in
chunks over several steps) while the running batch decodes a token. Each sequence
samples its token, checks its stop criteria, pushes it to its channel, and leaves
the batch the step it finishes. The HTTP event loop never runs model code; this
thread never waits on a client.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import pluggy
import torch

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.sampling.grammar import batch_allowed
from tokenmill.interfaces import BackendRunner, PrefillOutput, SchedulerQueue, StepBudget, StepOutput
from tokenmill.sampling.sampler import SequenceSampler, new_seed, prompt_logprobs, uses_sampling
from tokenmill.engine.sequence import (
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
from tokenmill.sampling.watermark import WatermarkProcessor

log = logging.getLogger(__name__)

StepObserver = Callable[[str, int, float, float, bool], None]
"""(method "prefill" or "decode", sequences prefilling in the step, forward seconds, whole step
seconds, succeeded)."""


@dataclass
class SequenceState:
    """What the engine keeps per admitted sequence."""

    sampler: SequenceSampler
    detokenizer: IncrementalDetokenizer
    stop_window: str = ""
    """The newest output text, special tokens included, that stop sequences are matched in."""


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


class Engine:
    """Continuous batching over a :class:`BackendRunner`.

    A backend that brings its own engine (``Backend.owns_engine``) subclasses this class and
    replaces :meth:`step`: it admits from ``self.queue``, starts each admitted sequence with
    :meth:`start_sequence`, hands every token its engine chose to :meth:`accept_token`, and ends
    sequences with :meth:`release` or :meth:`fail`. Queueing, cancellation, detokenization, stop
    sequences and the events the HTTP side reads stay the same. Its runner still answers
    ``chunked_prefill``, ``pausable``, ``kv_block_size``, ``kv_free_tokens``, ``release``,
    ``reset`` and ``kv_usage``.
    """

    def __init__(
        self,
        runner: BackendRunner,
        queue: SchedulerQueue,
        tokenizer: Any,
        eos_ids: set[int],
        prefill_budget: int,
        pm: pluggy.PluginManager | None = None,
        stream_buffer_tokens: int = 64,
        watermark: tuple[float, float] = (0.5, 2.0),
    ) -> None:
        self.runner = runner
        self.queue = queue
        self.prefill_budget = prefill_budget
        self.stream_buffer_tokens = stream_buffer_tokens
        """A sequence whose client has this many tokens unread pauses (keeping its KV) until it reads."""
        self.watermark_gamma, self.watermark_delta = watermark
        """Green-list share and logit bias for requests that ask for a watermark."""
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.pm = pm
        self.step_observer: StepObserver | None = None
        """Told about every step that runs the model (the server sets its metrics here after warm-up)."""
        self.running: list[Sequence] = []
        """Sequences that decode: their whole context is in the KV cache."""
        self.prefilling: list[Sequence] = []
        """Admitted sequences whose prompt is prefilled in chunks over several steps."""
        self.preemptions = 0
        self.suspensions = 0
        self.prefix_caching = bool(getattr(runner, "prefix_caching", False))
        """Whether sequences start from the runner's cached prefixes (see :meth:`BackendRunner.prefix_hit`)."""
        self.prefix_queried_tokens = 0
        """Tokens of the sequences started (or restarted after a preemption) that were looked up in the prefix cache ..."""
        self.prefix_hit_tokens = 0
        """... and of those, the tokens found there."""
        self._reset_requests: list[Callable[[int], None]] = []
        self._incoming: list[Sequence] = []
        self._cancelled: dict[int, Sequence] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._broken = False
        self._closed = False
        """Set when the loop has ended: later submissions fail at once instead of waiting forever."""
        self._thread: threading.Thread | None = None
        self._published: tuple[tuple[Sequence, ...], ...] = ((), (), ())

    # ---- called from the HTTP side -------------------------------------------------

    def submit(self, request: GenerationRequest, sink: EventSink, seed: int | None = None,
               backlog: Callable[[], int] | None = None) -> Sequence:
        """Queue one sequence; its events go to ``sink`` (called from the engine thread).
        ``backlog`` tells how many of them the client has not taken yet (see ``stream_buffer_tokens``)."""
        if seed is None and uses_sampling(request.sampling):
            seed = request.sampling.seed if request.sampling.seed is not None else new_seed()
        seq = Sequence(request, sink, seed)
        if backlog is not None:
            seq.backlog = backlog
        with self._wake:
            if not self._closed:
                self._incoming.append(seq)
                self._wake.notify()
                return seq
        self._emit(seq, ErrorEvent("the engine is not running", "unhealthy"))
        return seq

    def refusal(self, request: GenerationRequest) -> str | None:
        """Why this engine cannot run ``request`` (answered with 422 at validation), or None."""
        return None

    def cancel(self, seq: Sequence) -> None:
        """The client went away: drop the sequence at the next step and free its KV memory."""
        with self._wake:
            seq.cancelled = True
            self._cancelled[seq.id] = seq
            self._wake.notify()

    def reset_prefix_cache(self, done: Callable[[int], None]) -> None:
        """Drop every cached block that no sequence holds, between two steps; ``done`` is then called
        (from the engine thread) with how many."""
        with self._wake:
            closed = self._closed
            if not closed:
                self._reset_requests.append(done)
                self._wake.notify()
        if closed:
            done(0)

    def drop_cached_prefixes(self) -> int:
        """(Engine thread.) What :meth:`reset_prefix_cache` does; an engine-owning backend's engine
        overrides it to reset its own cache."""
        return self.runner.reset_prefix_cache() if self.prefix_caching else 0

    @property
    def queue_size(self) -> int:
        return len(self.queue) + len(self._incoming)

    @property
    def batch_size(self) -> int:
        return len(self.running) + len(self.prefilling)

    @property
    def healthy(self) -> bool:
        """False once the engine thread has died or given up; /health then says 503."""
        return self._thread is not None and self._thread.is_alive() and not self._broken

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tokenmill-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop; every sequence still queued or running gets an error event."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def warmup(self, prompt_tokens: int, vocab_size: int, new_tokens: int = 2, max_steps: int = 100) -> None:
        """Run one small request through prefill and decode before serving."""
        prompt = torch.randint(0, vocab_size, (prompt_tokens,)).tolist()
        request = GenerationRequest("", prompt, new_tokens, SamplingParams())
        events: list[Event] = []
        self.queue.add(Sequence(request, events.append, None))
        for _ in range(max_steps):
            self.step()
            errors = [e.message for e in events if isinstance(e, ErrorEvent)]
            if errors:
                raise RuntimeError(errors[0])
            if any(isinstance(e, TokenEvent) and e.final for e in events):
                return
        raise RuntimeError(f"the warm-up request did not finish in {max_steps} steps (is the prefill budget too small?)")

    # ---- the engine thread ------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._broken and self._wait_for_work():
                try:
                    self.run_once()
                except Exception:  # noqa: BLE001 - a step that fails must not end the loop
                    log.exception("engine step failed; failing the running batch and starting afresh")
                    self.fail(self.running + self.prefilling, "internal error in the engine step")
                    self.runner.reset()
                    self.running, self.prefilling = [], []
        except Exception:  # noqa: BLE001 - even recovery failed: stop serving, loudly
            log.exception("the engine cannot recover; /health now reports it")
            self._broken = True
        finally:
            self._fail_everything("the server is shutting down" if self._stopping else "the engine stopped")

    def give_up(self, reason: str) -> None:
        """End the loop after this step, for good: what an engine-owning backend calls when its own
        machinery has died. Every sequence gets an error, and /health reports 503."""
        log.error("the engine gives up: %s", reason)
        self._broken = True

    def _wait_for_work(self) -> bool:
        """Block until there is something to do; False when the engine is stopping."""
        with self._wake:
            idle = not (self._incoming or self._cancelled or self._reset_requests)
            if idle and not self.batch_size and len(self.queue):
                # Requests wait but none fits: wait for a change rather than spin.
                self._wake.wait(0.05)
            elif idle and self.running and not self.prefilling and not len(self.queue) and not self._decoding():
                self._wake.wait(0.01)  # every sequence waits for its client to read
            while not self._stopping and not (self._incoming or self._cancelled or self._reset_requests
                                              or self.batch_size or len(self.queue)):
                self._wake.wait()
            return not self._stopping

    def _fail_everything(self, message: str) -> None:
        with self._wake:
            self._closed = True
            incoming, self._incoming = self._incoming, []
            resets, self._reset_requests = self._reset_requests, []
        for done in resets:
            done(0)
        waiting = self.queue.drain()
        for seq in self.running + self.prefilling + waiting + incoming:
            self._emit(seq, ErrorEvent(message, "unhealthy"))
        self.running, self.prefilling = [], []

    def run_once(self) -> None:
        """Take the requests and cancellations the HTTP side handed over, then run one step."""
        with self._wake:
            incoming, self._incoming = self._incoming, []
            cancelled, self._cancelled = self._cancelled, {}
            resets, self._reset_requests = self._reset_requests, []
        for seq in incoming:
            if not seq.cancelled:
                self.queue.add(seq)
        self._drop(cancelled)
        for done in resets:
            done(self.drop_cached_prefixes())
        self.step()
        self._publish()

    def _publish(self) -> None:
        """Hand the HTTP side a copy of who waits and who runs, for ``GET /queue`` and metrics."""
        pending = getattr(self.queue, "pending", None)
        self._published = (tuple(pending() if pending else ()), tuple(self.prefilling), tuple(self.running))

    def queue_view(self) -> dict[str, list[dict[str, Any]]]:
        """Pending and running sequences as of the last step (requests handed over since then
        first among the pending): ids, classes, lengths and times; never prompt text."""
        with self._wake:
            incoming = list(self._incoming)
        waiting, prefilling, running = self._published
        now = time.monotonic()

        def entry(seq: Sequence, state: str) -> dict[str, Any]:
            started = seq.admitted_at if seq.admitted_at is not None and state != "waiting" else now
            return {"id": seq.id, "state": state, "priority": seq.request.priority, "prompt_tokens": seq.prompt_len,
                    "generated_tokens": len(seq.generated_ids), "max_new_tokens": seq.request.max_new_tokens,
                    "waited_seconds": round(max(0.0, started - seq.arrived_at), 3),
                    "unsent_tokens": seq.backlog(), "cached_tokens": seq.cached_tokens,
                    "preempted": seq.admitted_at is not None and state == "waiting"}

        return {"pending": [entry(s, "waiting") for s in incoming + list(waiting)],
                "running": [entry(s, "prefilling") for s in prefilling]
                + [entry(s, "paused" if self._paused(s) else "decoding") for s in running]}

    def _drop(self, cancelled: dict[int, Sequence]) -> None:
        """Forget cancelled sequences, waiting or running, and free their KV memory now."""
        for seq in cancelled.values():
            self.queue.remove(seq)
        self.release(list(cancelled.values()))

    def step(self) -> None:
        """One engine step: the running batch decodes one token while newcomers (and chunks of
        long prompts) prefill, in one backend call; a sequence whose prompt completes samples
        its first token now and decodes from the next step."""
        self._make_room_for_decode()
        self._preempt_for_waiting()
        plan = self._plan_prefill()
        decoding = self._decoding()
        if not plan and not decoding:
            return
        prefilling = [s for s, _ in plan]
        chunks = [n for _, n in plan]
        method = "prefill" if prefilling else "decode"
        started = time.perf_counter()
        try:
            out = self.runner.step(prefilling, chunks, [s.wants_prompt_logits for s in prefilling], decoding)
        except Exception as error:  # noqa: BLE001 - the step's sequences fail, the engine goes on
            log.exception("engine step failed")
            self._observe(method, len(plan), started, started, ok=False)
            self.fail(prefilling + decoding, f"generation failed: {type(error).__name__}: {error}")
            return
        forwarded = time.perf_counter()
        self._sample(prefilling, chunks, decoding, out)
        self._observe(method, len(plan), started, forwarded, ok=out.prefill_error is None)

    def _observe(self, method: str, prefilling: int, started: float, forwarded: float, ok: bool) -> None:
        if self.step_observer is not None:
            ended = time.perf_counter()
            self.step_observer(method, prefilling, forwarded - started, ended - started, ok)

    def _sample(self, prefilling: list[Sequence], chunks: list[int], decoding: list[Sequence], out: StepOutput) -> None:
        """Sample the step's tokens from its logits and hand them to their sequences."""
        if decoding:
            assert out.decode_logits is not None
            self._advance(decoding, out.decode_logits)
        if out.prefill_error is not None:
            error = out.prefill_error
            log.error("prefill failed: %s: %s", type(error).__name__, error)
            self.fail(prefilling, f"prefill failed: {type(error).__name__}: {error}")
        elif prefilling:
            assert out.prefill is not None
            self._prefilled(prefilling, chunks, out.prefill)

    def _decoding(self) -> list[Sequence]:
        """The running sequences that decode this step: not those whose client lags behind
        (backpressure: they keep their KV memory and go on once the client reads), where the
        backend can leave rows out of a step (the padded batch cannot)."""
        return [s for s in self.running if not self._paused(s)]

    def _paused(self, seq: Sequence) -> bool:
        return self.runner.pausable and seq.backlog() >= self.stream_buffer_tokens

    def _step_budget(self, prefill_tokens: int) -> StepBudget:
        return StepBudget(prefill_tokens, self.runner.chunked_prefill, self.runner.kv_free_tokens(),
                          self.runner.kv_block_size, self.runner if self.prefix_caching else None)

    def _preempt_for_waiting(self) -> None:
        """Set aside the running sequences the scheduler names to let waiting ones start (a
        scheduler without ``preempt`` never does)."""
        choose = getattr(self.queue, "preempt", None)
        holding = self.running + self.prefilling
        if choose is None or not holding or not len(self.queue):
            return
        for preemption in choose(holding, self._step_budget(self.prefill_budget)):
            if preemption.seq not in holding:
                continue
            if preemption.keep_kv and self.runner.pausable and preemption.seq in self.running:
                self._suspend(preemption.seq)
            else:
                self._preempt(preemption.seq)

    def _suspend(self, seq: Sequence) -> None:
        """Take a decoding sequence out of the batch with its KV memory kept; when the scheduler
        admits it again, its one pending token runs as a one-token prefill and it decodes on."""
        self.running = [s for s in self.running if s.id != seq.id]
        self.queue.requeue(seq)
        self.suspensions += 1
        log.info("suspended sequence %d (%d tokens, KV kept)", seq.id, seq.total_len)

    def _plan_prefill(self) -> list[tuple[Sequence, int]]:
        """This step's prefill work: (sequence, tokens), prompts under way first, then newcomers."""
        budget = self.prefill_budget
        plan: list[tuple[Sequence, int]] = []
        for seq in self.prefilling:
            chunk = self._chunk(seq, budget)
            if chunk and self._plan_chunk(seq, chunk):
                plan.append((seq, chunk))
                budget -= chunk
        if budget <= 0:
            return plan
        for seq in self.queue.admit(self.running + self.prefilling, self._step_budget(budget)):
            chunk = self._start_prefill(seq, budget)
            if chunk:
                self.prefilling.append(seq)
                plan.append((seq, chunk))
                budget -= chunk
        return plan

    def _start_prefill(self, seq: Sequence, budget: int) -> int:
        """An admitted sequence's first chunk this step, after what it takes from the prefix cache;
        0 when it waits for the next step (requeued, first in line) or failed to start."""
        fresh = seq.num_computed == 0  # new, or preempted: it holds no KV memory
        cached = self.runner.prefix_hit(seq).tokens if self.prefix_caching and fresh else 0
        seq.num_computed += cached
        chunk = self._chunk(seq, budget)
        if chunk and not self.start_sequence(seq):
            return 0  # it failed, and was told
        if not chunk or not self._plan_chunk(seq, chunk):
            # It must go whole and does not fit what is left, or its KV memory is short: next step.
            seq.num_computed -= cached
            self.queue.requeue(seq)
            return 0
        if self.prefix_caching and fresh:
            if not seq.generated_ids:
                seq.cached_tokens = cached
            self.prefix_queried_tokens += seq.total_len
            self.prefix_hit_tokens += cached
        return chunk

    def _plan_chunk(self, seq: Sequence, chunk: int) -> bool:
        """Tell a prefix-caching runner the chunk ``seq`` prefills this step; False when its KV memory
        cannot be had now (nothing was taken)."""
        if not self.prefix_caching:
            return True
        try:
            self.runner.plan_prefill(seq, chunk)
        except MemoryError as error:
            log.info("sequence %d waits: %s", seq.id, error)
            return False
        return True

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """How many of ``seq``'s pending tokens to prefill with ``budget`` left (0: next step)."""
        whole = seq.pending_len
        if self.runner.chunked_prefill and not seq.wants_prompt_logits:
            return max(0, min(whole, budget))
        # All at once. One that could never fit a step's budget runs oversized rather than wait forever.
        return whole if whole <= budget or whole > self.prefill_budget else 0

    def start_sequence(self, seq: Sequence) -> bool:
        """Give an admitted sequence its sampling state (kept across preemptions)."""
        if seq.state is not None:
            return True
        try:
            seq.state = self._new_state(seq)
            seq.admitted_at = time.monotonic()
            return True
        except Exception as error:  # noqa: BLE001 - a bad plugin processor fails only its request
            self.fail([seq], f"could not start the request: {error}")
            return False

    def _prefilled(self, seqs: list[Sequence], chunks: list[int], out: PrefillOutput) -> None:
        """Account for prefilled chunks; sequences whose prompt is complete join the running batch."""
        done, done_rows = [], []
        for row, (seq, chunk, logits) in enumerate(zip(seqs, chunks, out.prompt_logits)):
            seq.num_computed += chunk
            if logits is not None:
                seq.prefill_tokens = self._prompt_tokens(seq.prompt_ids, logits)
            if seq.pending_len == 0:
                done.append(seq)
                done_rows.append(row)
        if done:
            finished_ids = {s.id for s in done}
            self.prefilling = [s for s in self.prefilling if s.id not in finished_ids]
            self.running.extend(done)
            self._advance(done, out.last_logits[done_rows])

    def _make_room_for_decode(self) -> None:
        """Preempt the latest arrivals until KV memory holds one more token for each running sequence."""
        while self.running and not self.runner.can_decode(self.running):
            holders = self.running + self.prefilling
            victim = max(holders, key=lambda s: (s.arrived_at, s.id))
            if len(holders) == 1:  # alone and still too big: recomputing it would not help
                self.fail([victim], "the KV cache cannot hold this sequence")
                return
            self._preempt(victim)

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's KV memory and queue it to be recomputed from its tokens so far."""
        self.release([seq])
        seq.num_computed = 0
        self.queue.requeue(seq)
        self.preemptions += 1
        log.info("preempted sequence %d (%d tokens)", seq.id, seq.total_len)

    def _new_state(self, seq: Sequence) -> SequenceState:
        request = seq.request
        extra: list[Any] = []
        if request.sampling.watermark:
            extra.append(WatermarkProcessor(self.watermark_gamma, self.watermark_delta))
        if self.pm is not None:
            for processors in self.pm.hook.tokenmill_logits_processors(parameters=request.parameters):
                extra.extend(processors or [])
        matcher = request.grammar.new_matcher(frozenset(self.eos_ids)) if request.grammar is not None else None
        sampler = SequenceSampler(request.sampling, seq.seed, extra, request.top_n_tokens, matcher, seq.prompt_len)
        return SequenceState(sampler, IncrementalDetokenizer(self.tokenizer))

    def _prompt_tokens(self, prompt_ids: list[int], logits: torch.Tensor) -> list[TokenInfo]:
        return self.prompt_token_infos(prompt_ids, prompt_logprobs(prompt_ids, logits))

    def prompt_token_infos(self, prompt_ids: list[int], logprobs: list[float | None]) -> list[TokenInfo]:
        """The prompt's tokens with their log-probabilities, as ``decoder_input_details`` reports them."""
        return [
            TokenInfo(i, self.tokenizer.decode([i]), lp, i in self.special_ids)
            for i, lp in zip(prompt_ids, logprobs)
        ]

    def _advance(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        finished = []
        masks = self._grammar_masks(seqs)
        for row, seq in enumerate(seqs):
            if seq.cancelled:
                finished.append(seq)
                continue
            try:
                if self._append_token(seq, logits[row], masks.get(seq.id)):
                    finished.append(seq)
            except Exception as error:  # noqa: BLE001 - one request's failure stays its own
                log.exception("sequence %d failed", seq.id)
                self._emit(seq, ErrorEvent(f"generation failed: {type(error).__name__}: {error}"))
                finished.append(seq)
        self.release(finished)

    def _grammar_masks(self, seqs: list[Sequence]) -> dict[int, torch.Tensor]:
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

    def release(self, seqs: list[Sequence]) -> None:
        """Free ``seqs`` in the backend (whether or not they joined the batch) and forget them."""
        if not seqs:
            return
        self.runner.release(seqs)
        leaving = {s.id for s in seqs}
        self.running = [s for s in self.running if s.id not in leaving]
        self.prefilling = [s for s in self.prefilling if s.id not in leaving]

    def fail(self, seqs: list[Sequence], message: str) -> None:
        for seq in seqs:
            self._emit(seq, ErrorEvent(message))
        self.release(list(seqs))

    @staticmethod
    def _emit(seq: Sequence, event: Event) -> None:
        try:
            seq.sink(event)
        except Exception:  # noqa: BLE001 - a closed channel must not stop the engine
            log.exception("could not deliver an event to sequence %d", seq.id)

    def _append_token(self, seq: Sequence, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> bool:
        state: SequenceState = seq.state
        history = seq.prompt_ids + seq.generated_ids if state.sampler.needs_history else []
        choice = state.sampler.choose(history, logits, allowed)
        return self.accept_token(seq, choice.token_id, choice.logprob, choice.top)

    def accept_token(self, seq: Sequence, token_id: int, logprob: float | None,
                     top: list[tuple[int, float]] | None = None) -> bool:
        """Append a chosen token to ``seq``: detokenize it, check the stop criteria and send its event.
        True when the sequence has finished (its final event is sent; the caller releases it)."""
        state: SequenceState = seq.state
        seq.generated_ids.append(token_id)
        seq.num_computed = seq.total_len - 1  # every token but the newest is in the KV cache
        special = token_id in self.special_ids
        text = state.detokenizer.push(token_id)
        if special:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        reason = self._finish_reason(seq, token_id, text)
        if reason is not None and not special:
            text += state.detokenizer.finish()
        token = TokenInfo(token_id, text, logprob, special)
        top_tokens = [TokenInfo(i, self.tokenizer.decode([i]), lp, i in self.special_ids) for i, lp in top or ()]
        seq.tokens.append(token)
        seq.top_tokens.append(top_tokens)
        final = None
        if reason is not None:
            seq.finish_reason = reason
            final = self._final(seq, state, reason)
        self._emit(seq, TokenEvent(index=len(seq.generated_ids), token=token, top_tokens=top_tokens, final=final))
        return reason is not None

    def _finish_reason(self, seq: Sequence, token_id: int, new_text: str) -> str | None:
        if len(seq.generated_ids) >= seq.request.max_new_tokens:
            return FINISH_LENGTH
        if token_id in self.eos_ids:
            return FINISH_EOS
        stops = seq.request.stop
        if stops:
            state: SequenceState = seq.state
            longest = max(len(stop) for stop in stops)
            window = state.stop_window + new_text
            for stop in stops:
                # Only matches that end in the new text count: earlier text was checked before.
                if stop in window[max(0, len(state.stop_window) - len(stop) + 1) :]:
                    return FINISH_STOP
            state.stop_window = window[-longest:]
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
            cached_tokens=seq.cached_tokens,
        )
