"""The engine loop: continuous batching gives model.generate()'s greedy tokens, and frees at once."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import PROMPTS, Collector, build_engine, greedy_request, reference_greedy, tiny_mistral, wait_for

import tokenmill
from tokenmill.engine.sequence import ErrorEvent, SamplingParams
from tokenmill.plugin_manager import build_plugin_manager


def test_greedy_tokens_equal_generate_when_requests_join_mid_batch(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True)
    lengths = [12, 20, 7, 16, 24, 9, 14, 18]
    sinks = [Collector() for _ in PROMPTS]
    for prompt, length, sink in zip(PROMPTS[:4], lengths, sinks):
        engine.submit(greedy_request(tokenizer, prompt, length), sink)
    for _ in range(3):
        engine.run_once()
    assert engine.batch_size == 4
    for prompt, length, sink in zip(PROMPTS[4:], lengths[4:], sinks[4:]):
        engine.submit(greedy_request(tokenizer, prompt, length), sink)
    batch_sizes = []
    while not all(s.done for s in sinks):
        engine.run_once()
        batch_sizes.append(engine.batch_size)
    assert max(batch_sizes) == 8, "the late requests joined the running batch"
    assert engine.batch_size == 0 and engine.kv_usage()["bytes"] == 0
    for prompt, length, sink in zip(PROMPTS, lengths, sinks):
        assert sink.token_ids == reference_greedy(model, tokenizer, prompt, length), prompt
        assert sink.final.finish_reason == "length"


def test_finished_sequences_leave_the_batch_the_step_they_finish(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True)
    short, long = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[0], 2), short)
    engine.submit(greedy_request(tokenizer, PROMPTS[6], 10), long)
    engine.run_once()  # prefill: token 1
    engine.run_once()  # decode: token 2, so the short one is done
    assert short.final is not None and engine.batch_size == 1
    kv_with_one = engine.kv_usage()["bytes"]
    while not long.done:
        engine.run_once()
    assert kv_with_one > 0 and engine.kv_usage()["bytes"] == 0


def test_cancel_frees_the_sequence_at_the_next_step(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True)
    kept, dropped = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 50), kept)
    seq = engine.submit(greedy_request(tokenizer, PROMPTS[6], 50), dropped)
    engine.run_once()
    assert engine.batch_size == 2
    before = engine.kv_usage()["bytes"]
    engine.cancel(seq)
    engine.run_once()
    assert engine.batch_size == 1
    assert engine.kv_usage()["bytes"] < before
    assert len(dropped.token_ids) == 1 and len(kept.token_ids) == 2


def test_a_failing_request_does_not_break_the_others(tiny_model):
    model, tokenizer = tiny_model

    class ExplodingProcessor:
        @tokenmill.hookimpl
        def tokenmill_logits_processors(self, parameters):
            if parameters.get("explode"):
                def explode(token_ids, scores):
                    if len(token_ids) > 4:
                        raise RuntimeError("boom")
                    return scores
                return [explode]
            return []

    pm = build_plugin_manager(autoload=False)
    pm.register(ExplodingProcessor())
    engine = build_engine(model, tokenizer, pm=pm, ignore_eos=True)
    good, bad = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 8), good)
    engine.submit(greedy_request(tokenizer, PROMPTS[0], 8, parameters={"explode": True}), bad)
    while not (good.done and bad.done):
        engine.run_once()
    assert any(isinstance(e, ErrorEvent) and "boom" in e.message for e in bad.events)
    assert good.token_ids == reference_greedy(model, tokenizer, PROMPTS[1], 8)


def test_same_seed_gives_the_same_sampled_tokens(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True)
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=50, seed=1234)
    runs = []
    for _ in range(2):
        sink = Collector()
        engine.submit(greedy_request(tokenizer, PROMPTS[2], 12, sampling=params), sink)
        while not sink.done:
            engine.run_once()
        runs.append(sink.token_ids)
        assert sink.final.seed == 1234
    assert runs[0] == runs[1]
    other = Collector()
    engine.submit(
        greedy_request(tokenizer, PROMPTS[2], 12, sampling=SamplingParams(do_sample=True, seed=99)), other)
    while not other.done:
        engine.run_once()
    assert other.token_ids != runs[0]


def test_stop_sequence_ends_generation_and_is_kept_in_the_text(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True)
    probe = Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[3], 10), probe)
    while not probe.done:
        engine.run_once()
    full_text = probe.final.generated_text
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    assert stop.strip(), full_text
    sink = Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[3], 10, stop=(stop,)), sink)
    while not sink.done:
        engine.run_once()
    assert sink.final.finish_reason == "stop_sequence"
    assert stop in sink.final.generated_text
    assert full_text.startswith(sink.final.generated_text)
    assert len(sink.token_ids) < 10


def test_prompt_logprobs_match_the_model(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer)
    sink = Collector()
    request = greedy_request(tokenizer, PROMPTS[1], 1, decoder_input_details=True)
    engine.submit(request, sink)
    while not sink.done:
        engine.run_once()
    prefill = sink.final.prefill
    assert [t.id for t in prefill] == request.input_ids and prefill[0].logprob is None
    with torch.no_grad():
        logits = model(torch.tensor([request.input_ids])).logits[0]
    expected = torch.log_softmax(logits, -1)[range(len(request.input_ids) - 1), request.input_ids[1:]]
    assert torch.allclose(torch.tensor([t.logprob for t in prefill[1:]]), expected, atol=1e-4)


def run_until_done(engine, sinks) -> list[int]:
    """Step until every sink is done; return the batch size after each step."""
    sizes = []
    while not all(s.done for s in sinks):
        engine.run_once()
        sizes.append(engine.batch_size)
    return sizes


def test_prefill_respects_max_batch_prefill_tokens(tiny_model):
    model, tokenizer = tiny_model
    prompt = PROMPTS[1]  # 9 tokens
    assert len(tokenizer(prompt)["input_ids"]) == 9
    engine = build_engine(model, tokenizer, max_batch_prefill_tokens=20, ignore_eos=True)
    sinks = [Collector() for _ in range(5)]
    for sink in sinks:
        engine.submit(greedy_request(tokenizer, prompt, 30), sink)
    sizes = run_until_done(engine, sinks)
    assert sizes[:3] == [2, 4, 5], "two 9-token prompts fit a 20-token prefill, so newcomers join two at a time"


def test_the_batch_respects_max_batch_total_tokens_and_max_batch_size(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, max_batch_total_tokens=100, ignore_eos=True)
    sinks = [Collector() for _ in range(4)]
    for sink in sinks:
        engine.submit(greedy_request(tokenizer, PROMPTS[1], 30), sink)  # 9 + 30 = 39 tokens each
    sizes = run_until_done(engine, sinks)
    assert max(sizes) == 2 and sizes[-1] == 0, "only two 39-token sequences fit in 100"
    assert all(len(s.token_ids) == 30 for s in sinks), "the others waited, then ran to the end"

    engine = build_engine(model, tokenizer, max_batch_size=3, ignore_eos=True)
    sinks = [Collector() for _ in range(5)]
    for sink in sinks:
        engine.submit(greedy_request(tokenizer, PROMPTS[0], 5), sink)
    assert max(run_until_done(engine, sinks)) == 3


def test_sliding_window_models_batch_and_match_generate(tiny_model):
    _, tokenizer = tiny_model
    model = tiny_mistral()
    engine = build_engine(model, tokenizer, ignore_eos=True)
    sinks = [Collector() for _ in PROMPTS[:4]]
    for prompt, sink in zip(PROMPTS[:4], sinks):
        engine.submit(greedy_request(tokenizer, prompt, 12), sink)
    run_until_done(engine, sinks)
    for prompt, sink in zip(PROMPTS[:4], sinks):
        assert sink.token_ids == reference_greedy(model, tokenizer, prompt, 12), prompt


class ForceToken:
    """A plugin that forces one token id at one step of requests that ask for it."""

    def __init__(self, token_id: int, at_step: int) -> None:
        self.token_id, self.at_step = token_id, at_step

    @tokenmill.hookimpl
    def tokenmill_logits_processors(self, parameters):
        if not parameters.get("force"):
            return []
        steps = []

        def force(token_ids, scores):
            steps.append(1)
            if len(steps) == self.at_step:
                forced = torch.full_like(scores, -float("inf"))
                forced[self.token_id] = 0.0
                return forced
            return scores

        return [force]


def test_a_stop_sequence_can_match_a_special_token(tiny_model):
    model, tokenizer = tiny_model
    pm = build_plugin_manager(autoload=False)
    pm.register(ForceToken(token_id=2, at_step=3))
    engine = build_engine(model, tokenizer, pm=pm, ignore_eos=True)
    sink = Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 10, stop=("<|im_end|>",), parameters={"force": True}), sink)
    run_until_done(engine, [sink])
    assert sink.final.finish_reason == "stop_sequence" and sink.token_ids[-1] == 2 and len(sink.token_ids) == 3
    last = list(sink.events)[-1].token
    assert last.special and last.text == "<|im_end|>"
    assert "<|im_end|>" not in sink.final.generated_text


def test_warmup_fits_a_small_prefill_budget_and_fails_clearly_when_nothing_fits(tiny_model):
    from tokenmill.engine.startup import run_warm_up

    model, tokenizer = tiny_model
    run_warm_up(build_engine(model, tokenizer, max_batch_prefill_tokens=8), 8, 49152)
    with pytest.raises(RuntimeError, match="did not finish"):
        run_warm_up(build_engine(model, tokenizer, max_batch_prefill_tokens=4), 8, 49152, max_steps=5)


class FlakyRunner:
    """Wraps a runner; a step with sequences to decode raises once when armed, ``release`` raises when broken."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.fail_next_decode = False
        self.broken_release = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, prefill, chunks, want, decode):
        if decode and self.fail_next_decode:
            self.fail_next_decode = False
            raise RuntimeError("device fell over")
        return self.inner.step(prefill, chunks, want, decode)

    def release(self, seqs):
        if self.broken_release:
            raise RuntimeError("cannot free")
        return self.inner.release(seqs)


