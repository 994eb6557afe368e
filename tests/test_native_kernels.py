"""tokenmill's native CPU decode kernel computes what SDPA computes over the same blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import native as native_kernels

pytestmark = pytest.mark.skipif(native_kernels.native_unavailable_reason() is not None,
                                reason=f"native kernels unavailable: {native_kernels.native_unavailable_reason()}")


def scattered_pool(context_lens: list[int], block_size: int, kv_heads: int, dim: int, dtype: torch.dtype):
    """Caches with each sequence's blocks scattered over the pool, and its block table."""
    generator = torch.Generator().manual_seed(0)
    widths = [-(-n // block_size) for n in context_lens]
    blocks = sum(widths) + 1
    order = (torch.randperm(blocks - 1, generator=generator) + 1).tolist()
    tables = torch.zeros(len(context_lens), max(widths), dtype=torch.int32)
    for row, width in enumerate(widths):
        tables[row, :width] = torch.tensor([order.pop() for _ in range(width)], dtype=torch.int32)
    shape = (blocks, block_size, kv_heads, dim)
    keys = torch.randn(shape, generator=generator).to(dtype)
    values = torch.randn(shape, generator=generator).to(dtype)
    return keys, values, tables


def sdpa_reference(query, keys, values, tables, context_lens, window, scale):
    out = []
    block_size = keys.shape[1]
    for row, length in enumerate(context_lens):
        blocks = tables[row, : -(-length // block_size)].long()
        k = keys[blocks].flatten(0, 1)[:length].float()
        v = values[blocks].flatten(0, 1)[:length].float()
        if window:
            k, v = k[-window:], v[-window:]
        attended = F.scaled_dot_product_attention(query[row].float()[:, None], k.transpose(0, 1), v.transpose(0, 1),
                                                  scale=scale, enable_gqa=True)
        out.append(attended[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3),
                                              (torch.float64, 1e-5)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dim", [64, 16, 8, 12], ids=["bf16-pair-dim", "sixteen-lane-dim", "eight-lane-dim",
                                                     "other-dim"])
def test_decode_attention_over_scattered_blocks_matches_sdpa(dtype, tolerance, window, dim):
    """Each dim takes the widest path the build has for it (see paged_decode.cpp's ``path_for``)."""
    context_lens = [1, 4, 5, 37, 200, 16]
    keys, values, tables = scattered_pool(context_lens, block_size=4, kv_heads=2, dim=dim, dtype=dtype)
    query = torch.randn(len(context_lens), 6, dim).to(dtype)
    got = native_kernels.paged_decode(query, keys, values, tables, torch.tensor(context_lens), window, 0.25)
    expected = sdpa_reference(query, keys, values, tables, context_lens, window, 0.25)
    assert got.dtype == dtype and got.shape == query.shape
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


def test_scores_far_apart_still_match_sdpa():
    """Scores that differ by far more than 87 (where the vectorised exp stops) weigh nothing, as in SDPA."""
    context_lens = [3, 50]
    keys, values, tables = scattered_pool(context_lens, block_size=4, kv_heads=1, dim=16, dtype=torch.float32)
    query = torch.randn(2, 2, 16) * 40
    got = native_kernels.paged_decode(query, keys, values, tables, torch.tensor(context_lens), None, 1.0)
    torch.testing.assert_close(got, sdpa_reference(query, keys, values, tables, context_lens, None, 1.0))


@pytest.mark.parametrize("dim", [16, 12], ids=["eight-lane-dim", "other-dim"])
def test_a_nan_in_the_keys_gives_nan_for_the_heads_that_read_it_and_no_others(dim):
    context_lens = [9, 9]
    keys, values, tables = scattered_pool(context_lens, block_size=4, kv_heads=2, dim=dim, dtype=torch.float32)
    keys[tables[0, 1], 2, 1, 0] = float("nan")  # sequence 0, position 6, KV head 1
    got = native_kernels.paged_decode(torch.randn(2, 4, dim), keys, values, tables, torch.tensor(context_lens), None,
                                      0.25)
    assert got[0, 2:].isnan().all() and not got[0, :2].isnan().any() and not got[1].isnan().any()


def test_the_kernel_refuses_a_block_table_that_names_a_block_outside_the_caches():
    keys, values, tables = scattered_pool([8], block_size=4, kv_heads=1, dim=8, dtype=torch.float32)
    tables[0, 1] = keys.shape[0]
    with pytest.raises(RuntimeError, match="outside the caches"):
        native_kernels.paged_decode(torch.randn(1, 1, 8), keys, values, tables, torch.tensor([8]), None, 1.0)


def test_the_kernel_refuses_a_context_longer_than_its_block_table():
    keys, values, tables = scattered_pool([8], block_size=4, kv_heads=1, dim=8, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        native_kernels.paged_decode(torch.randn(1, 1, 8), keys, values, tables, torch.tensor([9]), None, 1.0)


def test_turning_native_kernels_off_gives_the_reason(monkeypatch):
    native_kernels._load.cache_clear()
    monkeypatch.setenv("TOKENMILL_NATIVE_KERNELS", "0")
    try:
        assert "TOKENMILL_NATIVE_KERNELS" in native_kernels.native_unavailable_reason()
        with pytest.raises(RuntimeError, match="unavailable"):
            native_kernels.paged_decode(torch.randn(1, 1, 8), *scattered_pool([4], 4, 1, 8, torch.float32),
                                        torch.tensor([4]), None, 1.0)
    finally:
        native_kernels._load.cache_clear()


def test_disable_custom_kernels_turns_them_off_with_the_flag_named(monkeypatch):
    from tokenmill.config import parse_config

    assert parse_config(["--disable-custom-kernels"], env={}).disable_custom_kernels is True
    monkeypatch.setattr(native_kernels, "_turned_off", None)
    native_kernels.turn_off("--disable-custom-kernels")
    assert native_kernels.native_unavailable_reason() == "turned off by --disable-custom-kernels"
