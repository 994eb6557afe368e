"""The gateway as a whole ``nginx.conf``, run in the foreground: ``nginx -p DIR -c FILE``.

Every path in it (pid, logs, request and response buffers) is relative, so under the prefix
``DIR``. A request's ``x-model`` picks, through a ``map``, an internal location per model: there
its timeout, body size and connection limits apply and the request goes to that model's ``upstream``,
its body read whole first (request buffering), with response buffering off so that server-sent
events pass as they are produced.
"""

from __future__ import annotations

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

INTERNAL = "/.tokenmill-gateway"
"""The prefix of the per-model internal locations (never reachable from outside)."""
MISSING, UNKNOWN = "missing", "unknown"
"""The map's values for no ``x-model`` and an unknown one: never an upstream's (those start ``model_``)."""
CONNECT_TIMEOUT_S = 5
KEEPALIVE = 32
"""Idle connections each worker keeps open to each model's instances."""


def quoted(text: str) -> str:
    """An nginx single-quoted string (bodies are JSON: double quotes, no single ones but escaped)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def render(gateway: Gateway) -> str:
    names = ", ".join(gateway.names)
    lines = [
        f"# tokenmill gateway-config --format nginx: {names}",
        "# Run it in the foreground with its files under DIR: nginx -p DIR -c FILE",
        "daemon off;",
        "worker_processes auto;",
        "pid nginx.pid;",
        "error_log error.log notice;",
        "",
        "events {",
        "    worker_connections 4096;",
        "}",
        "",
        "http {",
        "    access_log access.log;",
        "    client_body_temp_path client_body_temp;",
        "    proxy_temp_path proxy_temp;",
        "    fastcgi_temp_path fastcgi_temp;",
        "    uwsgi_temp_path uwsgi_temp;",
        "    scgi_temp_path scgi_temp;",
        f"    client_max_body_size {max(model.max_body for model in gateway.models)};",
        "    # Bodies are read whole, within the servers' own deadlines, before a model's server sees them:",
        "    # a client that sends slowly holds a gateway connection, never a server's concurrency place.",
        f"    client_header_timeout {BODY_TIMEOUT_S}s;",
        f"    client_body_timeout {BODY_TIMEOUT_S}s;",
        "    default_type application/json;",
        "    server_tokens off;",
        "",
        "    map $http_x_model $tokenmill_model {",
        f"        default {UNKNOWN};",
        f"        \"\" {MISSING};",
        *(f"        \"{model.name}\" {model.upstream};" for model in gateway.models),
        "    }",
        "    # GET / without x-model is the gateway's own health check.",
        "    map \"$request_method:$tokenmill_model\" $tokenmill_gateway_itself {",
        "        default 0;",
        f"        \"GET:{MISSING}\" 1;",
        f"        \"HEAD:{MISSING}\" 1;",
        "    }",
        "    limit_conn_zone $tokenmill_model zone=tokenmill_models:1m;",
        "    limit_conn_status 429;",
        "",
        *(line for model in gateway.models for line in upstream(model)),
        "    server {",
        f"        listen {listen_address(gateway)};",
        "        error_page 502 503 504 = @unavailable;",
        "        error_page 429 = @overloaded;",
        "        error_page 413 = @too_large;",
        "",
        "        location = / {",
        "            if ($tokenmill_gateway_itself) {",
        f"                return 200 {quoted(status_body(gateway))};",
        "            }",
        f"            rewrite ^ {INTERNAL}/$tokenmill_model/ last;",
        "        }",
        "        location / {",
        f"            rewrite ^(.*)$ {INTERNAL}/$tokenmill_model$1 last;",
        "        }",
        f"        location ^~ {INTERNAL}/{MISSING}/ {{",
        "            internal;",
        f"            return 404 {quoted(missing_model_body(gateway))};",
        "        }",
        f"        location ^~ {INTERNAL}/{UNKNOWN}/ {{",
        "            internal;",
        f"            return 404 {quoted(unknown_model_body(gateway))};",
        "        }",
        *(line for model in gateway.models for line in model_location(model)),
        "        location @unavailable {",
        f"            return 502 {quoted(unavailable_body())};",
        "        }",
        "        location @too_large {",
        f"            return 413 {quoted(too_large_body())};",
        "        }",
        "        location @overloaded {",
        f"            return 429 {quoted(overloaded_body())};",
        "        }",
        "    }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def listen_address(gateway: Gateway) -> str:
    host = f"[{gateway.host}]" if ":" in gateway.host else gateway.host
    return f"{host}:{gateway.port}"


def upstream(model: Model) -> list[str]:
    return [
        f"    upstream {model.upstream} {{",
        f"        zone {model.upstream} 64k;",
        *(f"        server {instance.address} max_fails=1 fail_timeout=5s;" for instance in model.instances),
        f"        keepalive {KEEPALIVE};",
        "    }",
    ]


def model_location(model: Model) -> list[str]:
    timeout = f"{model.timeout_s}s"
    return [
        f"        location ^~ {INTERNAL}/{model.upstream}/ {{",
        "            internal;",
        f"            limit_conn tokenmill_models {model.max_connections};",
        f"            client_max_body_size {model.max_body};",
        f"            rewrite ^{INTERNAL}/{model.upstream}(/.*)$ $1 break;",
        f"            proxy_pass http://{model.upstream};",
        "            proxy_http_version 1.1;",
        "            proxy_set_header Connection \"\";",
        "            proxy_set_header Host $host;",
        "            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;",
        "            proxy_set_header X-Forwarded-Proto $scheme;",
        "            proxy_buffering off;",
        "            proxy_ignore_headers X-Accel-Buffering;  # unbuffered whatever the server asks",
        "            proxy_cache off;",
        f"            proxy_connect_timeout {min(model.timeout_s, CONNECT_TIMEOUT_S)}s;",
        f"            proxy_read_timeout {timeout};",
        f"            proxy_send_timeout {timeout};",
        "            proxy_next_upstream error timeout;",
        "        }",
    ]
