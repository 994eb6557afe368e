"""TGI's request and response shapes (``/generate``, ``/generate_stream``, ``/``, ``/tokenize``), as
its OpenAPI description (``router/src/lib.rs``) types them, plus tokenmill's extra parameters.

Requests check JSON kinds and nullability exactly as TGI's serde does: a parameter may be absent,
but only those that are ``Option`` in TGI may be null; unknown fields are kept (``extra="allow"``)
for the handlers and plugins that read them. The ranges TGI's spec gives are checked here too
(worded as TGI's validation words them); those that depend on the server's limits (``--max-best-of``,
``--max-total-tokens``, ...) or the vocabulary are checked by :mod:`tokenmill.http.tgi.validation`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, PlainValidator, RootModel

from tokenmill.config.settings import PRIORITY_CLASSES
from tokenmill.http.schemas import RequestModel, ResponseModel
from tokenmill.http.schemas.kinds import (
    Boolean,
    String,
    documented_as,
    integer,
    kind_error,
    number,
    one_of,
    string,
)

# --- grammars (documented; ``tokenmill.sampling.grammar`` reads them, with precise errors) ------------


class JsonSchemaConfig(BaseModel):
    name: String | None = Field(None, description="A name for the schema (not used)")
    schema_: Any = Field(alias="schema", description="The JSON schema the output must follow")


class JsonGrammar(BaseModel):
    type: Literal["json"]
    value: Any = Field(description="A JSON schema (an object, or its JSON text)")


class RegexGrammar(BaseModel):
    type: Literal["regex"]
    value: String = Field(description="A regular expression the whole output must match")


class JsonSchemaGrammar(BaseModel):
    type: Literal["json_schema"]
    value: JsonSchemaConfig


class GrammarType(RootModel[Annotated[JsonGrammar | RegexGrammar | JsonSchemaGrammar, Field(discriminator="type")]]):
    """What the output must follow: a JSON schema or a regular expression."""


TokenIds = Annotated[list[integer(minimum=0)], one_of("a list of token ids (integers)")]
MAX_STOP_TOKEN_IDS = 1024
"""The most ``stop_token_ids`` a request may give: each generated token is checked against them."""
MAX_STOP_CHARACTERS = 512
"""The longest stop sequence a request may give (matched as text, one character at a time)."""
MAX_LOGIT_BIAS = 100
"""OpenAI's bound on a token's bias either way (100 all but forces the token, -100 bans it)."""
MAX_LOGIT_BIASES = 1024
"""The most tokens one request may bias."""
StopSequence = string(min_length=1, max_length=MAX_STOP_CHARACTERS)
LogitBiases = Annotated[dict[str, number(minimum=-MAX_LOGIT_BIAS, maximum=MAX_LOGIT_BIAS)],
                        Field(max_length=MAX_LOGIT_BIASES)]
"""Token id (as a string; validation checks it against the vocabulary) -> a bias added to its logit."""
GRAMMAR_KINDS = ("json", "json_schema", "regex")
Priority = string(enum=PRIORITY_CLASSES)


def _grammar(value: Any) -> dict[str, Any]:
    """TGI's grammar, its shape only (``tokenmill.sampling.grammar`` compiles it, and names what is wrong in it)."""
    if not isinstance(value, dict) or "type" not in value or "value" not in value:
        raise kind_error('an object with `type` ("json", "json_schema" or "regex") and `value`')
    if value["type"] not in GRAMMAR_KINDS:
        raise kind_error(f"one of {', '.join(GRAMMAR_KINDS)}", at="type")
    inner = value["value"]
    if value["type"] == "regex" and not isinstance(inner, str):
        raise kind_error("a string (a regular expression)", at="value")
    if value["type"] == "json_schema":
        if not isinstance(inner, dict) or "schema" not in inner:
            raise kind_error("an object with `schema` (and an optional `name`)", at="value")
        if inner.get("name") is not None and not isinstance(inner["name"], str):
            raise kind_error("a string", detail=repr(inner["name"]), at="value.name")
    return value


Grammar = Annotated[dict[str, Any], PlainValidator(_grammar),
                    documented_as({"$ref": "#/components/schemas/GrammarType"})]


# --- requests ---------------------------------------------------------------------------------------


