"""The settings of one server: TGI's flag names and defaults (the flags themselves are in
:mod:`tokenmill.config.flags`).

A Config is frozen once parsed. Settings that depend on the model (token limits) are settled
after loading, into a new Config (:meth:`Config.with_limits`); nothing changes one in place.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

MAX_SPECULATE = 32
"""The most draft tokens ``--speculate`` may ask for per sequence and step."""

CPU_MIXED_PREFILL_TOKENS = 2048
"""The default prefill budget per step of a backend with mixed steps on CPU (see :meth:`Config.with_limits`)."""


def split_keys(text: str) -> tuple[str, ...]:
    """Comma-separated API keys, each stripped, empty ones skipped."""
    return tuple(key.strip() for key in text.split(",") if key.strip())


TASKS = ("generate", "embed", "score")
TASK_ALIASES = {"embedding": "embed", "embeddings": "embed", "classify": "score", "rerank": "score"}
"""vLLM's and TEI's other names for the tasks."""
CLIENT_BATCH_SIZES = {"generate": 4}
"""``--max-client-batch-size`` unless given: TGI's 4 choices for generation, TEI's 32 inputs for embed and score."""
POOLING = "pooling"
"""vLLM's ``--runner pooling``: embed or score, whichever the checkpoint's architecture says (settled at load)."""


class ConfigError(Exception):
    """A contradictory or invalid setting; the message is one line for the operator."""


PRIORITY_CLASSES = ("high", "normal", "low")
"""A request's priority class, most urgent first (the ``priority`` parameter or ``X-Priority`` header)."""


