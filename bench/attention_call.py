"""What one layer's paged attention costs at small batches, call and all: the backend's ``_attend`` (this step's
keys and values into the pool, then the attention kernel plugin over the blocks), as a decode step calls it once
per layer. At batch 1 the call's dispatch (views, copies, plan lookups) weighs as much as the arithmetic.

Run it in another checkout to compare (``PYTHONPATH=OTHER/core:OTHER/plugins python -m bench.attention_call``
from this one's root times the other's backend with this file).

    python -m bench.attention_call [--batch 1 8] [--context 160] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from bench.decode_attention import decode_step, median_ms
from tokenmill_plugins.backends.paged.attention import _attend

SMOLLM2 = {"heads": 9, "kv_heads": 3, "head_dim": 64}


def layer_calls(batch: int, context: int, dtype: torch.dtype, calls: int) -> Callable[[], None]:
    """``calls`` calls of layer 0's attention for a decode step of ``batch`` sequences of ``context`` positions."""
    step = decode_step(1, SMOLLM2["kv_heads"], SMOLLM2["head_dim"], [context] * batch, False, dtype=dtype)
    step.slot_mapping = step.block_tables[:, (context - 1) // 16].long() * 16 + (context - 1) % 16
    query = torch.randn(1, SMOLLM2["heads"], batch, SMOLLM2["head_dim"]).to(dtype)
    key = torch.randn(1, SMOLLM2["kv_heads"], batch, SMOLLM2["head_dim"]).to(dtype)
    scale = SMOLLM2["head_dim"] ** -0.5

    def run() -> None:
        for _ in range(calls):
            _attend(step, 0, query, key, key, scale, None)
    return run


def parser() -> argparse.ArgumentParser:
    """``python -m bench.attention_call``'s command line."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    result.add_argument("--context", type=int, default=160)
    result.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    result.add_argument("--calls", type=int, default=2000)
    return result


def main() -> None:
    args = parser().parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"one layer's paged attention call, {args.dtype}, context {args.context}, {torch.get_num_threads()} threads")
    for batch in args.batch:
        with torch.inference_mode():
            per_call = median_ms(layer_calls(batch, args.context, dtype, args.calls), 5) / args.calls * 1000
        print(f"batch {batch:>3}: {per_call:6.1f} µs a layer")


if __name__ == "__main__":
    main()
