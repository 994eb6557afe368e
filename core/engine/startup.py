"""From a configuration to a warmed-up engine: plugins, model, KV memory, limits.

Runs in the loader thread while the HTTP server already answers /health (503).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import pluggy
import torch

from tokenmill.kernels import native as native_kernels
from tokenmill.model import sharding
from tokenmill.config import Config
from tokenmill.model.cpu_linears import pack_linears, packing_unavailable_reason
from tokenmill.engine.engine import Engine, eos_ids_of, eos_token_ids
from tokenmill.interfaces import BatchLimits, EngineSetup, SchedulerQueue
from tokenmill.model.kv_memory import bytes_per_token
from tokenmill.model.loading import (
    LoadedModel,
    ModelLoadError,
    Stages,
    load_model,
    pick_device,
    pick_dtype,
    resolve_checkpoint,
)
from tokenmill.model.lora import AdapterBusy, AdapterCache, AdapterError, install
from tokenmill.plugin_manager import AUTO_BACKENDS, Chosen, PluginError, choose, choose_all, offered
from tokenmill.model.quant_linears import read_quantization_config

log = logging.getLogger(__name__)

PREFIX_CACHING_TURNED_OFF = "turned off (--no-prefix-caching or PREFIX_CACHING=0)"


@dataclass
class Started:
    engine: Engine
    loaded: LoadedModel
    chosen: Chosen
    vocab_size: int
    """Rows of the model's input embeddings: token ids must stay below it."""
    adapters: AdapterCache | None = None
    """The LoRA adapters, when the server serves them."""
    prefix_caching_off: str | None = None
    """Why prompts' computed prefixes are not reused, or None when they are."""


def _readers_of(pm: pluggy.PluginManager, method: str) -> list[str]:
    return [impl.name for impl, _ in offered(pm, "quantizer") if getattr(impl, "checkpoint_method", None) == method]


def choose_quantizer(pm: pluggy.PluginManager, requested: str | None, path: Any) -> Any:
    """``--quantize``'s plugin, or the one for the checkpoint's own ``quant_method`` (as TGI does); None for neither."""
    found = read_quantization_config(path) if path.is_dir() else None
    method = (found or {}).get("quant_method")
    if requested and method and requested != method and requested not in _readers_of(pm, method):
        raise ModelLoadError(f"--quantize {requested} was given, but the checkpoint is already quantized with {method}")
    if requested is None and method is not None:  # the plugin that reads this checkpoint format
        readers = _readers_of(pm, method)
        if not readers:
            raise ModelLoadError(f"the checkpoint is quantized with {method!r}, which no quantizer plugin reads")
        requested = readers[0]
    if requested is None:
        return None
    try:
        return choose(pm, "quantizer", requested)
    except PluginError as error:
        raise ModelLoadError(str(error)) from None


