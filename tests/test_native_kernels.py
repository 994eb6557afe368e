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
@pytest.mark.parametrize("context_lens", [[1, 4, 5, 37, 200, 16], [37]], ids=["batch", "one-sequence"])
def test_decode_attention_over_scattered_blocks_matches_sdpa(dtype, tolerance, window, dim, context_lens):
    """Each dim takes the widest path the build has for it (see paged_decode.cpp's ``path_for``)."""
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


def prefill_reference(query, keys, values, tables, starts, chunks, context_lens, window, scale):
    """Each chunk's queries (its context's last positions) against its whole context, SDPA in float32."""
    out = torch.zeros(query.shape, dtype=torch.float32)
    block_size = keys.shape[1]
    for row, (start, chunk, length) in enumerate(zip(starts, chunks, context_lens)):
        blocks = tables[row, : -(-length // block_size)].long()
        k = keys[blocks].flatten(0, 1)[:length].float().transpose(0, 1)
        v = values[blocks].flatten(0, 1)[:length].float().transpose(0, 1)
        at = torch.arange(length - chunk, length)[:, None]
        visible = torch.arange(length)[None, :] <= at
        if window:
            visible &= torch.arange(length)[None, :] > at - window
        q = query[start:start + chunk].float().transpose(0, 1)
        out[start:start + chunk] = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale,
                                                                  enable_gqa=True).transpose(0, 1)
    return out


def sdpa_over_step(query, keys, values, tables, context_lens, query_lens, scale, window=None, **switches):
    """The SDPA plugin's paged attention over a step of these sequences (their tokens packed in order), with
    its ``_native`` / ``_native_prefill`` switches set as given; returns the output and the step's plans."""
    from types import SimpleNamespace

    from tokenmill.interfaces import PagedStep
    from tokenmill_plugins.attention.torch_kernels import SdpaAttention

    step = PagedStep(pool=SimpleNamespace(block_size=keys.shape[1]), kernel=None,
                     slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long),
                     query_starts=[sum(query_lens[:i]) for i in range(len(query_lens))], query_lens=query_lens,
                     context_lens=context_lens, block_tables=tables, max_context_len=max(context_lens))
    kernel = SdpaAttention()
    for name, value in switches.items():
        setattr(kernel, f"_{name}", value)
    return kernel.paged_attention(query, keys, values, step, scale, window), step.scratch[f"sdpa:{window}"]


prefill_available = pytest.mark.skipif(native_kernels.prefill_unavailable_reason() is not None,
                                       reason=f"no bf16 prefill kernel: {native_kernels.prefill_unavailable_reason()}")


@prefill_available
@pytest.mark.parametrize("dim", [64, 80, 96, 128])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (32, 2)], ids=["gqa-3", "mha", "gqa-16"])
@pytest.mark.parametrize("window", [None, 20])
def test_bf16_prefill_over_scattered_blocks_matches_sdpa_in_float32(dim, heads, kv_heads, window):
    """Chunks with and without a cached prefix before them (context > chunk), of lengths that fill no tile
    evenly, each reading its own scattered blocks; a token of the step that no chunk covers stays as it was."""
    chunks, context_lens = [9, 70, 33, 1], [9, 100, 130, 40]
    keys, values, tables = scattered_pool(context_lens, block_size=16, kv_heads=kv_heads, dim=dim,
                                          dtype=torch.bfloat16)
    starts = [1]
    for chunk in chunks[:-1]:
        starts.append(starts[-1] + chunk)
    query = torch.randn(starts[-1] + chunks[-1] + 1, heads, dim).to(torch.bfloat16)
    out = torch.full_like(query, 7.0)
    native_kernels.paged_prefill(query, keys, values, tables, torch.tensor(starts), torch.tensor(chunks),
                                 torch.tensor(context_lens), window, dim ** -0.5, out)
    expected = prefill_reference(query, keys, values, tables, starts, chunks, context_lens, window, dim ** -0.5)
    torch.testing.assert_close(out[1:-1].float(), expected[1:-1], atol=2e-2, rtol=2e-2)
    assert (out[0] == 7).all() and (out[-1] == 7).all()


