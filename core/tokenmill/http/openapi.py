"""The OpenAPI 3.1 document of what this server serves, and the routes that show it:
``GET /api-doc/openapi.json`` (TGI's path), ``GET /openapi.json`` and ``GET /docs``.

The document is written from two sources: the route table (:mod:`tokenmill.http.schemas.operations`)
and the pydantic models it names, whose JSON schemas become its components. It lists the routes
the Falcon app really has, as ``falcon.inspect`` finds them once every route (plugins' too) is
added, so a route that a flag turns off is left out, and one that the table lacks (a plugin's) is
listed as undocumented rather than hidden.
"""

from __future__ import annotations

import html
import json
from typing import Any

import falcon
import falcon.asgi
import falcon.inspect
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, models_json_schema

from tokenmill import __version__
from tokenmill.config import Config
from tokenmill.http.middleware import OPEN_ROUTES
from tokenmill.http.schemas.operations import OPERATIONS_BY_KEY, TAGS, Operation, models_by_name, ref

REF_TEMPLATE = "#/components/schemas/{model}"
DOCUMENT_PATHS = ("/api-doc/openapi.json", "/openapi.json")
DOCS_PATH = "/docs"
SWAGGER_UI = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5"

STATUS_TEXT = {
    401: "No API key, or the wrong one (--api-key)", 403: "Not allowed on this server",
    404: "Not found here (no such adapter, no fast tokenizer, ...)", 409: "Not now: requests are running",
    413: "The body is larger than --payload-limit",
    422: "Invalid request (`error_type` validation)", 424: "The generation failed (`error_type` generation)",
    429: "Overloaded: --max-concurrent-requests are in flight", 500: "Internal error",
    501: "Not available on this server", 503: "Not ready yet (loading), unhealthy, or shutting down",
}


class WithoutTitles(GenerateJsonSchema):
    """Pydantic's JSON schema without a ``title`` on every field (the field's name says it)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def served_operations(app: falcon.App) -> list[tuple[str, str]]:
    """(method, path) of every route ``app`` serves, Falcon's own default responders left out."""
    return [(method.method, route.path) for route in falcon.inspect.inspect_routes(app)
            for method in route.methods if not method.internal]


def undocumented(app: falcon.App) -> list[tuple[str, str]]:
    """The routes ``app`` serves that the route table does not describe."""
    return [key for key in served_operations(app) if key not in OPERATIONS_BY_KEY]


def is_open(method: str, path: str) -> bool:
    """Whether the route answers without the API key (as :mod:`tokenmill.http.middleware` lets it)."""
    return path in OPEN_ROUTES or (path == "/" and method in ("GET", "HEAD"))


def build_document(app: falcon.App, config: Config) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``app``'s routes."""
    paths: dict[str, dict[str, Any]] = {}
    for method, path in served_operations(app):
        operation = OPERATIONS_BY_KEY.get((method, path))
        entry = describe(operation, bool(config.api_keys)) if operation else {
            "summary": "Undocumented (added by a plugin)", "responses": {"default": {"description": "Its answer"}}}
        paths.setdefault(path, {})[method.lower()] = entry
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "tokenmill", "version": __version__,
                 "description": "A TGI-compatible LLM inference server (TGI's and OpenAI's routes). Errors are "
                                "TGI's `{\"error\", \"error_type\"}` body.",
                 "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"}},
        "tags": [{"name": name, "description": text} for name, text in TAGS.items()],
        "paths": paths,
        "components": {"schemas": components(paths)},
    }
    if config.api_keys:
        document["components"]["securitySchemes"] = {"api_key": {"type": "http", "scheme": "bearer"}}
    return document


def describe(operation: Operation, api_key: bool) -> dict[str, Any]:
    """One operation of the document."""
    entry: dict[str, Any] = {"tags": [operation.tag], "summary": operation.summary,
                             "operationId": operation_id(operation)}
    if operation.query:
        entry["parameters"] = list(operation.query)
    if operation.request is not None:
        entry["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(operation.request)}}}
    content: dict[str, Any] = {}
    if operation.ok is not None:
        content["application/json"] = {"schema": ref(operation.ok)}
    elif operation.ok_media:
        content[operation.ok_media] = {"schema": {"type": "string"}}
    if operation.stream is not None:
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"],
            "description": "Each event's `data` is one JSON object of this shape (an error: TGI's error body)",
            "properties": {"data": {"type": "string", "contentMediaType": "application/json",
                                    "contentSchema": ref(operation.stream)}}}}
    ok: dict[str, Any] = {"description": "OK"}
    if content:
        ok["content"] = content
    responses: dict[str, Any] = {"200": ok}
    statuses = sorted(set(operation.errors) | ({401} if api_key and not is_open(*operation.key) else set()))
    for status in statuses:
        responses[str(status)] = {"description": STATUS_TEXT[status], "content": {
            "application/json": {"schema": {"$ref": REF_TEMPLATE.format(model="ErrorResponse")}}}}
    entry["responses"] = responses
    if api_key and not is_open(*operation.key):
        entry["security"] = [{"api_key": []}]
    return entry


