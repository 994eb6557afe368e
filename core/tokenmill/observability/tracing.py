"""Optional OpenTelemetry traces (``--otlp-endpoint``): one span tree per finished request, sent to an
OTLP/HTTP collector as protobuf.

The OpenTelemetry packages are the ``otlp`` extra, so they are imported only inside :meth:`Tracing.start`
and never when this module is imported. Each request becomes a root span named after its route (as TGI's
router names them: ``generate``, ``generate_stream``, ``chat_completions``, ``completions``) with the
children ``validation``, ``queue`` and ``inference`` laid end to end from the request's arrival. A caller's
W3C ``traceparent`` header is continued: the root span joins its trace as a child of the caller's span (a
malformed one is ignored and the request starts a trace of its own). Spans are
built after the fact from a :class:`~tokenmill.observability.telemetry.RequestRecord` with explicit timestamps; a
``BatchSpanProcessor`` ships them from its own thread, so recording never waits on the network.
"""

from __future__ import annotations

from typing import Any

from tokenmill.observability.telemetry import RequestRecord

_TRACES_PATH = "/v1/traces"
_INSTALL_HINT = "pip install 'tokenmill[otlp]'"
_PHASES = ("validation", "queue", "inference")


class TracingUnavailable(Exception):
    """--otlp-endpoint was given but the OpenTelemetry packages are not installed; message says
    ``pip install 'tokenmill[otlp]'``."""


def require_packages() -> tuple[Any, Any, Any, Any]:
    """The OpenTelemetry classes tracing needs (exporter, resource, provider, span processor), or
    :class:`TracingUnavailable` naming the extra to install."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as error:
        raise TracingUnavailable(
            f"--otlp-endpoint needs the OpenTelemetry packages ({error}); install them with: {_INSTALL_HINT}"
        ) from error
    return OTLPSpanExporter, Resource, TracerProvider, BatchSpanProcessor


def _traces_url(endpoint: str) -> str:
    """The URL spans are POSTed to: ``endpoint`` + ``/v1/traces``, unless it already ends so."""
    base = endpoint.rstrip("/")
    return base if base.endswith(_TRACES_PATH) else base + _TRACES_PATH


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def _root_attributes(record: RequestRecord) -> dict[str, Any]:
    """The root span's attributes: short names plus the OpenTelemetry GenAI ones where they fit."""
    attributes: dict[str, Any] = {
        "request_id": record.request_id,
        "route": record.route,
        "input_tokens": record.input_tokens,
        "generated_tokens": record.generated_tokens,
        "max_new_tokens": record.max_new_tokens,
        "gen_ai.usage.input_tokens": record.input_tokens,
        "gen_ai.usage.output_tokens": record.generated_tokens,
        "gen_ai.request.max_tokens": record.max_new_tokens,
    }
    if record.finish_reason is not None:
        attributes["finish_reason"] = record.finish_reason
        attributes["gen_ai.response.finish_reasons"] = [record.finish_reason]
    for name, value in record.parameters.items():
        if isinstance(value, (str, bool, int, float)):
            attributes[f"parameters.{name}"] = value
    if record.inputs is not None:
        attributes["inputs"] = record.inputs
    if record.error_type is not None:
        attributes["error_type"] = record.error_type
        attributes["error.type"] = record.error_type
    return attributes


class Tracing:
    """Sends one span tree per finished request to an OTLP/HTTP collector."""

    def __init__(self, provider: Any) -> None:
        """Wrap a started SDK ``TracerProvider``; use :meth:`start` to build one."""
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = provider
        self._tracer = provider.get_tracer("tokenmill")
        self._server_kind = SpanKind.SERVER
        self._status, self._error_code = Status, StatusCode.ERROR
        self._in_context = set_span_in_context
        self._propagator = TraceContextTextMapPropagator()
        self._stopped = False

    @classmethod
    def start(cls, endpoint: str, service_name: str) -> Tracing:
        """Export to the collector at ``endpoint`` (``http://host:4318``, with or without ``/v1/traces``)
        as ``service_name``; raises :class:`TracingUnavailable` when the ``otlp`` extra is missing."""
        OTLPSpanExporter, Resource, TracerProvider, BatchSpanProcessor = require_packages()
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=_traces_url(endpoint))))
        return cls(provider)

    def record_request(self, record: RequestRecord) -> None:
        """Queue the spans of one finished request (success or failure); never blocks on export."""
        if self._stopped:
            return
        start = record.started_ns
        bounds = [start]
        for seconds in (record.validation_seconds, record.queue_seconds, record.inference_seconds):
            bounds.append(bounds[-1] + _ns(seconds))
        end = max(start + _ns(record.total_seconds), bounds[-1])
        root = self._tracer.start_span(
            record.route, context=self._caller_context(record), kind=self._server_kind,
            attributes=_root_attributes(record), start_time=start,
        )
        parent = self._in_context(root)
        for name, begin, finish in zip(_PHASES, bounds, bounds[1:]):
            self._tracer.start_span(name, context=parent, start_time=begin).end(end_time=finish)
        if record.error_type is not None:
            root.set_status(self._status(self._error_code, record.error or record.error_type))
        root.end(end_time=end)

    def _caller_context(self, record: RequestRecord) -> Any:
        """The caller's span from its ``traceparent`` (and ``tracestate``) as the root's parent, or None
        (a new trace) without a well-formed one; the propagator never raises on a malformed header."""
        if not record.traceparent:
            return None
        carrier = {"traceparent": record.traceparent}
        if record.tracestate:
            carrier["tracestate"] = record.tracestate
        return self._propagator.extract(carrier)

    def shutdown(self) -> None:
        """Flush queued spans and stop the exporter (at server shutdown); safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        self._provider.shutdown()