@prefill_available
def test_bf16_prefill_takes_query_and_out_as_strided_views():
    """The paged backend's queries are a transposed view of the model's ``[1, heads, tokens, dim]``."""
    keys, values, tables = scattered_pool([50], block_size=16, kv_heads=2, dim=64, dtype=torch.bfloat16)
    query = torch.randn(1, 6, 50, 64).to(torch.bfloat16)[0].transpose(0, 1)
    out = torch.empty(6, 50, 64, dtype=torch.bfloat16).transpose(0, 1)
    native_kernels.paged_prefill(query, keys, values, tables, torch.tensor([0]), torch.tensor([50]),
                                 torch.tensor([50]), None, 0.125, out)
    expected = prefill_reference(query, keys, values, tables, [0], [50], [50], None, 0.125)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@prefill_available
def test_bf16_prefill_refuses_what_it_cannot_read():
    keys, values, tables = scattered_pool([8], block_size=4, kv_heads=1, dim=16, dtype=torch.bfloat16)
    query = torch.randn(8, 1, 16).to(torch.bfloat16)
    arguments = (torch.tensor([0]), torch.tensor([8]))
    with pytest.raises(RuntimeError, match="longer than its block table"):
        native_kernels.paged_prefill(query, keys, values, tables, *arguments, torch.tensor([9]), None, 1.0,
                                     torch.empty_like(query))
    with pytest.raises(RuntimeError, match="bfloat16"):
        native_kernels.paged_prefill(query.float(), keys, values, tables, *arguments, torch.tensor([8]), None, 1.0,
                                     torch.empty_like(query.float()))


@prefill_available
@pytest.mark.parametrize("window", [None, 12])
def test_a_bf16_step_of_prompt_chunks_and_decode_rows_attends_as_the_gather_path_does(window):
    """The SDPA plugin sends a step's bfloat16 prompt chunks (a whole prompt, a chunk after a cached prefix)
    to the prefill kernel in one call and its decode rows to the decode kernel, and gets what gathering
    the blocks for SDPA gets."""
    context_lens, query_lens = [40, 1, 90, 31], [40, 1, 25, 3]
    keys, values, tables = scattered_pool(context_lens, 16, kv_heads=3, dim=64, dtype=torch.bfloat16)
    query = torch.randn(1, 9, sum(query_lens), 64).to(torch.bfloat16)[0].transpose(0, 1)  # the backend's view
    outputs = []
    for native_prefill in (True, False):
        out, plans = sdpa_over_step(query, keys, values, tables, context_lens, query_lens, 0.125, window,
                                    native_prefill=native_prefill)
        outputs.append(out.float())
        assert sum(bool(plan.get("prefill")) for plan in plans) == (1 if native_prefill else 0)
    torch.testing.assert_close(outputs[0], outputs[1], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_each_token_into_its_slot_as_index_copy_does(dtype):
    """Keys and values arrive as the model makes them, ``[1, kv_heads, tokens, dim]`` (here a transposed view)."""
    keys, values, _ = scattered_pool([20], block_size=4, kv_heads=2, dim=16, dtype=dtype)
    key = torch.randn(1, 5, 2, 16).to(dtype).transpose(1, 2)
    value = torch.randn(1, 2, 5, 16).to(dtype)
    slots = torch.tensor([7, 0, 13, 21, 2])
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys.view(-1, 2, 16).index_copy_(0, slots, key[0].transpose(0, 1))
    expected_values.view(-1, 2, 16).index_copy_(0, slots, value[0].transpose(0, 1))
    native_kernels.store_kv(key, value, keys, values, slots)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)


def test_store_kv_refuses_a_slot_outside_the_caches_and_another_dtype():
    keys, values, _ = scattered_pool([8], block_size=4, kv_heads=1, dim=8, dtype=torch.float32)
    before = keys.clone(), values.clone()
    key = torch.randn(1, 1, 2, 8)
    with pytest.raises(RuntimeError, match="outside the caches"):
        native_kernels.store_kv(key, key, keys, values, torch.tensor([0, keys.shape[0] * 4]))
    with pytest.raises(RuntimeError, match="one dtype"):
        native_kernels.store_kv(key.to(torch.bfloat16), key.to(torch.bfloat16), keys, values, torch.tensor([0, 1]))
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1]), "nothing was written"
