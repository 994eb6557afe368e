"""What each route takes and answers: the table the OpenAPI document is written from.

One :class:`Operation` per method and path that tokenmill can serve. The document lists those the
app really serves (routes that depend on flags, such as ``/debug/profile``, only when they are on),
so this table may hold more than one server serves; a served route missing here shows up in the
document as undocumented, and a test keeps that list empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from tokenmill.http.anthropic import schemas as anthropic
from tokenmill.http.openai import schemas as oai
from tokenmill.http.pooling import schemas as pooling
from tokenmill.http.responses import schemas as responses
from tokenmill.http.schemas import ops
from tokenmill.http.tgi import schemas as tgi

Shape = type[BaseModel] | dict[str, Any]
"""A body's shape: a model (a reference to its component), or a JSON schema as it is."""

GENERATION_ERRORS = (413, 422, 424, 429, 503)
SERVING_ERRORS = (503,)
"""Every route that needs the model answers 503 until it is loaded (and while the server drains)."""

TGI, OPENAI, PLATFORMS, OPERATIONS, DOCS = "Text Generation Inference", "OpenAI", "Platforms", "Operations", "Docs"
ANTHROPIC, EMBEDDINGS = "Anthropic", "Embeddings and scores"
POOLING_ERRORS = (404, 413, 422, 424, 429, 503)
"""404: the server runs another --task."""
TAGS = {
    TGI: "TGI's routes, with its request and response shapes",
    OPENAI: "OpenAI's routes, as the openai client speaks them (plus vLLM's extra fields)",
    ANTHROPIC: "Anthropic's Messages API, as the anthropic client speaks it (served on the chat path, as vLLM does)",
    EMBEDDINGS: "A server started with --task embed or --task score: OpenAI's, TEI's, Cohere's and vLLM's routes",
    PLATFORMS: "What SageMaker and vLLM's clients call: /ping, /invocations, /detokenize, /tokenizer_info, /version",
    OPERATIONS: "The state of the server and its LoRA adapters",
    DOCS: "This document and its viewer",
}


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    tag: str
    request: Shape | None = None
    ok: Shape | None = None
    """The 200 answer's JSON body (None: no JSON body)."""
    stream: Shape | None = None
    """The JSON in each ``data:`` event of the 200 answer's ``text/event-stream``."""
    ok_media: str = ""
    """The 200 answer's media type when its body is not JSON (``ok`` None); empty: no body."""
    errors: tuple[int, ...] = ()
    query: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    """Its parameters (OpenAPI parameter objects: in the query or the path)."""

    @property
    def key(self) -> tuple[str, str]:
        return self.method, self.path


def one_of(*shapes: type[BaseModel]) -> dict[str, Any]:
    return {"oneOf": [ref(shape) for shape in shapes]}


def ref(shape: Shape) -> dict[str, Any]:
    """The JSON schema of ``shape``: a reference to its component when it is a model."""
    if isinstance(shape, dict):
        return shape
    return {"$ref": f"#/components/schemas/{shape.__name__}"}


def list_of(model: type[BaseModel]) -> dict[str, Any]:
    return {"type": "array", "items": ref(model)}


ANY_OBJECT = {"type": "object"}

