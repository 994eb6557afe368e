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
    """``generate``, ``generate_stream``, ``compat_generate`` (``POST /``), ``chat_completions`` or ``completions``."""
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
    max_new_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    error_type: str | None = None
    """None for a success; TGI's ``error_type`` (validation, overloaded, generation, unhealthy, ...)."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """The request's parameters (never its prompt)."""
    inputs: str | None = None
    """The prompt, kept only with ``--log-prompts``."""

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
    if record.inputs is not None:
        fields["inputs"] = record.inputs
    if record.succeeded:
        fields["finish_reason"] = record.finish_reason
        log.info("%s succeeded: %s, %d tokens in %.3fs", record.route, record.finish_reason, record.generated_tokens,
                 record.total_seconds, extra={"fields": fields})
    else:
        fields.update(error=record.error, error_type=record.error_type)
        log.info("%s failed (%s): %s", record.route, record.error_type, record.error, extra={"fields": fields})
