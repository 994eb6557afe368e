"""Schedulers, driven step by step with a fake clock and fake sequences (no model), and on the tiny model.

A policy is driven as the engine drives it, through :class:`Admission` (admission within the step's
limits, preemption through the policy's ``choose_victim``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tokenmill.engine.admission import Room
from tokenmill.engine.queue import WaitingQueue
from tokenmill.engine.scheduling import Admission, LegacyAdmission
from tokenmill.engine.sequence import PRIORITY_CLASSES, GenerationRequest, SamplingParams, Sequence
from tokenmill.engine.stream import CallbackStream
from tokenmill.interfaces import BatchLimits, Preemption, StepBudget
from tokenmill_plugins.schedulers.fifo import FifoQueue
from tokenmill_plugins.schedulers.priority import PriorityQueue

ROOT = Path(__file__).resolve().parent.parent


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake(prompt: int, new_tokens: int = 10, priority: str = "normal", at: float = 1000.0) -> Sequence:
    seq = Sequence(GenerationRequest("", [5] * prompt, new_tokens, SamplingParams(), priority=priority),
                   lambda event: None, None)
    seq.arrived_at = at
    return seq


def limits(**overrides) -> BatchLimits:
    values = {"max_batch_prefill_tokens": 100, "max_batch_total_tokens": 10_000, "max_batch_size": None}
    return BatchLimits(**{**values, **overrides})


def budget(prefill: int = 100, free_tokens: int | None = None, block_size: int = 1) -> StepBudget:
    return StepBudget(prefill, chunked=False, kv_free_tokens=free_tokens, block_size=block_size)


# ---- the base queue: what every scheduler gets by subclassing WaitingQueue ------------------------


class ShortestFirst(WaitingQueue):
    """A third-party scheduler's queue: the ordering only; the bookkeeping and ``admit`` are inherited."""

    def key(self, seq: Sequence) -> int:
        return seq.pending_len


class ByClass(WaitingQueue):
    """Ordering by class only: within a class the line order decides (requeued first, then arrival)."""

    def key(self, seq: Sequence) -> int:
        return PRIORITY_CLASSES.index(seq.request.priority)


def test_a_subclass_supplying_only_an_order_serves_every_call_the_engine_makes():
    queue = Admission.of(ShortestFirst(limits()))
    long, short, middle = fake(30), fake(5), fake(10)
    for seq in (long, short, middle):
        queue.add(seq)
    assert len(queue) == 3
    assert queue.pending() == [short, middle, long] and len(queue) == 3  # pending changes nothing
    assert queue.admit([], budget(prefill=20)) == [short, middle]  # `long` is next and does not fit
    assert queue.pending() == [long]
    queue.requeue(short)  # preempted: it waits again and competes by its key
    assert queue.pending() == [short, long]
    assert queue.remove(long) is True and queue.remove(long) is False  # a cancelled request, once
    assert queue.pending() == [short]
    assert queue.drain() == [short] and len(queue) == 0 and queue.pending() == []


def test_the_default_order_is_the_line_requeued_sequences_first_the_latest_requeued_first():
    queue = Admission.of(WaitingQueue(limits()))
    new, older, oldest = fake(5), fake(5), fake(5)
    queue.add(new)
    queue.requeue(older)
    queue.requeue(oldest)  # the engine requeues the latest arrival first when it preempts several
    assert queue.pending() == [oldest, older, new]
    assert queue.admit([], budget()) == [oldest, older, new]


def test_requeued_sequences_go_first_among_those_of_equal_key():
    queue = Admission.of(ByClass(limits()))
    low, normal_first, normal_second, high = fake(5, priority="low"), fake(5), fake(5), fake(5, priority="high")
    for seq in (low, normal_first, normal_second, high):
        queue.add(seq)
    assert queue.admit([], budget(prefill=5)) == [high]
    queue.requeue(resumed := fake(5, at=900.0))
    assert queue.pending() == [resumed, normal_first, normal_second, low]
    queue.requeue(high)  # still the only high one: the class decides first
    assert queue.pending() == [high, resumed, normal_first, normal_second, low]


