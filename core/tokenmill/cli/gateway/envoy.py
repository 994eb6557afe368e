"""The gateway as a static Envoy bootstrap (YAML): ``envoy -c FILE``.

One listener with an HTTP connection manager whose routes match the ``x-model`` header exactly,
one cluster per model (least-request balancing over its instances, a circuit breaker at its
connection limit), and direct JSON answers for the gateway itself and for a missing or unknown
model. Envoy's own replies to a failed upstream (503 "no healthy upstream", 504 on a timeout) and
to an open circuit breaker are rewritten into TGI's JSON error by ``local_reply_config``. Request
bodies are buffered whole (at most each model's ``max-body``; its own 413 in TGI's JSON beyond), so a
client that sends slowly never holds a server's concurrency place.
"""

from __future__ import annotations

from typing import Any

from tokenmill.cli.gateway.spec import (
    BODY_TIMEOUT_S,
    Gateway,
    Model,
    missing_model_body,
    overloaded_body,
    status_body,
    too_large_body,
    unavailable_body,
    unknown_model_body,
)

ADMIN_PORT = 9901
CONNECT_TIMEOUT_S = 5
JSON = [{"header": {"key": "content-type", "value": "application/json"}}]
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
CONNECTION_MANAGER = ("type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                      "HttpConnectionManager")
HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
BUFFER_FILTER = "envoy.filters.http.buffer"
BUFFER = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"
BUFFER_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute"


def max_body(gateway: Gateway) -> int:
    return max(model.max_body for model in gateway.models)


def render(gateway: Gateway) -> str:
    import yaml

    header = (f"# tokenmill gateway-config --format envoy: {', '.join(gateway.names)}\n"
              "# Run it with: envoy -c FILE\n")
    return header + yaml.safe_dump(bootstrap(gateway), sort_keys=False, default_flow_style=False)


def bootstrap(gateway: Gateway) -> dict[str, Any]:
    return {
        "admin": {"address": socket_address("127.0.0.1", ADMIN_PORT)},
        "static_resources": {
            "listeners": [listener(gateway)],
            "clusters": [cluster(model) for model in gateway.models],
        },
    }


def socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def listener(gateway: Gateway) -> dict[str, Any]:
    manager = {
        "@type": CONNECTION_MANAGER,
        "stat_prefix": "tokenmill_gateway",
        "codec_type": "AUTO",
        # A stream's events may be minutes apart in all; each route's own idle timeout bounds the gaps.
        "stream_idle_timeout": "0s",
        "route_config": {"name": "models", "virtual_hosts": [{
            "name": "models", "domains": ["*"], "routes": routes(gateway)}]},
        "local_reply_config": {"mappers": [
            reply_mapper(503, 429, overloaded_body(), flags=["UO"]),  # the model's circuit breaker is open
            reply_mapper(503, 502, unavailable_body()),  # no healthy upstream, connection refused or reset
            reply_mapper(504, 504, unavailable_body()),  # the upstream timed out
            body_too_large_mapper(),
        ]},
        # Bodies are read whole here, within the servers' own deadline, before a model's server sees them
        # (request_timeout ends when the request's last byte goes upstream: a response may stream on).
        "request_headers_timeout": f"{BODY_TIMEOUT_S}s",
        "request_timeout": f"{BODY_TIMEOUT_S}s",
        "http_filters": [
            {"name": BUFFER_FILTER, "typed_config": {"@type": BUFFER, "max_request_bytes": max_body(gateway)}},
            {"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}],
    }
    return {
        "name": "tokenmill_gateway",
        "address": socket_address(gateway.host, gateway.port),
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": manager}]}],
    }


def routes(gateway: Gateway) -> list[dict[str, Any]]:
    found = [model_route(model) for model in gateway.models]
    found.append({"name": "gateway_itself",
                  "match": {"path": "/", "headers": [
                      {"name": "x-model", "present_match": False},
                      {"name": ":method", "string_match": {"safe_regex": {"regex": "GET|HEAD"}}}]},
                  "direct_response": {"status": 200, "body": {"inline_string": status_body(gateway)}},
                  "response_headers_to_add": JSON})
    found.append({"name": "missing_model",
                  "match": {"prefix": "/", "headers": [{"name": "x-model", "present_match": False}]},
                  "direct_response": {"status": 404, "body": {"inline_string": missing_model_body(gateway)}},
                  "response_headers_to_add": JSON})
    found.append({"name": "unknown_model", "match": {"prefix": "/"},
                  "direct_response": {"status": 404, "body": {"inline_string": unknown_model_body(gateway)}},
                  "response_headers_to_add": JSON})
    return found


def model_route(model: Model) -> dict[str, Any]:
    timeout = f"{model.timeout_s}s"
    return {
        "name": model.upstream,
        "match": {"prefix": "/", "headers": [{"name": "x-model", "string_match": {"exact": model.name}}]},
        # timeout bounds the whole response, idle_timeout the gaps between its bytes (a stream's events).
        "route": {"cluster": model.upstream, "timeout": "0s", "idle_timeout": timeout},
        "typed_per_filter_config": {BUFFER_FILTER: {
            "@type": BUFFER_PER_ROUTE, "buffer": {"max_request_bytes": model.max_body}}},
    }


def cluster(model: Model) -> dict[str, Any]:
    return {
        "name": model.upstream,
        "type": "STRICT_DNS",
        "connect_timeout": f"{CONNECT_TIMEOUT_S}s",
        "lb_policy": "LEAST_REQUEST",
        "circuit_breakers": {"thresholds": [{
            "priority": "DEFAULT", "max_connections": model.max_connections,
            "max_requests": model.max_connections, "max_pending_requests": model.max_connections}]},
        "typed_extension_protocol_options": {HTTP_OPTIONS: {
            "@type": HTTP_OPTIONS, "explicit_http_config": {"http_protocol_options": {}}}},
        "load_assignment": {"cluster_name": model.upstream, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": socket_address(instance.host, instance.port)}}
            for instance in model.instances]}]},
    }


def body_too_large_mapper() -> dict[str, Any]:
    """The buffer filter's own 413 (local replies only: a server's 413 passes as it is) in TGI's JSON."""
    return {
        "filter": {"status_code_filter": {"comparison": {"op": "EQ", "value": {
            "default_value": 413, "runtime_key": "tokenmill_gateway.local_reply_413"}}}},
        "body": {"inline_string": too_large_body()},
        "body_format_override": {"text_format": "%LOCAL_REPLY_BODY%", "content_type": "application/json"},
    }


def reply_mapper(status: int, rewritten: int, body: str, flags: list[str] | None = None) -> dict[str, Any]:
    """Envoy's own reply with ``status`` (not an upstream's answer: it carries a response flag, one of
    ``flags`` where given) becomes ``rewritten`` with ``body``."""
    return {
        "filter": {"and_filter": {"filters": [
            {"status_code_filter": {"comparison": {"op": "EQ", "value": {
                "default_value": status, "runtime_key": f"tokenmill_gateway.local_reply_{status}"}}}},
            {"response_flag_filter": {"flags": flags} if flags else {}},
        ]}},
        "status_code": rewritten,
        "body": {"inline_string": body},
        "body_format_override": {"text_format": "%LOCAL_REPLY_BODY%", "content_type": "application/json"},
    }