OPERATIONS_TABLE: tuple[Operation, ...] = (
    Operation("POST", "/", "Generate: `stream` false answers /generate's body in a list, true streams as "
              "/generate_stream", TGI, tgi.CompatGenerateRequest, list_of(tgi.GenerateResponse), tgi.StreamResponse,
              errors=GENERATION_ERRORS),
    Operation("GET", "/", "TGI's health check: 200 once the model serves", TGI, errors=SERVING_ERRORS),
    Operation("POST", "/generate", "Generate tokens", TGI, tgi.GenerateRequest, tgi.GenerateResponse,
              errors=GENERATION_ERRORS),
    Operation("POST", "/generate_stream", "Generate a stream of tokens (server-sent events; an error in the "
              "stream is an event with TGI's error body)", TGI, tgi.GenerateRequest, stream=tgi.StreamResponse,
              errors=GENERATION_ERRORS),
    Operation("POST", "/tokenize", "Tokenize `inputs` (its `parameters` are checked, then unused), answered in "
              "TGI's shape; vLLM's bodies (`prompt` or `messages`) are answered in vLLM's", TGI,
              one_of(tgi.GenerateRequest, ops.VllmTokenizePrompt, ops.VllmTokenizeChat),
              {"oneOf": [ref(tgi.TokenizeResponse), ref(ops.VllmTokenizeResponse)]}, errors=(404, 413, 422, 503)),
    Operation("POST", "/chat_tokenize", "Template a chat request and tokenize it, as /v1/chat/completions would",
              TGI, oai.ChatRequest, tgi.ChatTokenizeResponse, errors=(404, 413, 422, 503)),
    Operation("GET", "/health", "200 once the model is loaded and warmed up, 503 before and while draining", TGI,
              errors=SERVING_ERRORS),
    Operation("GET", "/info", "The model, the server's limits and plugins, the load stages", TGI, ok=ops.Info),
    Operation("GET", "/metrics", "Prometheus metrics (TGI's names, and tokenmill's)", TGI,
              ok_media="text/plain"),
    Operation("POST", "/v1/chat/completions", "Chat completion (whole, or streamed with `stream`; the stream "
              "ends with `data: [DONE]`)", OPENAI, oai.ChatRequest, oai.ChatCompletion, oai.ChatCompletionChunk,
              errors=GENERATION_ERRORS),
    Operation("POST", "/v1/completions", "Completion of one prompt or a batch (text or token ids; streamed "
              "with `stream`, ending with `data: [DONE]`)", OPENAI, oai.CompletionRequest, oai.Completion,
              oai.CompletionChunk, errors=GENERATION_ERRORS),
    Operation("GET", "/v1/models", "The base model and the LoRA adapters served", OPENAI, ok=oai.ModelList),
    Operation("POST", "/v1/responses", "A response (OpenAI's Responses API; whole, or streamed as its named "
              "events; `previous_response_id` continues a stored one)", OPENAI, responses.ResponsesRequest,
              responses.ResponseObject, responses.ResponseEvent, errors=(404, *GENERATION_ERRORS)),
    Operation("GET", "/v1/responses/{response_id}", "A stored response", OPENAI, ok=responses.ResponseObject,
              errors=(404,), query=({"name": "response_id", "in": "path", "required": True,
                                     "schema": {"type": "string"}},)),
    Operation("POST", "/v1/messages", "A message (whole, or streamed with `stream` as Anthropic's named events)",
              ANTHROPIC, anthropic.MessagesRequest, anthropic.AnthropicResponse, anthropic.StreamEvent,
              errors=GENERATION_ERRORS),
    Operation("POST", "/v1/messages/count_tokens", "The prompt tokens a /v1/messages request would take", ANTHROPIC,
              anthropic.MessagesInput, anthropic.TokenCount, errors=(413, 422, 503)),
    Operation("POST", "/v1/embeddings", "Embeddings (OpenAI's; `--task embed`)", EMBEDDINGS, pooling.EmbeddingRequest,
              pooling.EmbeddingList, errors=POOLING_ERRORS),
    Operation("POST", "/embed", "Embeddings as a list of vectors (TEI's; `--task embed`)", EMBEDDINGS,
              pooling.EmbedRequest, {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
              errors=POOLING_ERRORS),
    Operation("POST", "/v1/rerank", "Documents ordered by relevance to a query (Cohere's and Jina's shape)",
              EMBEDDINGS, pooling.RerankRequest, pooling.RerankResponse, errors=POOLING_ERRORS),
    Operation("POST", "/rerank", "As /v1/rerank; a body with `texts` is TEI's and answered in TEI's shape",
              EMBEDDINGS, one_of(pooling.RerankRequest, pooling.TeiRerankRequest),
              {"oneOf": [ref(pooling.RerankResponse), list_of(pooling.TeiRank)]}, errors=POOLING_ERRORS),
    Operation("POST", "/score", "Scores of text pairs (vLLM's): a cross-encoder's, or an embedding model's cosine",
              EMBEDDINGS, pooling.ScoreRequest, pooling.ScoreResponse, errors=POOLING_ERRORS),
    Operation("POST", "/classify", "Labels and their probabilities (vLLM's; `--task score`)", EMBEDDINGS,
              pooling.ClassifyRequest, pooling.ClassifyResponse, errors=POOLING_ERRORS),
    Operation("GET", "/ping", "SageMaker's health check (as /health)", PLATFORMS,
              errors=SERVING_ERRORS),
    Operation("POST", "/invocations", "SageMaker's inference route: a chat request (`messages`), a completion "
              "(`prompt`) or TGI's (`inputs`); on an embedding or score server, an embedding or score route's body",
              PLATFORMS,
              one_of(tgi.CompatGenerateRequest, oai.ChatRequest, oai.CompletionRequest),
              {"oneOf": [list_of(tgi.GenerateResponse), ref(oai.ChatCompletion), ref(oai.Completion)]},
              one_of(tgi.StreamResponse, oai.ChatCompletionChunk, oai.CompletionChunk), errors=GENERATION_ERRORS),
    Operation("POST", "/detokenize", "Token ids back to text (vLLM's)", PLATFORMS, ops.DetokenizeRequest,
              ops.DetokenizeResponse, errors=(413, 422, 503)),
    Operation("GET", "/tokenizer_info", "The tokenizer's configuration (vLLM's)", PLATFORMS, ok=ops.TokenizerInfo,
              errors=SERVING_ERRORS),
    Operation("GET", "/version", "The server's version (vLLM's)", PLATFORMS, ok=ops.Version),
    Operation("GET", "/queue", "Who waits and who runs (no prompt text)", OPERATIONS, ok=ops.QueueView,
              errors=SERVING_ERRORS),
    Operation("GET", "/adapters", "The LoRA adapters known and those in memory", OPERATIONS, ok=ops.Adapters,
              errors=(404, 503)),
    Operation("POST", "/adapters", "Load a LoRA adapter while serving (--api-key or --allow-adapter-loading)",
              OPERATIONS, ops.LoadAdapterRequest, ops.LoadedAdapter, errors=(403, 404, 413, 422, 429, 503)),
    Operation("POST", "/reset_prefix_cache", "Drop every cached KV block that no sequence holds (vLLM's)",
              OPERATIONS, ok=ops.PrefixCacheReset, errors=SERVING_ERRORS),
    Operation("POST", "/sleep", "Drop the prefix cache and give the KV memory back until the next request (vLLM's)",
              OPERATIONS, ok=ops.Sleeping, errors=(409, 503), query=({"name": "level", "in": "query",
                                                                      "required": False,
                                                                      "schema": {"type": "integer"}},)),
    Operation("POST", "/wake_up", "Wake a sleeping server (vLLM's; a request wakes it too)", OPERATIONS,
              ok=ops.Sleeping, errors=SERVING_ERRORS),
    Operation("GET", "/is_sleeping", "Whether the server sleeps (vLLM's)", OPERATIONS, ok=ops.Sleeping,
              errors=SERVING_ERRORS),
    Operation("GET", "/debug/profile", "A flame graph of every thread over `seconds` (--enable-profiling; py-spy)",
              OPERATIONS, ok_media="image/svg+xml", errors=(422, 429, 500, 501),
              query=({"name": "seconds", "in": "query", "required": False,
                      "schema": {"type": "integer", "minimum": 1, "maximum": 60, "default": 10}},)),
    Operation("GET", "/api-doc/openapi.json", "This OpenAPI document (TGI's path)", DOCS, ok=ANY_OBJECT),
    Operation("GET", "/openapi.json", "This OpenAPI document", DOCS, ok=ANY_OBJECT),
    Operation("GET", "/docs", "This document, rendered (Swagger UI from a CDN, or a plain listing offline)", DOCS,
              ok_media="text/html"),
)

OPERATIONS_BY_KEY = {operation.key: operation for operation in OPERATIONS_TABLE}



def models_by_name() -> dict[str, type[BaseModel]]:
    """Every shape of :mod:`~tokenmill.http.schemas`' modules by its component name (its class name)."""
    found: dict[str, type[BaseModel]] = {}
    for module in (tgi, oai, responses, anthropic, pooling, ops):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == module.__name__:
                if value.__name__ in found:
                    raise RuntimeError(f"two shapes are named {value.__name__}: component names must be unique")
                found[value.__name__] = value
    return found