def operation_id(operation: Operation) -> str:
    words = operation.path.strip("/").replace("/", "_").replace(".", "_").replace("-", "_") or "root"
    return f"{operation.method.lower()}_{words}"


def components(paths: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of every model the paths refer to, and of those their schemas refer to."""
    known = models_by_name()
    wanted: dict[str, type[BaseModel]] = {"ErrorResponse": known["ErrorResponse"]}
    schemas: dict[str, Any] = {}
    while True:
        missing = {name for name in referred(paths) | referred(schemas) if name not in wanted}
        if not missing and schemas:
            return schemas
        wanted.update((name, known[name]) for name in sorted(missing))
        _, definitions = models_json_schema([(model, "validation") for model in wanted.values()],
                                                ref_template=REF_TEMPLATE, schema_generator=WithoutTitles)
        schemas = dict(definitions.get("$defs", {}))


def referred(value: Any) -> set[str]:
    """The component names that ``$ref`` values under ``value`` point at."""
    text = json.dumps(value)
    prefix = REF_TEMPLATE.format(model="")
    found, start = set(), text.find(prefix)
    while start != -1:
        end = text.find('"', start)
        found.add(text[start + len(prefix):end])
        start = text.find(prefix, end)
    return found


class OpenApiRoute:
    """``GET /api-doc/openapi.json`` and ``/openapi.json``: the document, written at the first request
    (once every route, plugins' too, has been added)."""

    def __init__(self, app: falcon.asgi.App, config: Config) -> None:
        self.app = app
        self.config = config
        self.document: bytes | None = None

    def body(self) -> bytes:
        if self.document is None:
            self.document = json.dumps(build_document(self.app, self.config)).encode()
        return self.document

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_JSON
        resp.data = self.body()


class DocsRoute:
    """``GET /docs``: Swagger UI, which comes from a CDN; where it cannot load (an offline machine) the
    page is a plain listing of the routes, written here, and says so."""

    def __init__(self, document: OpenApiRoute) -> None:
        self.document = document

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_HTML
        resp.text = docs_page(json.loads(self.document.body()))


def docs_page(document: dict[str, Any]) -> str:
    """The HTML of ``/docs`` for ``document``."""
    rows = []
    for path, methods in document["paths"].items():
        for method, entry in methods.items():
            rows.append(f"<tr><td><code>{method.upper()}</code></td><td><code>{html.escape(path)}</code></td>"
                        f"<td>{html.escape(entry.get('summary', ''))}</td>"
                        f"<td>{_shape_names(entry)}</td></tr>")
    url = "." + DOCUMENT_PATHS[0]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tokenmill {html.escape(__version__)}: HTTP API</title>
<link rel="stylesheet" href="{SWAGGER_UI}/swagger-ui.css">
<style>body{{font-family:system-ui,sans-serif;margin:1.5em}} table{{border-collapse:collapse}}
td,th{{border-bottom:1px solid #ddd;padding:.3em .6em;text-align:left;vertical-align:top}}</style>
</head><body>
<div id="swagger-ui"></div>
<div id="listing">
<h1>tokenmill {html.escape(__version__)}: HTTP API</h1>
<p>This page shows the OpenAPI document <a href="{url}">{DOCUMENT_PATHS[0]}</a> with Swagger UI, which is
loaded from a CDN ({SWAGGER_UI}). It could not load here (the machine may be offline, or scripts are off),
so the routes are listed below instead; the document holds every request and response shape.</p>
<table><tr><th>Method</th><th>Path</th><th>What it does</th><th>Request → answer</th></tr>
{chr(10).join(rows)}
</table></div>
<script src="{SWAGGER_UI}/swagger-ui-bundle.js" crossorigin="anonymous"></script>
<script>
if (window.SwaggerUIBundle) {{
  document.getElementById("listing").hidden = true;
  window.SwaggerUIBundle({{url: "{url}", dom_id: "#swagger-ui"}});
}}
</script>
</body></html>
"""


def _shape_names(entry: dict[str, Any]) -> str:
    """The request's and the 200 answer's shapes by name (``GenerateRequest → GenerateResponse``)."""
    request = entry.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    answer = entry.get("responses", {}).get("200", {}).get("content", {})
    names = [" | ".join(sorted(referred(request))) or "-" if request else "-",
             " | ".join(sorted(referred(answer))) or ", ".join(answer) or "-"]
    return html.escape(" → ".join(names))


def add_document_routes(app: falcon.asgi.App, config: Config) -> None:
    """Serve the document and its viewer on ``app`` (no API key needed, as for /health)."""
    document = OpenApiRoute(app, config)
    for path in DOCUMENT_PATHS:
        app.add_route(path, document)
    app.add_route(DOCS_PATH, DocsRoute(document))
