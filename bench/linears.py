"""The matmuls of a whole forward in bfloat16: oneDNN's packed kernel against tokenmill's blocked kernel.

Every linear layer of the model (each its own weight, as a step reads them: nothing stays in cache from
one layer to the next) at each row count, the two kernels alternating round by round; the median round
of each, and tokenmill's speed-up. At a decode step's few rows the time is the weights' bytes over the
memory's read rate, shown as GB/s.

    python -m bench.linears [--model DIR] [--rows 1 8 32 64 256 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def model_shapes(model: str | None, layers: int | None = None) -> list[tuple[int, int]]:
    """(out, in) of every linear layer of ``model``'s forward (default: SmolLM2-135M's), the LM head last."""
    if model:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
        hidden, inter, count = config.hidden_size, config.intermediate_size, config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        kv, heads, vocab = config.num_key_value_heads * head_dim, config.num_attention_heads * head_dim, \
            config.vocab_size
    else:
        hidden, inter, count, kv, heads, vocab = 576, 1536, 30, 192, 576, 49152
    layer = [(heads, hidden), (kv, hidden), (kv, hidden), (hidden, heads), (inter, hidden), (inter, hidden),
             (hidden, inter)]
    return [shape for _ in range(layers or count) for shape in layer] + [(vocab, hidden)]


def sweep(weights: list[torch.Tensor], shapes: list[tuple[int, int]], inputs: dict[int, torch.Tensor],
          call: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]) -> float:
    """Milliseconds for one pass of ``call`` (input, weight, out features) over every weight."""
    started = time.perf_counter()
    for weight, (out_features, in_features) in zip(weights, shapes):
        call(inputs[in_features], weight, out_features)
    return (time.perf_counter() - started) * 1000


def parser() -> argparse.ArgumentParser:
    """``python -m bench.linears``'s command line."""
    result = argparse.ArgumentParser(prog="python -m bench.linears", description=__doc__.splitlines()[0])
    result.add_argument("--model", help="a checkpoint directory (default: SmolLM2-135M-Instruct's shapes)")
    result.add_argument("--layers", type=int, help="only this many decoder layers (default: all)")
    result.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256, 1024])
    result.add_argument("--rounds", type=int, default=5)
    return result


def main(argv: list[str] | None = None) -> None:
    from tokenmill.kernels import native

    args = parser().parse_args(argv)
    unavailable = native.linear_unavailable_reason()
    if unavailable:
        raise SystemExit(f"tokenmill's bfloat16 linear kernel is unavailable: {unavailable}")
    shapes = model_shapes(args.model, args.layers)
    dense = [torch.randn(rows, columns).to(torch.bfloat16) for rows, columns in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(weight, None) for weight in dense]
    blocked = [native.block_weight(weight) for weight in dense]
    del dense
    weight_bytes = sum(rows * columns * 2 for rows, columns in shapes)

    def onednn_call(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")

    print(f"{len(shapes)} linear layers, {weight_bytes / 1e6:.0f} MB of bfloat16 weights, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} rounds")
    print("| rows | oneDNN ms | tokenmill ms | speed-up | oneDNN GB/s | tokenmill GB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in args.rows:
        inputs = {width: torch.randn(rows, width).to(torch.bfloat16) for width in {w for _, w in shapes}}
        sweep(onednn, shapes, inputs, onednn_call)  # warm-up: primitives created, pages touched
        sweep(blocked, shapes, inputs, native.blocked_linear)
        times: dict[str, list[float]] = {"onednn": [], "blocked": []}
        for _ in range(args.rounds):
            times["onednn"].append(sweep(onednn, shapes, inputs, onednn_call))
            times["blocked"].append(sweep(blocked, shapes, inputs, native.blocked_linear))
        ours, theirs = statistics.median(times["blocked"]), statistics.median(times["onednn"])
        print(f"| {rows} | {theirs:.1f} | {ours:.1f} | {theirs / ours:.2f}× | {weight_bytes / theirs / 1e6:.1f} | "
              f"{weight_bytes / ours / 1e6:.1f} |")


if __name__ == "__main__":
    main()