def test_the_engine_thread_survives_a_failed_step_and_serves_the_next_request(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True)
    engine.runner = flaky = FlakyRunner(engine.runner)
    engine.start()
    try:
        victim = Collector()
        flaky.fail_next_decode = True
        engine.submit(greedy_request(tokenizer, PROMPTS[1], 20), victim)
        wait_for(lambda: victim.done)
        assert isinstance(victim.events[-1], ErrorEvent) and "device fell over" in victim.events[-1].message
        after = Collector()
        engine.submit(greedy_request(tokenizer, PROMPTS[1], 6), after)
        wait_for(lambda: after.done)
        assert after.token_ids == reference_greedy(model, tokenizer, PROMPTS[1], 6)
        assert engine.healthy
    finally:
        engine.stop()


def test_an_engine_that_cannot_recover_reports_unhealthy_and_fails_every_request(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer)
    engine.runner = flaky = FlakyRunner(engine.runner)
    flaky.fail_next_decode = flaky.broken_release = True
    engine.start()
    sinks = [Collector() for _ in range(3)]
    for sink in sinks:
        engine.submit(greedy_request(tokenizer, PROMPTS[1], 20), sink)
    wait_for(lambda: all(s.done for s in sinks))
    wait_for(lambda: not engine.healthy)
    assert all(isinstance(s.events[-1], ErrorEvent) for s in sinks)


