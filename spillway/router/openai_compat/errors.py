"""Every failure on the OpenAI-compatible paths in OpenAI's error shape, mapped once.

The door answers through the core's catch-and-log (``spillway.protocol.replies.guarded``:
a ``SpillwayError`` is logged and answered with its status and ``{"error", "code"}``,
anything else logged with its traceback and answered 500), and the router's walk returns
a backend's error answer as it came. Both are V2 error replies; ``openai_reply`` rewrites
any of them into ``{"error": {"message", "type", "param", "code"}}`` with the same status
and headers (``Retry-After``, ``Allow``, ``x-spillway-*``), the stable Spillway code as
``code``. So the ``openai`` client raises the exception class of the status, and a
caller that reads ``code`` reads the one every other door gives for the same input.
"""

from __future__ import annotations

import json
from typing import Any

from spillway.protocol.replies import Reply, json_reply

ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
"""OpenAI's ``type`` by status; any other 4xx is ``invalid_request_error``, a 5xx
``server_error``."""
_DROPPED_HEADERS = frozenset({"content-type", "content-length"})


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    if status >= 500:
        return "server_error"
    return ERROR_TYPES.get(status, "invalid_request_error")


def openai_reply(reply: Reply, param: str | None = None) -> Reply:
    """``reply`` as the OpenAI-compatible door answers it: a success as it is, an error
    (a V2 ``{"error", "code"}`` body, or any body a gateway in between wrote) in OpenAI's
    shape, with ``param`` naming the request field at fault."""
    if reply.status < 400:
        return reply
    message, code = _v2_error(reply)
    body = {
        "error": {
            "message": message,
            "type": error_type(reply.status),
            "param": param,
            "code": code,
        }
    }
    headers = [(k, v) for k, v in reply.headers if k not in _DROPPED_HEADERS]
    return json_reply(reply.status, body, headers)


def _v2_error(reply: Reply) -> tuple[str, str]:
    """The message and code of a V2 error body; a body of another shape (a gateway's)
    gets a message naming the status, and ``internal`` (5xx) or ``invalid_input``."""
    document: Any
    try:
        document = json.loads(reply.body)
    except ValueError:
        document = None
    if isinstance(document, dict):
        message, code = document.get("error"), document.get("code")
        if isinstance(message, str) and isinstance(code, str):
            return message, code
    fallback = "internal" if reply.status >= 500 else "invalid_input"
    return f"the request failed with HTTP {reply.status}", fallback
