"""The embedding and score routes: OpenAI's ``/v1/embeddings``, TEI's ``/embed``, ``/v1/rerank`` and
``/rerank`` (Cohere's and Jina's shape; TEI's when the body has ``texts``), vLLM's ``/score`` and
``/classify``.

Each request takes a concurrency slot (429 when none is free), is read and tokenized on a validation
worker (422 for what the limits refuse), and its inputs are queued on the pooling engine
(:mod:`tokenmill.engine.pooling`), batched with other requests'. A client that leaves cancels its
inputs still waiting. ``/score`` and ``/rerank`` run on a cross-encoder (``--task score``) or, on an
embedding model (``--task embed``), compare embeddings by cosine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import falcon.asgi
import torch

from tokenmill.engine.pooling import Pooled, PoolingEngine
from tokenmill.http.body import ApiError, read_json
from tokenmill.http.context import HANDED_SLOT, on_disconnect, record_of, watch_receive
from tokenmill.http.openai.convert import completion_prompts
from tokenmill.http.openai.routes import served_model
from tokenmill.http.pooling import inputs as read
from tokenmill.http.pooling.schemas import (
    ClassifyRequest,
    EmbeddingRequest,
    EmbedRequest,
    RerankRequest,
    ScoreRequest,
    TeiRerankRequest,
)
from tokenmill.http.pooling.vectors import as_base64, check_dimensions, cosine, embedding, relevance
from tokenmill.http.schemas import ValidationError, check_body
from tokenmill.http.state import ServerState
from tokenmill.http.tgi.validation import Validator

T = TypeVar("T")
Encoded = tuple[list[int], list[int] | None]
"""One model input: token ids, and a pair's token types."""


@dataclass
class Checked:
    """A request read and tokenized: its body as its route's model, and its inputs in order."""

    request: Any
    inputs: list[Encoded]

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.inputs)


class Pooling:
    """What the routes share: admission, tokenizing on a worker, and the engine's rows for the inputs."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def run(self, req: falcon.asgi.Request, task: str | None,
                  check: Callable[[Any, Validator], Checked]) -> tuple[Checked, list[torch.Tensor]]:
        """``check(body, validator)`` on a validation worker, then every input's row from the engine."""
        state = self.state
        pooler = state.ready_pooler(task)
        slot = state.take_slot(req.context.pop(HANDED_SLOT, None))
        record = record_of(req)
        try:
            body = await read_json(req, state.config)
            started = time.monotonic()
            try:
                checked = await state.workers.validate(lambda validator: check(body, validator))
            except ValidationError as error:
                raise ApiError(422, str(error), "validation") from None
            record.validation_seconds = time.monotonic() - started
            record.input_tokens = checked.tokens
            started = time.monotonic()
            rows = await self.rows(req, pooler, checked.inputs)
            record.inference_seconds = time.monotonic() - started
        finally:
            slot.release()
        state.telemetry.request_finished(record)
        return checked, rows

    async def rows(self, req: falcon.asgi.Request, pooler: PoolingEngine, inputs: list[Encoded]) -> list[torch.Tensor]:
        pooled = [Pooled(ids, types) for ids, types in inputs]
        try:
            pooler.submit(pooled)
        except RuntimeError as error:
            raise ApiError(503, f"the engine cannot serve: {error}", "unhealthy") from None
        on_disconnect(req, lambda: [item.answer.cancel() for item in pooled])
        watcher = asyncio.create_task(watch_receive(req))
        try:
            return [await asyncio.wrap_future(item.answer) for item in pooled]
        except asyncio.CancelledError:
            if any(item.answer.cancelled() for item in pooled):
                raise ApiError(499, "client disconnected", "cancelled") from None
            raise
        except RuntimeError as error:
            raise ApiError(424, str(error), "generation") from None
        finally:
            for item in pooled:
                item.answer.cancel()  # those still waiting (another input failed): no step for them
            watcher.cancel()

    @property
    def model(self) -> Any:
        assert self.state.pooler is not None
        return self.state.pooler.model


def usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


class EmbeddingsRoute:
    """``POST /v1/embeddings``: OpenAI's."""

    def __init__(self, pooling: Pooling) -> None:
        self.pooling = pooling

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        pooling = self.pooling

        def check(body: Any, validator: Validator) -> Checked:
            request = check_body(EmbeddingRequest, body)
            check_dimensions(pooling.model, request.dimensions)
            if request.input == []:
                raise ValidationError("`input` must be a string, token ids, or a non-empty list of either")
            cut = read.Cut(last=request.truncate_prompt_tokens)
            return Checked(request, read.encode_all(validator, completion_prompts(request.input), cut, "input",
                                                    request.add_special_tokens is not False))

        checked, rows = await pooling.run(req, "embed", check)
        request, normalize = checked.request, pooling.model.pooling.normalize
        vectors = [embedding(row, normalize or request.dimensions is not None, request.dimensions) for row in rows]
        encoded = [as_base64(v) if request.encoding_format == "base64" else v.tolist() for v in vectors]
        resp.media = {"object": "list", "model": served_model(pooling.state), "usage": usage(checked.tokens),
                      "data": [{"object": "embedding", "embedding": e, "index": i} for i, e in enumerate(encoded)]}