def test_the_default_admit_never_skips_past_the_first_sequence_that_does_not_fit():
    queue = Admission.of(WaitingQueue(limits(max_batch_size=3)))
    first, too_long, small = fake(60), fake(50), fake(5)
    for seq in (first, too_long, small):
        queue.add(seq)
    assert queue.admit([], budget(prefill=100)) == [first]
    assert queue.admit([fake(5), fake(5)], budget(prefill=100)) == [too_long]  # one seat left
    assert queue.pending() == [small]


def test_fitting_and_take_are_the_parts_of_admit_a_subclass_can_reuse():
    class EveryOtherStep(WaitingQueue):
        """Admits what fits, but only on every other call: its own rule on top of the inherited parts."""

        def __init__(self, batch_limits: BatchLimits) -> None:
            super().__init__(batch_limits)
            self.calls = 0

        def admit(self, holding: list[Sequence], step: StepBudget) -> list[Sequence]:
            self.calls += 1
            ready = self.fitting(holding, step)
            return self.take(ready) if self.calls % 2 == 0 else []

    queue = EveryOtherStep(limits())
    queue.add(first := fake(40))
    queue.add(second := fake(40))
    queue.add(fake(40))
    assert queue.fitting([], budget(prefill=100)) == [first, second] and len(queue) == 3  # nothing removed
    assert queue.admit([], budget(prefill=100)) == []
    assert queue.admit([], budget(prefill=100)) == [first, second] and len(queue) == 1


def test_a_waiting_queue_preempts_nothing_unless_its_subclass_says_how():
    # The engine asks a policy for a victim only when it has a ``choose_victim`` method.
    assert not hasattr(WaitingQueue(limits()), "choose_victim")
    assert not hasattr(FifoQueue(limits()), "choose_victim")
    assert callable(PriorityQueue(limits()).choose_victim)
    assert Admission.of(WaitingQueue(limits())).preempt([fake(5)], budget()) == []


def test_removing_a_sequence_that_is_not_waiting_changes_nothing():
    queue = WaitingQueue(limits())
    queue.add(waiting := fake(5))
    assert queue.remove(fake(5)) is False
    assert queue.pending() == [waiting]


def test_the_built_in_queues_are_waiting_queues():
    assert isinstance(FifoQueue(limits()), WaitingQueue)
    assert isinstance(PriorityQueue(limits()), WaitingQueue)


def example_queue(path: str) -> type:
    """The ``ShortestPromptFirstQueue`` class of a scheduler module at ``path`` (under the repository)."""
    spec = importlib.util.spec_from_file_location(f"scheduler_{Path(path).parent.name}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ShortestPromptFirstQueue


THIRD_PARTY_QUEUES = {
    "WaitingQueue subclass": (lambda: ShortestFirst, Admission),
    "tokenmill-example (hooks 2.0)": (
        lambda: example_queue("plugins/packages/tokenmill-example/tokenmill_example/scheduler.py"), Admission),
    "tokenmill-example as written for hooks 1.0": (
        lambda: example_queue("tests/hooks1_example_scheduler.py"), LegacyAdmission),
}


@pytest.mark.parametrize("written", sorted(THIRD_PARTY_QUEUES))
def test_a_third_party_waiting_queue_drives_the_engine_to_the_same_tokens(tiny_model, written):
    from engine_helpers import PROMPTS, Collector, build_engine, greedy_request, reference_greedy

    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True, max_batch_size=1)
    queue_class, admission = THIRD_PARTY_QUEUES[written]
    engine.queue = queue_class()(engine.queue.limits)
    assert type(engine.queue) is admission  # a hooks 1.x queue runs through the adapter
    prompts = [PROMPTS[6], PROMPTS[0], PROMPTS[1]]  # longest first: they start shortest first
    collectors = [Collector() for _ in prompts]
    for prompt, collector in zip(prompts, collectors):
        engine.submit(greedy_request(tokenizer, prompt, 4), collector)
    engine.run_once()
    assert [e["prompt_tokens"] for e in engine.queue_view()["pending"]] == sorted(
        len(tokenizer(p)["input_ids"]) for p in (PROMPTS[6], PROMPTS[1]))
    finished = []
    while not all(c.done for c in collectors):
        engine.run_once()
        finished += [i for i, c in enumerate(collectors) if c.done and i not in finished]
    assert finished == [1, 2, 0]
    for prompt, collector in zip(prompts, collectors):
        assert collector.token_ids == reference_greedy(model, tokenizer, prompt, 4)
    assert len(engine.queue) == 0


