"""Every hook a tokenmill plugin can implement.

Plugin kinds (backends, attention kernels, schedulers, KV allocators) are offered
through the ``tokenmill_*s`` hooks: each returns a list of implementations, and the
matching command-line flag picks one of them by ``name``. The other hooks let a
plugin observe and extend the server. ``hooks.md`` documents each one for plugin
authors; a test fails when a hook here is missing there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    import falcon.asgi

    from tokenmill.interfaces import AttentionKernel, Backend, KVAllocator, Quantizer, Scheduler

hookspec = pluggy.HookspecMarker("tokenmill")

HOOKS_VERSION = "1.0"
"""The version of this set of hooks, ``major.minor``: the major grows when a hook changes in a way
old plugins cannot follow, the minor when hooks are added. A plugin module says which version it
was built for (``tokenmill_hooks_version = "1.0"``); it loads when the major versions are equal
and its minor is not newer than this one, and is refused with both versions named otherwise."""


@hookspec
def tokenmill_backends() -> list[Backend]:
    """Offer engine backends.

    Called once when the plugin manager resolves ``--backend``.
    Receives nothing. Returns a list of :class:`tokenmill.interfaces.Backend`
    implementations; the one whose ``name`` equals ``--backend`` runs the model.
    """


@hookspec
def tokenmill_attention_kernels() -> list[AttentionKernel]:
    """Offer attention kernels.

    Called once when the plugin manager resolves ``--attention``.
    Receives nothing. Returns a list of :class:`tokenmill.interfaces.AttentionKernel`
    implementations; the one named by ``--attention`` is used by the backend.
    """


@hookspec
def tokenmill_schedulers() -> list[Scheduler]:
    """Offer request schedulers.

    Called once when the plugin manager resolves ``--scheduler``.
    Receives nothing. Returns a list of :class:`tokenmill.interfaces.Scheduler`
    implementations; the one named by ``--scheduler`` decides which waiting
    requests join the running batch at each engine step.
    """


@hookspec
def tokenmill_kv_allocators() -> list[KVAllocator]:
    """Offer KV-cache allocators.

    Called once when the plugin manager resolves ``--kv-allocator``.
    Receives nothing. Returns a list of :class:`tokenmill.interfaces.KVAllocator`
    implementations; the one named by ``--kv-allocator`` owns the backend's KV memory.
    """


@hookspec
def tokenmill_quantizers() -> list[Quantizer]:
    """Offer quantizers.

    Called once when the plugin manager resolves ``--quantize`` (or the
    ``quant_method`` of a pre-quantized checkpoint). Receives nothing. Returns a
    list of :class:`tokenmill.interfaces.Quantizer` implementations; the one whose
    ``name`` equals ``--quantize`` loads or quantizes the model.
    """


@hookspec
def tokenmill_load_stage(stage: str, seconds: float, detail: str) -> None:
    """Observe model loading.

    Called in the loader thread each time a load stage ends, done or failed
    (``resolving``, ``converting gguf``, ``loading weights``, ``quantizing``, ``warm-up``).
    Receives the stage name, its duration in seconds and a short detail (the path,
    or ``failed: <cause>``). Returns nothing.
    """


@hookspec
def tokenmill_request_started(request_id: str, inputs: str, parameters: dict[str, Any]) -> None:
    """Observe a request that passed validation and entered the queue.

    Called on the HTTP event loop; it must not block.
    Receives the request id (the ``X-Request-Id`` of the response and the logs), the prompt
    text and the validated parameters.
    Returns nothing.
    """


@hookspec
def tokenmill_request_finished(
    request_id: str, finish_reason: str | None, generated_tokens: int, error: str | None
) -> None:
    """Observe a request that ended: finished, failed, or cancelled by its client.

    Called on the HTTP event loop; it must not block.
    Receives the request id, the finish reason (``length``, ``eos_token``,
    ``stop_sequence``, or None when it failed or was cancelled), the number of
    generated tokens and an error message (None on success). Returns nothing.
    """


@hookspec
def tokenmill_logits_processors(
    parameters: dict[str, Any],
) -> list[Callable[[list[int], Any], Any]]:
    """Add logits processors to one request.

    Called once per sequence when it is admitted, in the engine thread.
    Receives the request's validated parameters. Returns a list of callables
    ``f(token_ids: list[int], logits: torch.Tensor[vocab]) -> torch.Tensor[vocab]``,
    applied in order after tokenmill's penalties and the watermark, before the
    grammar mask, temperature and truncation. ``token_ids`` holds the prompt and the tokens generated so far.
    """


@hookspec
def tokenmill_add_routes(app: falcon.asgi.App, server: Any) -> None:
    """Add HTTP routes.

    Called once when the Falcon app is built, before it serves.
    Receives the Falcon ASGI app and the server state (``server.config``, and
    ``server.engine``, which is None until the model is loaded). Returns nothing;
    call ``app.add_route``.
    """
