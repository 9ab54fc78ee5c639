"""What API Gateway hands a WebSocket API's function: the record of each open connection
(its identity, activity and queued messages) and the events of the three routes, each
with the ``requestContext`` API Gateway builds.

Locally a client's ``x-api-key`` header stands for its API key id in
``requestContext.identity`` (as the REST door in ``spillway_cli.local.lambda_http`` does).
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

STAGE = "local"
DOMAIN = "127.0.0.1"
API_ID = "local"


def connection_id() -> str:
    """A new connection id in API Gateway's form (16 base64 characters, ``=`` last),
    from the URL-safe alphabet so that it travels in a path unchanged."""
    return base64.urlsafe_b64encode(secrets.token_bytes(11)).decode()


@dataclass
class Connection:
    """One open WebSocket connection."""

    id: str
    socket: web.WebSocketResponse
    source_ip: str
    user_agent: str
    api_key: str | None
    connected_at: float = field(default_factory=time.time)
    last_active_at: float = field(default_factory=time.time)
    active_at: float = field(default_factory=time.monotonic)
    """When a message last went either way (the idle timeout's clock)."""
    invocations: set[asyncio.Future[Any]] = field(default_factory=set)
    queue: deque[dict[str, Any]] = field(default_factory=deque)
    """``$default`` events received and not yet given a thread, oldest first."""
    running: int = 0
    """Its invocations holding a thread."""
    ready: bool = False
    """Whether it waits in the gateway's round-robin line."""
    transport: asyncio.Transport | None = None
    """The connection's TCP transport: aborted when a push waits past the write timeout
    (a frame cut off half-written leaves no stream to close politely)."""

    def identity(self) -> dict[str, Any]:
        """``requestContext.identity`` of this connection's events."""
        identity: dict[str, Any] = {"sourceIp": self.source_ip, "userAgent": self.user_agent}
        if self.api_key:
            identity.update(apiKey=self.api_key, apiKeyId=self.api_key)
        return identity

    def described(self) -> dict[str, Any]:
        """The management API's ``GetConnection`` answer (botocore reads it as
        ``ConnectedAt``, ``LastActiveAt`` and ``Identity``)."""
        return {
            "connectedAt": _iso(self.connected_at),
            "lastActiveAt": _iso(self.last_active_at),
            "identity": {"sourceIp": self.source_ip, "userAgent": self.user_agent},
        }


def request_context(
    connection: Connection, route: str, event_type: str, **extra: Any
) -> dict[str, Any]:
    """``requestContext`` of an event as API Gateway builds it for a WebSocket API."""
    now = time.time()
    request_id = _short_id()
    return {
        "routeKey": route,
        "eventType": event_type,
        "extendedRequestId": request_id,
        "requestTime": datetime.fromtimestamp(now, UTC).strftime("%d/%b/%Y:%H:%M:%S +0000"),
        "messageDirection": "IN",
        "stage": STAGE,
        "connectedAt": int(connection.connected_at * 1000),
        "requestTimeEpoch": int(now * 1000),
        "identity": connection.identity(),
        "requestId": request_id,
        "domainName": DOMAIN,
        "connectionId": connection.id,
        "apiId": API_ID,
        **extra,
    }


def connect_event(connection: Connection, request: web.Request) -> dict[str, Any]:
    """The ``$connect`` event of an upgrade request: its headers and query string."""
    headers: dict[str, str] = {}
    multi_headers: dict[str, list[str]] = {}
    for name, value in request.headers.items():
        headers[name] = value if name not in headers else f"{headers[name]},{value}"
        multi_headers.setdefault(name, []).append(value)
    event: dict[str, Any] = {
        "headers": headers,
        "multiValueHeaders": multi_headers,
        "requestContext": request_context(connection, "$connect", "CONNECT"),
        "isBase64Encoded": False,
    }
    if request.query:
        event["queryStringParameters"] = dict(request.query)
        multi_query: dict[str, list[str]] = {}
        for name, value in request.query.items():
            multi_query.setdefault(name, []).append(value)
        event["multiValueQueryStringParameters"] = multi_query
    return event


def message_event(connection: Connection, text: str) -> dict[str, Any]:
    """The ``$default`` event of one (text) message."""
    return {
        "requestContext": request_context(connection, "$default", "MESSAGE", messageId=_short_id()),
        "body": text,
        "isBase64Encoded": False,
    }


def disconnect_event(connection: Connection, code: int, reason: str) -> dict[str, Any]:
    """The ``$disconnect`` event of a closed connection."""
    context = request_context(
        connection,
        "$disconnect",
        "DISCONNECT",
        disconnectStatusCode=code,
        disconnectReason=reason,
    )
    return {"headers": {"Host": DOMAIN}, "requestContext": context, "isBase64Encoded": False}


def _short_id() -> str:
    return base64.b64encode(secrets.token_bytes(6)).decode()


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds")
