"""What every transport writes back, written once.

The ``Reply`` every server returns (status, headers, body), the JSON and infer answers,
the one mapping from a ``SpillwayError`` to a status, headers and body (with the mark of
a server's own fault), the reason phrase after a status, and the catch, reply and log of
a refused request or an unexpected exception.

No numpy here: the router imports this module and must stay light.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from spillway.protocol.errors import MethodNotAllowedError, SpillwayError
from spillway.protocol.framing import BINARY_CONTENT_TYPE, HEADER_LENGTH, JSON_CONTENT_TYPE

FAULT_HEADER = "x-spillway-fault"
"""On an error answer: ``server`` when the server says the failure is its own (it failed
to compute, load or serve), so a router may count it against the server's health. An
answer without it (a client error, a busy 504, an unexpected exception) never does."""

Headers = list[tuple[str, str]]


@dataclass(frozen=True)
class Reply:
    """Status, headers (names lower-case) and body of a response."""

    status: int
    headers: Headers
    body: bytes

    def header(self, name: str) -> str | None:
        """The first value of a header."""
        return next((v for k, v in self.headers if k == name), None)


def json_bytes(value: Any) -> bytes:
    """Compact JSON."""
    return json.dumps(value, separators=(",", ":")).encode()


def json_reply(status: int, value: Any, headers: Headers | None = None) -> Reply:
    """A JSON response."""
    return Reply(status, [("content-type", JSON_CONTENT_TYPE), *(headers or [])], json_bytes(value))


def infer_reply(
    body: bytes, header_length: int | None, version: int, extra: Headers | None = None
) -> Reply:
    """The 200 of an infer request, on every server: the model version that answered,
    ``extra`` (a server's load report), and JSON or binary with its header length."""
    headers: Headers = [("x-spillway-model-version", str(version)), *(extra or [])]
    if header_length is None:
        headers.append(("content-type", JSON_CONTENT_TYPE))
    else:
        headers += [
            ("content-type", BINARY_CONTENT_TYPE),
            (HEADER_LENGTH, str(header_length)),
        ]
    return Reply(200, headers, body)


def error_reply(error: SpillwayError) -> Reply:
    """The one response of an error, on every transport: its status, ``{"error", "code"}``,
    ``Retry-After`` (whole seconds, at least 1) when it carries one, ``Allow`` on 405, and
    the server-fault mark on a 5xx the server knows is its own (504 means busy)."""
    headers: Headers = []
    if error.status >= 500 and error.status != 504:
        headers.append((FAULT_HEADER, "server"))
    if error.retry_after_s is not None:
        headers.append(("retry-after", str(max(1, round(error.retry_after_s)))))
    if isinstance(error, MethodNotAllowedError) and error.allow:
        headers.append(("allow", error.allow))
    return json_reply(error.status, error.to_body(), headers)


_PHRASES = {status.value: status.phrase for status in HTTPStatus}


def status_phrase(status: int) -> str:
    """The reason phrase every transport writes after a status (``Unknown`` for a status
    HTTP does not name)."""
    return _PHRASES.get(status, "Unknown")


INTERNAL_ERROR = json_reply(500, {"error": "internal error", "code": "internal"})
"""The last-resort answer to an unexpected exception (logged with its traceback)."""


def refused(log: logging.Logger, error: SpillwayError, **where: object) -> Reply:
    """The reply to a refused request, logged once at INFO on every transport: ``refused``
    with where it happened (``where``: method, path, request id…) and the error's status,
    code and reason."""
    fields = {**where, "status": error.status, "code": error.code, "reason": error.message}
    log.info("refused", extra=fields)
    return error_reply(error)


def unhandled(log: logging.Logger, **where: object) -> Reply:
    """The reply to an unexpected exception (call it from its ``except``): logged with its
    traceback as ``unhandled error`` and where it happened; answered ``INTERNAL_ERROR``."""
    log.exception("unhandled error", extra=where)
    return INTERNAL_ERROR


def guarded(log: logging.Logger, answer: Callable[[], Reply], **where: object) -> Reply:
    """``answer()``, or the reply to what it raised: a ``SpillwayError`` as ``refused``,
    anything else as ``unhandled``. Never raises."""
    try:
        return answer()
    except SpillwayError as error:
        return refused(log, error, **where)
    except Exception:  # noqa: BLE001 - logged with its traceback by unhandled()
        return unhandled(log, **where)
