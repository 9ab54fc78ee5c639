"""The HTTP transport: a small ASGI application over the data plane.

It only translates: route, read the body within its cap, call the data plane, write the
response. Errors are mapped here once: a ``SpillwayError`` becomes its status and
``{"error", "code"}`` body (with ``Retry-After`` when it carries one); anything else is
logged with its traceback and answered with a generic 500.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from gpu_service import metrics, openapi
from gpu_service.async_consumer import AsyncConsumer, start_consumer
from gpu_service.dataplane import DataPlane
from spillway.errors import (
    InvalidInputError,
    PayloadTooLargeError,
    RouteNotFoundError,
    SpillwayError,
    UnauthorizedError,
)
from spillway.wire import (
    INTERNAL_ERROR,
    Reply,
    Target,
    allow,
    error_reply,
    model_target,
    parse_header_length,
)

log = logging.getLogger("spillway.http")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

_REPOSITORY_PATH = re.compile(r"^/v2/repository/models/(?P<model>[^/]+)/(?P<op>load|unload)$")
_JSON = (b"content-type", b"application/json")
_BINARY = (b"content-type", b"application/octet-stream")
_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
_OPENAPI = openapi.document_bytes()
_MAX_TARGETS = 1024


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


class GpuServiceApp:
    """ASGI entry point; the lifespan loads and drains the registry."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.consumer: AsyncConsumer | None = None
        # Parsed model paths: a regex and two name checks saved on every request.
        self._targets: dict[str, Target] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.plane.registry.start()
                except Exception as exc:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                self.consumer = start_consumer(self.plane)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.consumer is not None:  # stop taking async work first
                    await self.consumer.stop(self.plane.settings.drain_timeout_s)
                self.plane.draining = True
                await self.plane.registry.stop(self.plane.settings.drain_timeout_s)
                self.plane.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            status, body, headers = await self._route(scope, receive)
        except SpillwayError as error:
            status, body, headers = _encoded(error_reply(error))
            log.info(
                "request refused",
                extra={
                    "method": scope["method"],
                    "path": scope["path"][:200],
                    "status": status,
                    "code": error.code,
                    "reason": error.message,
                },
            )
        except Exception:
            log.exception("unhandled error on %s", scope["method"])
            status, body, headers = _encoded(INTERNAL_ERROR)
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _route(self, scope: Scope, receive: Receive) -> tuple[int, bytes, Headers]:
        method, path = scope["method"], scope["path"]
        plane = self.plane
        if path.startswith("/v2/models/") and (target := self._target(path)) is not None:
            return await self._model_route(method, target, scope, receive)
        if path.startswith("/v2/repository/"):
            return await self._repository_route(method, path, scope, receive)
        allow(method, path, "GET")
        if path == "/v2/health/live":
            return 200, b"", [_JSON]
        if path == "/v2/health/ready":
            return self._flag(plane.ready(), "the service is not ready")
        if path == "/v2":
            return 200, _json(plane.server_metadata()), [_JSON]
        if path == "/openapi.json":
            return 200, _OPENAPI, [_JSON]
        if path == "/metrics":
            text = metrics.render(plane.registry).encode()
            return 200, text, [(b"content-type", b"text/plain; version=0.0.4")]
        raise RouteNotFoundError(f"no route for {path}")

    def _target(self, path: str) -> Target | None:
        target = self._targets.get(path)
        if target is None and (target := model_target(path)) is not None:
            if len(self._targets) >= _MAX_TARGETS:  # clients choose paths: stay bounded
                self._targets.clear()
            self._targets[path] = target
        return target

    async def _model_route(
        self, method: str, target: Target, scope: Scope, receive: Receive
    ) -> tuple[int, bytes, Headers]:
        model, version, op = target.model, target.version, target.operation
        plane = self.plane
        allow(method, scope["path"], target.method)
        if model is None:  # /v2/models/stats
            return 200, _json(plane.model_stats(None, None)), [_JSON]
        if op == "infer":
            return await self._infer(model, version, scope, receive)
        if op == "ready":
            return self._flag(plane.model_ready(model, version), f"model {model} is not ready")
        if op == "config":
            return 200, _json(plane.model_config(model, version)), [_JSON]
        if op == "stats":
            return 200, _json(plane.model_stats(model, version)), [_JSON]
        return 200, _json(plane.model_metadata(model, version)), [_JSON]

    async def _infer(
        self, model: str, version: str | None, scope: Scope, receive: Receive
    ) -> tuple[int, bytes, Headers]:
        plane = self.plane
        # Everything that can refuse the request is checked before the body is read.
        header_length, content_length = _infer_headers(scope)
        length = parse_header_length(header_length)
        plane.check_infer(model)
        declared = self._declared_length(content_length)
        size = declared or plane.settings.max_body_bytes
        plane.bodies.reserve(size)
        try:
            body = await self._body(receive, declared)
            result = await plane.infer(model, version, body, length)
        finally:
            plane.bodies.release(size)
        headers: Headers = [
            (b"x-spillway-model-version", str(result.version).encode()),
            (b"x-spillway-queue-depth", str(result.queue_depth).encode()),
            (b"x-spillway-busy", f"{result.busy:.3f}".encode()),
        ]
        if result.cold_start_s is not None:
            headers.append(
                (b"x-spillway-cold-start-ms", f"{result.cold_start_s * 1e3:.0f}".encode())
            )
        if result.header_length is None:
            headers.append(_JSON)
        else:
            headers += [
                _BINARY,
                (b"inference-header-content-length", str(result.header_length).encode()),
            ]
        return 200, result.body, headers

    async def _repository_route(
        self, method: str, path: str, scope: Scope, receive: Receive
    ) -> tuple[int, bytes, Headers]:
        allow(method, path, "POST")
        self._authorize(scope)
        # A load request's body (parameters) is not used.
        declared = self._declared_length(_header(scope, b"content-length"))
        await self._body(receive, declared)
        if path == "/v2/repository/index":
            return 200, _json(await self.plane.repository_index()), [_JSON]
        match = _REPOSITORY_PATH.match(path)
        if match is None:
            raise RouteNotFoundError(f"no route for {path}")
        if match["op"] == "load":
            await self.plane.load(match["model"])
        else:
            await self.plane.unload(match["model"])
        return 200, b"", [_JSON]

    def _authorize(self, scope: Scope) -> None:
        settings = self.plane.settings
        token = settings.admin_token
        if token is None:
            if settings.host in _LOOPBACK:
                return
            raise UnauthorizedError(
                "repository control needs GPU_ADMIN_TOKEN when the service listens beyond loopback"
            )
        given = _header(scope, b"authorization") or ""
        if not hmac.compare_digest(given.encode(), f"Bearer {token.get_secret_value()}".encode()):
            raise UnauthorizedError("repository control needs the admin token")

    def _declared_length(self, declared: str | None) -> int | None:
        """The declared ``Content-Length`` (``None`` when chunked); 413 past the cap."""
        limit = self.plane.settings.max_body_bytes
        if declared is None or not declared.isdigit():
            return None
        if int(declared) > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
        return int(declared)

    async def _body(self, receive: Receive, declared: int | None) -> bytes:
        limit = self.plane.settings.max_body_bytes if declared is None else declared
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                # The client went away mid-body: never parse what arrived as a request.
                raise InvalidInputError("the client disconnected before its body arrived")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                if declared is not None and size < declared:
                    raise InvalidInputError(f"the body ended after {size} of {declared} bytes")
                return b"".join(chunks)

    @staticmethod
    def _flag(value: bool, reason: str) -> tuple[int, bytes, Headers]:
        if value:
            return 200, b"", [_JSON]
        return 400, _json({"error": reason, "code": "not_ready"}), [_JSON]


def _encoded(reply: Reply) -> tuple[int, bytes, Headers]:
    headers = [(k.encode(), v.encode()) for k, v in reply.headers]
    return reply.status, reply.body, headers


def _infer_headers(scope: Scope) -> tuple[str | None, str | None]:
    """``Inference-Header-Content-Length`` and ``Content-Length`` (each the first one
    sent, as ``_header`` reads them), in one pass."""
    header_length = content_length = None
    for key, value in scope["headers"]:
        if key == b"inference-header-content-length" and header_length is None:
            header_length = value.decode("latin-1")
        elif key == b"content-length" and content_length is None:
            content_length = value.decode("latin-1")
    return header_length, content_length


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None
