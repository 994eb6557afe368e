"""tokenmill-example: one plugin of each kind, as a third party writes them.

tokenmill finds this module through the ``tokenmill`` entry point in ``pyproject.toml`` and
registers the functions marked ``@tokenmill.hookimpl``; each one implements the hook of the
same name (see tokenmill's ``hooks.md``).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import falcon
import falcon.asgi

import tokenmill
from tokenmill.interfaces import Scheduler

from tokenmill_example.banned import BannedWords
from tokenmill_example.scheduler import ShortestPromptFirstQueue

tokenmill_hooks_version = "2.0"
"""The version of tokenmill's hooks this plugin was written for: tokenmill refuses to load it
into a tokenmill whose hooks it cannot follow, and says so."""

BANNED_WORDS_VARIABLE = "TOKENMILL_EXAMPLE_BANNED_WORDS"


class ShortestPromptFirst(Scheduler):
    name = "shortest-prompt-first"
    description = "waiting requests start shortest prompt first (tokenmill-example)"

    def create(self, limits: Any) -> ShortestPromptFirstQueue:
        return ShortestPromptFirstQueue(limits)


@tokenmill.hookimpl
def tokenmill_schedulers() -> list[Scheduler]:
    return [ShortestPromptFirst()]


class ExamplePlugin:
    """What the hooks share: the server (for the tokenizer), the banned words, the stages seen."""

    def __init__(self) -> None:
        self.server: Any = None
        self.stages: list[dict[str, Any]] = []
        words = [w.strip() for w in os.environ.get(BANNED_WORDS_VARIABLE, "").split(",") if w.strip()]
        self.banned: BannedWords | None = BannedWords(words) if words else None

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.media = {"stages": self.stages}


PLUGIN = ExamplePlugin()


@tokenmill.hookimpl
def tokenmill_load_stage(stage: str, seconds: float, detail: str) -> None:
    PLUGIN.stages.append({"stage": stage, "seconds": round(seconds, 3)})


@tokenmill.hookimpl
def tokenmill_add_routes(app: falcon.asgi.App, server: Any) -> None:
    PLUGIN.server = server
    app.add_route("/example/load-stages", PLUGIN)


@tokenmill.hookimpl
def tokenmill_logits_processors(parameters: dict[str, Any]) -> list[Callable[[list[int], Any], Any]]:
    loaded = getattr(PLUGIN.server, "loaded", None)
    if PLUGIN.banned is None or loaded is None:
        return []
    return [PLUGIN.banned.processor(loaded.tokenizer)]
