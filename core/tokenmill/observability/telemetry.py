"""What the server tells operators about each request: one record, read by the metrics, the
request log line and the traces (never prompt text unless ``--log-prompts``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.observability.metrics import Metrics
    from tokenmill.observability.tracing import Tracing

log = logging.getLogger("tokenmill.requests")


@dataclass
class RequestRecord:
    """One HTTP generation request from arrival to its last byte (all its sequences together)."""

    request_id: str
    route: str
    """``generate``, ``generate_stream``, ``compat_generate`` (``POST /``), ``chat_completions``, ``completions``,
    ``invocations`` or ``messages``."""
    started_ns: int
    """Wall-clock arrival (``time.time_ns()``): where the trace's spans start."""
    started_monotonic: float = field(default_factory=time.monotonic)
    """The same moment on the monotonic clock, which the durations are measured on."""
    validation_seconds: float = 0.0
    queue_seconds: float = 0.0
    inference_seconds: float = 0.0
    total_seconds: float = 0.0
    input_tokens: int = 0
    cached_tokens: int = 0
    """Of the prompt tokens, those whose keys and values came from the prefix cache."""
    generated_tokens: int = 0
    draft_tokens: int = 0
    """With ``--speculate``: draft tokens the model checked for its (best) sequence, and of those ..."""
    accepted_tokens: int = 0
    """... the ones kept."""
    max_new_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    error_type: str | None = None
    """None for a success; TGI's ``error_type`` (validation, overloaded, generation, unhealthy, ...)."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """The request's parameters (never its prompt)."""
    inputs: str | None = None
    """The prompt, kept only with ``--log-prompts``."""
    traceparent: str | None = None
    """The caller's W3C ``traceparent`` header, which the request's trace continues (None: a new trace)."""
    tracestate: str | None = None
    """The caller's W3C ``tracestate`` header, handed on with the traceparent."""
    first_token_seconds: float | None = None
    """From arrival to the engine's first token of any of its sequences (None: no token came)."""
    tokens_received: int = 0
    """Tokens of all its sequences that reached the HTTP side (``n`` and ``best_of`` choices included)."""
    last_token_at: dict[int, float] = field(default_factory=dict, repr=False)
    """When each of its sequences (by index) last produced a token, on the monotonic clock."""

    finished: bool = False
    """Set once the record has been reported; a request is reported once."""

    @property
    def succeeded(self) -> bool:
        return self.error_type is None

    @property
    def time_per_token_seconds(self) -> float:
        return self.inference_seconds / max(self.generated_tokens, 1)


class Telemetry:
    """Where a finished request is reported: metrics, one log line, and a trace when enabled."""

    def __init__(self, metrics: Metrics, tracing: Tracing | None = None) -> None:
        self.metrics = metrics
        self.tracing = tracing
        self.open_requests = 0
        """Generation requests that arrived and are not reported yet: what a drain waits for."""

    def request_arrived(self, record: RequestRecord) -> None:
        self.open_requests += 1
        self.metrics.request_arrived()

    def token_arrived(self, record: RequestRecord, sequence: int, emitted_at: float) -> None:
        """A token of ``record``'s sequence number ``sequence``, made by the engine at ``emitted_at``
        (monotonic), reached the HTTP side. Observed as it comes, so that a long generation shows in
        the latency histograms and token counters while it runs, and no per-token list is kept."""
        last = record.last_token_at.get(sequence)
        record.last_token_at[sequence] = emitted_at
        record.tokens_received += 1
        if last is None and record.first_token_seconds is None:
            record.first_token_seconds = max(0.0, emitted_at - record.started_monotonic)
            self.metrics.first_token(record)
        self.metrics.token_generated(None if last is None else max(0.0, emitted_at - last))

    def request_finished(self, record: RequestRecord) -> None:
        """Report ``record`` once (later calls for the same request do nothing)."""
        if record.finished:
            return
        record.finished = True
        self.open_requests -= 1
        record.total_seconds = time.monotonic() - record.started_monotonic
        self.metrics.request_finished(record)
        log_request(record)
        if self.tracing is not None:
            self.tracing.record_request(record)


    def request_failed(self, record: RequestRecord, message: str, error_type: str) -> None:
        """Report ``record`` as failed, unless it was reported already."""
        if not record.finished:
            record.error, record.error_type = message, error_type
            self.request_finished(record)


def log_request(record: RequestRecord) -> None:
    """One line per request: its outcome and timings as fields (``--json-output`` shows them all)."""
    fields: dict[str, Any] = {
        "route": record.route,
        "total_time": round(record.total_seconds, 6),
        "validation_time": round(record.validation_seconds, 6),
        "queue_time": round(record.queue_seconds, 6),
        "inference_time": round(record.inference_seconds, 6),
        "time_per_token": round(record.time_per_token_seconds, 6),
        "input_tokens": record.input_tokens,
        "cached_tokens": record.cached_tokens,
        "generated_tokens": record.generated_tokens,
        "parameters": record.parameters,
    }
    if record.first_token_seconds is not None:
        fields["time_to_first_token"] = round(record.first_token_seconds, 6)
    if record.inputs is not None:
        fields["inputs"] = record.inputs
    speculated = ""
    if record.draft_tokens:
        rate = record.accepted_tokens / record.draft_tokens
        fields.update(draft_tokens=record.draft_tokens, accepted_tokens=record.accepted_tokens,
                      acceptance_rate=round(rate, 4))
        speculated = f", {rate:.0%} of {record.draft_tokens} draft tokens accepted"
    if record.succeeded:
        fields["finish_reason"] = record.finish_reason
        log.info("%s succeeded: %s, %d tokens in %.3fs%s", record.route, record.finish_reason,
                 record.generated_tokens, record.total_seconds, speculated, extra={"fields": fields})
    else:
        fields.update(error=record.error, error_type=record.error_type)
        log.info("%s failed (%s): %s", record.route, record.error_type, record.error, extra={"fields": fields})
