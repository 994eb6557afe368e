"""Logging: plain lines, or JSON lines with ``--json-output`` (gunicorn's own loggers included)."""

from __future__ import annotations

import json
import logging
from typing import Any

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "timestamp": self.formatTime(record),
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(json_output: bool) -> None:
    handler = logging.StreamHandler()
    if json_output:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(PLAIN_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def gunicorn_logconfig(json_output: bool) -> dict[str, Any]:
    """A ``logconfig_dict`` that sends gunicorn's loggers through the same format as ours."""
    formatter: dict[str, Any] = {"()": JsonFormatter} if json_output else {"format": PLAIN_FORMAT}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"tokenmill": formatter},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "tokenmill"}},
        "root": {"level": "INFO", "handlers": ["console"]},
        "loggers": {
            "gunicorn.error": {"level": "INFO", "handlers": [], "propagate": True},
            "gunicorn.access": {"level": "INFO", "handlers": [], "propagate": True},
        },
    }
