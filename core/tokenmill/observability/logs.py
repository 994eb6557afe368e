"""Logging: plain lines, or JSON lines with ``--json-output`` or ``LOG_FORMAT=json`` (gunicorn's own
loggers included), at the levels ``LOG_LEVEL`` sets (TGI's form: ``info``, or ``warn,tokenmill=debug``).

Every line written while a request is handled carries its id (``request_id`` in JSON). A record
may carry structured ``fields`` (``extra={"fields": {...}}``), which JSON lines include whole.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

request_id_var: ContextVar[str | None] = ContextVar("tokenmill_request_id", default=None)
"""The id of the request being handled in this context (set by the HTTP middleware)."""


class RequestIdFilter(logging.Filter):
    """Stamps each record with the current request's id (None outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

MAX_MESSAGE_CHARS = 4096
MAX_FIELD_CHARS = 2048
"""A field's most characters, as JSON (a request's ``parameters`` may be megabytes of client text)."""
MAX_PROMPT_CHARS = 32768
"""The ``inputs`` field's (``--log-prompts``)."""
CONTROL_ESCAPES = {**{code: f"\\x{code:02x}" for code in (*range(32), 127, 0x85)},
                   9: "\\t", 10: "\\n", 13: "\\r", 0x2028: "\\u2028", 0x2029: "\\u2029"}
"""Characters that would end or forge a plain log line, and how they are written instead."""


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def capped(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with each one over its limit replaced by the start of its JSON text."""
    result = {}
    for key, value in fields.items():
        text = json.dumps(value, default=str)
        limit = MAX_PROMPT_CHARS if key == "inputs" else MAX_FIELD_CHARS
        result[key] = value if len(text) <= limit else cut(text, limit)
    return result


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "timestamp": self.formatTime(record),
            "level": record.levelname,
            "target": record.name,
            "message": cut(record.getMessage(), MAX_MESSAGE_CHARS),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry["fields"] = capped(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class PlainFormatter(logging.Formatter):
    """A line of text; a record's ``fields`` follow its message as ``key=value`` pairs. Control
    characters in the message are escaped, so that no client text can end the line or forge another."""

    def __init__(self) -> None:
        super().__init__(PLAIN_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = cut(record.message, MAX_MESSAGE_CHARS).translate(CONTROL_ESCAPES)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line += "".join(f" {key}={json.dumps(value, default=str)}" for key, value in capped(fields).items())
        return line


LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
          "warning": logging.WARNING, "error": logging.ERROR, "off": logging.CRITICAL + 1}
"""``LOG_LEVEL``'s words (Rust's tracing levels, as TGI takes them) and Python's levels for them."""


class LogLevelError(ValueError):
    """A ``LOG_LEVEL`` that cannot be read; the message says which part."""


def log_levels(spec: str | None) -> dict[str, int]:
    """``LOG_LEVEL`` read as TGI's filter: comma-separated ``level`` (every logger) or ``target=level``
    (that logger and its children; Rust's ``a::b`` is Python's ``a.b``). The root logger is ``""``;
    info when the spec gives none."""
    levels = {"": logging.INFO}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        target, _, word = item.rpartition("=")
        level = LEVELS.get(word.strip().lower())
        if level is None:
            raise LogLevelError(f"LOG_LEVEL: {item!r} names no level (levels: {', '.join(LEVELS)})")
        levels[target.strip().replace("::", ".")] = level
    return levels


def wants_json(json_output: bool, env: Mapping[str, str] | None = None) -> bool:
    """JSON lines with ``--json-output`` or ``LOG_FORMAT=json``."""
    env = os.environ if env is None else env
    return json_output or env.get("LOG_FORMAT", "").strip().lower() == "json"


def setup_logging(json_output: bool, env: Mapping[str, str] | None = None) -> None:
    """Configure the root logger for ``--json-output`` / ``LOG_FORMAT`` and ``LOG_LEVEL`` (raises
    LogLevelError)."""
    env = os.environ if env is None else env
    levels = log_levels(env.get("LOG_LEVEL"))
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if wants_json(json_output, env) else PlainFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    for target, level in levels.items():
        logging.getLogger(target or None).setLevel(level)


def gunicorn_logconfig(json_output: bool, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A ``logconfig_dict`` that sends gunicorn's loggers through the same format and levels as ours."""
    env = os.environ if env is None else env
    formatter: dict[str, Any] = {"()": JsonFormatter if wants_json(json_output, env) else PlainFormatter}
    levels = log_levels(env.get("LOG_LEVEL"))
    root_level = logging.getLevelName(levels.pop(""))
    targets = {target: {"level": logging.getLevelName(level)} for target, level in levels.items()}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"tokenmill": formatter},
        "filters": {"request_id": {"()": RequestIdFilter}},
        "handlers": {
            "console": {"class": "logging.StreamHandler", "formatter": "tokenmill", "filters": ["request_id"]},
        },
        "root": {"level": root_level, "handlers": ["console"]},
        "loggers": {
            "gunicorn.error": {"level": root_level, "handlers": [], "propagate": True},
            "gunicorn.access": {"level": root_level, "handlers": [], "propagate": True},
            **targets,
        },
    }
