"""Building an engine on a loaded model without the HTTP server, for engine-level tests."""

from __future__ import annotations

import time
from typing import Any

import pluggy
import torch

from tokenmill.engine import Engine, eos_token_ids
from tokenmill.engine.sequence import Event, GenerationRequest, SamplingParams, TokenEvent
from tokenmill.interfaces import BatchLimits
from tokenmill.plugin_manager import build_plugin_manager, choose_all

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "In 1492, Columbus",
    "def fibonacci(n):\n    return",
    "Paris is the capital of",
    "A",
    "Once upon a time, in a land far far away, there lived a king who had three daughters",
    "1, 2, 3, 4,",
]


def reference_greedy(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int,
                     eos_token_id: int | None = None) -> list[int]:
    """The tokens ``model.generate()`` picks greedily for ``prompt`` alone."""
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2,
                             eos_token_id=eos_token_id)
    return out[0, ids["input_ids"].shape[1]:].tolist()


def tiny_mistral(sliding_window: int = 6):
    """A tiny random Mistral whose sliding window is shorter than the test prompts."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=sliding_window,
                           initializer_range=0.3, tie_word_embeddings=True, pad_token_id=2, eos_token_id=2)
    return MistralForCausalLM(config).eval()


def build_engine(model: Any, tokenizer: Any, pm: pluggy.PluginManager | None = None, ignore_eos: bool = False,
                 backend: str = "transformers", block_size: int = 16, scheduler: str = "fifo",
                 prefix_caching: bool = False, **limits: Any) -> Engine:
    """An engine on the built-in plugins; ``ignore_eos`` runs every request to max_new_tokens;
    ``prefix_caching`` turns the paged runner's prefix cache on (the server's default).

    The paged backend takes over the model's attention: give it a model of its own."""
    pm = pm or build_plugin_manager(autoload=False)
    chosen = choose_all(pm, backend, None, None, scheduler, block_size)
    paged = chosen.backend.kv_layout == "paged"
    total = limits.get("max_batch_total_tokens", 65536)
    prefill = limits.get("max_batch_prefill_tokens", 4096)
    rules = {name: limits[name] for name in ("waiting_served_ratio", "max_waiting_tokens") if name in limits}
    batch_limits = BatchLimits(max_batch_prefill_tokens=prefill, max_batch_total_tokens=total,
                               max_batch_size=limits.get("max_batch_size"), padded=not paged, **rules)
    store = chosen.kv_allocator.create(model.config, model.dtype, model.device, total, chosen.block_size)
    runner = chosen.backend.create(model, store, chosen.attention)
    if prefix_caching:
        runner.enable_prefix_caching()
    eos = set() if ignore_eos else eos_token_ids(model, tokenizer)
    return Engine(runner, chosen.scheduler.create(batch_limits), tokenizer, eos, prefill, pm,
                  stream_buffer_tokens=limits.get("stream_buffer_tokens", 64))


def greedy_request(tokenizer: Any, prompt: str, max_new_tokens: int, **extra: Any) -> GenerationRequest:
    ids = tokenizer(prompt)["input_ids"]
    return GenerationRequest(prompt, ids, max_new_tokens, extra.pop("sampling", SamplingParams()), **extra)


class Collector:
    """An event sink that keeps everything a sequence emitted."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    @property
    def token_ids(self) -> list[int]:
        return [e.token.id for e in self.events if isinstance(e, TokenEvent)]

    @property
    def final(self):
        for event in self.events:
            if isinstance(event, TokenEvent) and event.final is not None:
                return event.final
        return None

    @property
    def done(self) -> bool:
        return self.final is not None or any(not isinstance(e, TokenEvent) for e in self.events)


def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    """Poll ``predicate`` (an engine running in its own thread) until it holds, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