def start_engine(config: Config, pm: pluggy.PluginManager, stages: Stages,
                 on_chosen: Callable[[Chosen], None] | None = None) -> Started:
    """Choose the plugins, load the model, size KV memory, resolve the limits and warm up.
    The engine is returned ready but not started."""
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
                            stages, pick_quantizer=lambda path: choose_quantizer(pm, config.quantize, path))
    chosen = fit_backend(pm, config, chosen, loaded.model)
    refusal = settings_refusal(config, chosen, loaded.device.type)
    if refusal:
        raise ModelLoadError(refusal)
    if on_chosen:
        on_chosen(chosen)
    if config.prepack_weights and packing_unavailable_reason(loaded.model) is None:
        packed = stages.run("packing weights", lambda: pack_linears(loaded.model), detail="oneDNN layout for CPU")
        log.info("packed %d linear layers for oneDNN", packed)
    adapters = load_adapters(config, loaded, stages) if config.lora_enabled else None
    model_config = loaded.model.config
    context = getattr(model_config, "max_position_embeddings", None)
    paged = chosen.backend.kv_layout == "paged"  # type: ignore[attr-defined]
    if paged and config.max_batch_total_tokens is None:
        pool = kv_pool_tokens(config, model_config, loaded)
        needed = config.max_total_tokens or min(context or 4096, 4096)
        if pool < needed:
            raise ModelLoadError(
                f"the KV block pool would hold only {pool} positions in the memory left, fewer than one "
                f"request of {needed} tokens; raise --kv-memory-fraction / --cuda-memory-fraction, lower "
                "--max-total-tokens, or set --max-batch-total-tokens")
        config.max_batch_total_tokens = pool
    config.resolve_limits(context, mixed_steps=chosen.backend.mixed_steps,  # type: ignore[attr-defined]
                          on_cpu=loaded.device.type == "cpu")
    assert config.max_total_tokens and config.max_input_tokens
    assert config.max_batch_prefill_tokens and config.max_batch_total_tokens
    if context and config.max_total_tokens > context:
        log.warning("--max-total-tokens %d exceeds the model's context of %d positions",
                    config.max_total_tokens, context)
    kv_store = chosen.kv_allocator.create(model_config, kv_dtype(config, loaded), loaded.device,  # type: ignore[attr-defined]
                                          config.max_batch_total_tokens, chosen.block_size)
    runner = chosen.backend.create(loaded.model, kv_store, chosen.attention)  # type: ignore[attr-defined]
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
            "max_tokens": config.max_batch_total_tokens, "kv_dtype": kv_dtype(config, loaded),
            "prepack_weights": config.prepack_weights, "disable_custom_kernels": config.disable_custom_kernels,
            "prefix_caching": prefix_caching_off is None})
    compiling = config.compile_model and _compile(config, loaded, runner)
    queue = new_queue(config, chosen, padded=not paged)
    engine = Engine(runner, queue, loaded.tokenizer, eos_token_ids(loaded.model, loaded.tokenizer),
                    config.max_batch_prefill_tokens, pm, stream_buffer_tokens=config.stream_buffer_tokens,
                    watermark=(config.watermark_gamma, config.watermark_delta))
    vocab_size = loaded.model.get_input_embeddings().num_embeddings
    warm_up(engine, config, stages, min(vocab_size, len(loaded.tokenizer)),
            detail="compiling the forward (torch.compile)" if compiling else "")
    log.info("ready: %s on %s (%s backend, %s attention)", loaded.model_id, loaded.device,
             chosen.backend.name, chosen.attention.name)
    return Started(engine, loaded, chosen, vocab_size, adapters, prefix_caching_off)


def prefix_caching_unavailable_reason(config: Config, chosen: Chosen, runner: Any) -> str | None:
    """Why this server does not reuse computed prompt prefixes, or None when it does."""
    if not config.prefix_caching:
        return PREFIX_CACHING_TURNED_OFF
    if not hasattr(runner, "enable_prefix_caching"):
        return f"the {chosen.backend.name} backend keeps no prefix cache (the paged backends do)"
    return runner.prefix_caching_unavailable_reason()


def new_queue(config: Config, chosen: Chosen, padded: bool) -> SchedulerQueue:
    """The chosen scheduler's waiting queue, within the resolved limits."""
    assert config.max_batch_prefill_tokens and config.max_batch_total_tokens
    assert config.waiting_served_ratio is not None
    return chosen.scheduler.create(BatchLimits(  # type: ignore[attr-defined]
        max_batch_prefill_tokens=config.max_batch_prefill_tokens,
        max_batch_total_tokens=config.max_batch_total_tokens,
        max_batch_size=config.max_batch_size,
        padded=padded,
        waiting_served_ratio=config.waiting_served_ratio,
        max_waiting_tokens=config.max_waiting_tokens,
        priority_class_weights=config.class_weights(),
        priority_aging=config.priority_aging,
        priority_cost=config.priority_cost,
    ))


