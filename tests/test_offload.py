"""While the server sleeps its weights are put out of memory in place (:mod:`tokenmill.model.offload`): resident
memory falls by about their size, the forward reads them back from the file and computes what it did before,
and a later sleep drops them again without writing them twice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tokenmill.model.offload import MIN_BYTES, WeightFile, model_tensors

MIB = 1 << 20


def rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.fixture
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32768, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, initializer_range=0.3)
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def logits(model: LlamaForCausalLM) -> torch.Tensor:
    return model(torch.arange(100, 132).unsqueeze(0)).logits


def test_the_weights_leave_memory_and_come_back_as_the_forward_reads_them(model, tmp_path: Path):
    before = logits(model)
    weights = sum(tensor.nbytes for tensor in model_tensors(model))
    assert weights > 64 * MIB
    file = WeightFile(tmp_path)
    resident = rss()
    released = file.put_away(model)
    assert released > weights - 64 * 4096 and resident - rss() > released * 0.8
    assert torch.equal(logits(model), before)
    assert file.put_away(model) == released and file.size == released, "dropped again, not written again"
    assert torch.equal(logits(model), before)
    assert list(tmp_path.iterdir()) == [], "the file is unlinked: nothing is left behind"
    file.close()


def test_a_weight_replaced_after_a_sleep_is_written_anew_never_brought_back_stale(model, tmp_path: Path):
    file = WeightFile(tmp_path)
    file.put_away(model)
    head = model.get_input_embeddings()
    shape = head.weight.shape
    head.weight = torch.nn.Parameter(torch.empty(0))
    head.weight = torch.nn.Parameter(torch.randn(shape))
    expected = logits(model)
    file.put_away(model)
    assert torch.equal(logits(model), expected)
    file.close()


def test_once_closed_the_tensors_memory_is_the_allocators_again_with_their_bytes(model, tmp_path: Path):
    before = logits(model)
    file = WeightFile(tmp_path)
    file.put_away(model)
    assert any("weights-" in line for line in Path("/proc/self/maps").read_text().splitlines())
    file.close()
    assert not any("weights-" in line for line in Path("/proc/self/maps").read_text().splitlines())
    assert torch.equal(logits(model), before)


def test_large_dense_weights_go_small_tensors_and_opaque_layouts_stay(model):
    model.model.norm.register_buffer("packed", torch.zeros(4 * MIB).to_mkldnn(), persistent=False)
    chosen = list(model_tensors(model))
    assert any(tensor is model.get_input_embeddings().weight for tensor in chosen)
    assert all(tensor.nbytes >= MIN_BYTES and tensor.layout == torch.strided for tensor in chosen)
