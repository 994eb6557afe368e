"""The paged backend: KV in a shared block pool, packed steps, chunked prefill and preemption.

Every test checks greedy tokens against ``model.generate()`` and that all blocks
are back in the pool at the end.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch
from engine_helpers import PROMPTS, Collector, build_engine, greedy_request, reference_greedy, tiny_mistral

from tokenmill.plugin_manager import PluginError, build_plugin_manager, choose, choose_all


@pytest.fixture
def paged_model(tiny_model_dir):
    """A model of its own: the paged backend routes its attention to the block pool."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def run(engine, requests) -> tuple[list[Collector], dict[str, int]]:
    """Submit (prompt, max_new_tokens, step to submit at) requests and step until all are done."""
    sinks = [Collector() for _ in requests]
    seen = {"max_batch": 0, "max_prefilling": 0, "steps": 0}
    pending = sorted(zip(requests, sinks), key=lambda item: item[0][2])
    while pending or not all(s.done for s in sinks):
        while pending and pending[0][0][2] <= seen["steps"]:
            (prompt, new_tokens, _), sink = pending.pop(0)
            engine.submit(greedy_request(engine.tokenizer, prompt, new_tokens), sink)
        engine.run_once()
        seen["steps"] += 1
        seen["max_batch"] = max(seen["max_batch"], engine.batch_size)
        seen["max_prefilling"] = max(seen["max_prefilling"], len(engine.scheduler.prefilling))
    return sinks, seen


def assert_pool_empty(engine) -> None:
    usage = engine.kv_usage()
    assert usage["blocks_used"] == 0 and engine.batch_size == 0


def check_against_generate(model, tokenizer, requests, sinks) -> None:
    for (prompt, new_tokens, _), sink in zip(requests, sinks):
        assert sink.token_ids == reference_greedy(model, tokenizer, prompt, new_tokens), prompt


REQUESTS = [(prompt, 10 + 3 * i, 0 if i < 4 else 3) for i, prompt in enumerate(PROMPTS)]


def test_paged_greedy_equals_generate_with_requests_joining_mid_batch(paged_model, tiny_model):
    _, tokenizer = tiny_model
    engine = build_engine(paged_model, tokenizer, backend="paged", ignore_eos=True)
    sinks, seen = run(engine, REQUESTS)
    assert seen["max_batch"] == 8
    check_against_generate(tiny_model[0], tokenizer, REQUESTS, sinks)
    assert_pool_empty(engine)


def test_decode_rows_are_grouped_by_context_so_short_ones_are_not_padded_to_long_ones():
    from tokenmill_plugins.attention.torch_kernels import decode_groups

    assert decode_groups({row: 10 + row % 3 for row in range(32)}) == [list(range(32))]
    assert decode_groups({0: 300, 1: 2, 2: 298, 3: 3}) == [[0, 2], [1, 3]]
    assert decode_groups({}) == []


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_single_query_attention_matches_sdpa(dtype, tolerance):
    from tokenmill_plugins.attention.torch_kernels import _decode_attention

    torch.manual_seed(0)
    sequences, context, heads, kv_heads, dim = 5, 48, 9, 3, 64
    query = torch.randn(sequences, heads, 1, dim)
    keys, values = torch.randn(sequences, context, kv_heads, dim), torch.randn(sequences, context, kv_heads, dim)
    mask = (torch.arange(context) < torch.tensor([3, 48, 17, 30, 1])[:, None])[:, None, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=dim**-0.5, enable_gqa=True)
    got = _decode_attention(query.to(dtype), keys.to(dtype), values.to(dtype), mask, dim**-0.5)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


def test_decode_groups_of_very_different_lengths_give_generates_tokens(paged_model, tiny_model, monkeypatch):
    from tokenmill_plugins.attention import torch_kernels

    _, tokenizer = tiny_model
    seen_groups: list[int] = []
    original = torch_kernels.decode_groups
    monkeypatch.setattr(torch_kernels, "decode_groups", lambda rows: seen_groups.append(len(
        result := original(rows))) or result)
    monkeypatch.setattr(torch_kernels.SdpaAttention, "_use_native", lambda self, device: False)  # the gather path
    long = " ".join(PROMPTS * 12)
    requests = [(long, 12, 0), (PROMPTS[1], 12, 0), (" ".join(PROMPTS * 6), 12, 0), (PROMPTS[3], 12, 0)]
    engine = build_engine(paged_model, tokenizer, backend="paged", ignore_eos=True, block_size=4)
    sinks, _ = run(engine, requests)
    assert max(seen_groups) >= 2
    check_against_generate(tiny_model[0], tokenizer, requests, sinks)
    assert_pool_empty(engine)


