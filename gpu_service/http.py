"""The service's HTTP handling, apart from any server: route, admit, answer.

A request is handled in three steps, so everything that can refuse it is checked before
its body is read: ``begin`` routes it on its method, path and headers (an infer request
is checked for its model, its declared length and the room left in the body budget
here; one the registry does not know yet is looked for while its body arrives:
``settle``) and returns an ``Exchange``; ``took`` charges each piece of body as it arrives
(past the request's limit a 413, past the body budget a 503); ``finish`` answers the
exchange once its body has arrived. Two servers use the steps: the service's own
HTTP/1.1 server (``gpu_service.transport``) and, through ``GpuServiceApp.__call__``, any
ASGI server (uvicorn, in-process test clients).

Requests are routed on the raw path, split on ``/`` before each segment is
percent-decoded (``route_path``): an encoded ``/`` is part of a name, never a separator.
``HEAD`` is served wherever ``GET`` is (the server sends the head alone). An HTTP/1.1
request without exactly one ``Host`` header is a 400 (RFC 9112, section 3.2).

Errors are mapped here once: a ``SpillwayError`` becomes its status and
``{"error", "code"}`` body (with ``Retry-After`` when it carries one); anything else is
logged with its traceback and answered with a generic 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from gpu_service import metrics, openapi
from gpu_service.async_consumer import AsyncConsumer, start_consumer
from gpu_service.dataplane import DataPlane
from gpu_service.registry import MISS_LIST_S
from gpu_service.served import Served
from spillway import tracing
from spillway.protocol.errors import (
    InvalidInputError,
    MethodNotAllowedError,
    PayloadTooLargeError,
    RequestTimeoutError,
    SpillwayError,
)
from spillway.protocol.framing import parse_header_length
from spillway.protocol.replies import Reply, infer_reply, refused, unhandled
from spillway.protocol.wire import Target, allow, model_target, no_route

if TYPE_CHECKING:
    from gpu_service.grpc_server import GrpcServer

log = logging.getLogger("spillway.http")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
Response = tuple[int, bytes, Headers]
"""Status, body and headers (without ``content-length``: the server adds it)."""

_REPOSITORY_PATH = re.compile(r"^/v2/repository/models/(?P<model>[^/]+)/(?P<op>load|unload)$")
_JSON = (b"content-type", b"application/json")
_OPENAPI = openapi.document_bytes()
_MAX_TARGETS = 1024
_SEGMENT_SAFE = "!$&'()*+,;=:@-._~"
"""What ``route_path`` leaves as it is when it re-encodes a segment (RFC 3986 pchar)."""
_GET_ROUTES = frozenset({"/v2/health/live", "/v2/health/ready", "/v2", "/openapi.json", "/metrics"})
_OTHER_BODY_BYTES = 1024 * 1024
"""The most body any request but an infer request may send (none reads its body)."""


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


@dataclass(slots=True)
class Exchange:
    """A request past its headers: how much body it may send and what answers it."""

    method: str
    path: str
    headers: Headers
    target: Target | None
    declared: int | None
    """The declared ``Content-Length`` (``None`` when chunked or absent)."""
    limit: int
    """The most body bytes accepted; past it the request is a 413."""
    header_length: int | None = None
    """An infer request's ``Inference-Header-Content-Length``."""
    held: int = 0
    """Body bytes received and charged to the body budget; given back when the request
    is answered or abandoned."""
    settling: asyncio.Future[Served] | None = None
    """For an infer request whose model the registry did not know on its headers: its
    look-up (``DataPlane.lookup``, a listing of the repository), begun then and awaited
    by ``settle`` before the body is waited for, and before the request is answered."""