# ---- fifo -------------------------------------------------------------------------------------


def test_fifo_puts_requeued_sequences_at_the_head_of_the_line():
    queue = Admission.of(FifoQueue(limits()))
    queue.add(waiting := fake(5))
    queue.add(preempted := fake(5))
    assert queue.admit([], budget(prefill=5)) == [waiting]
    queue.add(newcomer := fake(5))
    queue.requeue(waiting)
    assert queue.pending() == [waiting, preempted, newcomer]


def test_fifo_admits_in_arrival_order_until_the_first_request_that_does_not_fit():
    queue = Admission.of(FifoQueue(limits()))
    first, too_long, small = fake(60), fake(50), fake(5)
    for seq in (first, too_long, small):
        queue.add(seq)
    assert queue.admit([], budget(prefill=100)) == [first]  # `small` would fit, but never overtakes
    assert queue.admit([], budget(prefill=100)) == [too_long, small]


def test_fifo_respects_kv_blocks_batch_size_and_total_tokens():
    queue = Admission.of(FifoQueue(limits(max_batch_size=2)))
    seqs = [fake(8) for _ in range(3)]
    for seq in seqs:
        queue.add(seq)
    # 4 free blocks of 4: the first alone needs 2, the second 2 + 1 to grow into: only one fits.
    assert queue.admit([], budget(free_tokens=16, block_size=4)) == seqs[:1]
    assert queue.admit(seqs[:1], budget(free_tokens=64, block_size=4)) == seqs[1:2]  # batch size 2 reached
    padded = Admission.of(FifoQueue(limits(max_batch_total_tokens=40)))
    for seq in (fake(10), fake(10), fake(10)):  # 20 tokens each over their lifetime
        padded.add(seq)
    assert len(padded.admit([], budget())) == 2


def test_newcomers_join_a_running_batch_only_when_enough_wait_or_after_max_waiting_tokens_steps():
    queue = Admission.of(FifoQueue(limits(waiting_served_ratio=0.3, max_waiting_tokens=4)))
    running = [fake(5) for _ in range(10)]  # 0.3 × 10: at least 3 newcomers at once
    queue.add(first := fake(5))
    queue.add(second := fake(5))
    assert [queue.admit(running, budget()) for _ in range(4)] == [[], [], [], []]
    assert queue.admit(running, budget()) == [first, second]  # 4 steps waited: they join anyway
    group = [fake(5) for _ in range(3)]
    for seq in group:
        queue.add(seq)
    assert queue.admit(running, budget()) == group  # 3 of 10: they join at once


def test_an_idle_engine_admits_at_once_whatever_the_ratio():
    queue = Admission.of(FifoQueue(limits(waiting_served_ratio=5.0, max_waiting_tokens=1000)))
    queue.add(seq := fake(5))
    assert queue.admit([], budget()) == [seq]


# ---- priority ---------------------------------------------------------------------------------


