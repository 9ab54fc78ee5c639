"""Structured JSON logs, one object a line (the keys Powertools uses on Lambda).

Request data (a path, a reason) travels as a field, JSON-escaped, so a client cannot forge
a log line with ``%0a`` in its path.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

# Attributes every LogRecord has; anything else was passed with ``extra=`` and is a field.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message"}


class JsonFormatter(logging.Formatter):
    """``{"timestamp", "level", "service", "logger", "message", ...extra}`` per record."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str, service: str) -> None:
    """Log JSON lines to stderr at ``level`` (uvicorn's loggers too)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
