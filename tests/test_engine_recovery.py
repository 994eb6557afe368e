"""Recovering from faults never changes another request's output: a sequence that shared blocks a failed
step never computed starts again from what is computed, an error after the forward fails only the
sequences it belongs to (never the suspended ones' KV), one request's failing forward is not taken for
a broken engine, and a prefix-cache reset is answered whatever else the engine's inbox held."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_helpers import PROMPTS, Collector, build_engine, greedy_request, reference_greedy, wait_for

from tokenmill.engine.sequence import ErrorEvent

SYSTEM = ("You are a careful assistant for a public library. Answer every question in full sentences, name the books "
          "and articles you draw on, keep to what the sources say, and say so plainly when you do not know. ")
QUESTIONS = ["What is two plus two?", "Name a primary colour.", "Why is the sky blue?"]


def errors(sink: Collector) -> list[str]:
    return [e.message for e in sink.events if isinstance(e, ErrorEvent)]


@pytest.fixture
def paged_engine(tiny_model_dir, tiny_model):
    """A paged engine on its own copy of the tiny model (the paged backend takes over its attention)."""
    from transformers import AutoModelForCausalLM

    def build(**settings):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        return build_engine(model, tiny_model[1], backend="paged", ignore_eos=True, **settings)

    return build


def fail_steps_that_prefill(runner, prompt: str) -> None:
    """Every step whose prefill holds ``prompt`` raises inside the runner, as a kernel would."""
    step = runner.step

    def failing(prefill, *args, **kwargs):
        if any(s.request.inputs == prompt for s in prefill):
            raise RuntimeError("the kernel rejected this prompt")
        return step(prefill, *args, **kwargs)

    runner.step = failing


def run_in_steps(engine, sinks, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if all(s.done for s in sinks):
            return
        engine.run_once()
    raise AssertionError("the sequences did not end")


def test_a_sequence_that_shared_blocks_a_failed_step_never_computed_starts_again(paged_engine, tiny_model):
    model, tokenizer = tiny_model
    engine = paged_engine(prefix_caching=True)
    first, second = SYSTEM + QUESTIONS[0], SYSTEM + QUESTIONS[1]
    fail_steps_that_prefill(engine.runner, first)  # the step of both fails, and then the first one's part alone
    failed, sharer = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, first, 8), failed)
    engine.submit(greedy_request(tokenizer, second, 8), sharer)
    run_in_steps(engine, [failed, sharer])
    assert "the kernel rejected this prompt" in errors(failed)[0]
    assert not errors(sharer) and sharer.token_ids == reference_greedy(model, tokenizer, second, 8)
    assert sharer.final.cached_tokens == 0  # nothing of the first one's was ever computed
    again = Collector()  # what the sharer left in the cache is what its own forward computed
    engine.submit(greedy_request(tokenizer, SYSTEM + QUESTIONS[2], 8), again)
    run_in_steps(engine, [again])
    assert again.final.cached_tokens > 0
    assert again.token_ids == reference_greedy(model, tokenizer, SYSTEM + QUESTIONS[2], 8)
    assert engine.kv_usage()["blocks_used"] == 0


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["plain", "caching"])
def test_an_error_after_the_forward_fails_its_own_sequence_and_a_suspended_one_resumes_intact(
        paged_engine, tiny_model, prefix_caching):
    model, tokenizer = tiny_model
    engine = paged_engine(prefix_caching=prefix_caching, scheduler="priority", max_batch_size=1)
    details = engine.output.prompt_details

    def failing_details(seq, logits):
        if seq.request.priority == "high":
            raise ValueError("the prompt's top tokens could not be decoded")
        details(seq, logits)

    engine.output.prompt_details = failing_details
    low, high = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 24, priority="low"), low)
    for _ in range(4):
        engine.run_once()
    engine.submit(greedy_request(tokenizer, PROMPTS[4], 4, priority="high", decoder_input_details=True), high)
    engine.start()  # the loop's own recovery, as a server runs it
    try:
        wait_for(lambda: low.done and high.done)
    finally:
        engine.stop()
    assert engine.suspensions == 1
    assert "could not be decoded" in errors(high)[0]
    assert not errors(low) and low.token_ids == reference_greedy(model, tokenizer, PROMPTS[1], 24)
    assert engine.health.failed_steps == 0 and engine.kv_usage()["blocks_used"] == 0


def test_an_error_in_verifying_drafts_fails_only_the_sequence_it_belongs_to(paged_engine, tiny_model):
    from tokenmill.engine.speculation import Speculator

    class Fixed(Speculator):
        def draft(self, seq, most):
            return [11] * most  # mostly rejected: every step rolls back

    model, tokenizer = tiny_model
    engine = paged_engine()
    engine.scheduler.speculator = Fixed(3, step_tokens=64)
    rollback = engine.scheduler.kv.rollback
    victim_prompt = PROMPTS[6]

    def failing_rollback(seq):
        if seq.request.inputs == victim_prompt:
            raise RuntimeError("the pool could not truncate a draft")
        rollback(seq)

    engine.scheduler.kv.rollback = failing_rollback
    victim, neighbour = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, victim_prompt * 2, 24), neighbour)
    engine.submit(greedy_request(tokenizer, victim_prompt, 24), victim)
    engine.start()
    try:
        wait_for(lambda: victim.done and neighbour.done)
    finally:
        engine.stop()
    assert "could not truncate" in errors(victim)[0]
    assert not errors(neighbour)
    assert neighbour.token_ids == reference_greedy(model, tokenizer, victim_prompt * 2, 24)
    assert engine.health.failed_steps == 0 and engine.kv_usage()["blocks_used"] == 0


def test_requests_whose_own_forward_fails_one_after_another_do_not_break_the_engine(paged_engine, tiny_model):
    model, tokenizer = tiny_model
    engine = paged_engine()
    engine.health.configure(max_failed_steps=3, step_timeout=None)
    poison = PROMPTS[6]
    fail_steps_that_prefill(engine.runner, poison)
    engine.start()
    try:
        for _ in range(5):  # each alone in its step: nothing to tell it apart from a broken device but a probe
            bad = Collector()
            engine.submit(greedy_request(tokenizer, poison, 4), bad)
            wait_for(lambda bad=bad: bad.done)
            assert "the kernel rejected this prompt" in errors(bad)[0]
        good = Collector()
        engine.submit(greedy_request(tokenizer, PROMPTS[1], 4), good)
        wait_for(lambda: good.done)
        assert engine.healthy and engine.broken is None
        assert good.token_ids == reference_greedy(model, tokenizer, PROMPTS[1], 4)
    finally:
        engine.stop()


def test_a_device_that_fails_every_step_still_breaks_the_engine_when_each_step_holds_one_request(
        paged_engine, tiny_model):
    _, tokenizer = tiny_model
    engine = paged_engine()
    engine.health.configure(max_failed_steps=3, step_timeout=None)

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.runner.step = broken
    told: list[str] = []
    engine.broken_observer = told.append
    engine.start()
    try:
        sinks = []
        for _ in range(3):
            sinks.append(Collector())
            engine.submit(greedy_request(tokenizer, PROMPTS[1], 4), sinks[-1])
            wait_for(lambda: sinks[-1].done)
        wait_for(lambda: not engine.healthy)
        assert told and "3 engine steps in a row failed" in told[0]
    finally:
        engine.stop()


def test_a_prefix_cache_reset_is_answered_when_taking_the_inbox_fails(paged_engine, tiny_model):
    _, tokenizer = tiny_model
    engine = paged_engine(prefix_caching=True)
    release = engine.scheduler.kv.free

    def failing_release(seqs):
        if seqs:
            raise RuntimeError("the pool's free list is inconsistent")
        release(seqs)

    cancelled = Collector()
    seq = engine.submit(greedy_request(tokenizer, PROMPTS[1], 4), cancelled)
    engine.cancel(seq)
    answered = threading.Event()
    engine.reset_prefix_cache(lambda dropped: answered.set())
    engine.scheduler.kv.free = failing_release
    engine.start()
    try:
        assert answered.wait(10), "the reset was never answered"
        engine.scheduler.kv.free = release
        served = Collector()
        engine.submit(greedy_request(tokenizer, PROMPTS[4], 4), served)
        wait_for(lambda: served.done)
        assert not errors(served)
    finally:
        engine.stop()


def test_a_prompt_that_took_computed_blocks_and_fails_on_its_own_gets_its_error_beside_others(
        paged_engine, tiny_model):
    model, tokenizer = tiny_model
    engine = paged_engine(prefix_caching=True)
    warm = Collector()  # fills the cache with the system prompt's blocks, computed and confirmed
    engine.submit(greedy_request(tokenizer, SYSTEM + QUESTIONS[0], 4), warm)
    run_in_steps(engine, [warm])
    poison = SYSTEM + QUESTIONS[1]
    fail_steps_that_prefill(engine.runner, poison)
    failing, neighbour = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 48), neighbour)
    engine.submit(greedy_request(tokenizer, poison, 4), failing)
    for _ in range(8):  # not restarted again and again while its neighbour decodes
        if failing.done:
            break
        engine.run_once()
    assert failing.done and "the kernel rejected this prompt" in errors(failing)[0]
    assert not neighbour.done
    run_in_steps(engine, [neighbour])
    assert neighbour.token_ids == reference_greedy(model, tokenizer, PROMPTS[1], 48)


def test_an_error_in_handing_on_an_isolated_part_s_tokens_fails_only_that_part(paged_engine, tiny_model):
    model, tokenizer = tiny_model
    engine = paged_engine()
    poison, unlucky = PROMPTS[6], PROMPTS[4]
    fail_steps_that_prefill(engine.runner, poison)
    sample = engine.output.sample

    def failing_sample(seqs, *args, **kwargs):
        if any(s.request.inputs == unlucky for s in seqs):
            raise ValueError("a logits processor raised")
        return sample(seqs, *args, **kwargs)

    engine.output.sample = failing_sample
    sinks = {prompt: Collector() for prompt in (poison, unlucky, PROMPTS[1])}
    for prompt, sink in sinks.items():
        engine.submit(greedy_request(tokenizer, prompt, 8), sink)
    engine.start()
    try:
        wait_for(lambda: all(s.done for s in sinks.values()))
    finally:
        engine.stop()
    assert "the kernel rejected this prompt" in errors(sinks[poison])[0]
    assert "a logits processor raised" in errors(sinks[unlucky])[0]
    assert not errors(sinks[PROMPTS[1]])
    assert sinks[PROMPTS[1]].token_ids == reference_greedy(model, tokenizer, PROMPTS[1], 8)


def test_on_the_transformers_backend_a_prompt_s_own_failure_is_not_the_engine_s(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True)
    engine.health.configure(max_failed_steps=1, step_timeout=None)
    prefill = engine.runner.prefill

    def failing_prefill(seqs, *args, **kwargs):
        if any(s.request.inputs == PROMPTS[6] for s in seqs):
            raise RuntimeError("the kernel rejected this prompt")
        return prefill(seqs, *args, **kwargs)

    engine.runner.prefill = failing_prefill
    bad, good = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[6], 4), bad)
    run_in_steps(engine, [bad])
    assert "the kernel rejected this prompt" in errors(bad)[0] and engine.broken is None
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 4), good)
    run_in_steps(engine, [good])
    assert good.token_ids == reference_greedy(model, tokenizer, PROMPTS[1], 4)


def test_on_the_transformers_backend_a_device_that_fails_decoding_breaks_the_engine(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True)
    engine.health.configure(max_failed_steps=1, step_timeout=None)
    running = Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 32), running)
    engine.run_once()
    engine.run_once()
    assert len(running.token_ids) == 2

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.runner.decode = engine.runner.prefill = broken  # the probe's prefill fails as the decode did
    engine.run_once()
    assert engine.broken is not None and "in a row failed" in engine.broken
    assert errors(running)


def test_a_prompt_whose_prefill_cannot_be_planned_fails_alone_and_the_batch_goes_on(paged_engine, tiny_model):
    """An error while the KV-cache manager allocates one prompt's blocks (not a shortage of KV memory) fails
    that request only: the prompt planned beside it in the same step gets its reference tokens, and no step fails."""
    model, tokenizer = tiny_model
    engine = paged_engine(prefix_caching=True)
    allocate = engine.scheduler.kv.allocate

    def failing(seq, cached, chunk):
        if seq.request.inputs == QUESTIONS[0]:
            raise RuntimeError("the pool's bookkeeping broke")
        allocate(seq, cached, chunk)

    engine.scheduler.kv.allocate = failing
    poisoned, served = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, QUESTIONS[0], 4), poisoned)
    engine.submit(greedy_request(tokenizer, QUESTIONS[1], 4), served)
    run_in_steps(engine, [poisoned, served])
    assert "the pool's bookkeeping broke" in errors(poisoned)[0]
    assert not errors(served) and served.token_ids == reference_greedy(model, tokenizer, QUESTIONS[1], 4)
    assert engine.health.failed_steps == 0 and len(engine.scheduler.live) == 0
