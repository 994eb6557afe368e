"""Speculation (``--speculate N``): n-gram drafts verified in the paged step give the very tokens single
steps give, greedy or sampled, with every request parameter applied per token; rejected drafts leave
nothing behind in the KV pool."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
from engine_helpers import PROMPTS, Collector, build_engine, greedy_request
from scipy.stats import chi2

from tokenmill.engine.sequence import GenerationRequest, SamplingParams, Sequence
from tokenmill.engine.speculation import NgramIndex, Speculator
from tokenmill.interfaces import blocks_for
from tokenmill.kernels import native as native_kernels


class Oracle(Speculator):
    """Drafts what a run without drafts produced (from ``reference``, by request), each token wrong with
    probability ``noise``, and made-up tokens past its end: every way a draft can be kept or rejected."""

    def __init__(self, reference: dict[int, list[int]], tokens: int = 4, noise: float = 0.0) -> None:
        super().__init__(tokens, step_tokens=1 << 20)
        self.reference = reference
        self.noise = noise
        self.random = random.Random(0)

    def draft(self, seq: Sequence, most: int) -> list[int]:
        known = self.reference.get(id(seq.request), [])[len(seq.generated_ids):]
        wanted = (known + [11] * most)[:most]
        return [token if self.random.random() >= self.noise else 7 for token in wanted]


class Fixed(Speculator):
    """Always drafts the same token."""

    def __init__(self, token: int, tokens: int) -> None:
        super().__init__(tokens, step_tokens=1 << 20)
        self.token = token

    def draft(self, seq: Sequence, most: int) -> list[int]:
        return [self.token] * most


@pytest.fixture
def fresh_model(tiny_model_dir):
    """A new copy of the tiny model for each engine: the paged backend routes its attention to its pool."""
    from transformers import AutoModelForCausalLM

    return lambda: AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def run(model: Any, tokenizer: Any, requests: list[GenerationRequest], speculator: Speculator | None = None,
        check_pool: bool = False, compiled: bool = False, **limits: Any) -> tuple[list[Collector], Any]:
    """Every request submitted at once, run to its end on a paged engine with the prefix cache."""
    engine = build_engine(model, tokenizer, backend="paged", ignore_eos=limits.pop("ignore_eos", True),
                          prefix_caching=True, **limits)
    engine.scheduler.speculator = speculator
    if compiled:
        engine.runner.compile_forward()
    sinks = [Collector() for _ in requests]
    for request, sink in zip(requests, sinks):
        engine.submit(request, sink)
    for _ in range(2000):
        if all(sink.done for sink in sinks):
            break
        engine.run_once()
        if check_pool:
            assert_only_kept_tokens_hold_kv(engine)
    assert all(sink.done for sink in sinks), "the requests never finished"
    return sinks, engine


def assert_only_kept_tokens_hold_kv(engine: Any) -> None:
    """Each decoding sequence holds the blocks of the tokens it kept, and zeros after them."""
    pool = engine.runner.kv_pool
    for seq in engine.scheduler.running:
        table = pool.blocks_of(seq.id)
        assert len(table) == blocks_for(seq.num_computed, pool.block_size), seq
        offset = seq.num_computed % pool.block_size
        if offset:
            for tensor in pool.keys + pool.values:
                assert not tensor[table[-1], offset:].any(), f"{seq}: keys of rejected drafts are left"


def assert_pool_at_rest(engine: Any) -> None:
    pool = engine.runner.kv_pool
    assert engine.batch_size == 0 and not pool.tables
    assert pool.free_blocks() == pool.num_blocks and not any(pool.ref_counts)


def same_results(plain: list[Collector], drafted: list[Collector]) -> None:
    for a, b in zip(plain, drafted):
        assert b.token_ids == a.token_ids
        assert b.final.generated_text == a.final.generated_text
        assert b.final.finish_reason == a.final.finish_reason
        assert [t.logprob for t in b.final.tokens] == pytest.approx([t.logprob for t in a.final.tokens], abs=1e-4)
        assert [[t.id for t in top] for top in b.final.top_tokens] == [
            [t.id for t in top] for top in a.final.top_tokens]


def reference_of(requests: list[GenerationRequest], sinks: list[Collector]) -> dict[int, list[int]]:
    return {id(request): sink.token_ids for request, sink in zip(requests, sinks)}


# ---- drafts -------------------------------------------------------------------------------------


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_last_tokens():
    index = NgramIndex()
    index.tokens = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    assert index.draft(2) == [8, 5]  # 1 2 3 occurred twice before: the latest one is followed by 8 5
    index.tokens += [7]
    assert index.draft(3) == []  # 3 7 never occurred before
    index.tokens += [1, 2]
    assert index.draft(4) == [3, 7, 1, 2]  # 7 1 2 occurred once, and what follows runs into the suffix


def test_drafts_stop_short_of_max_new_tokens_and_pause_after_misses(tiny_model):
    _, tokenizer = tiny_model
    seq = Sequence(greedy_request(tokenizer, "a b c a b", 5), lambda event: None, None)
    speculator = Speculator(4, step_tokens=64)
    seq.prompt_ids = [5, 6, 7, 5, 6]
    seq.generated_ids = [7]
    assert speculator.propose((seq,), 0) == ((5, 6, 7),)  # 4 new tokens left: a draft of 3 and one of its own
    Speculator.observe(seq, produced=1)
    assert speculator.propose((seq,), 0) == ()  # a miss: it pauses
    seq.generated_ids += [5]
    assert speculator.propose((seq,), 0) == ((6, 7),)
    assert Speculator(4, step_tokens=2).propose((seq, seq), 0) == ()  # a step of 2 rows has no room left


# ---- the same tokens ----------------------------------------------------------------------------


@pytest.mark.parametrize("noise", [0.0, 0.3, 1.0], ids=["right", "partly-wrong", "all-wrong"])
def test_greedy_tokens_are_the_same_with_drafts_kept_or_rejected(fresh_model, tiny_model, noise):
    _, tokenizer = tiny_model
    requests = [greedy_request(tokenizer, prompt, 24) for prompt in PROMPTS]
    plain, _ = run(fresh_model(), tokenizer, requests)
    drafted, engine = run(fresh_model(), tokenizer, requests, Oracle(reference_of(requests, plain), noise=noise),
                          check_pool=True)
    same_results(plain, drafted)
    kept = sum(s.final.accepted_tokens for s in drafted)
    assert sum(s.final.draft_tokens for s in drafted) > 0
    assert (kept > 0) == (noise < 1.0)
    assert_pool_at_rest(engine)


def test_stops_penalties_grammar_logprobs_and_limits_apply_per_token_inside_a_kept_run(fresh_model, tiny_model):
    from tokenmill.sampling.grammar import GrammarCompiler

    _, tokenizer = tiny_model
    prompt = PROMPTS[6]
    free = greedy_request(tokenizer, prompt, 24)
    plain_free, _ = run(fresh_model(), tokenizer, [free])
    stop = tokenizer.decode(plain_free[0].token_ids[5:7])  # ends on the 7th token, inside a run of drafts
    grammar = GrammarCompiler(tokenizer, 49152).regex(r"[a-z ]{3,40}\.")
    variants = [
        {"stop": (stop,)},
        {"stop_token_ids": (plain_free[0].token_ids[9],)},
        {"sampling": SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5)},
        {"sampling": SamplingParams(presence_penalty=1.0, occurrence_penalty=0.5, logit_bias=((260, 3.0),))},
        {"sampling": SamplingParams(watermark=True)},
        {"grammar": grammar},
        {"top_n_tokens": 3, "details": True},
        {"min_tokens": 20},
    ]
    requests = [greedy_request(tokenizer, prompt, 24, **variant) for variant in variants]
    requests += [greedy_request(tokenizer, prompt, new) for new in (1, 2, 7)]  # the limit lands at a run's end
    plain, _ = run(fresh_model(), tokenizer, requests, ignore_eos=False)
    drafted, engine = run(fresh_model(), tokenizer, requests, Oracle(reference_of(requests, plain), noise=0.1),
                          ignore_eos=False)
    same_results(plain, drafted)
    assert plain[0].final.finish_reason == "stop_sequence" and len(plain[0].token_ids) <= 7
    assert [len(s.token_ids) for s in drafted[-3:]] == [1, 2, 7]
    assert drafted[5].final.generated_text.endswith(".")
    assert sum(s.final.accepted_tokens for s in drafted) > 0
    assert_pool_at_rest(engine)


def test_a_stream_gets_one_event_per_kept_token_in_order(fresh_model, tiny_model):
    _, tokenizer = tiny_model
    requests = [greedy_request(tokenizer, PROMPTS[1], 16)]
    plain, _ = run(fresh_model(), tokenizer, requests)
    drafted, _ = run(fresh_model(), tokenizer, requests, Oracle(reference_of(requests, plain)))
    events = drafted[0].events
    assert [e.index for e in events] == list(range(1, 17))
    assert [e.final is not None for e in events] == [False] * 15 + [True]
    assert drafted[0].final.accepted_tokens == 12  # the first step prefills; then 3 steps of 1 + 4 tokens


def test_the_gather_path_verifies_drafts_as_the_native_kernel_does(fresh_model, tiny_model, monkeypatch):
    _, tokenizer = tiny_model
    requests = [greedy_request(tokenizer, prompt, 20) for prompt in PROMPTS]
    plain, _ = run(fresh_model(), tokenizer, requests)
    monkeypatch.setattr(native_kernels, "native_unavailable_reason", lambda: "turned off by the test")
    drafted, engine = run(fresh_model(), tokenizer, requests, Oracle(reference_of(requests, plain), noise=0.3))
    assert engine.runner.kernel._native is False
    same_results(plain, drafted)


@pytest.mark.slow
def test_a_compiled_forward_verifies_drafts_in_its_one_graph(fresh_model, tiny_model):
    _, tokenizer = tiny_model
    requests = [greedy_request(tokenizer, prompt, 20) for prompt in PROMPTS]
    plain, _ = run(fresh_model(), tokenizer, requests)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    drafted, _ = run(fresh_model(), tokenizer, requests, Oracle(reference_of(requests, plain), noise=0.3),
                     compiled=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before + 1, "one graph for every step"
    same_results(plain, drafted)


def test_seeded_sampling_gives_the_same_tokens_with_and_without_drafts(fresh_model, tiny_model):
    _, tokenizer = tiny_model
    sampled = [SamplingParams(do_sample=True, seed=seed, temperature=0.8, top_k=20) for seed in range(6)]
    sampled.append(SamplingParams(do_sample=True, seed=3, top_p=0.9, repetition_penalty=1.2, watermark=True))
    requests = [greedy_request(tokenizer, PROMPTS[i % len(PROMPTS)], 16, sampling=params)
                for i, params in enumerate(sampled)]
    plain, _ = run(fresh_model(), tokenizer, requests)
    drafted, _ = run(fresh_model(), tokenizer, requests, Oracle(reference_of(requests, plain), noise=0.3))
    same_results(plain, drafted)
    assert sum(s.final.accepted_tokens for s in drafted) > 0


def test_sampled_outputs_keep_the_models_distribution(tiny_model):
    """A 16-token vocabulary, 2,000 seeds, a draft of the likeliest first token for every position: the
    first token and the second (after the commonest first) follow the model's own probabilities."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = tiny_model
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.1,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    state = LlamaForCausalLM(config).eval().state_dict()

    def model() -> Any:
        fresh = LlamaForCausalLM(copy.deepcopy(config)).eval()  # the paged backend sets the config's attention
        fresh.load_state_dict(state)
        return fresh

    prompt = [3, 4, 5, 6]
    with torch.no_grad():
        first_p = model()(torch.tensor([prompt])).logits[0, -1].softmax(-1)
    likeliest = int(first_p.argmax())
    requests = [GenerationRequest("", prompt, 3, SamplingParams(do_sample=True, seed=seed)) for seed in range(2000)]
    plain, _ = run(model(), tokenizer, requests, max_batch_total_tokens=65536)
    drafted, engine = run(model(), tokenizer, requests, Fixed(likeliest, 2), max_batch_total_tokens=65536)
    assert [s.token_ids for s in drafted] == [s.token_ids for s in plain]  # each seed: the same tokens
    assert sum(s.final.accepted_tokens for s in drafted) > 50

    firsts = torch.tensor([s.token_ids[0] for s in drafted])
    assert_follows(firsts, first_p)
    common = int(firsts.bincount(minlength=16).argmax())
    with torch.no_grad():
        second_p = model()(torch.tensor([prompt + [common]])).logits[0, -1].softmax(-1)
    assert_follows(torch.tensor([s.token_ids[1] for s in drafted if s.token_ids[0] == common]), second_p)
    assert_pool_at_rest(engine)


