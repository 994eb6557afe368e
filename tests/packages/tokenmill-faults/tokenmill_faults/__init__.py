"""tokenmill-faults: plugins that fail on demand, for tokenmill's hardening tests.

``--attention faulty`` and ``--scheduler faulty-fifo`` behave as ``sdpa`` and ``fifo`` until the
JSON file named by ``$TOKENMILL_FAULTS`` asks for a fault (the keys are listed in the package's
README); a logits processor can fail one sequence; ``GET /faults`` reports the settings read and
the faults injected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import falcon.asgi

import tokenmill
from tokenmill.interfaces import AttentionKernel, Scheduler
from tokenmill_faults.attention import FaultyAttention, register_with_transformers
from tokenmill_faults.control import CONTROL, InjectedFault
from tokenmill_faults.scheduler import FaultyFifo

tokenmill_hooks_version = "1.0"

register_with_transformers()  # before any model loads with attn_implementation="tokenmill_faulty"


@tokenmill.hookimpl
def tokenmill_attention_kernels() -> list[AttentionKernel]:
    return [FaultyAttention()]


@tokenmill.hookimpl
def tokenmill_schedulers() -> list[Scheduler]:
    return [FaultyFifo()]


class FailingProcessor:
    """A logits processor that raises when asked for its token number ``after + 1``."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.calls = 0

    def __call__(self, token_ids: list[int], scores: Any) -> Any:
        self.calls += 1
        if self.calls > self.after:
            raise InjectedFault(f"injected fault in a logits processor (token {self.calls})")
        return scores


@tokenmill.hookimpl
def tokenmill_logits_processors(parameters: dict[str, Any]) -> list[Callable[[list[int], Any], Any]]:
    CONTROL.note("processors")
    if CONTROL.take("processor_raise"):
        return [FailingProcessor(int(CONTROL.get("processor_after_tokens", 0)))]
    return []


class FaultsRoute:
    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.media = CONTROL.report()


@tokenmill.hookimpl
def tokenmill_add_routes(app: falcon.asgi.App, server: Any) -> None:
    app.add_route("/faults", FaultsRoute())
