"""From a configuration to a warmed-up engine, stage by stage: plugins, model, KV memory, limits.

Runs in the loader thread while the HTTP server already answers /health (503).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pluggy
import torch

from tokenmill.config import Config
from tokenmill.engine import Engine, eos_ids_of, eos_token_ids
from tokenmill.engine.scheduling import Admission
from tokenmill.engine.sequence import ErrorEvent, Event, GenerationRequest, Sequence, TokenEvent
from tokenmill.engine.speculation import STEP_TOKENS, FixedDrafts, Speculator
from tokenmill.interfaces import BatchLimits, EngineSetup
from tokenmill.kernels import native as native_kernels
from tokenmill.model import kv_memory, sharding
from tokenmill.model.adapters import AdapterCache, load_adapters
from tokenmill.model.compile import Compiler, use_compile_cache_dir
from tokenmill.model.cpu_linears import pack_linears, packed_layout, packing_unavailable_reason
from tokenmill.model.dtypes import checkpoint_choice
from tokenmill.model.loading import (
    LoadedModel,
    ModelLoadError,
    Stages,
    generation_eos,
    load_model,
    pick_device,
    resolve_checkpoint,
)
from tokenmill.model.quantization import choose_quantizer
from tokenmill.plugin_manager import AUTO_BACKENDS, Chosen, PluginError, choose_all
from tokenmill.sampling import SamplingParams

log = logging.getLogger(__name__)

PREFIX_CACHING_TURNED_OFF = "turned off (--no-prefix-caching or PREFIX_CACHING=0)"


@dataclass
class Started:
    engine: Engine
    loaded: LoadedModel
    chosen: Chosen
    vocab_size: int
    """Rows of the model's input embeddings: token ids must stay below it."""
    config: Config
    """The config it started with, its limits settled for this model and backend."""
    adapters: AdapterCache | None = None
    """The LoRA adapters, when the server serves them."""
    prefix_caching_off: str | None = None
    """Why prompts' computed prefixes are not reused, or None when they are."""
    compiler: Compiler | None = None
    """Which forward the steps take; its ``start()``, once the engine serves, begins a compile in the
    background where one is due. None for a backend with its own engine."""