def test_priority_serves_high_then_normal_then_low_and_short_before_long():
    clock = FakeClock()
    queue = Admission.of(PriorityQueue(limits(), clock))
    low, normal_long, normal_short, high = fake(5, priority="low"), fake(80), fake(5), fake(5, priority="high")
    for seq in (low, normal_long, normal_short, high):
        queue.add(seq)
    assert queue.queue.ordered() == [high, normal_short, normal_long, low]
    assert queue.admit([], budget(prefill=20)) == [high, normal_short]  # normal_long is next and does not fit
    assert queue.admit([], budget(prefill=100)) == [normal_long, low]


def test_priority_places_a_requeued_sequence_by_its_weight_with_its_original_arrival_time():
    clock = FakeClock()
    queue = Admission.of(PriorityQueue(limits(), clock))
    queue.add(early := fake(5, at=clock.now))
    clock.now += 5.0
    queue.add(later := fake(5, at=clock.now))
    assert queue.admit([], budget(prefill=5)) == [early]
    clock.now += 5.0
    queue.add(newcomer := fake(5, at=clock.now))
    queue.add(high := fake(5, priority="high", at=clock.now))
    queue.requeue(early)  # it aged the longest, but a high one still outweighs it
    assert queue.pending() == [high, early, later, newcomer]


def run_flood(queue: PriorityQueue, clock: FakeClock, low: Sequence, steps: int) -> int | None:
    """A flood of short high requests, one arriving per second, and one free seat per second
    (the batch is otherwise full): the second at which ``low`` starts, or None."""
    others = [fake(1) for _ in range(3)]  # the rest of the batch: max_batch_size 4 leaves one seat
    queue.add(low)
    for second in range(1, steps + 1):
        clock.now += 1.0
        queue.add(fake(10, new_tokens=10, priority="high", at=clock.now))
        if low in queue.admit(others, budget(prefill=1_000)):
            return second
    return None


def test_aging_serves_a_low_request_within_its_bound_under_a_flood_of_high_ones():
    clock = FakeClock()
    queue = Admission.of(PriorityQueue(limits(max_batch_size=4), clock))
    low = fake(90, new_tokens=10, priority="low", at=clock.now)
    # It outranks every high request arriving more than (4000 - 0 + 100 - 20) / 100 = 40.8 s after it;
    # the ~41 that arrived before that go first, one per second.
    started = run_flood(queue, clock, low, steps=200)
    assert started is not None and 40 <= started <= 43


def test_without_aging_the_same_flood_starves_the_low_request():
    clock = FakeClock()
    queue = Admission.of(PriorityQueue(limits(max_batch_size=4, priority_aging=0.0), clock))
    assert run_flood(queue, clock, fake(90, priority="low", at=clock.now), steps=200) is None


def test_a_full_batch_preempts_its_lightest_lower_class_sequence_for_a_higher_one():
    clock = FakeClock()
    queue = Admission.of(PriorityQueue(limits(max_batch_size=2), clock))
    low_long, low_short = fake(50, priority="low"), fake(5, priority="low")
    queue.add(high := fake(5, priority="high"))
    assert queue.preempt([low_short, low_long], budget()) == [Preemption(low_long, keep_kv=True)]
    assert queue.preempt([fake(5, priority="high"), fake(5, priority="high")], budget()) == []  # none lower
    roomy = Admission.of(PriorityQueue(limits(max_batch_size=3), clock))
    roomy.add(high)
    assert roomy.preempt([low_short, low_long], budget()) == []  # a seat is free: no need


def test_lacking_kv_memory_preempts_with_the_memory_freed():
    queue = Admission.of(PriorityQueue(limits(), FakeClock()))
    queue.add(fake(40, priority="high"))
    running = fake(30, priority="low")
    assert queue.preempt([running], budget(free_tokens=16, block_size=4)) == [Preemption(running, keep_kv=False)]


def test_waiting_only_for_this_steps_prefill_budget_preempts_nothing():
    queue = Admission.of(PriorityQueue(limits(), FakeClock()))
    queue.add(fake(80, priority="high"))
    assert Room(queue.limits, [], budget(prefill=50)).shortage(queue.queue.waiting[0]) == "prefill"
    assert queue.preempt([fake(5, priority="low")], budget(prefill=50)) == []


