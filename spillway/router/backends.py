"""Backends the router forwards to, and the HTTP one with its keep-alive pool.

Every backend keeps the contract of ``spillway.policy.backend``: it takes a
``BackendRequest`` and a timeout and returns a ``BackendResponse``, or raises a
``BackendError`` saying how it failed. The router decides what each means.

Only headers on an allowlist cross the router, in either direction: no hop-by-hop,
``Authorization``, cookies or API keys reach a backend. The router adds the caller's
tenant scope (``x-spillway-tenant-scope``, a digest of the tenant API Gateway vouched
for), signed with the scope proof key (``spillway.tenancy.proof``) so the backend can
tell it from a scope a client computed: a client's own header of that name is never
forwarded.
"""

from __future__ import annotations

import http.client
import queue
import socket
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from spillway.policy.backend import (
    BackendRequest,
    BackendResponse,
    ConnectFailed,
    ConnectionLost,
    TimedOut,
)
from spillway.protocol.replies import FAULT_HEADER
from spillway.protocol.wire import TENANT_SCOPE_HEADER
from spillway.state.table import scope

if TYPE_CHECKING:
    from spillway.tenancy.proof import ScopeProofs

TenantScopes = Callable[[str | None], str]
"""The ``TENANT_SCOPE_HEADER`` value the router sends for a tenant (``None``: anonymous)."""


def signed_scopes(proofs: ScopeProofs) -> TenantScopes:
    """A tenant's scope with the router's proof (a bare scope while no key is held)."""
    return lambda tenant: proofs.sign(scope(tenant))


# What the router itself sets on a backend request (it copies nothing else from a client).
REQUEST_HEADERS = frozenset(
    {
        "content-type",
        "accept",
        "inference-header-content-length",
        "idempotency-key",
        # The request's W3C trace context (https://www.w3.org/TR/trace-context/).
        "traceparent",
        "tracestate",
    }
)
LOAD_HEADERS = frozenset({"x-spillway-busy", "x-spillway-queue-depth", FAULT_HEADER})
RESPONSE_HEADERS = frozenset(
    {
        "content-type",
        "inference-header-content-length",
        "location",
        "retry-after",
        "x-spillway-model-version",
    }
)
USER_AGENT = "spillway-router"


def forwardable(headers: Mapping[str, str], allowed: frozenset[str]) -> dict[str, str]:
    """The headers on the allowlist, names lower-cased."""
    return {k.lower(): v for k, v in headers.items() if k.lower() in allowed}


class _Pool:
    """Idle keep-alive connections to one host, most recently used first."""

    def __init__(
        self,
        make: Callable[[], http.client.HTTPConnection],
        size: int,
        idle_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._make = make
        self._idle: queue.LifoQueue[tuple[http.client.HTTPConnection, float]] = queue.LifoQueue(
            size
        )
        self._idle_s = idle_s
        self._clock = clock

    def take(self) -> tuple[http.client.HTTPConnection, bool]:
        """A connection and whether it was used before (fresh ones are not connected)."""
        while True:
            try:
                conn, since = self._idle.get_nowait()
            except queue.Empty:
                return self._make(), False
            if self._clock() - since <= self._idle_s:
                return conn, True
            conn.close()

    def fresh(self) -> http.client.HTTPConnection:
        """A new, not yet connected connection."""
        return self._make()

    def give_back(self, conn: http.client.HTTPConnection) -> None:
        """Keep a healthy connection for the next request (close it if the pool is full)."""
        try:
            self._idle.put_nowait((conn, self._clock()))
        except queue.Full:
            conn.close()


class HttpBackend:
    """A backend over HTTP/1.1 with pooled keep-alive connections."""

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        pool_size: int = 32,
        idle_s: float = 30.0,
        connect_timeout_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        scopes: TenantScopes = scope,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{base_url!r} is not an http(s) URL")
        self.name = name
        self.base_url = base_url
        self._prefix = parts.path.rstrip("/")
        self._connect_timeout_s = connect_timeout_s
        self._scopes = scopes
        factory = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        host, port = parts.hostname, parts.port
        self._pool = _Pool(lambda: factory(host, port), pool_size, idle_s, clock)

    def send(self, request: BackendRequest, timeout_s: float) -> BackendResponse:
        """One HTTP exchange; a reused connection the peer had closed is replaced once."""
        started = time.monotonic()
        conn, reused = self._pool.take()
        try:
            return self._exchange(conn, request, started, started + timeout_s)
        except ConnectionLost:
            if not reused:
                raise
        # The pooled connection had gone stale (or the peer died). Inference has no side
        # effects, so the request goes once more on a fresh connection, in the same time.
        return self._exchange(self._pool.fresh(), request, started, started + timeout_s)

    def _connect(self, conn: http.client.HTTPConnection, deadline: float) -> None:
        conn.timeout = min(self._connect_timeout_s, max(deadline - time.monotonic(), 1e-3))
        try:
            conn.connect()
        except TimeoutError as exc:
            conn.close()
            raise ConnectFailed(f"{self.name}: connect timed out") from exc
        except OSError as exc:
            conn.close()
            raise ConnectFailed(f"{self.name}: {exc.strerror or exc}") from exc
        # http.client sends the headers and the body in two writes; with Nagle's algorithm
        # the body would wait for the peer's delayed ACK (up to 40 ms on Linux).
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _exchange(
        self,
        conn: http.client.HTTPConnection,
        request: BackendRequest,
        started: float,
        deadline: float,
    ) -> BackendResponse:
        headers = {
            **forwardable(request.headers, REQUEST_HEADERS),
            "user-agent": USER_AGENT,
            TENANT_SCOPE_HEADER: self._scopes(request.tenant),
        }
        if request.request_id:
            headers["x-request-id"] = request.request_id
        if conn.sock is None:
            self._connect(conn, deadline)
        try:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            conn.sock.settimeout(remaining)
            body = request.body if request.body or request.method != "GET" else None
            conn.request(request.method, (self._prefix + request.path) or "/", body, headers)
            response = conn.getresponse()
            answer = response.read()
        except TimeoutError as exc:
            conn.close()
            raise TimedOut(f"{self.name}: no answer within {deadline - started:.3f} s") from exc
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise ConnectionLost(f"{self.name}: {type(exc).__name__}") from exc
        if response.will_close:
            conn.close()
        else:
            self._pool.give_back(conn)
        return BackendResponse(
            response.status,
            forwardable(dict(response.getheaders()), RESPONSE_HEADERS | LOAD_HEADERS),
            answer,
            time.monotonic() - started,
        )
