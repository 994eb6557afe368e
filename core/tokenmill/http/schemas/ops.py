"""The shapes of tokenmill's operational and tokenizer routes: ``/info`` (TGI's Info, and more),
``/queue``, ``/adapters``, ``/reset_prefix_cache``, vLLM's ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` and
``/version``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from tokenmill.http.openai.schemas import MAX_TOOLS, Message, Tool
from tokenmill.http.schemas import RequestModel, ResponseModel
from tokenmill.http.schemas.kinds import Boolean, Integer, Object, String


class LoadStage(ResponseModel):
    stage: str
    seconds: float = Field(ge=0)


class Info(ResponseModel):
    """TGI's Info, then tokenmill's: the chosen plugins, the KV cache, the load stages and the load now."""

    model_id: str | None
    model_sha: str | None = None
    model_dtype: str | None = None
    model_dtype_reason: str | None = None
    """Why the weights run in model_dtype: --dtype, or what auto found on this device."""
    quantize: str | None = None
    num_shard: int | None = None
    model_device_type: str | None = None
    model_pipeline_tag: str | None = None
    task: str | None = Field(None, description="generate, embed or score (--task)")
    max_concurrent_requests: int = Field(ge=0)
    max_best_of: int = Field(ge=0)
    max_stop_sequences: int = Field(ge=0)
    max_input_tokens: int | None = Field(None, ge=0)
    max_total_tokens: int | None = Field(None, ge=0)
    max_batch_prefill_tokens: int | None = None
    max_batch_total_tokens: int | None = None
    max_batch_size: int | None = None
    max_top_n_tokens: int | None = None
    validation_workers: int = Field(ge=0)
    max_client_batch_size: int = Field(ge=0)
    takes_images: bool = Field(False, description="Whether the model is a vision-language model that reads images")
    max_images: int = Field(0, ge=0, description="Most images per request (--max-images; 0 where it takes none)")
    speculate: int | None = Field(None, ge=0, description="Draft tokens per sequence and step (--speculate; 0: off)")
    router: str
    version: str
    sha: str | None = None
    docker_label: str | None = None
    backend: str | None = None
    attention: str | None = None
    scheduler: str | None = None
    kv_allocator: str | None = None
    block_size: int | None = None
    prefix_caching: bool | None = None
    prefix_caching_off_reason: str | None = None
    kv: dict[str, Any] | None = Field(None, description="The KV cache's use now (bytes, blocks)")
    tool_call_parser: str | None = Field(None, description="What reads chat outputs' tool calls (--tool-call-parser)")
    reasoning_parser: str | None = Field(None, description="What splits reasoning from the answer (--reasoning-parser)")
    lora_adapters: list[str] | None = None
    ready: bool | None = None
    load_stage: str | None = None
    load_stages: list[LoadStage] | None = None
    forward: Literal["eager", "compiling", "compiled"] | None = None
    """The model forward the steps run: compiled, eager, or eager while the compiled one is built."""
    forward_from_cache: bool | None = None
    """Once the compiled forward is built in the background: whether its graph came from the compile cache
    (``TOKENMILL_CACHE_DIR``; a restart where this checkpoint was compiled with these settings before)."""
    sleeping: bool | None = None
    """The server sleeps (``--sleep-after-idle``, ``POST /sleep``): its KV memory went back to the system."""
    queue_size: int | None = None
    batch_size: int | None = None


class QueuedSequence(ResponseModel):
    id: int
    state: Literal["waiting", "prefilling", "decoding", "paused"]
    priority: str
    prompt_tokens: int
    generated_tokens: int
    max_new_tokens: int
    waited_seconds: float
    unsent_tokens: int
    cached_tokens: int
    adapter_id: str | None
    preempted: bool


class QueueView(ResponseModel):
    """Who waits and who runs, without prompt text."""

    queue_size: int
    batch_size: int
    scheduler: str
    pending: list[QueuedSequence]
    running: list[QueuedSequence]


class Adapters(ResponseModel):
    adapters: list[str] = Field(description="Every adapter the server knows")
    known: int
    loaded: list[str] = Field(description="Those in memory now")
    limit: int | None
    bytes: int
    loads: int
    evictions: int


class LoadAdapterRequest(RequestModel):
    id: String = Field(description="The adapter's name (then `model` or `adapter_id` in requests)")
    path: String | None = Field(None, description="A PEFT adapter directory inside a --lora-adapter-dir; "
                                                  "absent: `id` in the local Hugging Face cache")


class LoadedAdapter(ResponseModel):
    id: str
    rank: int
    layers: int
    path: str


class PrefixCacheReset(ResponseModel):
    prefix_caching: bool
    dropped_blocks: int = Field(ge=0)


class Sleeping(ResponseModel):
    """``/sleep``, ``/wake_up`` and ``/is_sleeping`` (vLLM's)."""

    is_sleeping: bool


class VllmTokenizePrompt(RequestModel):
    """vLLM's ``/tokenize`` with a prompt."""

    model: String | None = None
    prompt: String
    add_special_tokens: Boolean = True
    return_token_strs: Boolean = False


class VllmTokenizeChat(RequestModel):
    """vLLM's ``/tokenize`` with messages, rendered by the chat template as a chat request would be."""

    model: String | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    add_generation_prompt: Boolean = True
    continue_final_message: Boolean = False
    add_special_tokens: Boolean = False
    chat_template_kwargs: Object | None = None
    return_token_strs: Boolean = False


class VllmTokenizeResponse(ResponseModel):
    """vLLM's ``/tokenize`` answer."""

    count: int = Field(ge=0)
    max_model_len: int = Field(ge=1)
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    tokens: list[Integer] = Field(description="Token ids of this model")


class DetokenizeResponse(ResponseModel):
    prompt: str


class TokenizerInfo(ResponseModel):
    """The tokenizer's configuration (its special tokens, chat template, ...)."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


class Version(ResponseModel):
    version: str