def owned_engine_refusal(config: Config, chosen: Chosen) -> str | None:
    """Why these settings cannot run with a backend that brings its own engine, or None."""
    name = chosen.backend.name
    for flag, value in (("--num-shard", config.num_shard > 1), ("--quantize", config.quantize),
                        ("--lora-adapters", config.lora_enabled),
                        ("--kv-cache-dtype", config.kv_cache_dtype not in (None, "auto"))):
        if value:
            return f"{flag} is not supported with --backend {name}, which loads and runs the model in its own engine"
    return None


def start_owned_engine(config: Config, pm: pluggy.PluginManager, stages: Stages, chosen: Chosen) -> Started:
    """A backend with its own engine (``owns_engine``): load only the tokenizer and the checkpoint's
    config here; the backend loads the weights, and its engine is warmed up like ours."""
    from transformers import AutoConfig, AutoTokenizer

    refusal = owned_engine_refusal(config, chosen)
    if refusal:
        raise ModelLoadError(refusal)
    display_id, path = resolve_checkpoint(config.model_id, config.revision, stages)
    tokenizer, model_config = stages.run("loading tokenizer", lambda: (
        AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code),
        AutoConfig.from_pretrained(path, trust_remote_code=config.trust_remote_code)), detail=str(path))
    device = pick_device()
    dtype = pick_dtype(config.dtype, device)
    context = getattr(model_config, "max_position_embeddings", None)

    def queue_for(kv_tokens: int) -> SchedulerQueue:
        if config.max_batch_total_tokens is None:
            config.max_batch_total_tokens = kv_tokens
        config.resolve_limits(context, mixed_steps=chosen.backend.mixed_steps,  # type: ignore[attr-defined]
                              on_cpu=device.type == "cpu")
        return new_queue(config, chosen, padded=False)

    setup = EngineSetup(path, display_id, tokenizer, model_config, dtype, device, config,
                        eos_ids_of(generation_eos(path, model_config), tokenizer), pm, queue_for)
    engine = stages.run("starting engine", lambda: chosen.backend.create_engine(setup),  # type: ignore[attr-defined]
                        detail=f"--backend {chosen.backend.name}")
    assert config.max_input_tokens and config.max_batch_prefill_tokens, "create_engine must call setup.new_queue"
    vocab_size = int(getattr(model_config, "vocab_size", None) or len(tokenizer))
    warm_up(engine, config, stages, min(vocab_size, len(tokenizer)))
    log.info("ready: %s on %s (%s backend)", display_id, device, chosen.backend.name)
    loaded = LoadedModel(None, tokenizer, display_id, path, dtype, device, stages.done)
    # Such an engine keeps its own prefix cache, turned on and off by the same flag (vLLM's does).
    off = None if config.prefix_caching else PREFIX_CACHING_TURNED_OFF
    return Started(engine, loaded, chosen, vocab_size, prefix_caching_off=off)


def warm_up(engine: Engine, config: Config, stages: Stages, token_ids_below: int, detail: str = "") -> None:
    """The warm-up load stage: one short request of random token ids through prefill and decode
    (where the forward is compiled, its first steps compile it)."""
    assert config.max_input_tokens and config.max_batch_prefill_tokens
    prompt_tokens = min(16, config.max_input_tokens, config.max_batch_prefill_tokens)
    stages.run("warm-up", lambda: engine.warmup(prompt_tokens, token_ids_below), detail=detail)


def compile_unavailable_reason(config: Config, loaded: LoadedModel, runner: Any) -> str | None:
    """Why the model forward is not compiled with these settings, or None."""
    if not hasattr(runner, "compile_forward"):
        return "the backend runs its forward eagerly"
    if config.num_shard > 1:
        return "a sharded forward (--num-shard) is not compiled"
    if loaded.quantization is not None:
        return "quantized layers are not compiled"
    return runner.compile_unavailable_reason()


def _compile(config: Config, loaded: LoadedModel, runner: Any) -> bool:
    """Have ``runner`` compile its forward where it can (the warm-up then compiles it)."""
    reason = compile_unavailable_reason(config, loaded, runner)
    if reason:
        log.info("the forward runs eagerly: %s", reason)
        return False
    runner.compile_forward()
    return True


