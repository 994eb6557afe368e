"""Float32 and bfloat16 linear layers packed for oneDNN, or blocked for tokenmill's bfloat16 kernel, on CPU
compute what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.config import parse_config
from tokenmill.kernels import native
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


blocked_kernel = pytest.mark.skipif(native.linear_unavailable_reason() is not None,
                                    reason=f"no bfloat16 linear kernel: {native.linear_unavailable_reason()}")


@blocked_kernel
@pytest.mark.parametrize("features", [(64, 96), (576, 49152), (30, 7), (1536, 576)],
                         ids=["whole-blocks", "lm-head", "partial-block", "down-projection"])
@pytest.mark.parametrize("bias", [True, False])
def test_the_bfloat16_kernel_computes_what_a_float32_linear_computes_at_every_row_count(features, bias):
    """Rows 1 to 13 take every remainder of the kernel's 6-row tasks; 0 rows give an empty result."""
    torch.manual_seed(0)
    in_features, out_features = features
    linear = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear)
    assert packed.blocked and "blocked" in repr(packed)
    for rows in range(14):
        x = torch.randn(rows, in_features, dtype=torch.bfloat16)
        with torch.inference_mode():
            expected = nn.functional.linear(x.float(), linear.weight.float(),
                                            linear.bias.float() if bias else None)
            got = packed(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


@blocked_kernel
def test_the_bfloat16_kernel_takes_three_dimensional_inputs_eagerly_and_compiled():
    torch.manual_seed(0)
    linear = nn.Linear(64, 100).to(torch.bfloat16)
    packed = PackedLinear(linear)
    compiled = torch.compile(packed, dynamic=True, fullgraph=True)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = linear(x)
        for out in (packed(x), compiled(x), compiled(x[:1])):
            torch.testing.assert_close(out, expected[: out.shape[0]], rtol=2e-2, atol=2e-2)


@blocked_kernel
def test_a_bfloat16_model_s_lm_head_gives_float32_logits_that_keep_their_order(tiny_model_dir):
    """bfloat16 rounds logits near 25 to steps of 0.125: two close candidates would tie, and greedy take the
    lower id whatever their order was."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    reference = model.lm_head.weight.detach().float().clone()
    pack_linears(model)
    assert model.lm_head.float_output and not model.model.layers[0].mlp.up_proj.float_output
    hidden = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():
        logits = model.lm_head(hidden)
        assert model(input_ids=torch.tensor([[1, 400, 2000]])).logits.dtype == torch.float32
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ reference.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bfloat16 matmul here")
def test_an_odd_number_of_input_features_keeps_the_onednn_layout():
    assert not PackedLinear(nn.Linear(63, 8).to(torch.bfloat16)).blocked
    assert not PackedLinear(nn.Linear(64, 8)).blocked  # float32 is packed for oneDNN


def test_the_blocked_layout_pairs_input_features_within_blocks_of_sixteen_outputs():
    weight = torch.arange(20 * 6, dtype=torch.float32).view(20, 6).to(torch.bfloat16)
    blocked = native.block_weight(weight)
    assert blocked.shape == (2, 3, 16, 2)
    assert blocked[1, 2, 3].tolist() == weight[16 + 3, 4:6].tolist()
    assert blocked[1, :, 4:].abs().sum() == 0  # outputs 20..31 are padding


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