def test_a_suspended_sequence_keeps_its_kv_and_resumes_with_the_tokens_it_would_have_had(tiny_model,
                                                                                       tiny_model_dir):
    from engine_helpers import PROMPTS, Collector, build_engine, greedy_request, reference_greedy
    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny_model
    paged_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = build_engine(paged_model, tokenizer, backend="paged", ignore_eos=True, scheduler="priority",
                          max_batch_size=1)
    low, high = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[6], 20, priority="low"), low)
    for _ in range(6):
        engine.run_once()
    held = engine.kv_usage()["blocks_used"]
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 5, priority="high"), high)
    engine.run_once()
    assert engine.suspensions == 1 and engine.preemptions == 0
    assert engine.kv_usage()["blocks_used"] > held, "both hold their blocks"
    assert [entry["preempted"] for entry in engine.queue_view()["pending"]] == [True]
    while not (low.done and high.done):
        engine.run_once()
    assert low.token_ids == reference_greedy(model, tokenizer, PROMPTS[6], 20)
    assert high.token_ids == reference_greedy(model, tokenizer, PROMPTS[1], 5)
    assert engine.kv_usage()["blocks_used"] == 0


def test_a_preempted_sequence_resumes_with_the_tokens_it_would_have_had(tiny_model):
    from engine_helpers import PROMPTS, Collector, build_engine, greedy_request, reference_greedy

    model, tokenizer = tiny_model
    # The padded batch cannot leave a row out: the sequence is preempted and recomputed instead.
    engine = build_engine(model, tokenizer, ignore_eos=True, scheduler="priority", max_batch_size=1)
    low, high = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[6], 20, priority="low"), low)
    for _ in range(6):
        engine.run_once()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 5, priority="high"), high)
    while not (low.done and high.done):
        engine.run_once()
    assert engine.preemptions == 1
    assert high.final.generated_tokens == 5 and len(low.token_ids) == 20
    assert low.token_ids == reference_greedy(model, tokenizer, PROMPTS[6], 20)
    assert high.token_ids == reference_greedy(model, tokenizer, PROMPTS[1], 5)


# ---- backpressure -----------------------------------------------------------------------------


def test_a_slow_reader_pauses_only_its_own_sequence_and_resumes_with_the_same_tokens(tiny_model, tiny_model_dir):
    from engine_helpers import PROMPTS, Collector, build_engine, greedy_request, reference_greedy
    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny_model
    paged_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()  # paged attention takes it over
    engine = build_engine(paged_model, tokenizer, backend="paged", ignore_eos=True, stream_buffer_tokens=4)
    slow, fast = Collector(), Collector()
    read = 0
    engine.submit(greedy_request(tokenizer, PROMPTS[0], 12),
                  CallbackStream(slow, unsent=lambda: len(slow.events) - read))
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 12), fast)
    for _ in range(14):
        engine.run_once()
    assert fast.done and len(fast.token_ids) == 12, "the fast reader never waited for the slow one"
    assert len(slow.token_ids) == 4 and not slow.done, "the slow reader's sequence stopped at its buffer"
    assert engine.batch_size == 1 and engine.kv_usage()["bytes"] > 0, "it kept its KV memory"
    while not slow.done:  # the client now reads everything it is sent
        read = len(slow.events)
        engine.run_once()
    assert slow.token_ids == reference_greedy(model, tokenizer, PROMPTS[0], 12)
    assert engine.kv_usage()["bytes"] == 0


def test_the_padded_batch_cannot_leave_a_row_out_so_it_keeps_decoding_a_slow_readers_sequence(tiny_model):
    from engine_helpers import PROMPTS, Collector, build_engine, greedy_request

    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True, stream_buffer_tokens=4)
    slow = Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[0], 8), CallbackStream(slow, unsent=lambda: len(slow.events)))
    while not slow.done:
        engine.run_once()
    assert len(slow.token_ids) == 8