def test_chunked_prefill_under_a_small_prefill_budget(paged_model, tiny_model):
    _, tokenizer = tiny_model
    engine = build_engine(paged_model, tokenizer, backend="paged", ignore_eos=True, max_batch_prefill_tokens=5)
    sinks, seen = run(engine, REQUESTS)
    assert seen["max_prefilling"] >= 1, "long prompts were prefilled over several steps"
    check_against_generate(tiny_model[0], tokenizer, REQUESTS, sinks)
    assert_pool_empty(engine)


def test_preemption_when_the_pool_runs_out_recomputes_and_gives_the_same_tokens(paged_model, tiny_model):
    _, tokenizer = tiny_model
    requests = [(PROMPTS[i], 40, 0) for i in (1, 2, 4, 7)]
    engine = build_engine(paged_model, tokenizer, backend="paged", ignore_eos=True, block_size=4,
                          max_batch_total_tokens=96)  # 24 blocks: two sequences of ~50 tokens, not four
    sinks, _ = run(engine, requests)
    assert engine.preemptions > 0
    check_against_generate(tiny_model[0], tokenizer, requests, sinks)
    assert_pool_empty(engine)


def test_cancelling_returns_blocks_at_once(paged_model, tiny_model):
    _, tokenizer = tiny_model
    engine = build_engine(paged_model, tokenizer, backend="paged", ignore_eos=True, block_size=4)
    seq = engine.submit(greedy_request(tokenizer, PROMPTS[6], 100), Collector())
    for _ in range(3):
        engine.run_once()
    assert engine.kv_usage()["blocks_used"] > 0
    engine.cancel(seq)
    engine.run_once()
    assert_pool_empty(engine)


def test_prompt_logprobs_match_the_transformers_backend(paged_model, tiny_model):
    model, tokenizer = tiny_model
    finals = []
    for backend, chosen_model in (("transformers", model), ("paged", paged_model)):
        engine = build_engine(chosen_model, tokenizer, backend=backend)
        sink = Collector()
        engine.submit(greedy_request(tokenizer, PROMPTS[6], 3, decoder_input_details=True), sink)
        while not sink.done:
            engine.run_once()
        finals.append(sink.final)
    reference, paged = finals
    assert [t.id for t in paged.prefill] == [t.id for t in reference.prefill]
    assert paged.prefill[0].logprob is None
    assert torch.allclose(torch.tensor([t.logprob for t in paged.prefill[1:]]),
                          torch.tensor([t.logprob for t in reference.prefill[1:]]), atol=1e-4)


@pytest.mark.parametrize("native", [True, False], ids=["native-decode", "gathered-decode"])
def test_sliding_window_attention_in_the_paged_kernel(tiny_model, native, monkeypatch):
    from tokenmill_plugins.attention import torch_kernels

    if not native:
        monkeypatch.setattr(torch_kernels.SdpaAttention, "_use_native", lambda self, device: False)
    _, tokenizer = tiny_model
    reference_model = tiny_mistral()
    paged_model = tiny_mistral()  # the same weights (same seed), and its own config: paged attention is set there
    engine = build_engine(paged_model, tokenizer, backend="paged", ignore_eos=True, max_batch_prefill_tokens=7)
    requests = [(prompt, 12, 0) for prompt in PROMPTS[:4]]
    sinks, _ = run(engine, requests)
    check_against_generate(reference_model, tokenizer, requests, sinks)


def test_a_model_outside_the_attention_interface_is_refused(paged_model, tiny_model):
    paged_model._supports_attention_backend = False
    with pytest.raises(ValueError, match="use --backend transformers"):
        build_engine(paged_model, tiny_model[1], backend="paged")