@dataclass(frozen=True)
class Config:
    model_id: str | None = None
    revision: str | None = None
    huggingface_hub_cache: str | None = None
    served_model_name: str | None = None
    tokenizer_config_path: str | None = None
    chat_template: str | None = None
    dtype: str | None = None
    quantize: str | None = None
    num_shard: int = 1
    sharded: bool | None = None
    master_addr: str = "localhost"
    master_port: int = 29500
    trust_remote_code: bool = False
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_client_batch_size: int = None  # type: ignore[assignment]  # settled in __post_init__
    max_input_tokens: int | None = None
    max_input_length: int | None = None
    max_total_tokens: int | None = None
    max_batch_prefill_tokens: int | None = None
    max_batch_total_tokens: int | None = None
    max_batch_size: int | None = None
    waiting_served_ratio: float | None = None
    max_waiting_tokens: int = 20
    priority_class_weights: str = "high=4000,normal=2000,low=0"
    priority_aging: float = 100.0
    priority_cost: float = 1.0
    stream_buffer_tokens: int = 64
    watermark_gamma: float = 0.5
    watermark_delta: float = 2.0
    hostname: str = "0.0.0.0"
    port: int = 3000
    payload_limit: int = 2_000_000
    body_read_timeout: float = 30.0
    graceful_termination_timeout: int = 90
    max_failed_steps: int = 5
    step_timeout: float = 600.0
    stream_idle_timeout: float = 300.0
    validation_workers: int = 2
    disable_grammar_support: bool = False
    max_images: int = 4
    allow_image_urls: bool = False
    hold_while_loading: int = 0
    sleep_after_idle: float = 0.0
    models_dir: str | None = None
    max_loaded_models: int = 2
    task: str = "generate"
    runner: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    api_key: str | None = None
    api_key_file: str | None = None
    priority_header_keys: str | None = None
    cors_allow_origin: str | None = None
    json_output: bool = False
    log_prompts: bool = False
    prometheus_port: int | None = None
    otlp_endpoint: str | None = None
    otlp_service_name: str = "tokenmill"
    enable_profiling: bool = False
    lora_adapters: str | None = None
    lora_cache_limit: int | None = None
    max_lora_rank: int = 64
    lora_adapter_dir: tuple[str, ...] = ()
    allow_adapter_loading: bool = False
    backend: str = "auto"
    attention: str | None = None
    scheduler: str = "fifo"
    kv_allocator: str | None = None
    block_size: int | None = None
    prefix_caching: bool = True
    kv_cache_dtype: str | None = None
    kv_memory_fraction: float = 0.3
    prepack_weights: bool = True
    compile_model: bool = True
    compile_before_ready: bool = False
    speculate: int = 0
    disable_custom_kernels: bool = False
    cuda_memory_fraction: float = 1.0
    server: str = "gunicorn"
    notices: tuple[str, ...] = field(default=(), compare=False, metadata={"flag": False})
    """What the operator should read at start: TGI flags accepted without effect, and what tokenmill does
    instead (set by :func:`tokenmill.config.parse_config`, logged once logging is set up)."""
    more_model_ids: tuple[str, ...] = field(default=(), metadata={"flag": False})
    """The models named by ``--model-id`` repeated, after the first (which is ``model_id``)."""

    def __post_init__(self) -> None:
        task = TASK_ALIASES.get(self.task, self.task)
        if self.runner == "pooling" and task == "generate":  # vLLM's --runner pooling: the checkpoint says which
            task = POOLING
        object.__setattr__(self, "task", task)
        if self.max_client_batch_size is None:
            object.__setattr__(self, "max_client_batch_size", CLIENT_BATCH_SIZES.get(task, 32))
        if self.max_input_tokens is None and self.max_input_length is not None:  # TGI's legacy name
            object.__setattr__(self, "max_input_tokens", self.max_input_length)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check(self) -> None:
        """Fail with one clear line on settings that contradict each other."""
        if self.max_input_length is not None:
            if self.max_input_tokens is not None and self.max_input_tokens != self.max_input_length:
                raise ConfigError(
                    f"--max-input-tokens ({self.max_input_tokens}) and its legacy name "
                    f"--max-input-length ({self.max_input_length}) disagree; set only --max-input-tokens"
                )
        positive = ("stream_buffer_tokens", "max_concurrent_requests", "max_failed_steps", "step_timeout",
                    "stream_idle_timeout", "validation_workers", "max_input_tokens", "max_total_tokens",
                    "max_batch_prefill_tokens", "max_batch_total_tokens", "max_batch_size", "payload_limit",
                    "block_size", "body_read_timeout")
        for name in positive:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0 (got {value})")
        self.class_weights()
        if self.waiting_served_ratio is not None and self.waiting_served_ratio < 0:
            raise ConfigError(f"--waiting-served-ratio must be >= 0 (got {self.waiting_served_ratio})")
        for name in ("max_best_of", "max_stop_sequences", "max_top_n_tokens", "max_waiting_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(self, name)})")
        if not 0 <= self.speculate <= MAX_SPECULATE:
            raise ConfigError(f"--speculate must be between 0 and {MAX_SPECULATE} (got {self.speculate})")
        if self.num_shard < 1:
            raise ConfigError(f"--num-shard must be >= 1 (got {self.num_shard})")
        if self.sharded is False and self.num_shard > 1:
            raise ConfigError(f"--sharded false contradicts --num-shard {self.num_shard}")
        if self.sharded is True and self.num_shard == 1:
            raise ConfigError("--sharded true needs more than one shard: --num-shard 1 (or one visible GPU) gives one")
        if self.num_shard > 1 and self.quantize:
            raise ConfigError(f"--quantize {self.quantize} cannot shard yet: run it with --num-shard 1")
        if self.sleep_after_idle < 0:
            raise ConfigError(f"--sleep-after-idle must be >= 0 (got {self.sleep_after_idle:g})")
        self.check_several_models()
        if self.hold_while_loading < 0:
            raise ConfigError(f"--hold-while-loading must be >= 0 (got {self.hold_while_loading})")
        if self.max_images < 0:
            raise ConfigError(f"--max-images must be >= 0 (got {self.max_images})")
        if self.max_client_batch_size < 1:
            raise ConfigError(f"--max-client-batch-size must be >= 1 (got {self.max_client_batch_size})")
        if not 0 < self.watermark_gamma < 1:
            raise ConfigError(f"--watermark-gamma must be in (0, 1) (got {self.watermark_gamma})")
        if self.watermark_delta <= 0:
            raise ConfigError(f"--watermark-delta must be > 0 (got {self.watermark_delta})")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be between 0 and 65535 (got {self.port})")
        if self.prometheus_port is not None:
            if not 0 < self.prometheus_port <= 65535:
                raise ConfigError(f"--prometheus-port must be between 1 and 65535 (got {self.prometheus_port})")
            if self.prometheus_port == self.port:
                raise ConfigError(f"--prometheus-port ({self.prometheus_port}) must differ from --port: "
                                  "/metrics is served on --port already")
        if self.graceful_termination_timeout < 0:
            raise ConfigError(f"--graceful-termination-timeout must be >= 0 (got {self.graceful_termination_timeout})")
        if self.lora_cache_limit is not None and self.lora_cache_limit < 1:
            raise ConfigError(f"--lora-cache-limit must be >= 1 (got {self.lora_cache_limit})")
        if self.max_lora_rank < 1:
            raise ConfigError(f"--max-lora-rank must be >= 1 (got {self.max_lora_rank})")
        if self.lora_enabled and self.num_shard > 1:
            raise ConfigError("LoRA adapters cannot shard yet: run them with --num-shard 1")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key is empty: give a key, or leave the flag (and API_KEY) unset")
        keys = self.api_keys
        if self.priority_header_keys is not None and not set(split_keys(self.priority_header_keys)) <= set(keys):
            raise ConfigError("--priority-header-keys must list keys that --api-key or --api-key-file give")
        if self.enable_profiling and not keys:
            raise ConfigError("--enable-profiling needs --api-key: a profile shows the server's insides")
        if self.dtype not in (None, "auto", "float16", "bfloat16", "float32"):
            raise ConfigError(f"--dtype must be auto, float16, bfloat16 or float32 (got {self.dtype!r})")
        for name in ("kv_memory_fraction", "cuda_memory_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be in (0, 1] (got {getattr(self, name)})")
        if self.kv_cache_dtype not in (None, "auto", "fp8_e4m3fn"):
            raise ConfigError(f"--kv-cache-dtype must be auto or fp8_e4m3fn (got {self.kv_cache_dtype!r})")
        if self.task not in (*TASKS, POOLING):
            raise ConfigError(f"--task must be generate, embed or score (got {self.task!r})")
        if self.runner not in (None, "auto", "generate", "pooling"):
            raise ConfigError(f"--runner must be generate or pooling (got {self.runner!r})")
        if self.runner == "generate" and self.task != "generate":
            raise ConfigError(f"--runner generate contradicts --task {self.task}")
        if self.task != "generate":
            if self.num_shard > 1:
                raise ConfigError(f"--task {self.task} cannot shard yet: run it with --num-shard 1")
            generating = {"--speculate": self.speculate, "--lora-adapters": self.lora_adapters,
                          "--tool-call-parser": self.tool_call_parser, "--reasoning-parser": self.reasoning_parser,
                          "--quantize": self.quantize}
            given = [flag for flag, value in generating.items() if value]
            if given:
                raise ConfigError(f"{', '.join(given)}: only for --task generate (this server runs --task {self.task})")
        if self.server not in ("gunicorn", "uvicorn"):
            raise ConfigError(f"--server must be gunicorn or uvicorn (got {self.server!r})")
        total, inputs = self.max_total_tokens, self.max_input_tokens
        if total is not None and inputs is not None and total <= inputs:
            raise ConfigError(f"--max-total-tokens ({total}) must be greater than --max-input-tokens ({inputs})")
        if self.backend == "transformers":
            self.check_prefill_budget(chunked=False)
        batch_total = self.max_batch_total_tokens
        if batch_total is not None and total is not None and batch_total < total:
            raise ConfigError(
                f"--max-batch-total-tokens ({batch_total}) must be >= --max-total-tokens ({total})"
            )

    def serves_several(self) -> bool:
        """``--models-dir`` or ``--model-id`` repeated: several models, each loaded when a request names it."""
        return self.models_dir is not None or bool(self.more_model_ids)

    def check_several_models(self) -> None:
        """``--max-loaded-models`` and what several models cannot be served with."""
        if self.max_loaded_models < 1:
            raise ConfigError(f"--max-loaded-models must be >= 1 (got {self.max_loaded_models})")
        if not self.serves_several():
            return
        if self.models_dir is not None and not os.path.isdir(self.models_dir):
            raise ConfigError(f"--models-dir {self.models_dir}: no such directory")
        if self.num_shard > 1:
            raise ConfigError("several models (--models-dir, --model-id repeated) are served on one shard each: "
                              "drop --num-shard")
        if self.served_model_name:
            raise ConfigError("--served-model-name names one model; with several, each is named by its --model-id "
                              "or its directory under --models-dir")

    def check_prefill_budget(self, chunked: bool) -> None:
        """TGI's rule, for a backend that prefills each prompt whole: a step's prefill budget
        holds the longest prompt. A backend that chunks prompts takes any budget."""
        prefill, inputs = self.max_batch_prefill_tokens, self.max_input_tokens
        if not chunked and prefill is not None and inputs is not None and prefill < inputs:
            raise ConfigError(
                f"--max-batch-prefill-tokens ({prefill}) must be >= --max-input-tokens ({inputs}) "
                "for a backend that prefills whole prompts"
            )

    @property
    def lora_enabled(self) -> bool:
        """Adapters are served (and can be loaded at run time) with --lora-adapters or --lora-cache-limit."""
        return bool(self.lora_adapters) or self.lora_cache_limit is not None

    def named_adapters(self) -> list[tuple[str, str]]:
        """``--lora-adapters`` as (id, source) pairs: ``id`` (a hub id, downloaded, its own
        source) or ``id=path``, comma-separated."""
        pairs = []
        for item in (self.lora_adapters or "").split(","):
            item = item.strip()
            if item:
                name, _, source = item.partition("=")
                pairs.append((name.strip(), source.strip() or name.strip()))
        return pairs

    @property
    def adapter_slots(self) -> int:
        """Adapters kept in memory: --lora-cache-limit, else room for those named at start (at least 8)."""
        if self.lora_cache_limit is not None:
            return self.lora_cache_limit
        return max(8, len(self.named_adapters()))

    @functools.cached_property
    def api_keys(self) -> tuple[str, ...]:
        """The keys the API accepts: ``--api-key``'s (comma-separated), then ``--api-key-file``'s (one a
        line; blank lines and ``#`` comments skipped), read once. Empty: no key is asked."""
        keys = split_keys(self.api_key or "")
        if self.api_key_file is not None:
            try:
                lines = Path(self.api_key_file).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as error:
                raise ConfigError(f"--api-key-file {self.api_key_file}: cannot be read ({error})") from None
            keys += tuple(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
            if not keys:
                raise ConfigError(f"--api-key-file {self.api_key_file} holds no key")
        return tuple(dict.fromkeys(keys))

    def cors_origins(self) -> tuple[str, ...]:
        """``--cors-allow-origin`` read: the origins (without a trailing slash), or ``*``; empty: no CORS."""
        return tuple(origin.strip().rstrip("/") for origin in (self.cors_allow_origin or "").split(",")
                     if origin.strip())

    def priority_keys(self) -> tuple[str, ...] | None:
        """The keys whose requests may set their priority (``--priority-header-keys``); None: any."""
        return None if self.priority_header_keys is None else split_keys(self.priority_header_keys)

    def class_weights(self) -> tuple[tuple[str, float], ...]:
        """``--priority-class-weights`` parsed: a weight for each of high, normal and low."""
        weights: dict[str, float] = {}
        for item in self.priority_class_weights.split(","):
            name, _, value = item.partition("=")
            try:
                weights[name.strip()] = float(value)
            except ValueError:
                raise ConfigError(f"--priority-class-weights: {item!r} is not class=number") from None
        if set(weights) != set(PRIORITY_CLASSES):
            raise ConfigError(f"--priority-class-weights must give {', '.join(PRIORITY_CLASSES)} a weight each "
                              f"(got {self.priority_class_weights!r})")
        return tuple((name, weights[name]) for name in PRIORITY_CLASSES)

    def total_tokens_limit(self, model_max_positions: int | None) -> int:
        """``--max-total-tokens``, or what it becomes when unset: the model's context up to 4096."""
        if self.max_total_tokens is not None:
            return self.max_total_tokens
        return max(min(model_max_positions or 4096, 4096), (self.max_input_tokens or 0) + 1)

    def with_limits(self, model_max_positions: int | None, mixed_steps: bool = False, on_cpu: bool = False,
                    kv_tokens: int | None = None) -> Config:
        """This config with the token limits and admission rules it left unset filled in, checked again.

        The token limits follow the model, as TGI's do; ``kv_tokens``, the KV positions the backend
        can hold, is the batch's token limit unless ``--max-batch-total-tokens`` sets it.
        ``mixed_steps``: the backend chunks prompts and prefills them in the same step as the
        running batch decodes, so a newcomer joining costs that batch only a longer step, not a
        prefill step of its own. Such a backend admits newcomers at once (``--waiting-served-ratio``
        0, where TGI holds them back until 0.3 × the batch of them wait) and, on CPU, prefills at
        most :data:`CPU_MIXED_PREFILL_TOKENS` a step (vLLM's default for its CPU server), so first
        tokens come in small groups instead of ``--max-input-tokens`` at a time."""
        total = self.total_tokens_limit(model_max_positions)
        inputs = self.max_input_tokens if self.max_input_tokens is not None else total - 1
        prefill = self.max_batch_prefill_tokens
        if prefill is None:
            prefill = min(inputs + 50, CPU_MIXED_PREFILL_TOKENS) if mixed_steps and on_cpu else inputs + 50
        ratio = self.waiting_served_ratio
        batch_total = self.max_batch_total_tokens
        if batch_total is None:
            batch_total = kv_tokens if kv_tokens is not None else 16 * total
        settled = replace(self, max_total_tokens=total, max_input_tokens=inputs, max_batch_prefill_tokens=prefill,
                          waiting_served_ratio=ratio if ratio is not None else (0.0 if mixed_steps else 0.3),
                          max_batch_total_tokens=batch_total)
        settled.check()
        settled.check_prefill_budget(chunked=mixed_steps)
        return settled
