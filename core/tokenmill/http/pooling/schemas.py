"""The shapes of the embedding and score routes: OpenAI's ``/v1/embeddings``, TEI's ``/embed`` and
``/rerank``, Cohere's and Jina's ``/v1/rerank`` (vLLM's too), vLLM's ``/score`` and ``/classify``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from tokenmill.http.openai.schemas import Prompt
from tokenmill.http.schemas import RequestModel, ResponseModel
from tokenmill.http.schemas.kinds import Boolean, Object, String, integer, one_of, string

Texts = Annotated[String | list[String], one_of("a string or a list of strings")]
TRUNCATE_PROMPT_TOKENS = Field(None, description="Keep only the last N tokens of each input (vLLM's)")


class EmbeddingRequest(RequestModel):
    """``POST /v1/embeddings`` (OpenAI's)."""

    input: Prompt = Field(description="A text, a list of texts, token ids, or a list of token id lists")
    model: String | None = None
    encoding_format: string(enum=("float", "base64")) | None = Field(
        None, description="float (the default) or base64: the little-endian float32 bytes, base64-encoded")
    dimensions: integer(minimum=1) | None = Field(None, description="Cut the embedding to its first N values "
                                                  "and normalize again (models trained for it: Matryoshka)")
    user: String | None = None
    truncate_prompt_tokens: integer(minimum=1) | None = TRUNCATE_PROMPT_TOKENS
    add_special_tokens: Boolean | None = Field(None, description="Add the tokenizer's special tokens (default: true)")


class EmbedRequest(RequestModel):
    """``POST /embed`` (TEI's)."""

    inputs: Texts
    normalize: Boolean | None = Field(None, description="Unit-length vectors (default: true)")
    truncate: Boolean | None = Field(None, description="Cut inputs longer than the limit instead of refusing them")
    dimensions: integer(minimum=1) | None = None


class RerankRequest(RequestModel):
    """``POST /v1/rerank`` and ``/rerank`` (Cohere's and Jina's, as vLLM serves them)."""

    query: String
    documents: list[Annotated[String | Object, one_of("a string or an object with `text`")]] = Field(min_length=1)
    model: String | None = None
    top_n: integer(minimum=0) | None = Field(None, description="Return only the best N (default: all)")
    return_documents: Boolean | None = Field(None, description="Include each document's text (default: true)")
    truncate_prompt_tokens: integer(minimum=1) | None = TRUNCATE_PROMPT_TOKENS


class TeiRerankRequest(RequestModel):
    """``POST /rerank`` with TEI's fields (``texts``)."""

    query: String
    texts: list[String] = Field(min_length=1)
    raw_scores: Boolean | None = Field(None, description="The model's logits instead of scores in [0, 1]")
    return_text: Boolean | None = None
    truncate: Boolean | None = None


class ScoreRequest(RequestModel):
    """``POST /score`` (vLLM's): ``text_1`` against each of ``text_2`` (one to one, one to many, or pairwise)."""

    text_1: Texts
    text_2: Texts
    model: String | None = None
    truncate_prompt_tokens: integer(minimum=1) | None = TRUNCATE_PROMPT_TOKENS


class ClassifyRequest(RequestModel):
    """``POST /classify`` (vLLM's)."""

    input: Texts
    model: String | None = None
    truncate_prompt_tokens: integer(minimum=1) | None = TRUNCATE_PROMPT_TOKENS


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(ResponseModel):
    object: Literal["embedding"]
    embedding: list[float] | str
    index: int


class EmbeddingList(ResponseModel):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class RerankDocument(ResponseModel):
    text: str


class RerankResult(ResponseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(ResponseModel):
    total_tokens: int


class RerankResponse(ResponseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class TeiRank(ResponseModel):
    index: int
    score: float
    text: str | None = None


class ScoreData(ResponseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(ResponseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class ClassifyData(ResponseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(ResponseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassifyData]
    usage: EmbeddingUsage