def test_block_pool_hands_out_zeroed_blocks_all_or_nothing_and_takes_them_back():
    from tokenmill_plugins.kv.paged import PagedPool

    pool = PagedPool(layers=1, num_blocks=4, block_size=2, kv_heads=1, head_dim=2, dtype=torch.float32,
                     device=torch.device("cpu"))
    assert pool.reserve(1, 3) and pool.blocks_of(1) == [1, 2] and pool.free_blocks() == 2
    assert not pool.reserve(2, 7) and pool.blocks_of(2) == [] and pool.free_blocks() == 2, "all or nothing"
    assert pool.reserve(1, 4) and pool.blocks_of(1) == [1, 2], "growing within its last block takes nothing"
    pool.layer(0)[0][1:3] = 7.0
    pool.free(1)
    assert pool.free_blocks() == 4 and pool.ref_counts == [0] * 5
    assert pool.reserve(3, 2) and torch.count_nonzero(pool.layer(0)[0][pool.blocks_of(3)]) == 0, \
        "a block is handed out zeroed"
    assert torch.count_nonzero(pool.layer(0)[0][0]) == 0, "block 0 is the zero block"


def test_flash_is_refused_on_cpu_with_the_reason_and_auto_picks_paged():
    pm = build_plugin_manager(autoload=False)
    with pytest.raises(PluginError, match="--backend flash is not available here: needs CUDA"):
        choose(pm, "backend", "flash")
    with pytest.raises(PluginError, match="--attention flash is not available here: needs CUDA"):
        choose(pm, "attention", "flash")
    chosen = choose_all(pm, "auto", None, None, "fifo", None)
    assert (chosen.backend.name, chosen.attention.name, chosen.kv_allocator.name, chosen.block_size) == (
        "paged", "sdpa", "paged", 16)


@pytest.mark.parametrize("backend, expected", [("auto", "transformers"), ("paged", None)])
def test_auto_falls_back_to_transformers_for_a_model_paged_cannot_run(backend, expected, tiny_model_dir,
                                                                      monkeypatch):
    from tokenmill.config import parse_config
    from tokenmill.http.app import ServerState
    from tokenmill.model.loading import ModelLoadError
    from tokenmill_plugins.backends.paged import PagedBackend

    monkeypatch.setattr(PagedBackend, "model_unavailable_reason", lambda self, model: "no AttentionInterface")
    config = parse_config(["--model-id", str(tiny_model_dir), "--backend", backend], env={})
    state = ServerState(config, build_plugin_manager(autoload=False))
    if expected is None:
        with pytest.raises(ModelLoadError, match="no AttentionInterface"):
            state.load()
        return
    state.load()
    try:
        assert state.chosen.backend.name == expected and state.chosen.kv_allocator.name == "dynamic"
        assert state.engine.healthy
    finally:
        state.engine.stop()
        gc.unfreeze()  # a server freezes its heap for its life (kv_memory.freeze_heap); the tests' process goes on


@pytest.mark.parametrize("change, reason", [
    (lambda config: setattr(config, "attn_logit_softcapping", 50.0), "soft-capping"),
    (lambda config: setattr(config, "attention_chunk_size", 8), "chunked attention"),
    (lambda config: setattr(config, "layer_types", ["full_attention", "conv"]), "conv layers"),
])
def test_models_the_paged_layout_would_get_wrong_are_refused(paged_model, change, reason):
    from tokenmill_plugins.backends.paged import PagedBackend

    assert PagedBackend().model_unavailable_reason(paged_model) is None
    change(paged_model.config)
    assert reason in PagedBackend().model_unavailable_reason(paged_model)


def test_flash_refuses_float32_models_so_auto_moves_on(paged_model):
    from tokenmill_plugins.backends.paged import FlashBackend

    assert "float16 and bfloat16 only" in FlashBackend().model_unavailable_reason(paged_model)
    assert FlashBackend().model_unavailable_reason(paged_model.to(torch.bfloat16)) is None