def generation_eos(path: Any, model_config: Any) -> Any:
    """The end-of-sequence id(s) of the checkpoint's generation config, else of its model config."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        return getattr(model_config, "eos_token_id", None)


def load_adapters(config: Config, loaded: LoadedModel, stages: Stages) -> AdapterCache:
    """Wrap the model's layers for LoRA and load the adapters --lora-adapters names."""
    named = config.named_adapters()

    def load() -> AdapterCache:
        try:
            cache = AdapterCache(install(loaded.model), config.adapter_slots, config.max_lora_rank,
                                 loaded.dtype, loaded.device, base_model_id=loaded.model_id)
            for name, source in named:
                cache.register(name, source)
        except (AdapterError, AdapterBusy) as error:
            raise ModelLoadError(str(error)) from None
        return cache

    return stages.run("loading adapters", load, detail=", ".join(name for name, _ in named) or "none yet")


def fit_backend(pm: pluggy.PluginManager, config: Config, chosen: Chosen, model: Any) -> Chosen:
    """The chosen plugins if the backend can run ``model``; with ``auto``, the next backend that can."""
    unsupported = chosen.backend.model_unsupported_reason(model)  # type: ignore[attr-defined]
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
        reason = candidate.backend.model_unsupported_reason(model)  # type: ignore[attr-defined]
        if reason is None:
            log.warning("%s; --backend auto takes the %s backend", "; ".join(reasons), name)
            return candidate
        reasons.append(reason)
    raise ModelLoadError("--backend auto found no backend for this model: " + "; ".join(reasons))


def available_memory_bytes() -> int:
    """RAM available now (Linux MemAvailable), or total physical memory elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def settings_refusal(config: Config, chosen: Chosen, device_type: str) -> str | None:
    """Why these settings cannot be honoured with these plugins on this device (``--kv-cache-dtype``, or the
    flags a backend with its own engine does not take), or None."""
    if chosen.attention is None:
        return owned_engine_refusal(config, chosen)
    if config.kv_cache_dtype in (None, "auto"):
        return None
    if device_type != "cuda":
        return f"--kv-cache-dtype {config.kv_cache_dtype} needs CUDA (float8 caches are for GPUs; CPU keeps the model's dtype)"
    if chosen.backend.kv_layout != "paged" or chosen.attention.name != "sdpa":  # type: ignore[attr-defined]
        return (f"--kv-cache-dtype {config.kv_cache_dtype} needs the paged layout with --attention sdpa "
                f"(flash-attn reads float16 and bfloat16 caches only); got --backend {chosen.backend.name} "
                f"--attention {chosen.attention.name}")
    return None


def kv_dtype(config: Config, loaded: LoadedModel) -> torch.dtype:
    """The KV pool's dtype: the model's, or float8 with ``--kv-cache-dtype fp8_e4m3fn``."""
    return torch.float8_e4m3fn if config.kv_cache_dtype == "fp8_e4m3fn" else loaded.dtype


def kv_pool_tokens(config: Config, model_config: Any, loaded: LoadedModel) -> int:
    """How many positions the KV pool holds when --max-batch-total-tokens is not given:
    the memory left after loading, within the configured fraction."""
    if loaded.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(loaded.device)
        budget = min(free, config.cuda_memory_fraction * total - (total - free)) * 0.9
    else:  # the ranks of --num-shard share this machine's RAM, each with a pool this size
        budget = available_memory_bytes() * config.kv_memory_fraction / config.num_shard
    per_token = bytes_per_token(model_config, kv_dtype(config, loaded))
    context = min(getattr(model_config, "max_position_embeddings", None) or 4096, 4096)
    tokens = int(max(0, budget) // per_token)
    ceiling = 64 * (config.max_total_tokens or context)  # enough for 64 full-length sequences
    log.info("KV pool: %d positions (%.0f MiB of %.0f MiB allowed)", min(tokens, ceiling),
             min(tokens, ceiling) * per_token / 2**20, budget / 2**20)
    return min(tokens, ceiling)
