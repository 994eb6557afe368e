"""What fusing a layer's projections would save: the q/k/v projections as one matmul, and gate/up as one.

Times oneDNN-packed float32 matmuls of a model's shapes at several row counts (the decode batch), the
projections apart as tokenmill runs them and fused, summed over the model's layers. A lever of issue 5
measured before building it.

    python -m bench.fused_linears [--model DIR] [--rows 1 8 32 64]
"""

from __future__ import annotations

import argparse
import time

import torch


def packed_ms(shapes: list[tuple[int, int]], rows: int, repeats: int = 300) -> float:
    """Milliseconds for one pass over float32 matmuls of ``shapes`` (out, in), weights packed for oneDNN."""
    weights = [torch.randn(out, inp).to_mkldnn() for out, inp in shapes]
    x = torch.randn(rows, shapes[0][1])
    linear = torch.ops.mkldnn._linear_pointwise
    for _ in range(20):
        for weight in weights:
            linear(x, weight, None, "none", [], "")
    started = time.perf_counter()
    for _ in range(repeats):
        for weight in weights:
            linear(x, weight, None, "none", [], "")
    return (time.perf_counter() - started) / repeats * 1000


def parser() -> argparse.ArgumentParser:
    """``python -m bench.fused_linears``'s command line."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--model", help="a checkpoint directory (default: SmolLM2-135M-Instruct's shapes)")
    result.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    return result


def main() -> None:
    args = parser().parse_args()
    if args.model:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.model)
        hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        kv = config.num_key_value_heads * head_dim
    else:
        hidden, inter, layers, kv = 576, 1536, 30, 192
    print("| rows | q, k, v apart ms | fused | gate, up apart ms | fused | saved per step ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in args.rows:
        qkv = packed_ms([(hidden, hidden), (kv, hidden), (kv, hidden)], rows) * layers
        qkv_fused = packed_ms([(hidden + 2 * kv, hidden)], rows) * layers
        gate_up = packed_ms([(inter, hidden), (inter, hidden)], rows) * layers
        gate_up_fused = packed_ms([(2 * inter, hidden)], rows) * layers
        saved = qkv - qkv_fused + gate_up - gate_up_fused
        print(f"| {rows} | {qkv:.1f} | {qkv_fused:.1f} | {gate_up:.1f} | {gate_up_fused:.1f} | {saved:.1f} |")


if __name__ == "__main__":
    main()