def test_a_request_as_long_as_the_whole_pool_runs_alone_and_the_queue_moves_on(paged_model, tiny_model):
    _, tokenizer = tiny_model
    engine = build_engine(paged_model, tokenizer, backend="paged", ignore_eos=True, block_size=16,
                          max_batch_total_tokens=64)  # 4 blocks
    requests = [(PROMPTS[1], 64 - 9, 0), (PROMPTS[2], 20, 0)]  # the first fills the pool to its last position
    sinks, _ = run(engine, requests)
    assert [len(s.token_ids) for s in sinks] == [55, 20]  # the second ran beside it until preempted
    check_against_generate(tiny_model[0], tokenizer, requests, sinks)
    assert_pool_empty(engine)


@pytest.mark.slow
def test_a_compiled_forward_gives_the_greedy_tokens_of_generate_through_chunks_joins_and_single_rows(
        paged_model, tiny_model):
    _, tokenizer = tiny_model
    engine = build_engine(paged_model, tokenizer, backend="paged", ignore_eos=True, max_batch_prefill_tokens=5)
    engine.runner.compile_forward()
    requests = REQUESTS + [(PROMPTS[0], 30, 40)]  # the last one decodes alone: a step of one token
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    sinks, seen = run(engine, requests)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before + 1, "one graph for every step"
    assert seen["max_prefilling"] >= 1 and seen["max_batch"] >= 4
    check_against_generate(tiny_model[0], tokenizer, requests, sinks)
    assert_pool_empty(engine)


def test_a_forward_compiled_in_the_background_serves_eagerly_until_built_and_then_takes_over(
        paged_model, tiny_model):
    import threading

    _, tokenizer = tiny_model
    engine = build_engine(paged_model, tokenizer, backend="paged", ignore_eos=True, max_batch_prefill_tokens=5)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    builder = threading.Thread(target=engine.runner.build_compiled_forward)
    builder.start()
    while_building, _ = run(engine, REQUESTS)  # the engine's steps meanwhile: eager, whatever the builder does
    builder.join()
    assert engine.runner.compiled is not None  # the last steps above may already have run through it
    built = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert built > graphs_before  # one graph, or one more for each build tried again (BUILD_ATTEMPTS)
    requests = REQUESTS + [(PROMPTS[0], 30, 40)]
    compiled, _ = run(engine, requests)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == built, "its steps reuse the graph"
    assert engine.runner.compiled.ran
    check_against_generate(tiny_model[0], tokenizer, REQUESTS, while_building)
    check_against_generate(tiny_model[0], tokenizer, requests, compiled)
    assert_pool_empty(engine)


def python_runs_in_every_collection(engine: Any) -> tuple[list[str], Any]:
    """Run the engine's requests while each allocation may start a collection that runs Python (as a
    finalizer or a ``gc.callbacks`` entry does); the collections seen and the requests' sinks."""
    seen: list[str] = []

    def python_during_collection(phase: str, info: dict) -> None:
        seen.append(phase)

    thresholds = gc.get_threshold()
    gc.callbacks.append(python_during_collection)
    gc.set_threshold(1)
    try:
        sinks, _ = run(engine, REQUESTS)
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(python_during_collection)
    return seen, sinks


def test_python_run_by_a_garbage_collection_never_fails_a_compiled_step(paged_model, tiny_model):
    _, tokenizer = tiny_model
    engine = build_engine(paged_model, tokenizer, backend="paged", ignore_eos=True, max_batch_prefill_tokens=5)
    engine.runner.build_compiled_forward()
    run(engine, REQUESTS[:1])  # the engine thread's first compiled call: later ones skip the guards
    assert engine.runner.compiled.ran
    seen, sinks = python_runs_in_every_collection(engine)
    assert seen, "collections ran, between the compiled calls"
    check_against_generate(tiny_model[0], tokenizer, REQUESTS, sinks)
    assert engine.runner.compiled is not None and engine.runner.compiled.ran


