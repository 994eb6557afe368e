"""Logging: plain lines, or JSON lines with ``--json-output`` (gunicorn's own loggers included).

Every line written while a request is handled carries its id (``request_id`` in JSON). A record
may carry structured ``fields`` (``extra={"fields": {...}}``), which JSON lines include whole.
"""

from __future__ import annotations

import json
import logging
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


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "timestamp": self.formatTime(record),
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry["fields"] = fields
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class PlainFormatter(logging.Formatter):
    """A line of text; a record's ``fields`` follow its message as ``key=value`` pairs."""

    def __init__(self) -> None:
        super().__init__(PLAIN_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line += "".join(f" {key}={json.dumps(value, default=str)}" for key, value in fields.items())
        return line


def setup_logging(json_output: bool) -> None:
    handler = logging.StreamHandler()
    if json_output:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(PlainFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def gunicorn_logconfig(json_output: bool) -> dict[str, Any]:
    """A ``logconfig_dict`` that sends gunicorn's loggers through the same format as ours."""
    formatter: dict[str, Any] = {"()": JsonFormatter if json_output else PlainFormatter}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"tokenmill": formatter},
        "filters": {"request_id": {"()": RequestIdFilter}},
        "handlers": {
            "console": {"class": "logging.StreamHandler", "formatter": "tokenmill", "filters": ["request_id"]},
        },
        "root": {"level": "INFO", "handlers": ["console"]},
        "loggers": {
            "gunicorn.error": {"level": "INFO", "handlers": [], "propagate": True},
            "gunicorn.access": {"level": "INFO", "handlers": [], "propagate": True},
        },
    }
