"""A stand-in OTLP/HTTP trace collector on loopback, for the tracing tests."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Collector:
    """An OTLP/HTTP trace receiver on loopback: decodes every POST body as ExportTraceServiceRequest."""

    url: str
    paths: list[str] = field(default_factory=list)
    resources: list[dict[str, Any]] = field(default_factory=list)
    spans: list[Any] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)
    """Cleared, the collector holds each export until it is set again (a slow collector)."""

    def span(self, name: str) -> Any:
        (match,) = [span for span in self.spans if span.name == name]
        return match

    def children(self, parent: Any) -> list[Any]:
        found = [span for span in self.spans
                 if span.parent_span_id == parent.span_id and span.trace_id == parent.trace_id]
        return sorted(found, key=lambda span: span.start_time_unix_nano)


def attributes(key_values: Any) -> dict[str, Any]:
    """OTLP KeyValue list -> plain dict (arrays become lists)."""
    def plain(value: Any) -> Any:
        kind = value.WhichOneof("value")
        if kind == "array_value":
            return [plain(item) for item in value.array_value.values]
        return getattr(value, kind)

    return {pair.key: plain(pair.value) for pair in key_values}


@contextmanager
def running_collector() -> Iterator[Collector]:
    """A collector that receives until the block ends (needs the opentelemetry-proto package)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            result.gate.wait(30)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            request = ExportTraceServiceRequest.FromString(body)
            with lock:
                result.paths.append(self.path)
                for resource_spans in request.resource_spans:
                    result.resources.append(attributes(resource_spans.resource.attributes))
                    for scope_spans in resource_spans.scope_spans:
                        result.spans.extend(scope_spans.spans)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    result = Collector(url=f"http://127.0.0.1:{server.server_address[1]}")
    result.gate.set()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        result.gate.set()
        server.shutdown()
        server.server_close()
        thread.join(5)