def test_a_background_build_that_fails_is_tried_again_before_the_forward_stays_eager(paged_model, tiny_model,
                                                                                    monkeypatch):
    import tokenmill_plugins.backends.paged.runner as paged

    builds, failing = [], [paged.BUILD_ATTEMPTS - 1]

    class FlakyForward:
        loaded = False

        def __init__(self, model, saved_at):
            self.model = model

        def build(self, pool, kernel, device):
            builds.append(self)
            if len(builds) <= failing[0]:
                raise AssertionError("Expected dict, got <class 'NoneType'>")  # dynamo's guard builder, racing

    engine = build_engine(paged_model, tiny_model[1], backend="paged")
    monkeypatch.setattr(paged, "CompiledForward", FlakyForward)
    engine.runner.build_compiled_forward()
    assert engine.runner.compiled is builds[-1] and len(builds) == paged.BUILD_ATTEMPTS
    builds.clear()
    engine.runner.compiled, failing[0] = None, paged.BUILD_ATTEMPTS  # every try fails

    with pytest.raises(AssertionError):
        engine.runner.build_compiled_forward()
    assert engine.runner.compiled is None and len(builds) == paged.BUILD_ATTEMPTS


def test_a_built_forward_that_fails_in_the_engines_first_step_gives_way_to_the_eager_one(paged_model, tiny_model,
                                                                                        monkeypatch):
    from types import SimpleNamespace

    from tokenmill.config import Config
    from tokenmill.model.compile import Compiler
    from tokenmill.model.loading import Stages

    _, tokenizer = tiny_model
    engine = build_engine(paged_model, tokenizer, backend="paged", ignore_eos=True)
    compiler = Compiler(Config(), SimpleNamespace(model=paged_model, quantization=None), engine.runner, Stages())
    compiler.start()
    compiler.thread.join()
    assert compiler.forward == "compiled"

    def broken(**inputs):
        raise RuntimeError("torch.compile with fullgraph=True found no compiled frames.")

    monkeypatch.setattr(engine.runner.compiled, "compiled", broken)
    sinks, _ = run(engine, REQUESTS[:3])
    check_against_generate(tiny_model[0], tokenizer, REQUESTS[:3], sinks)  # no request failed
    assert engine.runner.compiled is None and compiler.forward == "eager"


@pytest.mark.slow
def test_the_background_compile_is_a_load_stage_and_info_says_which_forward_runs(paged_model, tiny_model):
    from types import SimpleNamespace

    from tokenmill.config import Config
    from tokenmill.model.compile import Compiler
    from tokenmill.model.loading import Stages

    engine = build_engine(paged_model, tiny_model[1], backend="paged")
    loaded = SimpleNamespace(model=paged_model, quantization=None)
    stages = Stages()
    compiler = Compiler(Config(), loaded, engine.runner, stages)
    assert (compiler.in_background, compiler.in_warm_up, engine.runner.compiled) == (True, False, None)
    compiler.start()
    assert compiler.forward == "compiling"
    compiler.thread.join()
    assert compiler.forward == "compiled" and engine.runner.compiled is not None
    assert [stage["stage"] for stage in stages.done] == ["compiling the forward"]

    before_ready = Compiler(Config(compile_before_ready=True), loaded, engine.runner, Stages())
    assert before_ready.in_warm_up and not before_ready.in_background
    eager = Compiler(Config(compile_model=False), loaded, engine.runner, Stages())
    eager.start()
    assert (eager.in_warm_up, eager.in_background, eager.forward) == (False, False, "eager")


def test_a_background_compile_that_fails_leaves_the_eager_forward(paged_model, tiny_model, monkeypatch):
    from types import SimpleNamespace

    from tokenmill.config import Config
    from tokenmill.model.compile import Compiler
    from tokenmill.model.loading import Stages

    _, tokenizer = tiny_model
    engine = build_engine(paged_model, tokenizer, backend="paged", ignore_eos=True)

    def broken_build():
        raise RuntimeError("inductor could not build a kernel")

    monkeypatch.setattr(engine.runner, "build_compiled_forward", broken_build)
    stages = Stages()
    compiler = Compiler(Config(), SimpleNamespace(model=paged_model, quantization=None), engine.runner, stages)
    compiler.start()
    compiler.thread.join()
    assert compiler.forward == "eager" and engine.runner.compiled is None
    assert stages.done[-1]["detail"].startswith("failed: model load failed while compiling the forward")
    sinks, _ = run(engine, REQUESTS[:2])
    check_against_generate(tiny_model[0], tokenizer, REQUESTS[:2], sinks)