def test_stop_fails_queued_and_running_requests(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, max_batch_size=1, ignore_eos=True)
    engine.start()
    sinks = [Collector() for _ in range(3)]
    for sink in sinks:
        engine.submit(greedy_request(tokenizer, PROMPTS[1], 1000), sink)
    wait_for(lambda: len(sinks[0].token_ids) > 2)
    engine.stop()
    assert all(s.done and isinstance(s.events[-1], ErrorEvent) for s in sinks)
    assert {s.events[-1].message for s in sinks} == {"the server is shutting down"}
    late = Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 5), late)
    assert isinstance(late.events[-1], ErrorEvent), "a request after the stop fails at once"


def test_a_newcomer_whose_prefill_fails_leaves_the_running_batch_alone(tiny_model):
    model, tokenizer = tiny_model
    engine = build_engine(model, tokenizer, ignore_eos=True)
    running = Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[1], 10), running)
    engine.run_once()
    inner_prefill = engine.runner.prefill

    def failing_prefill(seqs, want):
        raise MemoryError("no room for that prompt")

    engine.runner.prefill = failing_prefill
    newcomer = Collector()
    engine.submit(greedy_request(tokenizer, PROMPTS[6], 10), newcomer)
    engine.run_once()
    engine.runner.prefill = inner_prefill
    assert isinstance(newcomer.events[-1], ErrorEvent) and "no room" in newcomer.events[-1].message
    run_until_done(engine, [running])
    assert running.token_ids == reference_greedy(model, tokenizer, PROMPTS[1], 10)
