"""Automatic prefix caching: a prompt's computed KV blocks are reused by the prompts that begin the same way.

Every engine scenario runs with and without the cache and must give the same greedy tokens
(and those of ``model.generate()``), and must leave the pool as it found it: every block free
or cached, no reference held.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import PROMPTS, Collector, build_engine, greedy_request, reference_greedy, tiny_mistral

from tokenmill.engine.prefix import BlockChain, block_hash, full_block_hashes
from tokenmill.engine.sequence import GenerationRequest, SamplingParams, Sequence
from tokenmill.interfaces import StepBudget

SYSTEM = ("You are a careful assistant for a public library. Answer every question in full sentences, name the books "
          "and articles you draw on, keep to what the sources say, and say so plainly when you do not know. Prefer "
          "short paragraphs, avoid jargon, and never invent a citation. ")
SHARED = 48
"""Tokens of ``SYSTEM + question`` that another question's prompt takes from the cache: the 57 tokens
they share, in whole blocks of 16 (checked by :func:`test_the_prompts_share_three_blocks`)."""
QUESTIONS = ["What is two plus two?", "Name a primary colour.", "Why is the sky blue?", "Who wrote Hamlet?"]


@pytest.fixture
def fresh_model(tiny_model_dir):
    """A new copy of the tiny model for each engine: the paged backend routes its attention to its pool."""
    from transformers import AutoModelForCausalLM

    return lambda: AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def paged_engine(fresh_model, tokenizer, cache: bool, **limits):
    return build_engine(fresh_model(), tokenizer, backend="paged", ignore_eos=True, prefix_caching=cache, **limits)


def one_by_one(engine, requests: list[GenerationRequest]) -> list[Collector]:
    """Each request alone, the next once the previous has finished."""
    sinks = []
    for request in requests:
        sink = Collector()
        engine.submit(request, sink)
        for _ in range(2000):
            if sink.done:
                break
            engine.run_once()
        assert sink.done, "the request never finished"
        sinks.append(sink)
    return sinks


def all_at_once(engine, requests: list[GenerationRequest]) -> tuple[list[Collector], int]:
    """Every request submitted before the first step; returns the sinks and the steps taken."""
    sinks = [Collector() for _ in requests]
    for request, sink in zip(requests, sinks):
        engine.submit(request, sink)
    steps = 0
    while not all(s.done for s in sinks):
        engine.run_once()
        steps += 1
        assert steps < 2000, "the requests never finished"
    return sinks, steps


def assert_pool_at_rest(engine) -> None:
    """No sequence holds a block: every block is free or cached, every reference count is 0."""
    pool = engine.runner.kv_pool
    assert engine.batch_size == 0 and not pool.tables
    assert pool.free_blocks() == pool.num_blocks
    assert not any(pool.ref_counts)
    assert len(pool.free_list) + len(pool.cached) == pool.num_blocks
    assert set(pool.cached) <= set(pool.hash_of) and len(pool.by_hash) == len(pool.hash_of)


def requests_of(tokenizer, prompts: list[str], new_tokens: int = 8, **extra) -> list[GenerationRequest]:
    return [greedy_request(tokenizer, prompt, new_tokens, **extra) for prompt in prompts]


def engine_after(fresh_model, tokenizer, prompt: str):
    """A caching engine that has run ``prompt`` once (its blocks now cached)."""
    engine = paged_engine(fresh_model, tokenizer, True)
    one_by_one(engine, requests_of(tokenizer, [prompt]))
    return engine


def run_both(fresh_model, tokenizer, requests, runner=one_by_one, **limits):
    """(``runner``'s result without the cache, with it, the caching engine)."""
    plain = runner(paged_engine(fresh_model, tokenizer, False, **limits), requests)
    engine = paged_engine(fresh_model, tokenizer, True, **limits)
    return plain, runner(engine, requests), engine


def test_the_prompts_share_three_blocks(tiny_model):
    _, tokenizer = tiny_model
    prompts = [tokenizer(SYSTEM + question)["input_ids"] for question in QUESTIONS]
    shared = 0
    while all(ids[shared] == prompts[0][shared] for ids in prompts):
        shared += 1
    assert shared // 16 * 16 == SHARED and all(len(ids) > SHARED + 8 for ids in prompts)


# ---- the hash chain ----------------------------------------------------------------------


def test_a_block_is_named_by_its_tokens_everything_before_them_and_its_namespace():
    first = block_hash(None, [1, 2, 3, 4])
    assert block_hash(None, [1, 2, 3, 4]) == first
    assert block_hash(None, [1, 2, 3, 5]) != first
    assert block_hash(None, [1, 2, 3, 4], "adapter-a\0") != first  # a LoRA adapter or a salt
    assert block_hash(first, [5, 6, 7, 8]) != block_hash(block_hash(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    chain = BlockChain("", 4, [])
    assert chain.extend([1, 2, 3]) == []
    assert chain.extend([4, 5, 6, 7, 8, 9]) == [(0, first), (1, block_hash(first, [5, 6, 7, 8]))]
    assert chain.tokens == 9 and chain.tail == [9]


def test_a_sequence_names_only_its_full_blocks_and_hashes_each_once():
    seq = Sequence(GenerationRequest("", list(range(10)), 4, SamplingParams(), cache_salt="tenant"), print, None)
    names = full_block_hashes(seq, 4, 2)
    assert names == [block_hash(None, [0, 1, 2, 3], seq.cache_namespace),
                     block_hash(names[0], [4, 5, 6, 7], seq.cache_namespace)]
    assert seq.block_hashes == names and full_block_hashes(seq, 4, 1) == names[:1]
    with pytest.raises(AssertionError, match="only full blocks"):
        full_block_hashes(seq, 4, 3)


# ---- the pool -----------------------------------------------------------------------------


def small_pool(blocks: int = 4):
    from tokenmill_plugins.kv.paged import PagedPool

    return PagedPool(layers=1, num_blocks=blocks, block_size=2, kv_heads=1, head_dim=2, dtype=torch.float32,
                     device=torch.device("cpu"))


def test_a_named_block_stays_cached_when_its_sequence_ends_and_counts_as_free():
    pool = small_pool()
    assert pool.reserve(1, 4)  # two blocks
    first, second = pool.blocks_of(1)
    assert pool.name(first, b"a") and not pool.name(second, b"a")  # one block per name
    pool.free(1)
    assert pool.free_blocks() == 4 and list(pool.cached) == [first]
    assert pool.lookup([b"a", b"b"]) == [first] and pool.lookup([b"b", b"a"]) == []
    pool.share(2, [first])
    assert pool.ref_counts[first] == 1 and not pool.cached and pool.free_blocks() == 3
    pool.share(3, [first])
    assert pool.ref_counts[first] == 2 and pool.idle_among([first]) == 0
    pool.free(2)
    pool.free(3)
    assert pool.idle_among([first]) == 1 and pool.cached_blocks() == 1


def test_allocation_takes_free_blocks_first_then_evicts_the_least_recently_used_cached_one():
    pool = small_pool(4)
    for seq_id, name in ((1, b"a"), (2, b"b")):
        assert pool.reserve(seq_id, 2)
        pool.name(pool.blocks_of(seq_id)[0], name)
    a, b = pool.blocks_of(1)[0], pool.blocks_of(2)[0]
    pool.free(1)
    pool.free(2)  # cached, a before b
    assert pool.reserve(3, 4)  # the two free blocks: nothing evicted
    assert pool.lookup([b"a"]) == [a] and pool.lookup([b"b"]) == [b]
    assert pool.reserve(4, 2)  # the pool is full of cached blocks now: a, the older, goes
    assert pool.blocks_of(4) == [a] and pool.lookup([b"a"]) == [] and pool.lookup([b"b"]) == [b]
    assert not pool.reserve(5, 4)  # one block left (b), not two
    assert pool.lookup([b"b"]) == [b]


def test_a_sequence_frees_its_tail_first_so_the_shared_head_is_evicted_last():
    pool = small_pool(3)
    assert pool.reserve(1, 6)
    for block, name in zip(pool.blocks_of(1), (b"x", b"y", b"z")):
        pool.name(block, name)
    head, middle, tail = pool.blocks_of(1)
    pool.free(1)
    assert list(pool.cached) == [tail, middle, head]


def test_unnamed_and_dropped_blocks_return_to_the_free_list():
    pool = small_pool(2)
    assert pool.reserve(1, 4)
    first, second = pool.blocks_of(1)
    pool.name(first, b"a")
    pool.name(second, b"b")
    pool.unname(second)  # held: it only loses its name
    pool.free(1)
    assert list(pool.cached) == [first] and second in pool.free_list
    assert pool.drop_cached() == 1
    assert not pool.cached and not pool.by_hash and len(pool.free_list) == 2


# ---- the engine ---------------------------------------------------------------------------


def test_a_repeated_prompt_takes_its_blocks_from_the_cache_and_generates_the_same_tokens(fresh_model, tiny_model):
    model, tokenizer = tiny_model
    prompt = SYSTEM + QUESTIONS[0]
    requests = requests_of(tokenizer, [prompt] * 3)
    plain, cached, engine = run_both(fresh_model, tokenizer, requests)
    assert [s.token_ids for s in cached] == [s.token_ids for s in plain]
    assert cached[0].token_ids == reference_greedy(model, tokenizer, prompt, 8)
    prompt_len = len(requests[0].input_ids)
    reusable = (prompt_len - 1) // 16 * 16  # whole blocks, the last token always computed
    assert [s.final.cached_tokens for s in cached] == [0, reusable, reusable]
    assert [s.final.cached_tokens for s in plain] == [0, 0, 0]
    scheduler = engine.scheduler
    assert scheduler.prefix_queried_tokens == 3 * prompt_len and scheduler.prefix_hit_tokens == 2 * reusable
    assert_pool_at_rest(engine)


def test_shared_blocks_are_never_written(fresh_model, tiny_model):
    _, tokenizer = tiny_model
    prompt = SYSTEM + QUESTIONS[0]
    engine = engine_after(fresh_model, tokenizer, prompt)
    pool = engine.runner.kv_pool
    blocks = pool.lookup(full_block_hashes(Sequence(greedy_request(tokenizer, prompt, 1), print, None), 16, 3))
    before = [(keys[blocks].clone(), values[blocks].clone()) for keys, values in zip(pool.keys, pool.values)]
    one_by_one(engine, requests_of(tokenizer, [prompt, SYSTEM + QUESTIONS[1]], new_tokens=20))
    assert pool.lookup(full_block_hashes(Sequence(greedy_request(tokenizer, prompt, 1), print, None), 16, 3)) == blocks
    for (keys, values), (old_keys, old_values) in zip(zip(pool.keys, pool.values), before):
        assert torch.equal(keys[blocks], old_keys) and torch.equal(values[blocks], old_values)


@pytest.mark.parametrize("cut", ["on a block boundary", "inside a block"])
def test_prompts_sharing_a_prefix_share_its_whole_blocks(fresh_model, tiny_model, cut):
    model, tokenizer = tiny_model
    base = tokenizer(SYSTEM)["input_ids"][:32 if cut == "on a block boundary" else 37]
    prompts = [tokenizer.decode(base) + question for question in QUESTIONS]
    requests = requests_of(tokenizer, prompts)
    shared = 0
    while all(r.input_ids[shared] == requests[0].input_ids[shared] for r in requests):
        shared += 1
    plain, cached, engine = run_both(fresh_model, tokenizer, requests)
    assert [s.token_ids for s in cached] == [s.token_ids for s in plain]
    for prompt, sink in zip(prompts, cached):
        assert sink.token_ids == reference_greedy(model, tokenizer, prompt, 8)
    assert [s.final.cached_tokens for s in cached] == [0] + [shared // 16 * 16] * 3
    assert_pool_at_rest(engine)


def test_a_long_prompt_after_a_short_cached_prefix_gives_the_tokens_of_generate(fresh_model, tiny_model):
    from tokenmill_plugins.attention.torch_kernels import CAUSAL_PADDING_RATIO

    model, tokenizer = tiny_model
    head = SYSTEM[:120]
    long = head + " " + PROMPTS[6] * 15
    requests = requests_of(tokenizer, [head, long])
    cached_blocks = (len(requests[0].input_ids) - 1) // 16
    uncached = len(requests[1].input_ids) - 16 * cached_blocks
    assert cached_blocks >= 1 and uncached >= CAUSAL_PADDING_RATIO * 16 * cached_blocks
    plain, cached, engine = run_both(fresh_model, tokenizer, requests)
    assert cached[1].final.cached_tokens == 16 * cached_blocks  # its rest runs as causal attention, padded
    assert [s.token_ids for s in cached] == [s.token_ids for s in plain]
    assert cached[1].token_ids == reference_greedy(model, tokenizer, long, 8)
    assert_pool_at_rest(engine)


def test_requests_admitted_in_one_step_share_a_new_prefix_and_prefill_it_once(fresh_model, tiny_model):
    model, tokenizer = tiny_model
    prompts = [SYSTEM + question for question in QUESTIONS]
    requests = requests_of(tokenizer, prompts)
    longest = max(len(r.input_ids) for r in requests)
    # Room for one whole prompt and the other three's own tails, not for four whole prompts.
    budget = longest + 3 * (longest - SHARED)
    (plain, plain_steps), (cached, cached_steps), engine = run_both(
        fresh_model, tokenizer, requests, runner=all_at_once, max_batch_prefill_tokens=budget)
    assert [s.token_ids for s in cached] == [s.token_ids for s in plain]
    assert [s.final.cached_tokens for s in cached] == [0] + [SHARED] * 3
    assert cached_steps == 8  # every first token in the first step, then 7 decode steps
    assert plain_steps > cached_steps  # without the cache the four prompts do not fit one step
    assert_pool_at_rest(engine)


def test_long_prompts_prefilled_in_chunks_share_only_what_is_computed(fresh_model, tiny_model):
    _, tokenizer = tiny_model
    prompts = [SYSTEM * 3 + question for question in QUESTIONS[:2]]
    requests = requests_of(tokenizer, prompts)
    (plain, _), (cached, _), engine = run_both(fresh_model, tokenizer, requests, runner=all_at_once,
                                               max_batch_prefill_tokens=40)
    assert [s.token_ids for s in cached] == [s.token_ids for s in plain]
    assert cached[1].final.cached_tokens > 0
    assert_pool_at_rest(engine)


def test_a_prefix_evicted_from_a_tiny_pool_is_computed_again(fresh_model, tiny_model):
    _, tokenizer = tiny_model
    first, other = SYSTEM + QUESTIONS[0], PROMPTS[6] * 3
    requests = requests_of(tokenizer, [first, other, first], new_tokens=8)
    blocks = -(-max(len(r.input_ids) + 8 for r in requests) // 16)
    plain, cached, engine = run_both(fresh_model, tokenizer, requests, max_batch_total_tokens=blocks * 16)
    assert [s.token_ids for s in cached] == [s.token_ids for s in plain]
    assert cached[2].final.cached_tokens < (len(requests[0].input_ids) - 1) // 16 * 16  # some blocks were evicted
    assert_pool_at_rest(engine)


@pytest.mark.parametrize("scheduler", ["fifo", "priority"])
def test_preempted_sequences_resume_from_what_is_still_cached(fresh_model, tiny_model, scheduler):
    model, tokenizer = tiny_model
    prompts = [SYSTEM + question for question in QUESTIONS]
    requests = requests_of(tokenizer, prompts, new_tokens=40)
    (plain, _), (cached, _), engine = run_both(fresh_model, tokenizer, requests, runner=all_at_once, block_size=4,
                                               max_batch_total_tokens=240, scheduler=scheduler)
    assert engine.preemptions > 0
    assert [s.token_ids for s in cached] == [s.token_ids for s in plain]
    for prompt, sink in zip(prompts, cached):
        assert sink.token_ids == reference_greedy(model, tokenizer, prompt, 40)
    queried_once = sum(len(r.input_ids) for r in requests)
    assert engine.scheduler.prefix_queried_tokens > queried_once  # the preempted ones were looked up again ...
    assert engine.scheduler.prefix_hit_tokens > sum(s.final.cached_tokens for s in cached)  # ... and found blocks
    assert_pool_at_rest(engine)


def test_a_sequence_suspended_for_a_higher_class_keeps_its_blocks_and_lends_them(fresh_model, tiny_model):
    _, tokenizer = tiny_model
    low = greedy_request(tokenizer, SYSTEM + QUESTIONS[0], 30, priority="low")
    high = greedy_request(tokenizer, SYSTEM + QUESTIONS[1], 10, priority="high")

    def low_then_high(engine, requests):
        sinks = [Collector(), Collector()]
        engine.submit(requests[0], sinks[0])
        for _ in range(5):
            engine.run_once()
        engine.submit(requests[1], sinks[1])
        while not all(sink.done for sink in sinks):
            engine.run_once()
        return sinks, engine.suspensions

    (plain, _), (cached, suspensions), engine = run_both(fresh_model, tokenizer, [low, high], runner=low_then_high,
                                                         scheduler="priority", max_batch_size=1)
    assert suspensions == 1
    assert [s.token_ids for s in cached] == [s.token_ids for s in plain]
    assert cached[1].final.cached_tokens == SHARED  # from the suspended sequence's blocks
    assert_pool_at_rest(engine)


def test_a_sliding_window_model_gives_the_same_tokens_with_the_cache(tiny_model):
    _, tokenizer = tiny_model
    reference = tiny_mistral(sliding_window=12)
    prompts = [SYSTEM + question for question in QUESTIONS[:2]] * 2
    requests = requests_of(tokenizer, prompts)

    def copy():
        model = tiny_mistral(sliding_window=12)
        model.load_state_dict(reference.state_dict())
        return model

    plain, cached, engine = run_both(copy, tokenizer, requests)
    assert [s.token_ids for s in cached] == [s.token_ids for s in plain]
    assert cached[0].token_ids == reference_greedy(reference, tokenizer, prompts[0], 8)
    assert cached[2].final.cached_tokens > 0
    assert_pool_at_rest(engine)


def test_prompt_details_compute_the_whole_prompt_and_still_fill_the_cache(fresh_model, tiny_model):
    _, tokenizer = tiny_model
    prompt = SYSTEM + QUESTIONS[1]
    requests = [greedy_request(tokenizer, prompt, 4), greedy_request(tokenizer, prompt, 4, decoder_input_details=True),
                greedy_request(tokenizer, prompt, 4)]
    plain, cached, engine = run_both(fresh_model, tokenizer, requests)
    assert [s.final.cached_tokens for s in cached] == [0, 0, SHARED]
    details = [[(t.id, t.logprob) for t in sink.final.prefill] for sink in (plain[1], cached[1])]
    assert len(details[1]) == len(requests[1].input_ids)
    assert [i for i, _ in details[1]] == [i for i, _ in details[0]]
    assert torch.allclose(torch.tensor([lp for _, lp in details[1][1:]]),
                          torch.tensor([lp for _, lp in details[0][1:]]))
    assert_pool_at_rest(engine)


def test_a_cache_salt_keeps_tenants_apart(fresh_model, tiny_model):
    _, tokenizer = tiny_model
    prompt = SYSTEM + QUESTIONS[2]
    requests = [greedy_request(tokenizer, prompt, 4, cache_salt="tenant-a"),
                greedy_request(tokenizer, prompt, 4, cache_salt="tenant-b"),
                greedy_request(tokenizer, prompt, 4),
                greedy_request(tokenizer, prompt, 4, cache_salt="tenant-a")]
    plain, cached, engine = run_both(fresh_model, tokenizer, requests)
    assert [s.final.cached_tokens for s in cached] == [0, 0, 0, SHARED]
    assert len({tuple(s.token_ids) for s in cached}) == 1 and cached[0].token_ids == plain[0].token_ids
    assert_pool_at_rest(engine)


def test_seeded_sampling_watermark_and_grammar_are_unaffected_by_the_cache(fresh_model, tiny_model):
    from tokenmill.sampling.grammar import GrammarCompiler

    _, tokenizer = tiny_model
    grammar = GrammarCompiler(tokenizer, 49152).json_schema({"type": "object", "properties": {
        "answer": {"type": "string"}}, "required": ["answer"]})
    prompt = SYSTEM + QUESTIONS[3]
    sampled = SamplingParams(do_sample=True, temperature=0.9, top_k=50, seed=7)
    variants = [{"sampling": sampled}, {"sampling": SamplingParams(watermark=True)}, {"grammar": grammar},
                {"sampling": SamplingParams(do_sample=True, seed=11, repetition_penalty=1.3)}]
    requests = [greedy_request(tokenizer, prompt, 12, **variant) for variant in variants for _ in (0, 1)]
    plain, cached, engine = run_both(fresh_model, tokenizer, requests)
    assert [s.token_ids for s in cached] == [s.token_ids for s in plain]
    assert all(s.final.cached_tokens == SHARED for s in cached[1:])
    assert_pool_at_rest(engine)


def test_a_step_that_fails_forgets_the_blocks_it_named(fresh_model, tiny_model, monkeypatch):
    _, tokenizer = tiny_model
    engine = paged_engine(fresh_model, tokenizer, True)
    prompt = SYSTEM + QUESTIONS[0]
    runner = engine.runner
    forward = runner._forward
    calls = []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the device fell over")
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "_forward", failing_once)
    failed, = one_by_one(engine, [greedy_request(tokenizer, prompt, 4)])
    assert "the device fell over" in failed.events[0].message
    assert runner.kv_pool.cached_blocks() == 0  # named for that step, never computed
    again, = one_by_one(engine, [greedy_request(tokenizer, prompt, 4)])
    assert again.final.cached_tokens == 0
    plain, = one_by_one(paged_engine(fresh_model, tokenizer, False), [greedy_request(tokenizer, prompt, 4)])
    assert again.token_ids == plain.token_ids
    assert_pool_at_rest(engine)


def test_reset_drops_every_cached_block_no_sequence_holds(fresh_model, tiny_model):
    _, tokenizer = tiny_model
    engine = engine_after(fresh_model, tokenizer, SYSTEM + QUESTIONS[0])
    holder = Collector()
    engine.submit(greedy_request(tokenizer, SYSTEM + QUESTIONS[1], 50), holder)
    engine.run_once()  # it holds the shared blocks (and names its own) while it decodes
    pool = engine.runner.kv_pool
    holding = pool.blocks_of(engine.running[0].id)
    unheld = len(pool.cached)
    assert unheld > 0 and pool.idle_among(holding) == 0
    counts = []
    engine.reset_prefix_cache(counts.append)
    engine.run_once()
    assert counts == [unheld] and not pool.cached
    assert all(block in pool.hash_of for block in holding[:3])  # held blocks keep their names
    while not holder.done:
        engine.run_once()
    assert_pool_at_rest(engine)


def test_admission_counts_only_uncached_tokens_against_the_prefill_budget(fresh_model, tiny_model):
    from tokenmill.engine.admission import Room
    from tokenmill.interfaces import BatchLimits

    _, tokenizer = tiny_model
    prompt = SYSTEM + QUESTIONS[0]
    engine = engine_after(fresh_model, tokenizer, prompt)
    seq = Sequence(greedy_request(tokenizer, prompt, 4), print, None)
    limits = BatchLimits(max_batch_prefill_tokens=64, max_batch_total_tokens=4096, max_batch_size=None)
    kv = engine.scheduler.kv
    uncached = seq.prompt_len - (seq.prompt_len - 1) // 16 * 16
    budget = StepBudget(uncached, False, kv.free_tokens(), 16, kv)
    assert Room(limits, [], budget).fits(seq)  # its cached blocks cost no prefill: the rest fits
    assert not Room(limits, [], StepBudget(uncached, False, kv.free_tokens(), 16)).fits(seq)


# ---- over HTTP ------------------------------------------------------------------------------

KEY, OTHER_KEY, FILED_KEY = "prefix-key", "other-tenant", "clé-été"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def caching_server(tiny_model_dir, tmp_path_factory):
    """Three tenants: two keys on the command line, one (not ASCII) in a key file; only the first may
    set a priority."""
    from conftest import start_server

    directory = tmp_path_factory.mktemp("prefix")
    key_file = directory / "keys.txt"
    key_file.write_text(f"# the third tenant\n\n{FILED_KEY}\n", encoding="utf-8")
    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "512",
                           "--backend", "paged", "--api-key", f"{KEY},{OTHER_KEY}", "--api-key-file", str(key_file),
                           "--priority-header-keys", KEY, "--json-output"], directory)
    yield server
    server.stop()


def generate(server, prompt: str, headers: dict | None = None, **parameters) -> dict:
    with server.client() as client:
        answer = client.post("/generate", headers=AUTH if headers is None else headers,
                             json={"inputs": prompt,
                                   "parameters": {"max_new_tokens": 4, "details": True, **parameters}})
    assert answer.status_code == 200, answer.text
    return answer.json()


def metric(server, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx_get(server, "/metrics").text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


def httpx_get(server, path: str):
    with server.client() as client:
        return client.get(path, headers=AUTH)


def test_openai_usage_reports_the_cached_prompt_tokens(caching_server):
    import openai

    client = openai.OpenAI(base_url=f"{caching_server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    messages = [{"role": "system", "content": SYSTEM * 2}, {"role": "user", "content": QUESTIONS[0]}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (second.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert second.choices[0].message.content == first.choices[0].message.content
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens == cached
    # The choices of one prompt count it once; the second copy of the prompt shares the first's blocks
    # in the very step they are computed.
    twice = [SYSTEM * 2, SYSTEM * 2]
    reusable = (len(tokenize(caching_server, SYSTEM * 2)) - 1) // 16 * 16
    first = client.completions.create(model="tiny", prompt=twice, max_tokens=2, n=2, temperature=0)
    again = client.completions.create(model="tiny", prompt=twice, max_tokens=2, n=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == reusable
    assert again.usage.prompt_tokens_details.cached_tokens == 2 * reusable


def tokenize(server, text: str) -> list[dict]:
    with server.client() as client:
        return client.post("/tokenize", headers=AUTH, json={"inputs": text}).json()


def test_tgi_routes_take_a_cache_salt_parameter_and_refuse_a_bad_one(caching_server):
    prompt = "Salted. " + SYSTEM + QUESTIONS[1]  # its own first block: no other test's prompt begins so
    reusable = (len(tokenize(caching_server, prompt)) - 1) // 16 * 16

    assert generate_cached(caching_server, prompt, cache_salt="a") == 0
    assert generate_cached(caching_server, prompt, cache_salt="b") == 0
    assert generate_cached(caching_server, prompt) == 0
    assert generate_cached(caching_server, prompt, cache_salt="a") == reusable
    for bad in ("", 7, ["a"]):
        with caching_server.client() as client:
            answer = client.post("/generate", headers=AUTH, json={"inputs": prompt, "parameters": {"cache_salt": bad}})
        assert answer.status_code == 422 and answer.json()["error_type"] == "validation"
        assert "cache_salt" in answer.json()["error"]


def generate_cached(server, prompt: str, **parameters) -> int:
    """Run a TGI request; the prompt tokens it took from the cache, as its JSON log line reports them."""
    import json
    import uuid

    request_id = uuid.uuid4().hex
    generate(server, prompt, headers={**AUTH, "X-Request-Id": request_id}, **parameters)
    for line in server.log().splitlines():
        if request_id in line and "succeeded" in line:
            return json.loads(line)["fields"]["cached_tokens"]
    raise AssertionError(f"no log line for request {request_id}")


def test_metrics_info_and_queue_show_the_cache(caching_server):
    import threading

    prompt = "Metrics. " + SYSTEM + QUESTIONS[2]
    queries, hits = (metric(caching_server, f"tokenmill_prefix_cache_{name}_total") for name in ("queries", "hits"))
    generate_cached(caching_server, prompt)
    assert generate_cached(caching_server, prompt) > 0
    prompt_len = len(tokenize(caching_server, prompt))
    reusable = (prompt_len - 1) // 16 * 16
    assert metric(caching_server, "tokenmill_prefix_cache_queries_total") - queries == 2 * prompt_len
    assert metric(caching_server, "tokenmill_prefix_cache_hits_total") - hits == reusable
    assert metric(caching_server, "tokenmill_prefix_cache_blocks") >= reusable // 16
    info = httpx_get(caching_server, "/info").json()
    assert info["prefix_caching"] is True and info["prefix_caching_off_reason"] is None
    assert info["kv"]["blocks_cached"] >= reusable // 16

    running = threading.Thread(target=generate, args=(caching_server, prompt), kwargs={"max_new_tokens": 200})
    running.start()
    entries = []
    while running.is_alive() and not entries:
        entries = httpx_get(caching_server, "/queue").json()["running"]
    running.join()
    assert entries and entries[0]["cached_tokens"] == reusable


def test_reset_prefix_cache_wants_the_api_key_and_drops_the_cached_blocks(caching_server):
    prompt = "Reset. " + SYSTEM + QUESTIONS[3]
    generate_cached(caching_server, prompt)
    with caching_server.client() as client:
        assert client.post("/reset_prefix_cache").status_code == 401
        answer = client.post("/reset_prefix_cache", headers=AUTH)
    assert answer.status_code == 200
    assert answer.json()["prefix_caching"] is True and answer.json()["dropped_blocks"] > 0
    assert generate_cached(caching_server, prompt) == 0
    assert metric(caching_server, "tokenmill_prefix_cache_blocks") > 0  # that request's blocks, cached again


@pytest.mark.parametrize("headers", [{"Origin": "http://intranet.example"}, {"Sec-Fetch-Site": "cross-site"}])
def test_a_web_page_of_another_site_cannot_reset_the_prefix_cache(caching_server, headers):
    with caching_server.client() as client:
        refused = client.post("/reset_prefix_cache", headers={**AUTH, **headers})
        host = caching_server.url.split("://", 1)[1]
        same_site = client.post("/reset_prefix_cache", headers={**AUTH, "Origin": f"http://{host}"})
    assert refused.status_code == 403 and refused.json()["error_type"] == "forbidden"
    assert "another site" in refused.json()["error"] or "Origin" in refused.json()["error"]
    assert same_site.status_code == 200


@pytest.mark.slow
def test_prefix_caching_0_turns_the_cache_off(tiny_model_dir, tmp_path):
    import openai
    from conftest import start_server

    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "512",
                           "--backend", "paged"], tmp_path, env={"PREFIX_CACHING": "0"})
    try:
        with server.client() as client:
            info = client.get("/info").json()
            reset = client.post("/reset_prefix_cache").json()
            metrics = client.get("/metrics").text
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        usages = [client.completions.create(model="tiny", prompt=SYSTEM, max_tokens=2).usage for _ in range(2)]
    finally:
        server.stop()
    assert info["prefix_caching"] is False and "PREFIX_CACHING=0" in info["prefix_caching_off_reason"]
    assert reset == {"prefix_caching": False, "dropped_blocks": 0}
    assert "tokenmill_prefix_cache" not in metrics
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, 0]
    assert "prefix caching is off: turned off" in server.log()


def test_the_flag_and_tgis_environment_name_turn_it_on_and_off():
    from tokenmill.config import parse_config

    assert parse_config([]).prefix_caching is True
    assert parse_config(["--no-prefix-caching"]).prefix_caching is False
    for value, expected in (("0", False), ("false", False), ("1", True), ("true", True)):
        assert parse_config([], env={"PREFIX_CACHING": value}).prefix_caching is expected
    assert parse_config(["--prefix-caching"], env={"PREFIX_CACHING": "0"}).prefix_caching is True


def test_the_transformers_backend_says_it_keeps_no_prefix_cache(tiny_model):
    from tokenmill.config import Config
    from tokenmill.engine.startup import prefix_caching_unavailable_reason
    from tokenmill.plugin_manager import build_plugin_manager, choose_all

    model, _ = tiny_model
    chosen = choose_all(build_plugin_manager(autoload=False), "transformers", None, None, "fifo", None)
    runner = chosen.backend.create(model, chosen.kv_allocator.create(model.config, torch.float32, torch.device("cpu"),
                                                                      1024, 1), chosen.attention)
    assert "transformers backend keeps no prefix cache" in prefix_caching_unavailable_reason(Config(), chosen, runner)


def chat_cached(server, key: str | bytes, messages: list[dict], **fields) -> int:
    """The prompt tokens a chat request took from the cache, as its usage says."""
    token = key.encode() if isinstance(key, str) else key
    with server.client() as client:
        answer = client.post("/v1/chat/completions", headers={"Authorization": b"Bearer " + token},
                             json={"messages": messages, "max_tokens": 2, "temperature": 0, **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_each_api_key_is_its_own_prefix_cache_tenant_unless_requests_share_a_cache_salt(caching_server):
    """A client cannot learn another's prompt from `cached_tokens`: hits count only within its key's part
    of the cache; a `cache_salt` both send is a part they share on purpose."""
    messages = [{"role": "system", "content": "Tenants. " + SYSTEM}, {"role": "user", "content": QUESTIONS[2]}]
    assert chat_cached(caching_server, KEY, messages) == 0
    assert chat_cached(caching_server, KEY, messages) > 0
    assert chat_cached(caching_server, OTHER_KEY, messages) == 0, "another key's cached prompt is not a hit"
    assert chat_cached(caching_server, OTHER_KEY, messages) > 0
    assert chat_cached(caching_server, FILED_KEY, messages) == 0
    salted = [{"role": "system", "content": "Shared. " + SYSTEM}, {"role": "user", "content": QUESTIONS[2]}]
    assert chat_cached(caching_server, KEY, salted, cache_salt="team") == 0
    assert chat_cached(caching_server, OTHER_KEY, salted, cache_salt="team") > 0
    assert chat_cached(caching_server, OTHER_KEY, salted) == 0


def test_a_key_from_the_key_file_is_taken_as_utf8_and_a_wrong_key_is_a_401(caching_server):
    messages = [{"role": "user", "content": "Hi"}]
    assert chat_cached(caching_server, FILED_KEY.encode("utf-8"), messages) == 0
    with caching_server.client() as client:
        for wrong in (FILED_KEY.encode("latin-1"), b"other", b"prefix-key,other-tenant"):
            answer = client.post("/v1/chat/completions", headers={"Authorization": b"Bearer " + wrong},
                                 json={"messages": messages, "max_tokens": 1})
            assert answer.status_code == 401, answer.text


def test_only_the_keys_listed_may_set_a_priority(caching_server):
    """--priority-header-keys: from other keys the X-Priority header is ignored (a gateway may add it to
    every request) and a `priority` parameter is refused."""
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 1}}
    with caching_server.client() as client:
        def post(key: str, headers: dict | None = None, **parameters):
            payload = {**body, "parameters": {**body["parameters"], **parameters}}
            return client.post("/generate", json=payload,
                               headers={"Authorization": f"Bearer {key}", **(headers or {})})

        assert post(KEY, {"X-Priority": "urgent"}).status_code == 422, "a listed key's header is read"
        assert post(OTHER_KEY, {"X-Priority": "urgent"}).status_code == 200, "another key's header is ignored"
        assert post(KEY, priority="high").status_code == 200
        refused = post(OTHER_KEY, priority="high")
        assert refused.status_code == 422 and "--priority-header-keys" in refused.json()["error"]
        assert post(OTHER_KEY, priority="normal").status_code == 200