def test_inductors_caches_live_in_tokenmills_cache_unless_the_operator_chose_a_place(tmp_path, monkeypatch):
    from torch._inductor.runtime.runtime_utils import default_cache_dir

    from tokenmill.model.compile import use_compile_cache_dir

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    ours = tmp_path / "inductor" / f"torch-{torch.__version__}"
    for before in (None, default_cache_dir()):  # unset, or set to inductor's default by an import of torch's
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        assert use_compile_cache_dir() == ours
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(ours)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "chosen"))
    assert use_compile_cache_dir() == tmp_path / "chosen"


def test_compiling_is_a_setting_that_defaults_on():
    from tokenmill.config import parse_config

    assert parse_config([], env={}).compile_model is True
    assert parse_config(["--no-compile-model"], env={}).compile_model is False
    assert parse_config([], env={"COMPILE_MODEL": "false"}).compile_model is False


@pytest.mark.parametrize("settings, quantization, lora, reason", [
    ({}, None, False, None),
    ({"num_shard": 2}, None, False, "--num-shard"),
    ({}, None, True, "LoRA"),  # start-up wraps the layers for --lora-adapters or --lora-cache-limit
    ({}, "awq", False, "quantized"),  # a quantized checkpoint, read without --quantize
])
def test_the_paged_runner_compiles_unless_sharding_lora_or_a_quantizer_rule_it_out(settings, quantization, lora,
                                                                                 reason, paged_model, tiny_model):
    from types import SimpleNamespace

    from tokenmill.config import Config
    from tokenmill.model.compile import compile_unavailable_reason
    from tokenmill.model.lora import install

    if lora:
        install(paged_model)
    engine = build_engine(paged_model, tiny_model[1], backend="paged")
    loaded = SimpleNamespace(model=paged_model, quantization=quantization)
    found = compile_unavailable_reason(Config(**settings), loaded, engine.runner)
    assert found is None if reason is None else reason in found


def test_without_a_cxx_compiler_the_forward_runs_eagerly(paged_model, tiny_model, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    engine = build_engine(paged_model, tiny_model[1], backend="paged")
    assert "no-such-compiler is not on PATH" in engine.runner.compile_unavailable_reason()


def test_a_compile_that_fails_falls_back_to_the_eager_forward(paged_model, tiny_model, monkeypatch):
    _, tokenizer = tiny_model
    engine = build_engine(paged_model, tokenizer, backend="paged", ignore_eos=True)
    engine.runner.compile_forward()

    def broken_compile(**inputs):
        raise RuntimeError("inductor could not build a kernel")

    monkeypatch.setattr(engine.runner.compiled, "compiled", broken_compile)
    requests = REQUESTS[:3]
    sinks, _ = run(engine, requests)
    assert engine.runner.compiled is None
    check_against_generate(tiny_model[0], tokenizer, requests, sinks)
    assert_pool_empty(engine)


def test_the_transformers_runner_runs_eagerly(tiny_model):
    from types import SimpleNamespace

    from tokenmill.config import Config
    from tokenmill.model.compile import compile_unavailable_reason

    engine = build_engine(tiny_model[0], tiny_model[1], backend="transformers")
    assert compile_unavailable_reason(Config(), SimpleNamespace(model=tiny_model[0]), engine.runner) == \
        "the backend runs its forward eagerly"


@pytest.mark.parametrize("backend, budget, ratio", [("paged", 2048, 0.0), ("transformers", 2047 + 50, 0.3)])
def test_start_up_gives_a_backend_with_mixed_steps_its_admission_defaults(backend, budget, ratio, tiny_model_dir):
    from tokenmill.config import Config
    from tokenmill.engine.startup import start_engine
    from tokenmill.model.loading import Stages

    config = Config(model_id=str(tiny_model_dir), backend=backend, compile_model=False, max_total_tokens=2048,
                    max_batch_total_tokens=8192)
    started = start_engine(config, build_plugin_manager(autoload=False), Stages())
    assert (started.config.max_batch_prefill_tokens, started.config.waiting_served_ratio) == (budget, ratio)
    assert started.engine.queue.limits.waiting_served_ratio == ratio
    assert started.engine.prefill_budget == budget
