"""OpenAI's request and response shapes (``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``) as tokenmill serves them: TGI's types for the fields TGI has, OpenAI's (which take
null nearly everywhere) for the rest, and vLLM's extra body fields.

A field documented as a union accepts each of its forms (``stop``: a string or a list; TGI's
``logit_bias`` list beside OpenAI's map). What needs the conversation, the model or the server's
limits to check (tool schemas, response formats, token ids, ``n`` × prompts) is checked by
:mod:`tokenmill.http.openai.convert` and :mod:`tokenmill.http.openai.chat`.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from tokenmill.http.schemas import RequestModel, ResponseModel
from tokenmill.http.schemas.kinds import (
    Boolean,
    Integer,
    Number,
    Object,
    String,
    documented_as,
    integer,
    number,
    one_of,
    string,
)
from tokenmill.http.tgi.schemas import MAX_STOP_TOKEN_IDS, LogitBiases, StopSequence, TokenIds

Stop = Annotated[StopSequence | list[StopSequence], one_of(
    "a stop sequence (a string of 1 to 512 characters) or a list of them")]
LogitBias = Annotated[LogitBiases | list[Number], one_of(
    "an object of token ids to numbers between -100 and 100")]
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOOLS = 128
"""The most tools one request may offer (OpenAI's limit)."""
Function = string(enum=("function",))


class StreamOptions(RequestModel):
    include_usage: Boolean = Field(False, description="Send the usage in a last chunk before `data: [DONE]`")


MAX_CHOICES = 256
"""The most alternatives a ``choice`` constraint may list."""
JsonSchema = Annotated[Object | String, one_of("a JSON schema (an object, or its JSON text)")]
Choices = Annotated[list[String], Field(min_length=1, max_length=MAX_CHOICES)]


class StructuredOutputs(RequestModel):
    """vLLM's ``structured_outputs``: one constraint on the output (another field is a 422)."""

    KINDS: ClassVar[tuple[str, ...]] = ("json", "regex", "choice", "grammar", "json_object")
    json_: JsonSchema | None = Field(None, alias="json", description="A JSON schema the output must follow")
    regex: String | None = Field(None, description="A regular expression the whole output must match")
    choice: Choices | None = Field(None, description="The output is exactly one of these")
    grammar: String | None = Field(None, description="A grammar in llguidance's Lark dialect")
    json_object: Boolean | None = Field(None, description="The output is a JSON object")

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""vLLM's older spelling of ``structured_outputs``' json, regex, choice and grammar."""


class SamplingFields(RequestModel):
    """What both generation routes take: OpenAI's sampling fields, then vLLM's and tokenmill's extras."""

    model: String | None = Field(None, description="The base model's name, or a LoRA adapter's (GET /v1/models)")
    frequency_penalty: number(minimum=-2, maximum=2) | None = None
    presence_penalty: number(minimum=-2, maximum=2) | None = None
    repetition_penalty: number(exclusiveMinimum=0) | None = Field(None, description="TGI's repetition penalty")
    temperature: number(minimum=0, maximum=2) | None = Field(None, description="0: greedy; default 1")
    top_p: number(exclusiveMinimum=0, maximum=1) | None = None
    top_k: integer(exclusiveMinimum=0) | None = None
    seed: integer(minimum=-(2**63), exclusiveMaximum=2**64) | None = Field(
        None, description="Any 64-bit integer, signed or not")
    max_tokens: integer(minimum=0) | None = Field(None, description="0 only with echo (scores the prompt)")
    stop: Stop | None = None
    n: integer(minimum=1) | None = Field(None, description="Choices per prompt (n × prompts <= "
                                                           "--max-client-batch-size)")
    stream: Boolean = False
    stream_options: StreamOptions | None = None
    watermark: Boolean | None = Field(None, description="TGI's watermark")
    user: String | None = Field(None, description="Not used")
    min_p: number(minimum=0, maximum=1) | None = Field(
        None, description="Drop tokens less likely than min_p times the most likely one")
    min_tokens: integer(minimum=0) | None = Field(None, description="Generate at least this many tokens")
    ignore_eos: Boolean | None = Field(None, description="Do not stop at EOS")
    stop_token_ids: TokenIds | None = Field(None, max_length=MAX_STOP_TOKEN_IDS,
                                           description="Stop when one of these tokens is generated")
    logit_bias: LogitBias | None = Field(
        None, description="Token id (as a string) -> a bias in [-100, 100] added to its logit; TGI's list form "
                          "is taken too")
    cache_salt: string(min_length=1) | None = Field(None, description="Keeps this request's prefix-cache "
                                                                      "entries apart")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's output constraint")
    guided_json: JsonSchema | None = Field(None, description="vLLM's older `structured_outputs.json`")
    guided_regex: String | None = Field(None, description="vLLM's older `structured_outputs.regex`")
    guided_choice: Choices | None = Field(None, description="vLLM's older `structured_outputs.choice`")
    guided_grammar: String | None = Field(None, description="vLLM's older `structured_outputs.grammar` (Lark)")
    guided_decoding_backend: String | None = Field(None, description="Not used: this server has one, llguidance")


# --- chat requests ----------------------------------------------------------------------------------


class ImageUrl(RequestModel):
    url: String = Field(description="A data URL (data:image/png;base64,...), or an http(s) URL where the server "
                                    "fetches them (--allow-image-urls)")
    detail: String | None = Field(None, description="OpenAI's; not used")


class ContentPart(RequestModel):
    type: String = Field(description='"text", or "image_url" for a vision-language model')
    text: String | None = None
    image_url: ImageUrl | None = None


Content = Annotated[String | list[ContentPart], one_of("a string or a list of content parts")]


class FunctionCall(RequestModel):
    name: String
    arguments: Annotated[String | Object, one_of("a JSON object or its text")] = "{}"


class ToolCall(RequestModel):
    """A call the assistant made, in the conversation's history."""

    id: String
    type: Function
    function: FunctionCall


class Message(RequestModel):
    role: string(enum=ROLES)
    content: Content | None = Field(None, description="Text, or content parts; only an assistant's tool calls "
                                                      "go without")
    name: String | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: String | None = None


class FunctionDefinition(RequestModel):
    name: string(min_length=1)
    description: String | None = None
    parameters: Object | None = Field(None, description="A JSON schema of the arguments")
    arguments: Object | None = Field(None, description="TGI's name for `parameters`")


class Tool(RequestModel):
    type: Function
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: String


class NamedToolChoice(RequestModel):
    type: String | None = Field(None, description='"function"')
    function: FunctionName


ToolChoice = Annotated[Literal["auto", "none", "required"] | NamedToolChoice, one_of(
    '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')]

RESPONSE_FORMAT = {"description": 'OpenAI\'s {"type": "text" | "json_object"}, {"type": "json_schema", '
                                  '"json_schema": {"name", "schema"}}, or TGI\'s grammar',
                   "oneOf": [{"type": "object", "required": ["type"],
                              "properties": {"type": {"enum": ["text", "json_object"]}}},
                             {"type": "object", "required": ["type", "json_schema"],
                              "properties": {"type": {"enum": ["json_schema"]}, "json_schema": {
                                  "type": "object", "required": ["schema"],
                                  "properties": {"name": {"type": "string"}, "schema": {}}}}},
                             {"$ref": "#/components/schemas/GrammarType"}]}


class ChatRequest(SamplingFields):
    """``POST /v1/chat/completions`` (and TGI's ``/chat_tokenize``)."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: integer(exclusiveMinimum=0) | None = Field(None, description="Wins over max_tokens")
    logprobs: Boolean | None = None
    top_logprobs: integer(minimum=0, maximum=20) | None = Field(None, description="Needs logprobs; <= "
                                                                                   "--max-top-n-tokens")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    tool_prompt: String | None = Field(None, description="TGI's lead-in to the tools (tokenmill writes its own)")
    parallel_tool_calls: Boolean | None = Field(None, description="Whether the answer may call several tools")
    response_format: Annotated[Object, documented_as(RESPONSE_FORMAT)] | None = None
    chat_template_kwargs: Object | None = Field(None, description="Extra variables for the chat template (vLLM's)")


# --- completion requests ----------------------------------------------------------------------------

Prompt = Annotated[String | list[String] | TokenIds | list[TokenIds], one_of(
    "a string, a list of strings, a list of token ids or a list of lists of token ids")]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: Prompt = Field(description="One prompt or a batch of them, as text or as token ids")
    suffix: String | None = Field(None, description="Not supported: only null or empty")
    echo: Boolean | None = Field(None, description="Return the prompt before the completion")
    logprobs: integer(minimum=0, maximum=5) | None = Field(None, description="Top log-probabilities per token")
    best_of: Integer | None = Field(None, description="Only equal to n")


# --- responses --------------------------------------------------------------------------------------


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = Field(ge=0, description="Prompt tokens served from the prefix cache")


class CompletionTokensDetails(ResponseModel):
    reasoning_tokens: int = Field(ge=0, description="Output tokens of the reasoning (with --reasoning-parser)")


class Usage(ResponseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[ChatLogprob]


class CalledFunction(ResponseModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text")


class CalledTool(ResponseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(ResponseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = Field(None, description="The model's thinking (with --reasoning-parser; vLLM's "
                                                             "name)")
    reasoning: str | None = Field(None, description="The same thinking, under the name newer clients read")
    tool_calls: list[CalledTool] | None = None


class ChatChoice(ResponseModel):
    index: int = Field(ge=0)
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class CompletionHeader(ResponseModel):
    id: str
    created: int = Field(ge=0)
    model: str
    system_fingerprint: str


class ChatCompletion(CompletionHeader):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(ResponseModel):
    index: int = Field(ge=0)
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class ChatDelta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(ResponseModel):
    index: int = Field(ge=0)
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(CompletionHeader):
    """One event of a streamed chat; with ``include_usage`` a last one has no choices and the usage."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int = Field(ge=0)
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = Field(description="null in a stream until the last chunk")


class Completion(CompletionHeader):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(CompletionHeader):
    """One event of a streamed completion."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Model(ResponseModel):
    id: str
    object: Literal["model"]
    created: int = Field(ge=0)
    owned_by: str
    parent: str | None = Field(None, description="A LoRA adapter's base model")


class ModelList(ResponseModel):
    """The base model, then each LoRA adapter (OpenAI's list, where TGI answers one model object)."""

    object: Literal["list"]
    data: list[Model]