def start_engine(config: Config, pm: pluggy.PluginManager, stages: Stages,
                 on_chosen: Callable[[Chosen], None] | None = None) -> Started:
    """Choose the plugins, load the model, size KV memory, resolve the limits and warm up.
    The engine is returned ready but not started."""
    kv_memory.bound_native_caches()
    use_compile_cache_dir()
    if config.disable_custom_kernels:
        native_kernels.turn_off("--disable-custom-kernels")
    chosen = choose_all(pm, config.backend, config.attention, config.kv_allocator, config.scheduler,
                        config.block_size)
    if chosen.attention is None:
        if on_chosen:
            on_chosen(chosen)
        return start_owned_engine(config, pm, stages, chosen)
    # A paged backend routes attention itself once it runs; until then the model loads with sdpa.
    attention = chosen.attention.transformers_name or "sdpa"  # type: ignore[attr-defined]
    sharded = config.num_shard > 1
    if sharded:
        loaded = sharding.load_rank0_model(config, stages, attention)
    else:
        loaded = load_model(config.model_id, config.revision, config.dtype, attention, config.trust_remote_code,
                            stages, pick_quantizer=lambda path: choose_quantizer(pm, config.quantize, path),
                            hub_cache=hub_cache(config))
    chosen = fit_backend(pm, config, chosen, loaded.model)
    unavailable = settings_unavailable_reason(config, chosen, loaded.device.type)
    if unavailable:
        raise ModelLoadError(unavailable)
    if on_chosen:
        on_chosen(chosen)
    if config.prepack_weights and packing_unavailable_reason(loaded.model) is None:
        packed = stages.run("packing weights", lambda: pack_linears(loaded.model),
                            detail=packed_layout(loaded.model))
        log.info("packed %d linear layers", packed)
    adapters = load_adapters(config, loaded, stages) if config.lora_enabled else None
    model_config = loaded.model.config
    context = getattr(model_config, "max_position_embeddings", None)
    paged = chosen.backend.kv_layout == "paged"  # type: ignore[attr-defined]
    pool = None
    if paged and config.max_batch_total_tokens is None:
        pool = kv_memory.kv_pool_tokens(config, model_config, loaded)
        needed = config.max_total_tokens or min(context or 4096, 4096)
        if pool < needed:
            raise ModelLoadError(
                f"the KV block pool would hold only {pool} positions in the memory left, fewer than one "
                f"request of {needed} tokens; raise --kv-memory-fraction / --cuda-memory-fraction, lower "
                "--max-total-tokens, or set --max-batch-total-tokens")
    config = config.with_limits(context, mixed_steps=chosen.backend.mixed_steps,  # type: ignore[attr-defined]
                                on_cpu=loaded.device.type == "cpu", kv_tokens=pool)
    assert config.max_total_tokens and config.max_input_tokens
    assert config.max_batch_prefill_tokens and config.max_batch_total_tokens
    if context and config.max_total_tokens > context:
        log.warning("--max-total-tokens %d exceeds the model's context of %d positions",
                    config.max_total_tokens, context)
    cache_dtype = kv_memory.kv_dtype(config, loaded)
    kv_store = chosen.kv_allocator.create(model_config, cache_dtype, loaded.device,  # type: ignore[attr-defined]
                                          config.max_batch_total_tokens, chosen.block_size)
    runner = chosen.backend.create(loaded.model, kv_store, chosen.attention)  # type: ignore[attr-defined]
    if config.speculate and not getattr(runner, "speculative", False):
        raise ModelLoadError(f"--speculate needs a backend that verifies drafts in its steps (paged, flash); "
                             f"--backend {chosen.backend.name} decodes one token per sequence and step")
    prefix_caching_off = prefix_caching_unavailable_reason(config, chosen, runner)
    if prefix_caching_off is None:
        runner.enable_prefix_caching()
        log.info("prefix caching is on: prompts that begin the same way share their computed KV blocks")
    else:
        log.info("prefix caching is off: %s", prefix_caching_off)
    if sharded:
        runner = sharding.mirror_runner(runner, {
            "backend": chosen.backend.name, "attention": chosen.attention.name,
            "kv_allocator": chosen.kv_allocator.name, "block_size": chosen.block_size,
            "max_tokens": config.max_batch_total_tokens, "kv_dtype": cache_dtype,
            "prepack_weights": config.prepack_weights, "disable_custom_kernels": config.disable_custom_kernels,
            "prefix_caching": prefix_caching_off is None})
    compiler = Compiler(config, loaded, runner, stages)
    queue = new_queue(config, chosen, padded=not paged)
    engine = Engine(runner, queue, loaded.tokenizer, eos_token_ids(loaded.model, loaded.tokenizer),
                    config.max_batch_prefill_tokens, pm, stream_buffer_tokens=config.stream_buffer_tokens,
                    watermark=(config.watermark_gamma, config.watermark_delta))
    if config.speculate:
        step_tokens = STEP_TOKENS.get(loaded.device.type, STEP_TOKENS["cuda"])
        engine.scheduler.speculator = Speculator(config.speculate, step_tokens)
        log.info("speculation is on: up to %d n-gram draft tokens per sequence and step", config.speculate)
    vocab_size = loaded.model.get_input_embeddings().num_embeddings
    warm_up(engine, config, stages, min(vocab_size, len(loaded.tokenizer)),
            detail="compiling the forward (torch.compile)" if compiler.in_warm_up else "")
    watch(engine, config)
    log.info("ready: %s on %s (%s backend, %s attention)", loaded.model_id, loaded.device,
             chosen.backend.name, chosen.attention.name)
    return Started(engine, loaded, chosen, vocab_size, config, adapters, prefix_caching_off, compiler)


def hub_cache(config: Config) -> str | None:
    """``--huggingface-hub-cache``: where hub downloads go (None: the hub client's own default)."""
    return getattr(config, "huggingface_hub_cache", None)


def prefix_caching_unavailable_reason(config: Config, chosen: Chosen, runner: Any) -> str | None:
    """Why this server does not reuse computed prompt prefixes, or None when it does."""
    if not config.prefix_caching:
        return PREFIX_CACHING_TURNED_OFF
    if not hasattr(runner, "enable_prefix_caching"):
        return f"the {chosen.backend.name} backend keeps no prefix cache (the paged backends do)"
    return runner.prefix_caching_unavailable_reason()


