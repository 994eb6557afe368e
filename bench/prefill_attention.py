"""Prefill attention on CPU in bfloat16: tokenmill's native flash-attention kernel against the SDPA path, side by side.

Times one layer's attention for a step of prompt chunks (SmolLM2-135M's shapes by default), through the
SDPA plugin as the engine calls it: ``native`` sends every chunk to the prefill kernel, which reads the
blocks in place; ``sdpa`` is the path without it (gather each chunk's blocks, then SDPA's CPU flash
attention, which computes in float32). Cases: whole prompts, and chunks after a cached prefix (a later
turn of a conversation). GFLOP/s counts the causal half only.

    python -m bench.prefill_attention [--head-dim 64 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Callable

import torch

from bench.decode_attention import median_ms
from tokenmill.interfaces import PagedStep, padded_block_tables
from tokenmill.kernels import native as native_kernels
from tokenmill_plugins.attention.torch_kernels import SdpaAttention
from tokenmill_plugins.kv.paged import PagedPool

CASES = {
    "1 prompt of 2048": [(2048, 2048)],
    "1 prompt of 512": [(512, 512)],
    "4 prompts of 512": [(512, 512)] * 4,
    "256 after 1024 cached": [(256, 1280)],
    "512 after 3072 cached": [(512, 3584)],
}
"""Each case's chunks as (query tokens, context after the step)."""


def prefill_step(chunks: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int,
                 block_size: int = 16) -> tuple[PagedStep, torch.Tensor]:
    """A step of prompt chunks over one layer of random bfloat16 keys and values, blocks shuffled over the pool."""
    generator = torch.Generator().manual_seed(0)
    contexts = [context for _, context in chunks]
    blocks = sum(-(-n // block_size) for n in contexts)
    pool = PagedPool(1, blocks, block_size, kv_heads, head_dim, torch.bfloat16, torch.device("cpu"))
    pool.free_list = deque(list(pool.free_list)[i] for i in torch.randperm(blocks, generator=generator).tolist())
    for seq, length in enumerate(contexts):
        if not pool.reserve(seq, length):
            raise RuntimeError("the pool is too small for the contexts")
    for cache in pool.keys + pool.values:
        cache[1:].normal_(generator=generator)
    lengths = [tokens for tokens, _ in chunks]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    step = PagedStep(pool=pool, kernel=SdpaAttention(), slot_mapping=torch.zeros(sum(lengths), dtype=torch.long),
                     query_starts=starts, query_lens=lengths, context_lens=contexts,
                     block_tables=padded_block_tables(pool, list(range(len(chunks)))), max_context_len=max(contexts))
    query = torch.randn(sum(lengths), heads, head_dim, generator=generator).to(torch.bfloat16)
    return step, query


def attention_of(step: PagedStep, query: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The step's attention as the engine runs it, its plan made afresh each time (once per step in the engine)."""
    keys, values = step.pool.layer(0)

    def run() -> torch.Tensor:
        step.scratch.clear()
        return step.kernel.paged_attention(query, keys, values, step, query.shape[-1] ** -0.5)
    return run


def causal_gflop(chunks: list[tuple[int, int]], heads: int, head_dim: int) -> float:
    """Multiply-adds of both products, each counted as two operations, for the visible pairs only."""
    pairs = sum(tokens * (context - tokens) + tokens * (tokens + 1) / 2 for tokens, context in chunks)
    return 4 * heads * head_dim * pairs / 1e9


def parser() -> argparse.ArgumentParser:
    """``python -m bench.prefill_attention``'s command line."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--heads", type=int, default=9)
    result.add_argument("--kv-heads", type=int, default=3)
    result.add_argument("--head-dim", type=int, nargs="+", default=[64])
    result.add_argument("--repeats", type=int, default=5)
    return result


def main() -> None:
    args = parser().parse_args()
    reason = native_kernels.prefill_unavailable_reason()
    if reason:
        raise SystemExit(f"the native prefill kernel is unavailable here: {reason}")
    print(f"prefill attention, one layer, bfloat16, {args.heads} heads / {args.kv_heads} KV heads, "
          f"{torch.get_num_threads()} threads; median ms (GFLOP/s)")
    print(f"{'case':<24} {'dim':>4} {'native':>16} {'sdpa':>16} {'sdpa / native':>14}")
    for head_dim in args.head_dim:
        for name, chunks in CASES.items():
            step, query = prefill_step(chunks, args.heads, args.kv_heads, head_dim)
            times, outputs = {}, {}
            for peer in ("native", "sdpa"):
                step.kernel._native_prefill = peer == "native"
                run = attention_of(step, query)
                outputs[peer] = run()
                times[peer] = median_ms(run, args.repeats)
            torch.testing.assert_close(outputs["native"].float(), outputs["sdpa"].float(), atol=3e-2, rtol=3e-2)
            gflop = causal_gflop(chunks, args.heads, head_dim)
            cells = [f"{times[p]:8.2f} ({gflop / times[p] * 1000:4.0f})" for p in ("native", "sdpa")]
            print(f"{name:<24} {head_dim:>4} {cells[0]:>16} {cells[1]:>16} {times['sdpa'] / times['native']:13.2f}×")


if __name__ == "__main__":
    main()
