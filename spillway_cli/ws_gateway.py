"""``spillway serve websocket``: an API Gateway WebSocket API on 127.0.0.1.

A Lambda handler (``handler(event, context)``, by default the WebSocket function's) is
called the way API Gateway calls it for a WebSocket API with ``$connect``,
``$disconnect`` and ``$default`` routes:

- an upgrade request becomes a ``$connect`` event (headers, query string); an answer
  whose ``statusCode`` is not 2xx refuses the upgrade with that status;
- each text message becomes a ``$default`` event (its text as the body), invoked in a
  thread pool and concurrently for one connection, as API Gateway invokes the function;
  a handler that raises, or runs past the 29 s integration timeout, gets the client the
  frame API Gateway sends;
- the pool's threads stand for the function's concurrency, where on AWS each invocation
  gets an execution environment of its own and none waits behind another connection's:
  each connection's messages wait in a queue of their own (``max_queued`` at most), the
  queues are served round-robin, and one connection runs at most
  ``connection_workers`` invocations at once, so a flood on one connection never holds
  the threads another connection's message needs;
- the stage's throttle (``DefaultRouteSettings`` in template.yaml and serverless.yml,
  ``THROTTLE_RATE``/``THROTTLE_BURST``) is a token bucket over every route, and new
  connections are limited to API Gateway's 500 a second; a message past either (or past
  its connection's queue) gets API Gateway's ``Too Many Requests`` frame and no
  invocation, an upgrade past either is refused with 429;
- what API Gateway refuses, it refuses the same way, with no invocation: a binary frame
  closes the connection with 1003 (WebSocket APIs take text frames only:
  https://docs.aws.amazon.com/apigateway/latest/developerguide/websocket-api-develop-binary-media-types.html),
  a frame over 32 KiB or a message (all its frames) over 128 KiB with 1009, and a
  connection idle for 10 minutes or open for 2 hours is closed with 1001 (the quotas:
  https://docs.aws.amazon.com/apigateway/latest/developerguide/apigateway-execution-service-websocket-limits-table.html;
  ``spillway.aws.limits``). A message over 32 KiB must span frames (a client
  sends it fragmented); permessage-deflate is not negotiated, so a frame's size is what
  it carries;
- a closed connection becomes a ``$disconnect`` event.

The same port serves the management API (``POST``/``GET``/``DELETE
/@connections/{id}``) that boto3's ``apigatewaymanagementapi`` client calls with this
server's URL as its ``endpoint_url``; a request's signature is not checked. An unknown
connection answers 410 ``GoneException`` and a post over 128 KiB 413
``PayloadTooLargeException``, as API Gateway does.

Each connection opened and closed is one log line. Locally a client's ``x-api-key``
header stands for its API key id in ``requestContext.identity`` (as the REST door in
``spillway_cli.lambda_http`` does).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib
import json
import logging
import secrets
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import WebSocketError, WSCloseCode, WSMsgType, web
from aiohttp.web_request import BaseRequest

from spillway.aws.limits import (
    WS_CLOSE_MESSAGE_TOO_BIG,
    WS_CLOSE_UNSUPPORTED_DATA,
    WS_CONNECTION_LIFETIME_S,
    WS_FRAME_BYTES,
    WS_IDLE_TIMEOUT_S,
    WS_INTEGRATION_TIMEOUT_S,
    WS_MESSAGE_BYTES,
    WS_NEW_CONNECTIONS_PER_S,
    WS_POST_BYTES,
)

log = logging.getLogger("spillway.websocket")

Handler = Callable[[dict[str, Any], Any], Any]
DEFAULT_HANDLER = "functions.websocket.handler.handler"
WRITE_TIMEOUT_S = 5.0
"""How long a push through ``@connections`` may wait on a client that reads nothing;
then the connection is dropped and the push answered 410 Gone."""
INTEGRATION_TIMEOUT_S = float(WS_INTEGRATION_TIMEOUT_S)
"""API Gateway's integration timeout: a handler's context counts down from it."""
IDLE_TIMEOUT_S = float(WS_IDLE_TIMEOUT_S)
"""API Gateway closes a connection with no message either way for 10 minutes."""
LIFETIME_S = float(WS_CONNECTION_LIFETIME_S)
"""API Gateway closes every connection after 2 hours."""
GOING_AWAY = int(WSCloseCode.GOING_AWAY)
"""The close code of a connection API Gateway ends (idle, past its lifetime)."""
THROTTLE_RATE = 1000.0
THROTTLE_BURST = 2000
"""The stage's ``DefaultRouteSettings`` (template.yaml, serverless.yml): a token bucket of
``THROTTLE_BURST`` tokens refilled at ``THROTTLE_RATE`` a second, one token a message or
``$connect``; past it the client gets ``429 Too Many Requests``
(https://docs.aws.amazon.com/apigateway/latest/developerguide/websocket-api-protect.html)."""
NEW_CONNECTIONS_PER_S = float(WS_NEW_CONNECTIONS_PER_S)
"""API Gateway's quota of new WebSocket connections a second (per account and Region):
https://docs.aws.amazon.com/apigateway/latest/developerguide/apigateway-execution-service-websocket-limits-table.html
(it sets no quota on concurrent connections; ``max_connections`` is this stand-in's own)."""
CONNECTION_WORKERS = 4
"""Invocations one connection runs at once; its other messages wait their turn."""
MAX_QUEUED = 64
"""Messages of one connection waiting for a thread; past it: ``Too Many Requests``. On AWS
nothing waits (each invocation runs at once, or is throttled): a client may send
``WS_MAX_IN_FLIGHT`` (32) frames at once and none waits long, not a flood's thousand."""
STAGE = "local"
DOMAIN = "127.0.0.1"
API_ID = "local"
FUNCTION_NAME = "spillway-local-websocket"


def load_handler(dotted: str) -> Handler:
    """The callable ``module.path.name`` names, imported in this process."""
    module, _, name = dotted.rpartition(".")
    if not module:
        raise ValueError(f"{dotted!r} is not module.attribute")
    handler: Handler = getattr(importlib.import_module(module), name)
    return handler


def _log_overrun(
    event: dict[str, Any], running: dict[str, float | int], submitted: float, timeout_s: float
) -> None:
    """One line on an invocation past the integration timeout: its route and connection,
    how long it waited for a pool thread, and the handler's stack now (where it is)."""
    context = event.get("requestContext") or {}
    started = running.get("started")
    frame = sys._current_frames().get(int(running.get("thread", -1)))
    stack = "".join(traceback.format_stack(frame)[-12:]) if frame is not None else "not started"
    log.error(
        "%s on %s: the handler ran past the %g s integration timeout (waited %.1f s for a "
        "thread); it is at:\n%s",
        context.get("routeKey"),
        context.get("connectionId"),
        timeout_s,
        (started if isinstance(started, float) else time.monotonic()) - submitted,
        stack,
    )


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` kept: API Gateway's throttle."""

    def __init__(
        self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a token bucket needs a positive rate and a burst of at least 1")
        self.rate, self.burst, self.clock = rate, float(burst), clock
        self.tokens, self._at = float(burst), clock()

    def take(self) -> bool:
        """Whether a token was there (and is now taken)."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self._at) * self.rate)
        self._at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class FrameGuard:
    """aiohttp's WebSocket parser behind API Gateway's frame rules, read off each frame's
    header before its payload: a binary frame ends the connection with 1003, a data frame
    over ``frame_limit`` bytes with 1009 (the module's docstring has the pages). The
    frames before the refused one are still delivered, none of its bytes; the refusal
    reaches ``receive`` after them as the ``WebSocketError`` aiohttp raises for its own
    limits, and aiohttp closes the connection with its code."""

    def __init__(self, parser: Any, queue: Any, frame_limit: int) -> None:
        self._parser, self._queue, self._limit = parser, queue, frame_limit
        self._pending = b""
        """The start of a frame header whose end has not arrived: held back."""
        self._skip = 0
        """Payload bytes of the current frame still to pass."""
        self._refused = False

    def feed_data(self, data: bytes | bytearray | memoryview) -> tuple[bool, bytes]:
        if self._refused:
            return True, b""
        stream = self._pending + bytes(data) if self._pending else data
        end, refusal = self._scan(stream)
        result: tuple[bool, bytes] = (False, b"")
        if end:
            result = self._parser.feed_data(stream if end == len(stream) else stream[:end])
        if refusal is None:
            return result
        self._refused = True
        self._queue.set_exception(refusal)
        return True, b""

    def feed_eof(self) -> None:
        self._parser.feed_eof()

    def _scan(self, stream: bytes | bytearray | memoryview) -> tuple[int, WebSocketError | None]:
        """How much of ``stream`` may pass (up to a refused frame, or to a header not yet
        whole, which is held back), and the refusal (``None``: none)."""
        at = 0
        self._pending = b""
        while at < len(stream):
            if self._skip:
                step = min(self._skip, len(stream) - at)
                self._skip, at = self._skip - step, at + step
                continue
            head = bytes(stream[at : at + _MAX_HEADER])
            size = _header_size(head)
            if len(head) < size:
                self._pending = head
                return at, None
            refusal = self._refusal(head[0] & 0x0F, _payload_size(head))
            if refusal is not None:
                return at, refusal
            self._skip, at = _payload_size(head), at + size
        return at, None

    def _refusal(self, opcode: int, size: int) -> WebSocketError | None:
        if opcode == WSMsgType.BINARY:
            return WebSocketError(WS_CLOSE_UNSUPPORTED_DATA, "Binary frames are not supported")
        if opcode in (WSMsgType.CONTINUATION, WSMsgType.TEXT) and size > self._limit:
            return WebSocketError(
                WS_CLOSE_MESSAGE_TOO_BIG,
                f"Frame of {size} bytes exceeds the frame limit of {self._limit} bytes",
            )
        return None


_MAX_HEADER = 14
"""A frame header's longest form: 2 bytes, a 64-bit length, a 4-byte mask."""


def _header_size(head: bytes) -> int:
    """A frame header's length (RFC 6455 section 5.2), once its first two bytes are in."""
    if len(head) < 2:
        return 2
    length = head[1] & 0x7F
    extended = 2 if length == 126 else 8 if length == 127 else 0
    return 2 + extended + (4 if head[1] & 0x80 else 0)


def _payload_size(head: bytes) -> int:
    length = head[1] & 0x7F
    if length < 126:
        return length
    width = 2 if length == 126 else 8
    return int.from_bytes(head[2 : 2 + width], "big")


class GuardedResponse(web.WebSocketResponse):
    """aiohttp's WebSocket response whose parser sits behind a ``FrameGuard``."""

    def __init__(self, *, frame_limit: int, **options: Any) -> None:
        super().__init__(**options)
        self.frame_limit = frame_limit

    def _post_start(self, request: BaseRequest, protocol: str | None, writer: Any) -> None:
        super()._post_start(request, protocol, writer)
        handler = request.protocol
        # aiohttp has no hook for this: the parser it just gave the connection is wrapped
        handler._payload_parser = FrameGuard(
            handler._payload_parser,
            self._reader,
            self.frame_limit,
        )


def connection_id() -> str:
    """A new connection id in API Gateway's form (16 base64 characters, ``=`` last),
    from the URL-safe alphabet so that it travels in a path unchanged."""
    return base64.urlsafe_b64encode(secrets.token_bytes(11)).decode()


class LambdaContext:
    """The parts of a Lambda context a handler reads; the remaining time counts down
    from API Gateway's integration timeout."""

    function_name = FUNCTION_NAME
    function_version = "$LATEST"
    memory_limit_in_mb = 1024
    invoked_function_arn = f"arn:aws:lambda:us-east-1:123456789012:function:{FUNCTION_NAME}"
    log_group_name = f"/aws/lambda/{FUNCTION_NAME}"
    log_stream_name = "local"

    def __init__(self, timeout_s: float = INTEGRATION_TIMEOUT_S) -> None:
        self.aws_request_id = str(uuid.uuid4())
        self._deadline = time.monotonic() + timeout_s

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


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


class WebSocketGateway:
    """The WebSocket API and its management API for one handler, on one port."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_connections: int = 1000,
        workers: int = 64,
        timeout_s: float = INTEGRATION_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        lifetime_s: float = LIFETIME_S,
        write_timeout_s: float = WRITE_TIMEOUT_S,
        connection_workers: int = CONNECTION_WORKERS,
        max_queued: int = MAX_QUEUED,
        throttle: TokenBucket | None = None,
        new_connections: TokenBucket | None = None,
    ) -> None:
        if min(max_connections, workers, connection_workers, max_queued) < 1:
            raise ValueError(
                "max_connections, workers, connection_workers and max_queued must be at least 1"
            )
        if min(idle_timeout_s, lifetime_s) <= 0:
            raise ValueError("idle_timeout_s and lifetime_s must be positive")
        self.handler = handler
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.lifetime_s = lifetime_s
        self.write_timeout_s = write_timeout_s
        self.workers = workers
        self.connection_workers = connection_workers
        self.max_queued = max_queued
        self.throttle = throttle or TokenBucket(THROTTLE_RATE, THROTTLE_BURST)
        self.new_connections = new_connections or TokenBucket(
            NEW_CONNECTIONS_PER_S, int(NEW_CONNECTIONS_PER_S)
        )
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="ws-invoke")
        # $connect and $disconnect never wait behind messages (each is its own invocation)
        self.route_pool = ThreadPoolExecutor(16, thread_name_prefix="ws-connect")
        self.connections: dict[str, Connection] = {}
        self._opening = 0
        self._busy = 0
        self._line: deque[Connection] = deque()

    def app(self) -> web.Application:
        """The aiohttp application: the upgrade on ``/``, ``@connections`` beside it."""
        # a body over WS_POST_BYTES is refused by ``_post`` (aiohttp's own 413 has no
        # error type botocore can read)
        app = web.Application(client_max_size=WS_POST_BYTES + 1)
        app.router.add_get("/", self._upgrade)
        management = "/@connections/{connection_id}"
        app.router.add_post(management, self._post)
        app.router.add_get(management, self._get)
        app.router.add_delete(management, self._delete)
        app.on_shutdown.append(self._shutdown)
        return app

    async def _invoke(self, event: dict[str, Any], done: Callable[[], None] | None = None) -> Any:
        """The handler's answer to one event, run in a pool (``$default`` in the message
        pool, ``done`` called when its thread is free again); ``TimeoutError`` past the
        integration timeout, logged with how long it waited for a thread and where the
        handler is (the call itself runs on here; Lambda would stop it at the function's
        own timeout)."""
        context = LambdaContext(self.timeout_s)
        running: dict[str, float | int] = {}

        def call() -> Any:
            running.update(thread=threading.get_ident(), started=time.monotonic())
            return self.handler(event, context)

        submitted = time.monotonic()
        pool = self.pool if done is not None else self.route_pool
        future = asyncio.get_running_loop().run_in_executor(pool, call)
        if done is not None:
            future.add_done_callback(lambda _: done())
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            _log_overrun(event, running, submitted, self.timeout_s)
            raise

    async def _upgrade(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return web.json_response({"message": "Upgrade Required"}, status=426)
        if len(self.connections) + self._opening >= self.max_connections:
            return _error(429, "LimitExceededException", "too many connections")
        if not (self.new_connections.take() and self.throttle.take()):
            return _error(429, "TooManyRequestsException", "Too Many Requests")
        # aiohttp refuses a message of max_msg_size bytes or more; API Gateway takes one
        # of WS_MESSAGE_BYTES
        socket = GuardedResponse(
            frame_limit=WS_FRAME_BYTES,
            max_msg_size=WS_MESSAGE_BYTES + 1,
            autoping=True,
            compress=False,
        )
        connection = Connection(
            connection_id(),
            socket,
            request.remote or "127.0.0.1",
            request.headers.get("User-Agent", ""),
            request.headers.get("x-api-key"),
            transport=request.transport,
        )
        self._opening += 1
        try:
            refused = await self._connect(connection, request)
            if refused is not None:
                return refused
            await socket.prepare(request)
            self.connections[connection.id] = connection
        finally:
            self._opening -= 1
        log.info("connection %s opened from %s", connection.id, connection.source_ip)
        code, reason = GOING_AWAY, "Going away"
        try:
            code, reason = await self._serve(connection)
        finally:
            await self._disconnect(connection, code, reason)
        return socket

    async def _connect(self, connection: Connection, request: web.Request) -> web.Response | None:
        """Run ``$connect``; the refusal to answer, or ``None`` when accepted."""
        try:
            answer = await self._invoke(connect_event(connection, request))
        except TimeoutError:  # logged by _invoke
            return _error(504, None, "Endpoint request timed out")
        except Exception:
            log.exception("$connect of %s: the handler raised", connection.id)
            return _error(500, None, "Internal server error")
        status = int(answer.get("statusCode", 200)) if isinstance(answer, dict) else 200
        if 200 <= status < 300:
            return None
        log.info("connection %s refused by $connect: %d", connection.id, status)
        body = answer.get("body") if isinstance(answer, dict) else None
        return web.Response(status=status, text=body if isinstance(body, str) else "")

    async def _serve(self, connection: Connection) -> tuple[int, str]:
        """Receive until the connection closes; its close code and reason. API Gateway
        ends a connection idle for ``idle_timeout_s`` (no message either way) or open for
        ``lifetime_s`` with 1001."""
        socket = connection.socket
        ends_at = time.monotonic() + self.lifetime_s
        while True:
            now = time.monotonic()
            idle_ends_at = connection.active_at + self.idle_timeout_s
            if now >= min(ends_at, idle_ends_at):
                why = "its lifetime ended" if now >= ends_at else "idle"
                log.info("connection %s closed by the gateway: %s", connection.id, why)
                await socket.close(code=GOING_AWAY, message=b"Going away")
                return GOING_AWAY, "Going away"
            try:
                message = await socket.receive(timeout=min(ends_at, idle_ends_at) - now)
            except TimeoutError:
                continue  # the loop's check decides (a post may have kept it active)
            if message.type == WSMsgType.TEXT:
                connection.last_active_at, connection.active_at = time.time(), time.monotonic()
                self._receive(connection, message.data)
                continue
            if message.type == WSMsgType.ERROR:
                # closed by aiohttp with the error's code: FrameGuard's 1003 and 1009, or
                # aiohttp's own 1009 for a message over the limit
                error = message.data
                code = error.code if isinstance(error, WebSocketError) else socket.close_code
                log.warning("connection %s refused: %s", connection.id, error)
                return int(code or WSCloseCode.PROTOCOL_ERROR), f"{error}"
            if message.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                return socket.close_code or WSCloseCode.OK, str(message.extra or "")

    def _receive(self, connection: Connection, data: str) -> None:
        """Queue ``$default`` for one message without waiting for it: the next message
        of the connection is read at once, as API Gateway does. Past the stage's throttle
        or the connection's queue, the client gets API Gateway's throttle frame."""
        event = message_event(connection, data)
        if len(connection.queue) >= self.max_queued or not self.throttle.take():
            self._spawn(connection, self._notice(connection, event, "Too Many Requests"))
            return
        connection.queue.append(event)
        self._enqueue(connection)
        self._pump()

    def _enqueue(self, connection: Connection) -> None:
        """Put the connection at the back of the line when it has a message waiting and
        may run one more."""
        if (
            connection.queue
            and not connection.ready
            and connection.running < self.connection_workers
        ):
            connection.ready = True
            self._line.append(connection)

    def _pump(self) -> None:
        """Give free threads to the connections in line, one message each in turn."""
        while self._busy < self.workers and self._line:
            connection = self._line.popleft()
            connection.ready = False
            if not connection.queue or connection.running >= self.connection_workers:
                continue
            event = connection.queue.popleft()
            connection.running += 1
            self._busy += 1
            self._spawn(connection, self._message(connection, event))
            self._enqueue(connection)

    def _freed(self, connection: Connection) -> None:
        """An invocation's thread is free (after its handler returned, also past the
        integration timeout)."""
        connection.running -= 1
        self._busy -= 1
        self._enqueue(connection)
        self._pump()

    def _spawn(self, connection: Connection, work: Any) -> None:
        task = asyncio.ensure_future(work)
        connection.invocations.add(task)
        task.add_done_callback(connection.invocations.discard)

    async def _message(self, connection: Connection, event: dict[str, Any]) -> None:
        try:
            await self._invoke(event, done=lambda: self._freed(connection))
            return
        except TimeoutError:  # logged by _invoke
            message = "Endpoint request timed out"
        except Exception:
            log.exception("$default on %s: the handler raised", connection.id)
            message = "Internal server error"
        await self._notice(connection, event, message)

    async def _notice(self, connection: Connection, event: dict[str, Any], message: str) -> None:
        """API Gateway's own frame about a message (no ``id``: not an answer)."""
        request_id = event["requestContext"]["requestId"]
        frame = {"message": message, "connectionId": connection.id, "requestId": request_id}
        if not connection.socket.closed:
            with contextlib.suppress(ConnectionError):
                await connection.socket.send_str(json.dumps(frame))

    async def _disconnect(self, connection: Connection, code: int, reason: str) -> None:
        self.connections.pop(connection.id, None)
        connection.queue.clear()  # nobody is left to answer
        log.info("connection %s closed: %d %s", connection.id, code, reason)
        try:
            await self._invoke(disconnect_event(connection, code, reason))
        except Exception:
            log.exception("$disconnect of %s: the handler failed", connection.id)

    async def _post(self, request: web.Request) -> web.Response:
        """``PostToConnection``: over ``WS_POST_BYTES``, 413 ``PayloadTooLargeException``
        (refused before the body is read when its length is announced)."""
        connection = self._connection(request)
        if (request.content_length or 0) > WS_POST_BYTES:
            return _too_large()
        try:
            data = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _too_large()
        try:
            text: str | None = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        socket = connection.socket
        send = socket.send_str(text) if text is not None else socket.send_bytes(data)
        try:
            await asyncio.wait_for(send, self.write_timeout_s)
        except ConnectionError:
            raise _gone(connection.id) from None
        except TimeoutError:
            log.warning(
                "connection %s dropped: it read nothing for %.1f s",
                connection.id,
                self.write_timeout_s,
            )
            if connection.transport is not None:
                connection.transport.abort()
            raise _gone(connection.id) from None
        connection.last_active_at, connection.active_at = time.time(), time.monotonic()
        return web.Response(status=200)

    async def _get(self, request: web.Request) -> web.Response:
        return web.json_response(self._connection(request).described())

    async def _delete(self, request: web.Request) -> web.Response:
        connection = self._connection(request)
        await connection.socket.close(code=WSCloseCode.OK, message=b"Connection deleted")
        return web.Response(status=204)

    def _connection(self, request: web.Request) -> Connection:
        wanted = request.match_info["connection_id"]
        connection = self.connections.get(wanted)
        if connection is None or connection.socket.closed:
            raise _gone(wanted)
        return connection

    async def _shutdown(self, _: web.Application) -> None:
        for connection in list(self.connections.values()):
            await connection.socket.close(code=WSCloseCode.GOING_AWAY, message=b"Going away")


def _error(status: int, error_type: str | None, message: str) -> web.Response:
    """An error in API Gateway's shape: ``{"message"}`` and the type botocore reads."""
    headers = {"x-amzn-errortype": error_type} if error_type else {}
    return web.json_response({"message": message}, status=status, headers=headers)


def _too_large() -> web.Response:
    return _error(
        413,
        "PayloadTooLargeException",
        f"Request entity too large: a message is at most {WS_POST_BYTES} bytes",
    )


def _gone(connection: str) -> web.HTTPException:
    return web.HTTPGone(
        text=json.dumps({"message": f"connection {connection[:32]} is gone"}),
        content_type="application/json",
        headers={"x-amzn-errortype": "GoneException"},
    )


def _short_id() -> str:
    return base64.b64encode(secrets.token_bytes(6)).decode()


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds")


def serve(
    handler: str,
    host: str,
    port: int,
    *,
    max_connections: int = 1000,
    workers: int = 64,
) -> None:
    """Import ``handler`` and serve it until SIGTERM or Ctrl-C."""
    gateway = WebSocketGateway(
        load_handler(handler), max_connections=max_connections, workers=workers
    )
    log.info("websocket API on ws://%s:%d (handler %s)", host, port, handler)
    try:
        web.run_app(gateway.app(), host=host, port=port, print=None, access_log=None)
    finally:
        gateway.pool.shutdown(wait=False, cancel_futures=True)
        gateway.route_pool.shutdown(wait=False, cancel_futures=True)