def new_queue(config: Config, chosen: Chosen, padded: bool) -> Admission:
    """The chosen scheduler's waiting queue, within the resolved limits, as the engine admits from it."""
    assert config.max_batch_prefill_tokens and config.max_batch_total_tokens
    assert config.waiting_served_ratio is not None
    limits = BatchLimits(
        max_batch_prefill_tokens=config.max_batch_prefill_tokens,
        max_batch_total_tokens=config.max_batch_total_tokens,
        max_batch_size=config.max_batch_size,
        padded=padded,
        waiting_served_ratio=config.waiting_served_ratio,
        max_waiting_tokens=config.max_waiting_tokens,
        priority_class_weights=config.class_weights(),
        priority_aging=config.priority_aging,
        priority_cost=config.priority_cost,
    )
    return Admission.of(chosen.scheduler.create(limits), limits)  # type: ignore[attr-defined]


def owned_engine_unavailable_reason(config: Config, chosen: Chosen) -> str | None:
    """Why these settings cannot run with a backend that brings its own engine, or None."""
    name = chosen.backend.name
    for flag, value in (("--num-shard", config.num_shard > 1), ("--quantize", config.quantize),
                        ("--lora-adapters", config.lora_enabled),
                        ("--kv-cache-dtype", config.kv_cache_dtype not in (None, "auto")),
                        ("--speculate", config.speculate > 0)):
        if value:
            return f"{flag} is not supported with --backend {name}, which loads and runs the model in its own engine"
    return None


def start_owned_engine(config: Config, pm: pluggy.PluginManager, stages: Stages, chosen: Chosen) -> Started:
    """A backend with its own engine (``owns_engine``): load only the tokenizer and the checkpoint's
    config here; the backend loads the weights, and its engine is warmed up like ours."""
    from transformers import AutoConfig, AutoTokenizer

    unavailable = owned_engine_unavailable_reason(config, chosen)
    if unavailable:
        raise ModelLoadError(unavailable)
    display_id, path = resolve_checkpoint(config.model_id, config.revision, stages, hub_cache(config))
    tokenizer, model_config = stages.run("loading tokenizer", lambda: (
        AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code),
        AutoConfig.from_pretrained(path, trust_remote_code=config.trust_remote_code)), detail=str(path))
    device = pick_device()
    choice = checkpoint_choice(config.dtype, device, path)
    dtype = choice.dtype
    context = getattr(model_config, "max_position_embeddings", None)

    def queue_for(kv_tokens: int) -> Admission:
        # The limits settle now; the engine reads them from ``setup.config`` from here on.
        setup.config = setup.config.with_limits(context, mixed_steps=chosen.backend.mixed_steps,  # type: ignore[attr-defined]
                                                on_cpu=device.type == "cpu", kv_tokens=kv_tokens)
        return new_queue(setup.config, chosen, padded=False)

    setup = EngineSetup(path, display_id, tokenizer, model_config, dtype, device, config,
                        eos_ids_of(generation_eos(path, model_config), tokenizer), pm, queue_for)
    engine = stages.run("starting engine", lambda: chosen.backend.create_engine(setup),  # type: ignore[attr-defined]
                        detail=f"--backend {chosen.backend.name}")
    config = setup.config
    assert config.max_input_tokens and config.max_batch_prefill_tokens, "create_engine must call setup.new_queue"
    vocab_size = int(getattr(model_config, "vocab_size", None) or len(tokenizer))
    warm_up(engine, config, stages, min(vocab_size, len(tokenizer)))
    watch(engine, config)
    log.info("ready: %s on %s (%s backend)", display_id, device, chosen.backend.name)
    loaded = LoadedModel(None, tokenizer, display_id, path, dtype, device, stages.done, dtype_reason=choice.reason)
    # Such an engine keeps its own prefix cache, turned on and off by the same flag (vLLM's does).
    off = None if config.prefix_caching else PREFIX_CACHING_TURNED_OFF
    return Started(engine, loaded, chosen, vocab_size, config, prefix_caching_off=off)


