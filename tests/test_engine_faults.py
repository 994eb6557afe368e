"""The engine under faults: no request is lost whatever a plugin raises, a run of failed steps or a
hung step breaks it (every request told, the server told), and a failure pinned to one request
on the paged backend fails only that request."""

from __future__ import annotations

import threading
import time

import torch
from engine_helpers import PROMPTS, Collector, build_engine, greedy_request, reference_greedy, wait_for

from tokenmill.engine.queue import WaitingQueue
from tokenmill.engine.sequence import ErrorEvent
from tokenmill.engine.stream import CallbackStream


def run_until_done(engine, sinks, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if all(s.done for s in sinks):
            return
        engine.run_once()
    raise AssertionError("the sequences did not end")


def errors(sink: Collector) -> list[str]:
    return [e.message for e in sink.events if isinstance(e, ErrorEvent)]


class FaultyQueue:
    """Wraps the engine's admission as a hooks 1.x queue; each armed call raises once (``admit`` after taking
    what it chose)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.armed: set[str] = set()
        """Calls that raise once."""
        self.always: set[str] = set()
        """Calls that raise every time."""
        self.greedy = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def _fault(self, call: str) -> None:
        if call in self.always:
            raise RuntimeError(f"injected {call} fault, again")
        if call in self.armed:
            self.armed.discard(call)
            raise RuntimeError(f"injected {call} fault")

    def admit(self, holding, budget):
        if self.greedy:  # everything, whether it fits or not: the engine puts back what does not
            taken = self.inner.queue.take(list(self.inner.queue.ordered()))
        else:
            taken = self.inner.admit(holding, budget)
        self._fault("admit")
        return taken

    def requeue(self, seq) -> None:
        self._fault("requeue")
        self.inner.requeue(seq)

    def drain(self):
        self._fault("drain")
        return self.inner.drain()

    def add(self, seq) -> None:
        self._fault("add")
        self.inner.add(seq)


class FailingRunner:
    """Wraps a runner: every step raises while ``failing``; a step that prefills ``poison`` always raises;
    a step hangs while ``hang`` is set."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.failing = False
        self.poison: str | None = None
        self.hang = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, prefill, chunks, want, decode):
        while self.hang.is_set():
            time.sleep(0.01)
        if self.failing:
            raise RuntimeError("device fell over")
        if self.poison is not None and any(s.request.inputs == self.poison for s in prefill):
            raise MemoryError("this prompt's logits do not fit")
        return self.inner.step(prefill, chunks, want, decode)


def test_sequences_an_admit_fault_took_get_an_error_and_the_next_ones_are_served(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True)
    engine.queue = faulty = FaultyQueue(engine.queue)
    faulty.armed.add("admit")
    taken = [Collector() for _ in range(3)]
    for sink in taken:
        engine.submit(greedy_request(tokenizer, PROMPTS[1], 4), sink)
    engine.run_once()
    assert all(s.done and "the scheduler failed" in errors(s)[0] for s in taken)
    assert len(engine.scheduler.live) == 0
    after = Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 4), after)
    run_until_done(engine, [after])
    assert after.token_ids == reference_greedy(model, tokenizer, PROMPTS[1], 4)
    assert engine.health.failed_steps == 0


def test_a_sequence_a_requeue_fault_dropped_gets_an_error_and_the_batch_goes_on(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True, max_batch_prefill_tokens=9)
    engine.queue = faulty = FaultyQueue(engine.queue)
    faulty.greedy = True
    first, second = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 6), first)  # 9 tokens: fills the step's prefill budget
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 6), second)  # ... so it is put back: requeue raises
    faulty.armed.add("requeue")
    engine.run_once()
    run_until_done(engine, [first, second])
    outcomes = sorted([bool(errors(first)), bool(errors(second))])
    assert outcomes == [False, True]
    served = first if not errors(first) else second
    assert served.token_ids == reference_greedy(model, tokenizer, PROMPTS[1], 6)


