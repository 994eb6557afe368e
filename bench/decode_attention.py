"""Decode attention on CPU: tokenmill's native kernel against the plain PyTorch path, side by side.

Times the attention of one decode step over a model's layers (SmolLM2-135M's shapes by default):
``--seqs`` sequences, contexts drawn from ``--context``, their KV blocks handed out by the paged
pool either in order (a fresh pool, or a prompt's blocks taken at once) or shuffled over the pool
(a pool after long churn). Every layer has keys and values of its own, so beyond a few sequences
they come from memory, not cache. Peers in one run:

- ``native``: the kernel the engine calls for decode rows on CPU;
- ``sdpa``: the plain path (``--disable-custom-kernels``): gather each sequence's blocks, then SDPA;
- ``--source FILE``: another version of the kernel's source (an older commit's, say), built apart:
  ``git show REV:core/tokenmill/kernels/csrc/paged_decode.cpp > /tmp/old.cpp``.

    python -m bench.decode_attention [--seqs 1 32] [--source /tmp/old.cpp]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tokenmill.interfaces import PagedStep, padded_block_tables
from tokenmill.kernels import native as native_kernels
from tokenmill_plugins.attention.torch_kernels import SdpaAttention
from tokenmill_plugins.kv.paged import PagedPool

SMOLLM2 = {"layers": 30, "heads": 9, "kv_heads": 3, "head_dim": 64}


def decode_step(layers: int, kv_heads: int, head_dim: int, context_lens: list[int], shuffled: bool,
                block_size: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32) -> PagedStep:
    """One decode step's layout over a pool of ``layers`` layers of random keys and values, as the
    engine builds it: one pool and one block table for every layer."""
    generator = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // block_size) for n in context_lens)
    pool = PagedPool(layers, blocks, block_size, kv_heads, head_dim, dtype, torch.device("cpu"))
    if shuffled:
        free = list(pool.free_list)
        pool.free_list = deque(free[i] for i in torch.randperm(blocks, generator=generator).tolist())
    for seq, length in enumerate(context_lens):
        if not pool.reserve(seq, length):
            raise RuntimeError("the pool is too small for the contexts")
    for cache in pool.keys + pool.values:
        cache[1:].normal_(generator=generator)  # after reserve zeroed them; block 0 stays the pool's zero block
    tables = padded_block_tables(pool, list(range(len(context_lens))))
    return PagedStep(pool=pool, kernel=SdpaAttention(), slot_mapping=torch.zeros(len(context_lens), dtype=torch.long),
                     query_starts=list(range(len(context_lens))), query_lens=[1] * len(context_lens),
                     context_lens=list(context_lens), block_tables=tables, max_context_len=max(context_lens))


def median_ms(run: Callable[[], torch.Tensor], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def peers(step: PagedStep, query: torch.Tensor, source: str | None) -> dict[str, Callable[[], torch.Tensor]]:
    """Each peer as a function running the step's attention over every layer (the last layer's output returned)."""
    scale = query.shape[-1] ** -0.5
    lengths = torch.tensor(step.context_lens)
    layers = list(zip(step.pool.keys, step.pool.values))

    def kernel_of(module: Any) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            for keys, values in layers:
                out = module.paged_decode(query, keys, values, step.block_tables, lengths, 0, scale)
            return out
        return run

    def sdpa() -> torch.Tensor:
        step.scratch.clear()  # the plan is made once per step, as in the engine, and used by every layer
        for keys, values in layers:
            out = step.kernel.paged_attention(query, keys, values, step, scale)
        return out

    found = {}
    module, reason = native_kernels._load()
    if module is None:
        print(f"native kernel unavailable: {reason}")
    else:
        found["native"] = kernel_of(module)
    if source:
        from torch.utils.cpp_extension import load

        name, flags = native_kernels._compiler_flags()
        suffix = re.sub(r"\W", "_", Path(source).stem)  # a module name takes no dots or dashes
        other = load(f"{name}_bench_{suffix}", [source], extra_cflags=flags, extra_ldflags=["-fopenmp"])
        found[Path(source).name] = kernel_of(other)
    step.kernel._native = False  # the plain path, as with --disable-custom-kernels
    found["sdpa"] = sdpa
    return found


def parser() -> argparse.ArgumentParser:
    """``python -m bench.decode_attention``'s command line."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 32])
    result.add_argument("--context", type=int, nargs=2, default=[100, 1500], metavar=("LOW", "HIGH"),
                        help="context lengths drawn uniformly from [LOW, HIGH)")
    result.add_argument("--layout", nargs="+", choices=["in-order", "shuffled"], default=["in-order", "shuffled"])
    result.add_argument("--source",
                        help="another version of core/tokenmill/kernels/csrc/paged_decode.cpp to time beside")
    result.add_argument("--repeats", type=int, default=7)
    result.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="of the KV pool and the queries")
    return result


def main() -> None:
    args = parser().parse_args()
    dtype = getattr(torch, args.dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    print(f"decode attention over {SMOLLM2['layers']} layers, {args.dtype}, {torch.get_num_threads()} threads; "
          f"median ms per step (KV read GB/s)")
    header = None
    for layout in args.layout:
        for seqs in args.seqs:
            generator = torch.Generator().manual_seed(seqs)
            context_lens = torch.randint(args.context[0], args.context[1], (seqs,), generator=generator).tolist()
            step = decode_step(SMOLLM2["layers"], SMOLLM2["kv_heads"], SMOLLM2["head_dim"], context_lens,
                               layout == "shuffled", dtype=dtype)
            query = torch.randn(seqs, SMOLLM2["heads"], SMOLLM2["head_dim"], generator=generator).to(dtype)
            runs = peers(step, query, args.source)
            outputs = {name: run() for name, run in runs.items()}
            reference = outputs["sdpa"]
            for name, out in outputs.items():
                torch.testing.assert_close(out, reference, atol=tolerance, rtol=tolerance,
                                           msg=f"{name} disagrees with sdpa")
            kv_bytes = (2 * sum(context_lens) * SMOLLM2["kv_heads"] * SMOLLM2["head_dim"] * dtype.itemsize
                        * SMOLLM2["layers"])
            times = {name: median_ms(run, args.repeats) for name, run in runs.items()}
            if header is None:
                header = list(times)
                print("| layout | seqs | " + " | ".join(header) + " | sdpa ÷ native |")
                print("| --- | --- | " + " | ".join("---" for _ in header) + " | --- |")
            cells = [f"{times[n]:.1f} ({kv_bytes / times[n] / 1e6:.1f})" for n in header]
            ratio = f"{times['sdpa'] / times['native']:.2f}×" if "native" in times else "-"
            print(f"| {layout} | {seqs} | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    main()
