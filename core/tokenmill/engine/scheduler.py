"""The engine's scheduler: :meth:`Scheduler.schedule` plans who runs in the next step (admission and
preemption in the scheduler plugin's order, within KV memory and the prefill budget), and
:meth:`Scheduler.update_from_output` takes the step's output: it is the one place that advances a
sequence's progress (``num_computed``) and finishes, fails or frees it."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from tokenmill.engine.output import Output, emit
from tokenmill.engine.plan import StepPlan
from tokenmill.engine.registry import LiveSequences
from tokenmill.engine.runner_kv import kv_cache_for
from tokenmill.engine.scheduling import Admission
from tokenmill.engine.sequence import ErrorEvent, Sequence
from tokenmill.engine.speculation import Speculator
from tokenmill.engine.timing import Speculated
from tokenmill.interfaces import BackendRunner, SchedulerQueue, StepBudget, StepOutput

log = logging.getLogger(__name__)


class Scheduler:
    """The running batch (sequences that decode, and sequences whose prompts prefill in chunks), what
    waits, and every sequence taken in and not yet ended."""

    def __init__(self, runner: BackendRunner, queue: SchedulerQueue | Admission, output: Output, prefill_budget: int,
                 stream_buffer_tokens: int) -> None:
        self.runner = runner
        self.kv = kv_cache_for(runner)
        """The KV memory's manager: the one owner of which blocks each sequence holds, and of the prefix cache."""
        self.waiting = Admission.of(queue)
        """Admission over the scheduler plugin's queue, every call guarded: none loses a sequence silently."""
        self.live = LiveSequences()
        """Every sequence taken in and not yet ended, wherever it is."""
        self.output = output
        self.prefill_budget = prefill_budget
        self.stream_buffer_tokens = stream_buffer_tokens
        """A sequence whose reader has this many events unsent pauses (keeping its KV) until it reads."""
        self.running: list[Sequence] = []
        """Sequences that decode: their whole context is in the KV cache."""
        self.prefilling: list[Sequence] = []
        """Admitted sequences whose prompt is prefilled in chunks over several steps."""
        self.preemptions = 0
        self.suspensions = 0
        self.prefix_caching = self.kv.prefix_caching
        """Whether sequences start from cached prefixes (see :meth:`KVCacheManager.lookup`)."""
        self.prefix_queried_tokens = self.prefix_hit_tokens = 0
        """Tokens of the sequences (re)started that were looked up in the prefix cache, and those found there."""
        self.speculator: Speculator | None = None
        """With ``--speculate``: the decoding sequences' drafts (the runner is ``speculative``)."""

    @property
    def holding(self) -> list[Sequence]:
        """The sequences that hold KV memory."""
        return self.running + self.prefilling

    def schedule(self) -> StepPlan:
        """The next step: make room for every decoding sequence's next token, let the scheduler
        set aside running sequences for waiting ones, then admit and plan this step's prefill."""
        self._make_room_for_decode()
        self._preempt_for_waiting()
        prefill = self._plan_prefill()
        seqs, chunks, cached = (tuple(column) for column in zip(*prefill)) if prefill else ((), (), ())
        decode = tuple(self.decoding())
        drafts = self.speculator.propose(decode, sum(chunks)) if self.speculator is not None and decode else ()
        fed = tuple(self.kv.allocate_decode(list(decode), list(drafts))) if decode else ()
        return StepPlan(seqs, chunks, decode, fed if any(fed) else (), cached)

    def decoding(self) -> list[Sequence]:
        """The running sequences that decode this step: not those whose reader lags behind
        (backpressure: they keep their KV memory and go on once it reads), where the backend can
        leave rows out of a step (the padded batch cannot)."""
        return [s for s in self.running if not self.paused(s)]

    def paused(self, seq: Sequence) -> bool:
        return self.runner.pausable and seq.stream.unsent() >= self.stream_buffer_tokens

    def idle_readers(self, timeout: float) -> list[Sequence]:
        """The running sequences whose reader has let its buffer stay full for over ``timeout`` seconds."""
        now, idle = time.monotonic(), []
        for seq in self.running:
            if not self.paused(seq):
                seq.paused_since = None
            elif seq.paused_since is None:
                seq.paused_since = now
            elif now - seq.paused_since > timeout:
                idle.append(seq)
        return idle

    def step_budget(self, prefill_tokens: int | None = None) -> StepBudget:
        """What a step can take in, as the scheduler is told: ``prefill_tokens`` (by default the whole
        prefill budget), the runner's free KV memory and its prefix cache."""
        tokens = self.prefill_budget if prefill_tokens is None else prefill_tokens
        return StepBudget(tokens, self.runner.chunked_prefill, self.kv.free_tokens(), self.kv.block_size,
                          self.kv if self.prefix_caching else None)

    def start_sequence(self, seq: Sequence) -> bool:
        """Give an admitted sequence its sampling state (kept across preemptions); False when that
        failed (it was told, and released)."""
        if seq.state is not None:
            return True
        try:
            seq.state = self.output.start(seq)
            seq.admitted_at = time.monotonic()
            return True
        except Exception as error:  # noqa: BLE001 - a bad plugin processor fails only its request
            self.fail([seq], f"could not start the request: {error}")
            return False

    def release(self, seqs: list[Sequence]) -> None:
        """Free ``seqs`` in the backend (whether or not they joined the batch) and drop them from it; those
        that ended are forgotten."""
        if not seqs:
            return
        self.kv.free(seqs)
        leaving = {s.id for s in seqs}
        self.running = [s for s in self.running if s.id not in leaving]
        self.prefilling = [s for s in self.prefilling if s.id not in leaving]
        self.live.forget_ended(seqs)

    def fail(self, seqs: list[Sequence], message: str) -> None:
        """End ``seqs`` with an error event, and release them."""
        for seq in seqs:
            emit(seq, ErrorEvent(message))
        self.release(list(seqs))

    # ---- after the step: the one writer of each sequence's progress -----------------------------------

    def update_from_output(self, plan: StepPlan, out: StepOutput) -> Speculated | None:
        """Take a step's output: advance each sequence by what the forward computed, sample its token
        (through its draft, with ``--speculate``) and hand it on, and release those that finished; with
        drafts, what speculation gave."""
        self.kv.commit(plan.prefill + plan.decode)
        speculated = None
        if plan.decode:
            assert out.decode_logits is not None
            if plan.drafts and out.draft_logits is not None:
                speculated = self._verify(plan, out.decode_logits, out.draft_logits)
            else:
                self.release(self._sample(list(plan.decode), out.decode_logits))
        if out.prefill_error is not None:
            error = out.prefill_error
            log.error("prefill failed: %s: %s", type(error).__name__, error)
            self.fail(list(plan.prefill), f"prefill failed: {type(error).__name__}: {error}")
        elif plan.prefill:
            assert out.prefill is not None
            done, rows = self._prefilled(plan, out.prefill.prompt_logits)
            if done:
                self.release(self._sample(done, out.prefill.last_logits[rows]))
        return speculated

    def _prefilled(self, plan: StepPlan, prompt_logits: list[Any]) -> tuple[list[Sequence], list[int]]:
        """Advance the prefilled sequences by their chunks; those whose prompt is complete join the running
        batch, and are returned with their rows of the step's last logits, to sample their first token."""
        done, rows = [], []
        for row, (seq, chunk, logits) in enumerate(zip(plan.prefill, plan.chunks, prompt_logits)):
            seq.num_computed += chunk
            if logits is not None and not self._prompt_details(seq, logits):
                continue
            if seq.pending_len == 0:
                done.append(seq)
                rows.append(row)
        if done:
            finished_ids = {s.id for s in done}
            self.prefilling = [s for s in self.prefilling if s.id not in finished_ids]
            self.running.extend(done)
        return done, rows

    def _prompt_details(self, seq: Sequence, logits: Any) -> bool:
        """Fill ``seq``'s prompt details; False when that failed (it was told, and released)."""
        try:
            self.output.prompt_details(seq, logits)
        except Exception as error:  # noqa: BLE001 - one request's failure stays its own
            log.exception("the prompt details of sequence %d failed", seq.id)
            self.fail([seq], f"prefill failed: {type(error).__name__}: {error}")
            return False
        return True

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, drafts: list[tuple[int, ...]] | None = None,
                draft_logits: list[torch.Tensor] | None = None) -> list[Sequence]:
        """Choose and hand on each sequence's tokens (:meth:`Output.sample`); the sequences that finished."""
        finished = self.output.sample(seqs, logits, drafts, draft_logits)
        self.decoded(seqs)
        return finished

    @staticmethod
    def decoded(seqs: list[Sequence]) -> None:
        """``seqs`` were handed their newest tokens: every token but the newest is in the KV cache."""
        for seq in seqs:
            seq.num_computed = seq.total_len - 1

    def _verify(self, plan: StepPlan, logits: torch.Tensor, draft_logits: list[torch.Tensor]) -> Speculated:
        """Choose the decoding sequences' tokens through their drafts, then drop the KV of rejected drafts."""
        decode = list(plan.decode)
        fed = [plan.drafts[row][: len(rows)] for row, rows in enumerate(draft_logits)]
        before = [len(seq.generated_ids) for seq in decode]
        finished = self._sample(decode, logits, fed, draft_logits)
        produced = [len(seq.generated_ids) - n for seq, n in zip(decode, before)]
        for seq, draft, count in zip(decode, fed, produced):
            if draft:
                Speculator.observe(seq, count)
        self._rollback([seq for seq, draft in zip(decode, fed) if draft])  # before those that ended go
        self.release(finished)
        skipped = tuple(max(0, count - 1) for draft, count in zip(fed, produced) if draft)
        return Speculated(sum(len(d) for d in fed), sum(skipped), skipped)

    def _rollback(self, seqs: list[Sequence]) -> None:
        """Drop the KV of the drafts ``seqs`` rejected, one sequence at a time, so that a failure fails
        its own sequence (and a rollback half done is never done twice)."""
        for seq in seqs:
            try:
                self.kv.rollback(seq)
            except Exception as error:  # noqa: BLE001 - one request's failure stays its own
                log.exception("rolling back the draft of sequence %d failed", seq.id)
                self.fail([seq], f"generation failed: {type(error).__name__}: {error}")

    def _preempt_for_waiting(self) -> None:
        """Set aside the running sequences the scheduler names to let waiting ones start (a
        scheduler without ``preempt`` never does)."""
        holding = self.holding
        if not holding or not len(self.waiting):
            return
        for preemption in self.waiting.preempt(holding, self.step_budget()):
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
        self.waiting.requeue(seq)
        self.suspensions += 1
        log.info("suspended sequence %d (%d tokens, KV kept)", seq.id, seq.total_len)

    def _make_room_for_decode(self) -> None:
        """Preempt the latest arrivals until KV memory holds one more token for each running sequence."""
        while self.running and not self.kv.can_decode(self.running):
            holders = self.holding
            victim = max(holders, key=lambda s: (s.arrived_at, s.id))
            if len(holders) == 1:  # alone and still too big: recomputing it would not help
                self.fail([victim], "the KV cache cannot hold this sequence")
                return
            self._preempt(victim)

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's KV memory and queue it to be recomputed from its tokens so far."""
        self.restart(seq)
        self.preemptions += 1
        log.info("preempted sequence %d (%d tokens)", seq.id, seq.total_len)

    def restart(self, seq: Sequence) -> None:
        """Free ``seq``'s KV memory and queue it, first in line, to be computed again (from the prefix cache)."""
        self.release([seq])
        self.waiting.requeue(seq)

    def _plan_prefill(self) -> list[tuple[Sequence, int, int]]:
        """This step's prefill work, prompts under way first: (sequence, tokens, tokens it took from the cache)."""
        budget = self.prefill_budget
        plan: list[tuple[Sequence, int, int]] = []
        for seq in self.prefilling:
            chunk = self._chunk(seq, budget)
            if chunk and self._plan_chunk(seq, chunk):
                plan.append((seq, chunk, 0))
                budget -= chunk
        if budget <= 0:
            return plan
        for seq in self.waiting.admit(self.holding, self.step_budget(budget)):
            chunk, cached = self._start_prefill(seq, budget)
            if chunk:
                self.prefilling.append(seq)
                plan.append((seq, chunk, cached))
                budget -= chunk
        return plan

    def _start_prefill(self, seq: Sequence, budget: int) -> tuple[int, int]:
        """An admitted sequence's first chunk this step and the tokens it took from the prefix cache;
        chunk 0 when it waits for the next step (requeued, first in line) or failed to start."""
        fresh = seq.num_computed == 0  # new, or preempted: it holds no KV memory
        try:
            cached = self.kv.lookup(seq).tokens if fresh else 0
        except Exception as error:  # noqa: BLE001 - one request's failure stays its own
            self._planning_failed(seq, error)
            return 0, 0
        chunk = self._chunk(seq, budget, cached)
        if chunk and not self.start_sequence(seq):
            return 0, 0  # it failed, and was told
        if not chunk or not self._plan_chunk(seq, chunk, cached):
            if not seq.ended:  # it must go whole and does not fit what is left, or its KV memory is short
                self.waiting.requeue(seq)
            return 0, 0
        if self.prefix_caching and fresh:
            if not seq.generated_ids:
                seq.cached_tokens = cached
            self.prefix_queried_tokens += seq.total_len
            self.prefix_hit_tokens += cached
        return chunk, cached

    def _plan_chunk(self, seq: Sequence, chunk: int, cached: int = 0) -> bool:
        """Allocate the KV memory of the chunk ``seq`` prefills this step (after the ``cached`` tokens it
        takes from the prefix cache, when it holds none yet); False when that memory cannot be had now
        (nothing was taken) or that failed (it was told, and released)."""
        try:
            self.kv.allocate(seq, cached, chunk)
        except MemoryError as error:
            log.info("sequence %d waits: %s", seq.id, error)
            return False
        except Exception as error:  # noqa: BLE001 - one request's failure stays its own
            self._planning_failed(seq, error)
            return False
        return True

    def _planning_failed(self, seq: Sequence, error: Exception) -> None:
        log.exception("planning the prefill of sequence %d failed", seq.id, exc_info=error)
        self.fail([seq], f"generation failed: {type(error).__name__}: {error}")

    def _chunk(self, seq: Sequence, budget: int, cached: int = 0) -> int:
        """How many of ``seq``'s pending tokens (less the ``cached`` it takes) to prefill with ``budget``
        left (0: next step)."""
        whole = seq.pending_len - cached
        if self.runner.chunked_prefill and not seq.wants_prompt_logits:
            return max(0, min(whole, budget))
        # All at once. One that could never fit a step's budget runs oversized rather than wait forever.
        return whole if whole <= budget or whole > self.prefill_budget else 0
