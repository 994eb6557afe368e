"""Float32 and bfloat16 linear layers packed for oneDNN on CPU compute what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.config import parse_config
from tokenmill.model.cpu_linears import PackedLinear, pack_linears, packing_unavailable_reason

pytestmark = pytest.mark.skipif(packing_unavailable_reason(nn.Linear(2, 2)) is not None,
                                reason="this torch build has no oneDNN linear kernel")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (1, 5, 64)])
def test_a_packed_linear_computes_what_nn_linear_computes(bias: bool, shape: tuple[int, ...]):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        expected = linear(x)
        packed = PackedLinear(linear)(x)
    assert packed.shape == expected.shape == (*shape[:-1], 96)
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)


def test_packing_replaces_every_linear_and_keeps_the_model_output(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 400, 2000, 31, 7, 99]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        linears = sum(type(m) is nn.Linear for m in model.modules())
        assert pack_linears(model) == linears > 0
        after = model(input_ids=ids).logits
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.get_input_embeddings().weight.shape[0] == 49152  # the tied embedding keeps its dense weight
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert torch.equal(after.argmax(-1), before.argmax(-1))


def test_only_float32_and_bfloat16_models_on_cpu_are_packed():
    assert packing_unavailable_reason(nn.Linear(4, 4)) is None
    assert "float16" in packing_unavailable_reason(nn.Linear(4, 4).to(torch.float16))
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert packing_unavailable_reason(nn.Linear(4, 4).to(torch.bfloat16)) is None


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bfloat16 matmul here")
@pytest.mark.parametrize("shape", [(1, 64), (9, 64), (1, 5, 64)])
def test_a_packed_bfloat16_linear_computes_what_nn_linear_computes_eagerly_and_compiled(shape: tuple[int, ...]):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).to(torch.bfloat16)
    x = torch.randn(shape, dtype=torch.bfloat16)
    packed = PackedLinear(linear)
    compiled = torch.compile(packed, dynamic=True, fullgraph=True)
    with torch.inference_mode():
        expected = linear(x)
        eager, through_compile = packed(x), compiled(x)
    for out in (eager, through_compile):
        assert out.shape == expected.shape == (*shape[:-1], 96)
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


def test_packing_is_a_setting_that_defaults_on():
    assert parse_config([], env={}).prepack_weights is True
    assert parse_config(["--no-prepack-weights"], env={}).prepack_weights is False
    assert parse_config([], env={"PREPACK_WEIGHTS": "false"}).prepack_weights is False


def test_a_packed_model_in_the_paged_engine_gives_generates_greedy_tokens(tiny_model_dir):
    from engine_helpers import PROMPTS, Collector, build_engine, greedy_request, reference_greedy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    packed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    pack_linears(packed)
    engine = build_engine(packed, tokenizer, backend="paged", ignore_eos=True)
    sinks = [Collector() for _ in PROMPTS]
    for prompt, sink in zip(PROMPTS, sinks):
        engine.submit(greedy_request(tokenizer, prompt, 12), sink)
    while not all(sink.done for sink in sinks):
        engine.run_once()
    for prompt, sink in zip(PROMPTS, sinks):
        assert sink.token_ids == reference_greedy(reference, tokenizer, prompt, 12), prompt