def test_a_scheduler_that_fails_every_step_breaks_the_engine_even_while_others_decode(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True)
    engine.queue = faulty = FaultyQueue(engine.queue)
    engine.health.configure(max_failed_steps=3, step_timeout=None)
    told: list[str] = []
    engine.broken_observer = told.append
    running = Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 100), running)
    engine.run_once()
    faulty.always.add("admit")
    for _ in range(3):  # the running sequence decodes fine each step; the scheduler fails each step
        engine.run_once()
    assert told and "3 engine steps in a row failed" in told[0]
    assert "the engine is broken" in errors(running)[0]


def test_a_drain_fault_at_shutdown_still_tells_every_request(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True, max_batch_size=1)
    engine.queue = faulty = FaultyQueue(engine.queue)
    engine.start()
    sinks = [Collector() for _ in range(3)]
    for sink in sinks:
        engine.submit(greedy_request(tokenizer, PROMPTS[1], 1000), sink)
    wait_for(lambda: len(sinks[0].token_ids) > 1)
    faulty.armed.add("drain")
    engine.stop()
    assert all(s.done and errors(s) == ["the server is shutting down"] for s in sinks)


def test_a_run_of_failed_steps_breaks_the_engine_and_tells_everyone(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True, max_batch_size=1)
    engine.runner = runner = FailingRunner(engine.runner)
    engine.health.configure(max_failed_steps=3, step_timeout=None)
    told: list[str] = []
    engine.broken_observer = told.append
    engine.start()
    runner.failing = True
    sinks = [Collector() for _ in range(6)]
    for sink in sinks:
        engine.submit(greedy_request(tokenizer, PROMPTS[1], 5), sink)
    wait_for(lambda: not engine.healthy and all(s.done for s in sinks))
    assert told and "3 engine steps in a row failed" in told[0] and engine.broken == told[0]
    assert all(errors(s) for s in sinks)
    late = Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 5), late)
    assert errors(late), "a broken engine answers at once"


def test_one_failed_step_is_transient(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True)
    engine.runner = runner = FailingRunner(engine.runner)
    engine.health.configure(max_failed_steps=2, step_timeout=None)
    for round_ in range(3):  # failed, served, failed, served ...: never two in a row
        runner.failing = True
        victim = Collector()
        engine.submit(greedy_request(tokenizer, PROMPTS[1], 3), victim)
        engine.run_once()
        assert errors(victim), round_
        runner.failing = False
        served = Collector()
        engine.submit(greedy_request(tokenizer, PROMPTS[1], 3), served)
        run_until_done(engine, [served])
        assert not errors(served)
    assert engine.broken is None


def test_a_hung_step_trips_the_watchdog(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True)
    engine.runner = runner = FailingRunner(engine.runner)
    engine.health.configure(max_failed_steps=5, step_timeout=0.5)
    told: list[str] = []
    engine.broken_observer = told.append
    runner.hang.set()
    engine.start()
    try:
        sink = Collector()
        engine.submit(greedy_request(tokenizer, PROMPTS[1], 5), sink)
        wait_for(lambda: sink.done, timeout=10)
        assert "--step-timeout" in errors(sink)[0] and not engine.healthy and told
    finally:
        runner.hang.clear()
        engine.stop()


def paged_engine(tiny_model_dir, tokenizer, **limits):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return build_engine(model, tokenizer, backend="paged", ignore_eos=True, **limits)


def test_on_the_paged_backend_a_failure_pinned_to_one_prompt_fails_only_that_request(tiny_model, tiny_model_dir):
    reference, tokenizer = tiny_model
    engine = paged_engine(tiny_model_dir, tokenizer)
    engine.runner = runner = FailingRunner(engine.runner)
    running = Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 8), running)
    engine.run_once()
    runner.poison = PROMPTS[6]
    poisoned, neighbour = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[6], 8), poisoned)
    engine.submit(greedy_request(tokenizer, PROMPTS[4], 8), neighbour)
    run_until_done(engine, [running, poisoned, neighbour])
    assert "logits do not fit" in errors(poisoned)[0]
    assert running.token_ids == reference_greedy(reference, tokenizer, PROMPTS[1], 8)
    assert neighbour.token_ids == reference_greedy(reference, tokenizer, PROMPTS[4], 8)
    assert engine.health.failed_steps == 0 and engine.kv_usage()["blocks_used"] == 0


