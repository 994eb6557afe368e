"""The shapes of Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens`` requests."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from tokenmill.http.openai.schemas import MAX_TOOLS
from tokenmill.http.schemas import RequestModel, ResponseModel
from tokenmill.http.schemas.kinds import Boolean, Object, String, integer, number, one_of, string

BLOCK_TYPES = ("text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking")


class ContentBlock(RequestModel):
    type: string(enum=BLOCK_TYPES)
    text: String | None = None
    id: String | None = Field(None, description="A tool_use block's id")
    name: String | None = Field(None, description="A tool_use block's tool")
    input: Object | None = Field(None, description="A tool_use block's arguments")
    tool_use_id: String | None = Field(None, description="The tool_use a tool_result answers")
    content: Annotated[String | list[Object], one_of("a string or a list of content blocks")] | None = None
    is_error: Boolean | None = None
    thinking: String | None = None
    source: Object | None = Field(None, description='An image block\'s source: {"type": "base64", "media_type", '
                                                    '"data"} or {"type": "url", "url"}')


Content = Annotated[String | list[ContentBlock], one_of("a string or a list of content blocks")]


class AnthropicMessage(RequestModel):
    role: string(enum=("user", "assistant"))
    content: Content


class AnthropicTool(RequestModel):
    name: string(min_length=1)
    description: String | None = None
    input_schema: Object = Field(description="A JSON schema of the tool's input")


class AnthropicToolChoice(RequestModel):
    type: string(enum=("auto", "any", "tool", "none"))
    name: String | None = Field(None, description="The tool, with type tool")
    disable_parallel_tool_use: Boolean | None = None


class MessagesInput(RequestModel):
    """What ``count_tokens`` counts: the conversation as the model will read it."""

    model: String | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Content | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: AnthropicToolChoice | None = None
    thinking: Object | None = Field(None, description='{"type": "enabled" | "disabled"}: the template\'s '
                                                      "enable_thinking")


class MessagesRequest(MessagesInput):
    """``POST /v1/messages``."""

    max_tokens: integer(minimum=1)
    stop_sequences: list[String] | None = None
    temperature: number(minimum=0, maximum=1) | None = Field(None, description="0: greedy; default 1")
    top_p: number(exclusiveMinimum=0, maximum=1) | None = None
    top_k: integer(exclusiveMinimum=0) | None = None
    stream: Boolean = False
    metadata: Object | None = None
    seed: integer() | None = Field(None, description="Not Anthropic's: a sampling seed, as vLLM takes it; vLLM's "
                                                     "other sampling extras pass through as on the chat route")


# --- responses ----------------------------------------------------------------------------------------


class AnthropicUsage(ResponseModel):
    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    cache_read_input_tokens: int | None = Field(None, ge=0, description="Prompt tokens served from the prefix cache")


class AnthropicResponse(ResponseModel):
    """A whole message: ``thinking`` (with --reasoning-parser), ``text`` and ``tool_use`` blocks."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class StreamEvent(ResponseModel):
    """One streamed event's data (its SSE ``event:`` name is its ``type``)."""

    type: Literal["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                  "message_delta", "message_stop", "error"]


class TokenCount(ResponseModel):
    input_tokens: int = Field(ge=0)