class EmbedRoute:
    """``POST /embed``: TEI's (a list of vectors, normalized unless ``normalize: false``)."""

    def __init__(self, pooling: Pooling) -> None:
        self.pooling = pooling

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        pooling = self.pooling

        def check(body: Any, validator: Validator) -> Checked:
            request = check_body(EmbedRequest, body)
            check_dimensions(pooling.model, request.dimensions)
            cut = read.Cut(to_limit=bool(request.truncate))
            return Checked(request, read.encode_all(validator, read.texts_of(request.inputs), cut, "inputs"))

        checked, rows = await pooling.run(req, "embed", check)
        request = checked.request
        resp.media = [embedding(row, request.normalize is not False, request.dimensions).tolist() for row in rows]


def pair_inputs(validator: Validator, model: Any, query: str, texts: list[str], cut: read.Cut,
                field: str) -> list[Encoded]:
    """A cross-encoder's (query, text) pairs; for an embedding model, the query then each text alone."""
    if model.task == "score":
        return [read.encode_pair(validator, query, text, cut, field) for text in texts]
    return [(read.encode(validator, text, cut, field), None) for text in [query, *texts]]


def pair_scores(model: Any, rows: list[torch.Tensor], raw: bool = False) -> list[float]:
    """Each pair's score: the cross-encoder's relevance, or the cosine of the query's embedding and the text's."""
    if model.task == "score":
        return [relevance(row, raw) for row in rows]
    return [cosine(rows[0], row) for row in rows[1:]]


class RerankRoute:
    """``POST /v1/rerank`` and ``/rerank``: the documents ordered by their relevance to the query
    (Cohere's and Jina's shape; TEI's for a body with ``texts``)."""

    def __init__(self, pooling: Pooling) -> None:
        self.pooling = pooling

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        pooling = self.pooling

        def check(body: Any, validator: Validator) -> Checked:
            tei = isinstance(body, dict) and "texts" in body and "documents" not in body
            if tei:
                request = check_body(TeiRerankRequest, body)
                texts, cut = list(request.texts), read.Cut(to_limit=bool(request.truncate))
            else:
                request = check_body(RerankRequest, body)
                texts = [read.document_text(doc, i) for i, doc in enumerate(request.documents)]
                cut = read.Cut(last=request.truncate_prompt_tokens)
            read.check_count(len(texts), validator, "texts" if tei else "documents")
            return Checked(request, pair_inputs(validator, pooling.model, request.query, texts, cut,
                                                "texts" if tei else "documents"))

        checked, rows = await pooling.run(req, None, check)
        request = checked.request
        tei = isinstance(request, TeiRerankRequest)
        scores = pair_scores(pooling.model, rows, raw=tei and bool(request.raw_scores))
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        if tei:
            texts = request.texts
            resp.media = [{"index": i, "score": scores[i], **({"text": texts[i]} if request.return_text else {})}
                          for i in order]
            return
        if request.top_n:
            order = order[:request.top_n]
        documents = [read.document_text(doc, i) for i, doc in enumerate(request.documents)]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": documents[i]}} if request.return_documents is not False else {})}
                   for i in order]
        resp.media = {"id": f"rerank-{uuid.uuid4().hex}", "model": served_model(pooling.state),
                      "usage": {"total_tokens": checked.tokens}, "results": results}


class ScoreRoute:
    """``POST /score``: vLLM's; ``text_1`` (one text, or one per ``text_2``) scored against each ``text_2``."""

    def __init__(self, pooling: Pooling) -> None:
        self.pooling = pooling

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        pooling = self.pooling

        def check(body: Any, validator: Validator) -> Checked:
            request = check_body(ScoreRequest, body)
            firsts, seconds = read.texts_of(request.text_1), read.texts_of(request.text_2)
            if len(firsts) not in (1, len(seconds)):
                raise ValidationError(f"`text_1` must hold one text or as many as `text_2` ({len(seconds)}). "
                                      f"Given: {len(firsts)}")
            read.check_count(len(seconds), validator, "text_2")
            cut = read.Cut(last=request.truncate_prompt_tokens)
            if len(firsts) == 1:
                return Checked(request, pair_inputs(validator, pooling.model, firsts[0], seconds, cut, "text_2"))
            pairs = [pair_inputs(validator, pooling.model, first, [second], cut, "text_2")
                     for first, second in zip(firsts, seconds)]
            return Checked(request, [encoded for pair in pairs for encoded in pair])

        checked, rows = await pooling.run(req, None, check)
        if pooling.model.task == "score" or len(read.texts_of(checked.request.text_1)) == 1:
            scores = pair_scores(pooling.model, rows)
        else:  # pairwise embeddings: (first, second) rows in turn
            scores = [cosine(rows[i], rows[i + 1]) for i in range(0, len(rows), 2)]
        resp.media = {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                      "model": served_model(pooling.state), "usage": usage(checked.tokens),
                      "data": [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]}


class ClassifyRoute:
    """``POST /classify``: vLLM's; each input's label and the probabilities of all labels (``--task score``)."""

    def __init__(self, pooling: Pooling) -> None:
        self.pooling = pooling

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        pooling = self.pooling

        def check(body: Any, validator: Validator) -> Checked:
            request = check_body(ClassifyRequest, body)
            cut = read.Cut(last=request.truncate_prompt_tokens)
            return Checked(request, read.encode_all(validator, read.texts_of(request.input), cut, "input"))

        checked, rows = await pooling.run(req, "score", check)
        labels = pooling.model.labels
        data = []
        for i, row in enumerate(rows):
            probs = torch.softmax(row, dim=0) if len(labels) > 1 else torch.sigmoid(row)
            best = int(torch.argmax(probs)) if len(labels) > 1 else 0
            data.append({"index": i, "label": labels[best], "probs": probs.tolist(), "num_classes": len(labels)})
        resp.media = {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                      "model": served_model(pooling.state), "usage": usage(checked.tokens), "data": data}
