"""A compiled forward is saved once per machine and model, and a later start loads it instead of compiling.

The forward of a model whose linear layers tokenmill packed is compiled ahead of time, its weights the
graph's inputs, and kept under ``TOKENMILL_CACHE_DIR/compiled/``; every runner below gives the greedy tokens
of ``model.generate()``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_helpers import PROMPTS, Collector, build_engine, greedy_request, reference_greedy

from tokenmill.model.cpu_linears import pack_linears, packing_unavailable_reason
from tokenmill_plugins.backends.paged.saved_forward import saved_forward_path

pytestmark = pytest.mark.skipif(packing_unavailable_reason(torch.nn.Linear(2, 2)) is not None,
                                reason="this torch build has no oneDNN linear kernel")

REQUESTS = [(prompt, 8 + 2 * i) for i, prompt in enumerate(PROMPTS[:4])]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    return tmp_path


def packed_model(tiny_model_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The tiny model as ``tokenmill launch`` loads it on CPU: its linear layers packed for oneDNN."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
    pack_linears(model)
    return model


def greedy_tokens(engine: Any) -> list[list[int]]:
    sinks = [Collector() for _ in REQUESTS]
    for (prompt, new_tokens), sink in zip(REQUESTS, sinks):
        engine.submit(greedy_request(engine.tokenizer, prompt, new_tokens), sink)
    while not all(sink.done for sink in sinks):
        engine.run_once()
    return [sink.token_ids for sink in sinks]


def expected_tokens(tiny_model: Any) -> list[list[int]]:
    model, tokenizer = tiny_model
    return [reference_greedy(model, tokenizer, prompt, new_tokens) for prompt, new_tokens in REQUESTS]


def test_the_first_build_compiles_and_saves_the_forward_and_the_next_loads_it(tiny_model_dir, tiny_model, cache):
    first = build_engine(packed_model(tiny_model_dir), tiny_model[1], backend="paged", ignore_eos=True)
    saved = saved_forward_path(first.runner.model)
    assert saved.parent == cache / "compiled" and not first.runner.compiled_forward_saved()

    assert first.runner.build_compiled_forward() is False  # compiled
    assert saved.is_file() and first.runner.compiled_forward_saved()
    assert greedy_tokens(first) == expected_tokens(tiny_model)
    assert first.runner.compiled.ran

    restarted = build_engine(packed_model(tiny_model_dir), tiny_model[1], backend="paged", ignore_eos=True)
    assert saved_forward_path(restarted.runner.model) == saved
    assert restarted.runner.build_compiled_forward() is True  # loaded
    assert greedy_tokens(restarted) == expected_tokens(tiny_model)
    assert restarted.runner.compiled.loaded and restarted.runner.compiled.ran


def test_a_saved_forward_that_cannot_be_loaded_is_compiled_again_and_replaced(tiny_model_dir, tiny_model, cache,
                                                                              caplog):
    engine = build_engine(packed_model(tiny_model_dir), tiny_model[1], backend="paged", ignore_eos=True)
    saved = saved_forward_path(engine.runner.model)
    saved.parent.mkdir(parents=True)
    saved.write_bytes(b"not a compiled forward")

    with caplog.at_level(logging.WARNING):
        assert engine.runner.build_compiled_forward() is False
    assert "could not be loaded" in caplog.text
    assert saved.stat().st_size > 1000  # the compiled one took its place
    assert greedy_tokens(engine) == expected_tokens(tiny_model)


def test_a_forward_is_saved_per_dtype_and_model_config(tiny_model_dir, cache):
    fp32 = saved_forward_path(packed_model(tiny_model_dir))
    assert saved_forward_path(packed_model(tiny_model_dir)) == fp32
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert saved_forward_path(packed_model(tiny_model_dir, torch.bfloat16)) != fp32
    wider = packed_model(tiny_model_dir)
    wider.config.rope_theta = 1234.0
    assert saved_forward_path(wider) != fp32


def test_an_unpacked_model_is_compiled_by_every_start_and_saves_nothing(tiny_model_dir, tiny_model, cache):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = build_engine(model, tiny_model[1], backend="paged", ignore_eos=True)
    engine.runner.compile_forward()
    assert engine.runner.compiled.freezing and engine.runner.compiled.saved_at is None
    assert not (cache / "compiled").exists()


def test_the_compiler_loads_a_saved_forward_and_info_says_it_came_from_the_cache(tiny_model_dir, tiny_model, cache):
    from tokenmill.config import Config
    from tokenmill.model.compile import Compiler
    from tokenmill.model.loading import Stages

    def started(model: Any) -> tuple[Compiler, Stages]:
        engine = build_engine(model, tiny_model[1], backend="paged", ignore_eos=True)
        stages = Stages()
        compiler = Compiler(Config(), SimpleNamespace(model=model, quantization=None), engine.runner, stages)
        compiler.start()
        compiler.thread.join()
        assert compiler.forward == "compiled"
        return compiler, stages

    compiled, stages = started(packed_model(tiny_model_dir))
    assert compiled.from_cache is False and "torch.compile" in stages.done[0]["detail"]
    loaded, stages = started(packed_model(tiny_model_dir))
    assert loaded.from_cache is True and "saved" in stages.done[0]["detail"]


def test_kernel_loading_is_prepared_while_the_compiled_code_s_imports_are_made():
    import sys

    from torch._inductor import cpu_vec_isa
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    from tokenmill.model.compile import OUTPUT_CODE_IMPORTS, PROBE_KERNEL, prepare_kernel_loading

    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    prepare_kernel_loading()
    assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1  # the probe checked the vector ISAs
    assert all(name in sys.modules for name in OUTPUT_CODE_IMPORTS)
    zeroed = torch.ones(1)
    CppPythonBindingsCodeCache.load_pybinding(["float*"], PROBE_KERNEL)(zeroed)
    assert zeroed.item() == 0.0
