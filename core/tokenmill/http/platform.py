"""Routes that platforms built around TGI and vLLM call: TGI's ``GET /`` health check, SageMaker's
``POST /invocations`` (its ``GET /ping`` is /health's route itself), and vLLM's ``GET /version``.

``/invocations`` takes any of TGI's request bodies, as TGI's SageMaker route does: a chat request
(``messages``) goes to /v1/chat/completions, a completion (``prompt``) to /v1/completions, anything
else to TGI's ``POST /``. On an embedding or score server (``--task``) it goes, as TEI's does, to
/v1/embeddings (``input``) or /embed (``inputs``); to /rerank (``query``), /score (``text_1``) or /classify.
"""

from __future__ import annotations

from typing import Any

import falcon.asgi

from tokenmill import __version__
from tokenmill.http.body import read_json
from tokenmill.http.context import HANDED_SLOT
from tokenmill.http.ops import HealthRoute
from tokenmill.http.state import ServerState


class RootRoute:
    """``/``: ``GET`` is TGI's health check (as /health), ``POST`` its compat generate route."""

    def __init__(self, health: HealthRoute, generate: Any) -> None:
        self.health = health
        self.generate = generate

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await self.health.on_get(req, resp)

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await self.generate.on_post(req, resp)


class InvocationsRoute:
    """SageMaker's inference route: the body's shape picks the route that answers it."""

    def __init__(self, state: ServerState, chat: Any, completions: Any, generate: Any, pooling: dict[str, Any]
                 ) -> None:
        self.state = state
        self.chat = chat
        self.completions = completions
        self.generate = generate
        self.pooling = pooling
        """The embedding and score routes by path: /v1/embeddings, /embed, /rerank, /score, /classify."""

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        """The place is taken before the body is read, and handed over with it to the route it picks."""
        self.state.check_ready()
        slot = req.context[HANDED_SLOT] = self.state.take_slot()
        try:
            body = await read_json(req, self.state.config)
            route = self.generate
            if self.state.config.task != "generate":
                route = self.pooling[pooling_path(self.state.config.task, body if isinstance(body, dict) else {})]
            elif isinstance(body, dict) and "messages" in body:
                route = self.chat
            elif isinstance(body, dict) and "prompt" in body and "inputs" not in body:
                route = self.completions
            await route.on_post(req, resp)
        finally:
            if req.context.pop(HANDED_SLOT, None) is not None:  # the route never took it
                slot.release()


def pooling_path(task: str, body: dict[str, Any]) -> str:
    """Which embedding or score route answers a SageMaker request, by its body's fields."""
    if task == "embed":
        return "/v1/embeddings" if "input" in body and "inputs" not in body else "/embed"
    if "query" in body:
        return "/rerank"
    return "/score" if "text_1" in body else "/classify"


class VersionRoute:
    """vLLM's ``GET /version``."""

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.media = {"version": __version__}