class GpuServiceApp:
    """The service's requests (``begin``/``finish``), and an ASGI entry point over them
    whose lifespan loads and drains the registry."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.bodies = plane.bodies
        self.consumer: AsyncConsumer | None = None
        self.grpc: GrpcServer | None = None
        """The gRPC server, when ``GPU_GRPC_PORT`` is set (started with the models)."""
        # Parsed model paths: a regex and two name checks saved on every request.
        self._targets: dict[str, Target] = {}

    # -- lifecycle ---------------------------------------------------------------------

    async def startup(self) -> None:
        """Read the scope proof keys, load the start-up models, start taking async work."""
        # Keys first, off the loop: later reads run in the background as they fall due.
        await asyncio.get_running_loop().run_in_executor(None, self.plane.scopes.prime)
        await self.plane.registry.start()
        if self.plane.settings.grpc_port is not None:
            from gpu_service.grpc_server import GrpcServer  # grpc only when it is served

            self.grpc = await GrpcServer.start(self.plane)
        self.consumer = start_consumer(self.plane)

    async def shutdown(self) -> None:
        """Stop taking async work, refuse new requests, drain the batchers, stop."""
        if self.consumer is not None:  # stop taking async work first
            await self.consumer.stop(self.plane.settings.drain_timeout_s)
        self.plane.start_draining("shutdown")
        if self.grpc is not None:  # its RPCs in flight still need the batchers
            await self.grpc.stop(self.plane.settings.drain_timeout_s)
        await self.plane.registry.stop(self.plane.settings.drain_timeout_s)
        self.plane.close()

    # -- the two steps -----------------------------------------------------------------

    def begin(self, method: str, path: str, headers: Headers, http_version: str) -> Exchange:
        """Route a request on its headers (``path`` as ``route_path`` gives it); raises
        ``SpillwayError`` to refuse it before its body is read."""
        _check_host(headers, http_version)
        target = None
        if path.startswith("/v2/models/") and (target := self._target(path)) is not None:
            _allow(method, path, target.method)
            if target.model is not None and target.operation == "infer":
                return self._begin_infer(method, path, headers, target)
        elif path == "/v2/repository/index" or _REPOSITORY_PATH.match(path):
            allow(method, path, "POST")
            self._authorize(headers)
        elif path in _GET_ROUTES:
            _allow(method, path, "GET")
        else:  # whatever the method: a 405 would say the path exists
            raise no_route(path)
        # No other route reads its body (a load request's parameters are not used).
        declared = self._declared_length(
            header_value(headers, b"content-length"), _OTHER_BODY_BYTES
        )
        limit = _OTHER_BODY_BYTES if declared is None else declared
        exchange = Exchange(method, path, headers, target, declared, limit)
        if target is not None and target.model is not None:
            # Metadata, ready, config, stats: a model published since the last listing
            # is found as an infer request finds it (``DataPlane.found``).
            exchange.settling = self._settling(target.model, MISS_LIST_S)
        return exchange

    def _settling(self, model: str, listed_within_s: float = 0.0) -> asyncio.Future[Served] | None:
        """The look-up (``DataPlane.lookup``) of a model the registry does not know now,
        begun now; ``None`` for a known one."""
        if self.plane.registry.known(model):
            return None
        return asyncio.ensure_future(self.plane.lookup(model, listed_within_s=listed_within_s))

    def _begin_infer(self, method: str, path: str, headers: Headers, target: Target) -> Exchange:
        plane = self.plane
        header_length, content_length = _infer_headers(headers)
        length = parse_header_length(header_length)
        known = plane.check_infer(target.model)  # type: ignore[arg-type]
        limit = plane.settings.max_body_bytes
        declared = self._declared_length(content_length, limit)
        # A declared size is checked against what the budget holds now, but reserves
        # nothing: a client that announces 32 MiB and sends nothing holds nothing.
        plane.bodies.admit(declared or 1)
        exchange = Exchange(method, path, headers, target, declared, declared or limit, length)
        if not known:  # begun now: the listing it waits for is one that begins after this
            exchange.settling = self._settling(target.model)  # type: ignore[arg-type]
        return exchange

    async def settle(self, exchange: Exchange) -> None:
        """Wait until an exchange's model is found (``Exchange.settling``; a 404 if the
        repository does not hold it); at once for a model the registry knew."""
        if exchange.settling is not None:
            await exchange.settling

    def took(self, exchange: Exchange, size: int, received: int) -> None:
        """Charge ``size`` more body bytes (``received`` in all, them included) to the
        exchange: past its limit a 413, past the body budget a 503 with ``Retry-After``
        (the request then ends; what it held is given back by ``abandon``)."""
        if received > exchange.limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {exchange.limit} bytes")
        self.bodies.charge(size)
        exchange.held += size

    def abandon(self, exchange: Exchange) -> None:
        """Give back what an exchange holds when it will never be finished."""
        if exchange.held:
            self.bodies.release(exchange.held)
            exchange.held = 0

    async def finish(self, exchange: Exchange, body: bytes) -> Response:
        """The response to an exchange whose body has arrived; never raises."""
        try:
            return await self._answer(exchange, body)
        except SpillwayError as error:
            return self.refusal(error, exchange.method, exchange.path)
        except Exception:  # noqa: BLE001 - logged with its traceback by unhandled()
            return self.failure(exchange.method, exchange.path)
        finally:
            self.abandon(exchange)

    def refusal(self, error: SpillwayError, method: str, path: str) -> Response:
        """The response to a refused request, logged (``replies.refused``)."""
        return encoded(refused(log, error, method=method[:16], path=path[:200]))

    def failure(self, method: str, path: str) -> Response:
        """The response to an unexpected exception, logged with its traceback (call it
        from its ``except``: ``replies.unhandled``)."""
        return encoded(unhandled(log, method=method[:16], path=path[:200]))

    # -- ASGI ----------------------------------------------------------------------------

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
                    await self.startup()
                except Exception as exc:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        try:
            path = route_path(scope.get("raw_path") or scope["path"].encode())
            exchange = self.begin(method, path, scope["headers"], scope["http_version"])
            await self.settle(exchange)  # refused as on its headers: no body read
        except SpillwayError as error:
            status, body, headers = self.refusal(error, method, scope["path"])
        except Exception:  # noqa: BLE001 - logged with its traceback by failure()
            status, body, headers = self.failure(method, scope["path"])
        else:
            try:
                request_body = await self._asgi_body(receive, exchange)
            except SpillwayError as error:
                self.abandon(exchange)
                status, body, headers = self.refusal(error, method, path)
                headers.append((b"connection", b"close"))  # the body's rest is not read
            else:
                answer = self.finish(exchange, request_body)
                if exchange.target is None or exchange.target.operation != "infer":
                    status, body, headers = await answer  # nothing queued to cancel
                else:
                    answered = await _unless_disconnected(answer, receive)
                    if answered is None:
                        return  # the client went away: its work was cancelled
                    status, body, headers = answered
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _asgi_body(self, receive: Receive, exchange: Exchange) -> bytes:
        """An ASGI request's body, charged as it arrives; a gap of ``body_timeout_s``
        between two pieces is a 408 (the one time limit an ASGI app can set itself)."""
        timeout_s = self.plane.settings.body_timeout_s
        chunks: list[bytes] = []
        size = 0
        # Without a body to wait for, the one message is there at once: no timer.
        waits = exchange.declared != 0 and (
            exchange.declared is not None or header_value(exchange.headers, b"transfer-encoding")
        )
        while True:
            if not waits:
                message = await receive()
            else:
                try:
                    async with asyncio.timeout(timeout_s):
                        message = await receive()
                except TimeoutError:
                    raise RequestTimeoutError(
                        f"no request body received for {timeout_s:g} s"
                    ) from None
            if message["type"] == "http.disconnect":
                # The client went away mid-body: never parse what arrived as a request.
                raise InvalidInputError("the client disconnected before its body arrived")
            chunk = message.get("body", b"")
            size += len(chunk)
            self.took(exchange, len(chunk), size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                declared = exchange.declared
                if declared is not None and size < declared:
                    raise InvalidInputError(f"the body ended after {size} of {declared} bytes")
                return b"".join(chunks)

    # -- routes --------------------------------------------------------------------------

    async def _answer(self, exchange: Exchange, body: bytes) -> Response:
        path, target = exchange.path, exchange.target
        plane = self.plane
        await self.settle(exchange)
        if target is not None:
            return await self._model_route(target, exchange, body)
        if path.startswith("/v2/repository/"):
            return await self._repository_route(path)
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
        raise no_route(path)

    def _target(self, path: str) -> Target | None:
        target = self._targets.get(path)
        if target is None and (target := model_target(path)) is not None:
            if len(self._targets) >= _MAX_TARGETS:  # clients choose paths: stay bounded
                self._targets.clear()
            self._targets[path] = target
        return target

    async def _model_route(self, target: Target, exchange: Exchange, body: bytes) -> Response:
        model, version, op = target.model, target.version, target.operation
        plane = self.plane
        if model is None:  # /v2/models/stats
            return 200, _json(plane.model_stats(None, None)), [_JSON]
        if op == "infer":
            # The tenant scope the router signed (the data plane proves it) and the trace.
            scope = header_value(exchange.headers, b"x-spillway-tenant-scope")
            with tracing.carry(tracing.carrier_of_pairs(exchange.headers)):
                return await self._infer(model, version, body, exchange.header_length, scope)
        if op == "ready":
            return self._flag(plane.model_ready(model, version), f"model {model} is not ready")
        if op == "config":
            return 200, _json(plane.model_config(model, version)), [_JSON]
        if op == "stats":
            return 200, _json(plane.model_stats(model, version)), [_JSON]
        return 200, _json(plane.model_metadata(model, version)), [_JSON]

    async def _infer(
        self,
        model: str,
        version: str | None,
        body: bytes,
        header_length: int | None,
        scope: str | None,
    ) -> Response:
        result = await self.plane.infer(model, version, body, header_length, tenant_scope=scope)
        load = [
            ("x-spillway-queue-depth", str(result.queue_depth)),
            ("x-spillway-busy", f"{result.busy:.3f}"),
        ]
        if result.cold_start_s is not None:
            load.append(("x-spillway-cold-start-ms", f"{result.cold_start_s * 1e3:.0f}"))
        return encoded(infer_reply(result.body, result.header_length, result.version, load))

    async def _repository_route(self, path: str) -> Response:
        if path == "/v2/repository/index":
            return 200, _json(await self.plane.repository_index()), [_JSON]
        match = _REPOSITORY_PATH.match(path)
        if match is None:  # begin() routes no other path here
            raise no_route(path)
        if match["op"] == "load":
            await self.plane.load(match["model"])
        else:
            await self.plane.unload(match["model"])
        return 200, b"", [_JSON]

    def _authorize(self, headers: Headers) -> None:
        self.plane.authorize(header_value(headers, b"authorization"))

    @staticmethod
    def _declared_length(declared: str | None, limit: int) -> int | None:
        """The declared ``Content-Length`` (``None`` when chunked); 413 past ``limit``."""
        if declared is None or not declared.isdigit():
            return None
        if int(declared) > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
        return int(declared)

    @staticmethod
    def _flag(value: bool, reason: str) -> Response:
        if value:
            return 200, b"", [_JSON]
        return 400, _json({"error": reason, "code": "not_ready"}), [_JSON]


async def _unless_disconnected(answer: Awaitable[Response], receive: Receive) -> Response | None:
    """``answer``'s response, or ``None`` once the client disconnects first (its work is
    then cancelled, so a request still queued never reaches compute)."""
    work = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled() or not work.done():
        return None
    return work.result()


async def _disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (after the body, an ASGI server's ``receive``
    waits for that, or for the response to be sent)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def route_path(raw: bytes) -> str:
    """The path a request is routed on: the raw path split on ``/`` first, then each
    segment percent-decoded. An encoded ``/`` stays in its segment, written ``%2F`` (so
    it can never name a route, and in a model's place is an invalid name); ``/`` for an
    absolute URL without a path. A path that is not ASCII, or whose escapes are not
    UTF-8, is the client's 400."""
    try:
        path = raw.decode("ascii") or "/"
        if "%" not in path:
            return path
        return "/".join(_segment(s) for s in path.split("/"))
    except UnicodeDecodeError:
        raise InvalidInputError("the request's path is not percent-encoded UTF-8") from None


def _segment(segment: str) -> str:
    decoded = unquote(segment, errors="strict") if "%" in segment else segment
    return quote(decoded, safe=_SEGMENT_SAFE) if "/" in decoded else decoded


def _check_host(headers: Headers, http_version: str) -> None:
    """RFC 9112, section 3.2: a 400 for an HTTP/1.1 request without a ``Host`` header,
    and for any request with more than one (HTTP/1.0 may omit it)."""
    hosts = 0
    for key, _ in headers:  # a loop, not sum() over a generator: this is on every request
        if key == b"host":
            hosts += 1
    if hosts > 1 or (hosts == 0 and http_version != "1.0"):
        raise InvalidInputError("a request needs exactly one Host header")


def _allow(method: str, path: str, allowed: str) -> None:
    """Like ``wire.allow``, with ``HEAD`` served wherever ``GET`` is."""
    if method == allowed or (method == "HEAD" and allowed == "GET"):
        return
    names = "GET, HEAD" if allowed == "GET" else allowed
    raise MethodNotAllowedError(f"{method[:16]} is not allowed on {path[:200]}", allow=names)


def encoded(reply: Reply) -> Response:
    """A reply as the servers write it: status, body, byte-string headers."""
    headers = [(k.encode(), v.encode()) for k, v in reply.headers]
    return reply.status, reply.body, headers


def _infer_headers(headers: Headers) -> tuple[str | None, str | None]:
    """``Inference-Header-Content-Length`` and ``Content-Length`` (each the first one
    sent, as ``header_value`` reads them), in one pass."""
    header_length = content_length = None
    for key, value in headers:
        if key == b"inference-header-content-length" and header_length is None:
            header_length = value.decode("latin-1")
        elif key == b"content-length" and content_length is None:
            content_length = value.decode("latin-1")
    return header_length, content_length


def header_value(headers: Headers, name: bytes) -> str | None:
    """The first value of a header (``name`` lower-case, as both servers keep names)."""
    for key, value in headers:
        if key == name:
            return str(value.decode("latin-1"))
    return None