def test_a_stream_left_unread_past_the_idle_timeout_is_ended_and_its_kv_freed(tiny_model, tiny_model_dir):
    _, tokenizer = tiny_model
    engine = paged_engine(tiny_model_dir, tokenizer, stream_buffer_tokens=2)
    engine.stream_idle_timeout = 0.3
    sink = Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 500), CallbackStream(sink, unsent=lambda: len(sink.events)))
    deadline = time.monotonic() + 10
    while not sink.done:
        assert time.monotonic() < deadline
        engine.run_once()
        time.sleep(0.02)
    assert "--stream-idle-timeout" in errors(sink)[0] and len(sink.token_ids) == 2
    assert engine.kv_usage()["blocks_used"] == 0


def test_the_engine_falls_asleep_only_once_no_sequence_is_live_and_a_request_wakes_it(tiny_model, tiny_model_dir):
    reference, tokenizer = tiny_model
    engine = paged_engine(tiny_model_dir, tokenizer, stream_buffer_tokens=2)
    sink, told = Collector(), []
    paused = engine.submit(greedy_request(tokenizer, PROMPTS[1], 500),
                           CallbackStream(sink, unsent=lambda: len(sink.events)))
    for _ in range(4):  # prefilled, then paused for its reader
        engine.run_once()
    engine.sleep(told.append)
    engine.run_once()
    assert told == [False] and not engine.asleep  # a live sequence keeps its KV blocks
    engine.cancel(paused)
    engine.sleep(told.append)
    engine.run_once()
    assert told == [False, True] and engine.asleep
    woken = Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[2], 8), woken)
    run_until_done(engine, [woken])
    assert not engine.asleep and woken.token_ids == reference_greedy(reference, tokenizer, PROMPTS[2], 8)


def test_an_idle_engine_thread_sleeps_while_every_sequence_waits_for_its_reader(tiny_model, tiny_model_dir):
    _, tokenizer = tiny_model
    engine = paged_engine(tiny_model_dir, tokenizer, stream_buffer_tokens=2, max_batch_size=1)
    sink, waiting = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 500), CallbackStream(sink, unsent=lambda: len(sink.events)))
    engine.submit(greedy_request(tokenizer, PROMPTS[2], 5), waiting)  # waits: the batch holds one already
    loops = []
    step = engine.run_once

    def counted() -> None:
        loops.append(time.monotonic())
        step()

    engine.run_once = counted
    engine.start()
    try:
        wait_for(lambda: len(sink.token_ids) == 2)
        time.sleep(0.2)
        before = len(loops)
        time.sleep(1.5)
        assert len(loops) - before <= 3, "the loop spins instead of sleeping"
        assert not waiting.done
    finally:
        engine.stop()


class FaultyPolicy(WaitingQueue):
    """A hooks 2.0 policy (line order) whose armed calls raise once: ``pop`` after taking the sequence off,
    ``prepend`` without putting it back, ``choose_victim`` before choosing."""

    def __init__(self, limits) -> None:
        super().__init__(limits)
        self.armed: set[str] = set()

    def _fault(self, call: str) -> None:
        if call in self.armed:
            self.armed.discard(call)
            raise RuntimeError(f"injected {call} fault")

    def pop(self):
        seq = super().pop()
        self._fault("pop")
        return seq

    def prepend(self, seq) -> None:
        self._fault("prepend")
        super().prepend(seq)

    def choose_victim(self, running, waiting, shortage):
        self._fault("choose_victim")


def test_a_policy_that_raises_loses_no_request_and_the_next_ones_are_served(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True, max_batch_prefill_tokens=9)
    engine.queue = policy = FaultyPolicy(engine.queue.limits)
    policy.armed |= {"pop", "choose_victim"}
    running = Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 6), running)  # popped as pop raises: orphaned, told
    engine.run_once()
    assert running.done and "the scheduler failed" in errors(running)[0]
    first, second = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 6), first)
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 6), second)  # waits: choose_victim is asked, and raises
    policy.armed.add("choose_victim")
    run_until_done(engine, [first, second])
    for sink in (first, second):
        assert sink.token_ids == reference_greedy(model, tokenizer, PROMPTS[1], 6)
    assert len(engine.scheduler.live) == 0 and engine.queue.faults == 2
