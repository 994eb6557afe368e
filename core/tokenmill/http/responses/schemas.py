"""The shapes of ``POST /v1/responses``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from tokenmill.http.openai.schemas import MAX_TOOLS
from tokenmill.http.schemas import RequestModel, ResponseModel
from tokenmill.http.schemas.kinds import Boolean, Object, String, integer, number, one_of, string

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class InputItem(RequestModel):
    """A message (``role`` and ``content``), a ``function_call`` the model made, or its
    ``function_call_output``; reasoning items of earlier turns are not shown again."""

    type: string(enum=ITEM_TYPES) | None = Field(None, description='Default "message"')
    role: string(enum=("user", "assistant", "system", "developer")) | None = None
    content: Annotated[String | list[Object], one_of("a string or a list of content parts")] | None = None
    call_id: String | None = None
    name: String | None = None
    arguments: String | None = None
    output: Annotated[String | list[Object], one_of("a string or a list of content parts")] | None = None


class FunctionTool(RequestModel):
    type: string(enum=("function",))
    name: string(min_length=1)
    description: String | None = None
    parameters: Object | None = None
    strict: Boolean | None = None


class NamedFunction(RequestModel):
    type: string(enum=("function",))
    name: String


class ResponsesRequest(RequestModel):
    """``POST /v1/responses``."""

    model: String | None = None
    input: Annotated[String | list[InputItem], one_of("a string or a list of input items")]
    instructions: String | None = Field(None, description="A system message for this response only")
    previous_response_id: String | None = None
    store: Boolean = True
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Annotated[Literal["auto", "none", "required"] | NamedFunction,
                           one_of('"auto", "none", "required" or {"type": "function", "name": ...}')] | None = None
    parallel_tool_calls: Boolean | None = None
    max_output_tokens: integer(minimum=1) | None = None
    temperature: number(minimum=0, maximum=2) | None = None
    top_p: number(exclusiveMinimum=0, maximum=1) | None = None
    stream: Boolean = False
    text: Object | None = Field(None, description='{"format": {"type": "text" | "json_object" | "json_schema", ...}}')
    reasoning: Object | None = None
    metadata: Object | None = None
    user: String | None = None
    seed: integer() | None = Field(None, description="Not OpenAI's: a sampling seed, as vLLM takes it")
    chat_template_kwargs: Object | None = Field(None, description="Not OpenAI's: extra chat template variables "
                                                                  '(vLLM\'s), such as {"enable_thinking": false}')


class ResponseUsage(ResponseModel):
    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    input_tokens_details: dict[str, int]
    output_tokens_details: dict[str, int]


class ResponseObject(ResponseModel):
    """A response: its ``output`` items (``reasoning``, ``message``, ``function_call``)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None = None
    previous_response_id: str | None = None
    incomplete_details: dict[str, Any] | None = None


class ResponseEvent(ResponseModel):
    """One streamed event's data (its SSE ``event:`` name is its ``type``)."""

    type: str
    sequence_number: int = Field(ge=0)
