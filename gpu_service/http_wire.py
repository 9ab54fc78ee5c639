"""HTTP/1.1 on the wire, apart from any connection: what a head says, what an answer is.

Reading: a request's routing path (``request_path``), whether it waits for ``100
Continue`` (``expects_continue``), and whether the body of a request refused on its head
is worth reading to keep the connection (``body_worth_reading``). Writing: every response
of the service's server (``gpu_service.transport``) becomes bytes by ``response_bytes``:
status line and headers, ``content-length``, the cached ``Date`` header and
``connection: close`` on a last answer; a small body is joined to its head (one write,
one copy) and a large one follows it. The answers the transport gives itself, before or
instead of the app (malformed request, head too large, too many connections, late head
or body), are built here once, shaped like every other error.
"""

from __future__ import annotations

from http import HTTPStatus

import httptools

from gpu_service.http import Headers, Response, encoded, header_value, route_path
from spillway.protocol.errors import RequestTimeoutError, UnavailableError
from spillway.protocol.replies import error_reply, status_phrase

_DROP_BODY_BYTES = 1024 * 1024
"""A refused request's body is read and dropped up to this size, else the connection
closes after the refusal."""
_INLINE_BODY = 64 * 1024
"""A response body up to this size is joined to its head (one write, one copy)."""

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def request_path(url: bytes) -> str:
    """The request's routing path (``route_path``); ``/`` for an absolute URL without one.
    Raises ``HttpParserError`` for a URL that is not one."""
    path = httptools.parse_url(url).path or b"/"
    return route_path(path) if b"%" in path else path.decode("ascii")


def expects_continue(headers: Headers) -> bool:
    """Whether the client waits for ``100 Continue`` before it sends the body."""
    expect = header_value(headers, b"expect")
    return expect is not None and expect.strip().lower() == "100-continue"


def body_worth_reading(headers: Headers) -> bool:
    """Whether the body that follows a refused head is small enough (none, or a known
    length up to ``_DROP_BODY_BYTES``) to read and drop, keeping the connection."""
    follows = header_value(headers, b"content-length")
    small = follows is None and header_value(headers, b"transfer-encoding") is None
    return small or (follows is not None and follows.isdigit() and int(follows) <= _DROP_BODY_BYTES)


def _status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, status_phrase(status).encode())


_STATUS_LINES = {status.value: _status_line(status.value) for status in HTTPStatus}


def _plain(status: int, code: str, message: str) -> Response:
    """A protocol-level error, shaped like every other error answer."""
    body = b'{"error":"%s","code":"%s"}' % (message.encode(), code.encode())
    return status, body, [(b"content-type", b"application/json")]


MALFORMED = _plain(400, "invalid_input", "malformed HTTP request")
HEAD_TOO_LARGE = _plain(431, "invalid_input", "request line and headers are too large")
TOO_MANY = encoded(
    error_reply(UnavailableError("too many connections; retry shortly", retry_after_s=1.0))
)
HEAD_LATE = encoded(
    error_reply(RequestTimeoutError("the request line and headers did not arrive in time"))
)
BODY_LATE = encoded(error_reply(RequestTimeoutError("the request body did not arrive in time")))


def response_bytes(
    response: Response, keep_alive: bool, head_only: bool, date_header: bytes
) -> tuple[bytes, bytes]:
    """The bytes of ``response``: its head, with a small body joined to it, and a large
    body to write after it (empty when there is none, or ``head_only``)."""
    status, body, headers = response
    parts = [_STATUS_LINES.get(status) or _status_line(status)]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"content-length: %d\r\n" % len(body))
    parts.append(date_header)
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    if head_only or not body:
        return b"".join(parts), b""
    if len(body) <= _INLINE_BODY:
        parts.append(body)
        return b"".join(parts), b""
    return b"".join(parts), body
