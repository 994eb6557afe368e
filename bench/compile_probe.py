"""What ``torch.compile`` would save in a decode step: the layers' work around attention, eager against compiled.

Runs SmolLM2's 30 decoder layers on ``rows`` single-token sequences (the decode batch) with
everything a step does there except attention itself: norms, the q/k/v/o and MLP projections
(on oneDNN-packed weights as tokenmill loads them, frozen as constants when compiled), rotary,
residual adds, the final norm and the LM head. Once eagerly and once compiled by inductor for
that exact shape. Attention is left out: the compiled engine calls it as one opaque operator. A
lever of issue 5, measured before building it (the engine compiles one graph for every step size
instead, see ``--compile-model``).

    python -m bench.compile_probe [--rows 1 8 32 64]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch


def around_attention(model: Any) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """One decode step's non-attention work over every layer; the attention output is stood in by the
    query plus the keys and values."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inner = model.model

    def step(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for layer in inner.layers:
            attn = layer.self_attn
            residual = hidden
            normed = layer.input_layernorm(hidden)
            shape = (*normed.shape[:-1], -1, attn.head_dim)
            query = attn.q_proj(normed).view(shape).transpose(1, 2)
            key = attn.k_proj(normed).view(shape).transpose(1, 2)
            value = attn.v_proj(normed).view(shape).transpose(1, 2)
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
            # Keys and values enter the result, so that the compiled graph cannot drop their projections.
            stand_in = query + (key + value).repeat_interleave(query.shape[1] // key.shape[1], dim=1)
            hidden = residual + attn.o_proj(stand_in.transpose(1, 2).reshape(*normed.shape[:-1], -1))
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        return model.lm_head(inner.norm(hidden)).argmax(-1)

    return step


def step_ms(step: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], repeats: int) -> float:
    for _ in range(3):
        step(*args)
    started = time.perf_counter()
    for _ in range(repeats):
        step(*args)
    return (time.perf_counter() - started) / repeats * 1000


def parser() -> argparse.ArgumentParser:
    """``python -m bench.compile_probe``'s command line."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    result.add_argument("--repeats", type=int, default=30)
    return result


@torch.inference_mode()
def main() -> None:
    args = parser().parse_args()
    from transformers import AutoModelForCausalLM

    from tokenmill.model.cpu_linears import pack_linears
    from tokenmill.model.loading import converted_gguf, default_gguf

    checkpoint = converted_gguf(default_gguf())
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    pack_linears(model)
    eager = around_attention(model)
    print("| rows | eager ms | compiled ms | compile s | saved per step ms |")
    print("| --- | --- | --- | --- | --- |")
    for rows in args.rows:
        hidden = torch.randn(1, rows, model.config.hidden_size)
        positions = torch.arange(100, 100 + rows)[None]
        cos, sin = model.model.rotary_emb(hidden, positions)
        eager_ms = step_ms(eager, (hidden, cos, sin), args.repeats)
        compiled = torch.compile(around_attention(model), dynamic=False)
        with torch._inductor.config.patch(freezing=True):  # as the paged runner compiles it
            started = time.perf_counter()
            compiled(hidden, cos, sin)
            compile_s = time.perf_counter() - started
            compiled_ms = step_ms(compiled, (hidden, cos, sin), args.repeats)
        print(f"| {rows} | {eager_ms:.1f} | {compiled_ms:.1f} | {compile_s:.0f} | {eager_ms - compiled_ms:.1f} |")


if __name__ == "__main__":
    main()