class GenerateParameters(RequestModel):
    """The ``parameters`` of a generation request: TGI's, then tokenmill's own (after ``watermark``)."""

    adapter_id: String | None = Field(None, description="The LoRA adapter to generate with (GET /adapters)")
    best_of: integer(exclusiveMinimum=0) | None = Field(
        None, description="Sample this many sequences and return the one of the highest log-probability "
                          "(<= --max-best-of; needs sampling)")
    decoder_input_details: Boolean = Field(False, description="Return the prompt's tokens and their log-probabilities")
    details: Boolean = Field(False, description="Return the generation details")
    do_sample: Boolean = Field(False, description="Sample; greedy when false and no sampling parameter is set")
    frequency_penalty: number(minimum=-2, maximum=2) | None = Field(
        None, description="Lowers a token's score by its count in the output so far, times this")
    grammar: Grammar | None = None
    max_new_tokens: integer(exclusiveMinimum=0) | None = Field(
        None, description="The most tokens to generate (prompt + this <= --max-total-tokens); the room left "
                          "when absent")
    repetition_penalty: number(exclusiveMinimum=0) | None = Field(
        None, description="Divides the scores of tokens already seen (1.0: no penalty)")
    return_full_text: Boolean | None = Field(None, description="Prepend the prompt to the generated text")
    seed: integer(minimum=0, exclusiveMaximum=2**64) | None = Field(None, description="The sampling seed")
    stop: list[StopSequence] = Field(
        default_factory=list, description="Stop when one of these is generated (at most --max-stop-sequences)")
    temperature: number(exclusiveMinimum=0) | None = Field(None, description="Divides the logits")
    top_k: integer(exclusiveMinimum=0) | None = Field(None, description="Keep only the k most likely tokens")
    top_n_tokens: integer(minimum=0) | None = Field(
        None, description="Return this many most likely tokens at each step (<= --max-top-n-tokens)")
    top_p: number(exclusiveMinimum=0, exclusiveMaximum=1) | None = Field(
        None, description="Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p")
    truncate: integer(exclusiveMinimum=0) | None = Field(None, description="Keep only the prompt's last n tokens")
    typical_p: number(exclusiveMinimum=0, exclusiveMaximum=1) | None = Field(
        None, description="Typical decoding mass (arXiv:2202.00666)")
    watermark: Boolean = Field(False, description="Watermark the output (arXiv:2301.10226)")
    # tokenmill's own, and vLLM's sampling extras
    presence_penalty: number(minimum=-2, maximum=2) | None = Field(
        None, description="Lowers the score of every token already in the output by this")
    occurrence_penalty: number(minimum=-2, maximum=2) | None = Field(
        None, description="OpenAI's frequency penalty: lowers a token's score by its count in the output")
    min_p: number(minimum=0, maximum=1) | None = Field(
        None, description="Drop tokens less likely than min_p times the most likely one (vLLM's)")
    min_tokens: integer(minimum=0) | None = Field(
        None, description="Generate at least this many tokens before EOS, stop tokens or stop sequences end it")
    ignore_eos: Boolean = Field(False, description="Do not stop at EOS (vLLM's)")
    stop_token_ids: TokenIds | None = Field(None, max_length=MAX_STOP_TOKEN_IDS,
                                           description="Stop when one of these tokens is generated")
    logit_bias: LogitBiases | None = Field(
        None, description="Token id (as a string) -> a bias in [-100, 100] added to its logit")
    priority: Priority = Field(
        "normal", description="The request's class for the scheduler (also the X-Priority header)")
    cache_salt: string(min_length=1) | None = Field(
        None, description="Keeps this request's prefix-cache entries apart from others' (tenants)")


class GenerateRequest(RequestModel):
    """``POST /generate``, ``/generate_stream`` and ``/tokenize`` (whose parameters are checked, then unused)."""

    errors_named_within: ClassVar[tuple[str, ...]] = ("parameters",)
    inputs: String = Field(examples=["My name is Olivier and I"])
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)


class CompatGenerateRequest(GenerateRequest):
    """``POST /``: ``stream`` chooses between /generate's answer (in a list) and /generate_stream's."""

    stream: Boolean = False


# --- responses --------------------------------------------------------------------------------------

FinishReason = Literal["length", "eos_token", "stop_sequence"]


class PrefillToken(ResponseModel):
    id: int = Field(ge=0)
    text: str
    logprob: float | None


class Token(ResponseModel):
    id: int = Field(ge=0)
    text: str
    logprob: float | None
    special: bool


class SequenceDetails(ResponseModel):
    """What TGI's details say of one generated sequence."""

    finish_reason: FinishReason
    generated_tokens: int = Field(ge=0)
    seed: int | None = Field(None, ge=0)
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None


class BestOfSequence(SequenceDetails):
    generated_text: str


class Details(SequenceDetails):
    best_of_sequences: list[BestOfSequence] | None = None


class GenerateResponse(ResponseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(ResponseModel):
    finish_reason: FinishReason
    generated_tokens: int = Field(ge=0)
    seed: int | None = Field(None, ge=0)
    input_length: int = Field(ge=0)


class StreamResponse(ResponseModel):
    """One event of a TGI stream; the last carries ``generated_text`` (and ``details`` when asked)."""

    index: int = Field(ge=0)
    token: Token
    top_tokens: list[Token] = []
    generated_text: str | None = None
    details: StreamDetails | None = None


class ErrorResponse(ResponseModel):
    """Every error: ``validation`` (422), ``generation`` (424), ``overloaded`` (429), ``unhealthy`` (503), ..."""

    error: str
    error_type: str


class SimpleToken(ResponseModel):
    id: int = Field(ge=0)
    text: str
    start: int = Field(ge=0)
    stop: int = Field(ge=0)


class TokenizeResponse(RootModel[list[SimpleToken]]):
    """The prompt's tokens, each with its text and character offsets."""


class ChatTokenizeResponse(ResponseModel):
    tokenize_response: list[SimpleToken]
    templated_text: str
