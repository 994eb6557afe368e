"""The engine loop: one thread that owns the model and runs continuous batching.

Each step: take new and cancelled requests from the HTTP side; plan the step (batching: make
room in KV memory, preempt, admit); run it (one backend call prefills newcomers, and chunks of
long prompts, while the running batch decodes a token); sample each sequence's token; emit it
(output: detokenize, check stops, push to the token stream). The event loop never runs model code.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pluggy

from tokenmill.engine.health import Broken, EngineHealth
from tokenmill.engine.inbox import Chore, Inbox, ResetDone
from tokenmill.engine.output import Output, emit
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.scheduling import Admission
from tokenmill.engine.sequence import ErrorEvent, GenerationRequest, Sequence, queue_snapshot
from tokenmill.engine.step import StepExecution
from tokenmill.engine.stream import EventSink, EventStream
from tokenmill.engine.surface import BackendSurface
from tokenmill.engine.timing import StepTiming
from tokenmill.interfaces import BackendRunner, SchedulerQueue
from tokenmill.model.kv_memory import trim_heap
from tokenmill.sampling import new_seed, uses_sampling

log = logging.getLogger(__name__)

TRIM_SECONDS = 10.0
"""How often a busy loop gives the C heap's free pages back to the system (``kv_memory.trim_heap``); an
idle one does so once its work is done."""


class Engine(BackendSurface):
    """Continuous batching over a :class:`BackendRunner`. A backend that brings its own engine
    (``Backend.owns_engine``) subclasses it and replaces :meth:`step`, using the surface hooks.md's
    "A backend with an engine of its own" lists; queueing, cancellation and the events stay the same."""

    def __init__(self, runner: BackendRunner, queue: SchedulerQueue | Admission, tokenizer: Any, eos_ids: set[int],
                 prefill_budget: int, pm: pluggy.PluginManager | None = None, stream_buffer_tokens: int = 64,
                 watermark: tuple[float, float] = (0.5, 2.0)) -> None:
        self.tokenizer = tokenizer
        self.output = Output(tokenizer, eos_ids, pm, watermark)
        self.scheduler = Scheduler(runner, queue, self.output, prefill_budget, stream_buffer_tokens)
        self.execution = StepExecution(self.scheduler)
        self.step_observer: Callable[[StepTiming], None] | None = None
        """Told about every step that runs the model (the server sets its metrics here after warm-up)."""
        self.inbox = Inbox()
        self.health = EngineHealth(self._on_broken)
        """Consecutive failed steps and the step watchdog (``--max-failed-steps``, ``--step-timeout``)."""
        self.broken_observer: Broken | None = None
        """Told once why the engine broke, after every request was told (the server then exits)."""
        self.stream_idle_timeout: float | None = None
        """Seconds a running sequence may stay paused for its reader before it is ended (``--stream-idle-timeout``)."""
        self._thread: threading.Thread | None = None
        self._idle = False
        """The last step had nothing to run although sequences were held or waiting."""
        self._faults_seen = 0
        """Scheduler faults already counted against a step."""
        self._published: tuple[tuple[Sequence, ...], ...] = ((), (), ())
        self.asleep = False
        """Its KV memory went back to the system while idle (:meth:`sleep`); the next request wakes it."""

    # ---- called from the HTTP side ----
    def submit(self, request: GenerationRequest, stream: EventStream | EventSink, seed: int | None = None,
               choice: int = 0) -> Sequence:
        """Queue one sequence of ``request``; its events go to ``stream`` (from the engine thread),
        tagged with ``choice``."""
        if seed is None and uses_sampling(request.sampling):
            seed = request.sampling.seed if request.sampling.seed is not None else new_seed()
        seq = Sequence(request, stream, seed, choice)
        if not self.inbox.submit(seq):
            emit(seq, ErrorEvent("the engine is not running", "unhealthy"))
        return seq

    def unavailable_reason(self, request: GenerationRequest) -> str | None:
        """Why this engine cannot run ``request`` (answered with 422 at validation), or None."""
        if request.images is not None and not getattr(self.scheduler.runner, "takes_images", False):
            return f"this server's backend ({type(self.scheduler.runner).__name__}) does not take images"
        return self.refusal(request)

    def refusal(self, request: GenerationRequest) -> str | None:
        """:meth:`unavailable_reason`'s name in hooks 1.0, which engines written for it may override."""
        return None

    def cancel(self, seq: Sequence) -> None:
        """The client went away: drop the sequence at the next step and free its KV memory."""
        self.inbox.cancel(seq)

    def wake(self) -> None:
        """A reader took events off its stream: a sequence paused for it may go on."""
        self.inbox.wake()

    def reset_prefix_cache(self, done: ResetDone) -> None:
        """Drop every cached block that no sequence holds, between two steps; ``done`` is then called
        (from the engine thread) with how many."""
        if not self.inbox.ask(Chore(self.drop_cached_prefixes, done, 0)):
            done(0)

    def sleep(self, done: Callable[[bool], None]) -> None:
        """Between two steps, if no sequence is live, drop the prefix cache and give the KV memory back to the
        system (where the runner can); ``done`` is then told whether it sleeps."""
        if not self.inbox.ask(Chore(self._fall_asleep, done, False)):
            done(False)

    def wake_up(self) -> None:
        """Be awake from the next step on (the KV memory comes back as requests write it)."""
        self.inbox.ask(Chore(lambda: setattr(self, "asleep", False), lambda _: None, None))

    def _fall_asleep(self) -> bool:
        if self.scheduler.live.all():
            return False
        self.drop_cached_prefixes()
        release = getattr(self.scheduler.runner, "release_memory", None)
        log.info("asleep: %d bytes of memory given back", release() if release is not None else 0)
        trim_heap()
        self.asleep = True
        return True

    def drop_cached_prefixes(self) -> int:
        """(Engine thread.) What :meth:`reset_prefix_cache` does; an engine-owning backend's engine
        overrides it to reset its own cache."""
        return self.scheduler.kv.drop_cached()

    @property
    def queue_size(self) -> int:
        return len(self.queue) + len(self.inbox)

    @property
    def batch_size(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.prefilling)

    @property
    def healthy(self) -> bool:
        """False once the engine thread has died or the engine broke; /health then says 503."""
        return self._thread is not None and self._thread.is_alive() and self.health.broken is None

    @property
    def broken(self) -> str | None:
        """Why the engine can no longer serve, once it cannot."""
        return self.health.broken

    def kv_usage(self) -> dict[str, Any]:
        """For /metrics and /info: the KV memory's usage, and the positions held at the last step."""
        held = sum(s.num_computed for seqs in self._published for s in seqs)
        return {"tokens_held": held, **self.scheduler.kv.usage()}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tokenmill-engine", daemon=True)
        self._thread.start()
        self.health.watch(self._thread)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop; every sequence still queued or running gets an error event."""
        self.inbox.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def release(self, seqs: list[Sequence]) -> None:
        """Free ``seqs`` in the backend and forget them."""
        self.scheduler.release(seqs)

    def fail(self, seqs: list[Sequence], message: str) -> None:
        """End ``seqs`` with an error event, and release them."""
        self.scheduler.fail(seqs, message)

    def observe_step(self, timing: StepTiming) -> None:
        """Report a step that ran the model to the metrics, and count it towards ``--max-failed-steps``."""
        if self.step_observer is not None:
            self.step_observer(timing)
        self.health.step_ended(timing.ok)

    def give_up(self, reason: str) -> None:
        """End the loop for good (an engine-owning backend's machinery died): every sequence gets an
        error, /health reports 503 and the server exits."""
        self.health.give_up(reason)

    def _on_broken(self, reason: str) -> None:
        """(Engine or watchdog thread.) Tell every request now: the engine thread may be stuck in a step."""
        for seq in self.scheduler.live.all() + self.inbox.close():
            emit(seq, ErrorEvent(f"the engine is broken: {reason}", "unhealthy"))
        self.inbox.stop()
        if self.broken_observer is not None:
            self.broken_observer(reason)

    def step(self) -> None:
        """One engine step: plan it, run it in one backend call, sample and emit its tokens. A
        sequence whose prompt completes samples its first token now and decodes from the next step."""
        plan = self.scheduler.schedule()
        faulted = self.scheduler.waiting.faults != self._faults_seen  # since the last step, queueing included
        self._faults_seen = self.scheduler.waiting.faults
        if faulted:
            self.end_orphans("the scheduler failed")
        self._idle = plan.empty and bool(self.batch_size or len(self.queue))
        if plan.empty:
            if faulted:
                self.health.step_ended(ok=False)
            return
        timing = self.execution.run(plan)
        self.observe_step(replace(timing, ok=timing.ok and not faulted))  # a step the scheduler failed in failed

    def end_orphans(self, why: str) -> None:
        """End with an error every live sequence that is neither in the batch nor waiting (after a
        scheduler fault); when the queue cannot say what waits, everything it held is drained."""
        orphans = self.scheduler.live.orphans(self.scheduler.holding, self.scheduler.waiting.knows_pending())
        if orphans is None:
            orphans = [s for s in self.scheduler.live.all() if s not in self.scheduler.holding]
            self.scheduler.waiting.drain()
        if orphans:
            log.error("%s: ending %d sequences it dropped", why, len(orphans))
            self.fail(orphans, f"{why}; the request could not be scheduled")

    def run_once(self) -> None:
        """Take the requests and cancellations the HTTP side handed over, then run one step."""
        self.health.step_began()
        try:
            self._take_inbox()
            if self.stream_idle_timeout is not None:
                idle = self.scheduler.idle_readers(self.stream_idle_timeout)
                self.fail(idle, f"the client read nothing for {self.stream_idle_timeout:g} s (--stream-idle-timeout)")
            self.step()
        finally:
            self.health.step_done()
        scheduler = self.scheduler
        self._published = (tuple(scheduler.waiting.pending()), tuple(scheduler.prefilling), tuple(scheduler.running))

    def _take_inbox(self) -> None:
        """Queue the new sequences, free the cancelled ones, then do the chores asked for (whatever raised)."""
        incoming, cancelled, chores = self.inbox.take()
        self.asleep = self.asleep and not incoming  # its KV memory comes back as the new sequences write it
        try:
            for seq in incoming:
                if not seq.cancelled:
                    self.scheduler.live.add(seq)
                    if not self.scheduler.waiting.add(seq):
                        self.fail([seq], "the scheduler failed; the request could not be queued")
            for seq in cancelled:  # waiting or running: its KV memory is freed now
                self.scheduler.waiting.remove(seq)
            self.release(cancelled)
        finally:
            self.inbox.answer(chores)

    def _loop(self) -> None:
        try:
            trimmed = time.monotonic()
            while self.health.broken is None and self._wait_for_work():
                try:
                    self.run_once()
                    if not (self.batch_size or len(self.queue)) or time.monotonic() - trimmed > TRIM_SECONDS:
                        trim_heap()  # a few milliseconds, between two steps or before the loop sleeps
                        trimmed = time.monotonic()
                except Exception:  # noqa: BLE001 - a step that fails must not end the loop
                    log.exception("engine step failed; failing the running batch and starting afresh")
                    self._recover()
        except Exception as error:  # noqa: BLE001 - even recovery failed: stop serving, loudly
            log.exception("the engine cannot recover; /health now reports it")
            self.health.give_up(f"recovering from a failed step failed: {type(error).__name__}: {error}")
        finally:
            self._fail_everything("the server is shutting down" if self.inbox.stopping else "the engine stopped")

    def _recover(self) -> None:
        """After an error no step part caught: fail the batch, drop every KV block (none can be trusted), and
        have every sequence still waiting (a suspended one kept its KV) computed again from its tokens."""
        self.fail(self.scheduler.holding, "internal error in the engine step")
        self.scheduler.kv.reset(self.scheduler.live.all())
        self.scheduler.running, self.scheduler.prefilling = [], []
        self.end_orphans("the engine step failed")
        self.health.step_ended(ok=False)

    def _wait_for_work(self) -> bool:
        scheduler = self.scheduler
        idle = self._idle or (bool(scheduler.running) and not scheduler.prefilling and not len(self.queue)
                              and not scheduler.decoding())
        return self.inbox.wait_for_work(bool(self.batch_size), bool(len(self.queue)), idle)

    def _fail_everything(self, message: str) -> None:
        scheduler = self.scheduler
        for seq in scheduler.holding + scheduler.waiting.drain() + self.inbox.close() + scheduler.live.all():
            emit(seq, ErrorEvent(message, "unhealthy"))
        self.scheduler.running, self.scheduler.prefilling = [], []

    def queue_view(self) -> dict[str, list[dict[str, Any]]]:
        """``GET /queue``: pending and running sequences as of the last step (those handed over since first)."""
        return queue_snapshot(self.inbox.waiting(), *self._published, self.scheduler.paused)