def assert_follows(samples: torch.Tensor, probabilities: torch.Tensor) -> None:
    """Pearson's chi-square test at the 0.1 % level, over the tokens expected at least 5 times (the rest pooled)."""
    observed = samples.bincount(minlength=len(probabilities)).double()
    expected = probabilities.double() * len(samples)
    big = expected >= 5
    observed = torch.cat([observed[big], observed[~big].sum(0, keepdim=True)])
    expected = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert statistic < chi2.ppf(0.999, int(keep.sum()) - 1), (statistic, observed.tolist(), expected.tolist())


# ---- KV memory and attention --------------------------------------------------------------------


def test_a_sequence_short_of_kv_memory_for_its_draft_decodes_without_it(fresh_model, tiny_model):
    _, tokenizer = tiny_model
    requests = [greedy_request(tokenizer, prompt, 30) for prompt in PROMPTS[:4]]
    plain, _ = run(fresh_model(), tokenizer, requests, max_batch_total_tokens=256, block_size=16)
    drafted, engine = run(fresh_model(), tokenizer, requests, Oracle(reference_of(requests, plain), tokens=8),
                          check_pool=True, max_batch_total_tokens=256, block_size=16)
    same_results(plain, drafted)
    assert_pool_at_rest(engine)


@pytest.mark.parametrize("block_size", [1, 16])
def test_a_sequence_cancelled_while_its_draft_is_verified_leaves_the_cached_blocks_intact(fresh_model, tiny_model,
                                                                                          block_size):
    _, tokenizer = tiny_model
    first = greedy_request(tokenizer, PROMPTS[6], 20)
    plain, _ = run(fresh_model(), tokenizer, [first])

    class CancelsAtSix(Oracle):  # the first step prefills a token, the next one drafts 4 and keeps them all
        def draft(self, seq: Sequence, most: int) -> list[int]:
            if seq.request is first and len(seq.generated_ids) == 6:
                seq.cancelled = True  # as the client's disconnect does, while the step runs
            return super().draft(seq, most)

    engine = build_engine(fresh_model(), tokenizer, backend="paged", ignore_eos=True, prefix_caching=True,
                          block_size=block_size)
    engine.scheduler.speculator = CancelsAtSix(reference_of([first], plain))
    cancelled = Collector()
    engine.submit(first, cancelled)
    for _ in range(50):
        engine.run_once()
    assert len(cancelled.token_ids) == 6 and not cancelled.done
    assert_pool_at_rest(engine)
    # A prompt that goes on from the cancelled one's first tokens takes their cached blocks.
    second = GenerationRequest("", first.input_ids + plain[0].token_ids[:6], 8, SamplingParams())
    again = Collector()
    engine.submit(second, again)
    for _ in range(50):
        engine.run_once()
    expected, _ = run(fresh_model(), tokenizer, [second])
    assert again.final.cached_tokens > 0 and again.token_ids == expected[0].token_ids