def warm_up(engine: Engine, config: Config, stages: Stages, token_ids_below: int, detail: str = "") -> None:
    """The warm-up load stage: one short request of random token ids through prefill and decode
    (where the forward is compiled, its first steps compile it)."""
    assert config.max_input_tokens and config.max_batch_prefill_tokens
    prompt_tokens = min(16, config.max_input_tokens, config.max_batch_prefill_tokens)
    speculator = engine.scheduler.speculator
    if speculator is None:
        stages.run("warm-up", lambda: run_warm_up(engine, prompt_tokens, token_ids_below), detail=detail)
        return
    # Made-up drafts, and a third token (a decode step with room for a draft): the warm-up verifies one too.
    engine.scheduler.speculator = FixedDrafts(speculator.tokens, speculator.step_tokens)
    try:
        stages.run("warm-up", lambda: run_warm_up(engine, prompt_tokens, token_ids_below, new_tokens=3), detail=detail)
    finally:
        engine.scheduler.speculator = speculator


def watch(engine: Engine, config: Config) -> None:
    """The engine's limits once it serves (warm-up runs without them): ``--max-failed-steps``,
    ``--step-timeout`` and ``--stream-idle-timeout``."""
    engine.health.configure(config.max_failed_steps, config.step_timeout)
    engine.stream_idle_timeout = config.stream_idle_timeout


def fit_backend(pm: pluggy.PluginManager, config: Config, chosen: Chosen, model: Any) -> Chosen:
    """The chosen plugins if the backend can run ``model``; with ``auto``, the next backend that can."""
    unsupported = chosen.backend.model_unavailable_reason(model)  # type: ignore[attr-defined]
    if not unsupported:
        return chosen
    if config.backend != "auto":
        raise ModelLoadError(unsupported)
    reasons = [unsupported]
    for name in AUTO_BACKENDS[AUTO_BACKENDS.index(chosen.backend.name) + 1 :]:
        try:
            candidate = choose_all(pm, name, config.attention, config.kv_allocator, config.scheduler,
                                   config.block_size)
        except PluginError as error:
            reasons.append(str(error))
            continue
        reason = candidate.backend.model_unavailable_reason(model)  # type: ignore[attr-defined]
        if reason is None:
            log.warning("%s; --backend auto takes the %s backend", "; ".join(reasons), name)
            return candidate
        reasons.append(reason)
    raise ModelLoadError("--backend auto found no backend for this model: " + "; ".join(reasons))


def settings_unavailable_reason(config: Config, chosen: Chosen, device_type: str) -> str | None:
    """Why these settings cannot be honoured with these plugins on this device (``--kv-cache-dtype``, or the
    flags a backend with its own engine does not take), or None."""
    if chosen.attention is None:
        return owned_engine_unavailable_reason(config, chosen)
    if config.kv_cache_dtype in (None, "auto"):
        return None
    if device_type != "cuda":
        return (f"--kv-cache-dtype {config.kv_cache_dtype} needs CUDA "
                "(float8 caches are for GPUs; CPU keeps the model's dtype)")
    if chosen.backend.kv_layout != "paged" or chosen.attention.name != "sdpa":  # type: ignore[attr-defined]
        return (f"--kv-cache-dtype {config.kv_cache_dtype} needs the paged layout with --attention sdpa "
                f"(flash-attn reads float16 and bfloat16 caches only); got --backend {chosen.backend.name} "
                f"--attention {chosen.attention.name}")
    return None


def run_warm_up(engine: Engine, prompt_tokens: int, vocab_size: int, new_tokens: int = 2, max_steps: int = 100) -> None:
    """Run one small request of random token ids through the engine's prefill and decode steps, before serving."""
    prompt = torch.randint(0, vocab_size, (prompt_tokens,)).tolist()
    events: list[Event] = []
    engine.queue.add(Sequence(GenerationRequest("", prompt, new_tokens, SamplingParams()), events.append, None))
    for _ in range(max_steps):
        engine.step()
        errors = [e.message for e in events if isinstance(e, ErrorEvent)]
        if errors:
            raise RuntimeError(errors[0])
        if any(isinstance(e, TokenEvent) and e.final for e in events):
            return
    raise RuntimeError(f"the warm-up did not finish in {max_steps} steps (is the prefill budget too small?)")