@pytest.mark.skipif(native_kernels.native_unavailable_reason() is not None, reason="native kernels unavailable")
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_decode_rows_of_several_tokens_through_the_native_kernel_match_sdpa(dtype, tolerance):
    from test_native_kernels import scattered_pool, sdpa_over_step

    context_lens, query_lens = [9, 23, 6, 30], [1, 5, 3, 8]
    keys, values, tables = scattered_pool(context_lens, 4, kv_heads=2, dim=16, dtype=dtype)
    query = torch.randn(sum(query_lens), 4, 16).to(dtype)
    outputs = []
    for native in (True, False):
        out, plans = sdpa_over_step(query, keys, values, tables, context_lens, query_lens, 0.25, native=native)
        outputs.append(out.float())
        if native:
            assert plans[0]["native"]
    torch.testing.assert_close(outputs[0], outputs[1], atol=tolerance, rtol=tolerance)


# ---- settings -----------------------------------------------------------------------------------


def test_speculate_is_tgis_flag_and_environment_variable_and_is_bounded():
    from tokenmill.config import ConfigError, parse_config

    assert parse_config([], env={}).speculate == 0
    assert parse_config(["--speculate", "4"], env={}).speculate == 4
    assert parse_config([], env={"SPECULATE": "3"}).speculate == 3
    for wrong in ("-1", "33"):
        with pytest.raises(ConfigError, match="--speculate must be between 0 and 32"):
            parse_config(["--speculate", wrong], env={}).check()


def test_the_transformers_backend_refuses_speculate_with_the_reason(tiny_model_dir, tmp_path):
    from conftest import launch_server

    server = launch_server(["--model-id", str(tiny_model_dir), "--backend", "transformers", "--speculate", "2"],
                           tmp_path)
    assert server.process.wait(120) != 0
    assert "--speculate needs a backend that verifies drafts in its steps (paged, flash)" in server.log()
