"""The gateway of the local WebSocket API: a Lambda handler (``handler(event, context)``,
by default the WebSocket function's) called the way API Gateway calls it for a WebSocket
API with ``$connect``, ``$disconnect`` and ``$default`` routes:

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
- the stage's throttle and the quota of new connections (``throttle``) are taken by
  every message and upgrade;
- what API Gateway refuses, it refuses the same way, with no invocation: a binary frame
  closes the connection with 1003, a frame over 32 KiB or a message over 128 KiB with
  1009 (``frames``), and a connection idle for 10 minutes or open for 2 hours is closed
  with 1001 (the quotas:
  https://docs.aws.amazon.com/apigateway/latest/developerguide/apigateway-execution-service-websocket-limits-table.html;
  ``spillway.aws.limits``);
- a closed connection becomes a ``$disconnect`` event.

The same port serves the ``@connections`` management API (``management``). Each
connection opened and closed is one log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import WebSocketError, WSCloseCode, WSMsgType, web

from spillway.aws.limits import (
    WS_CONNECTION_LIFETIME_S,
    WS_FRAME_BYTES,
    WS_IDLE_TIMEOUT_S,
    WS_INTEGRATION_TIMEOUT_S,
    WS_MESSAGE_BYTES,
    WS_POST_BYTES,
)
from spillway_cli.local.lambda_runtime import Handler, LambdaContext, load_handler
from spillway_cli.local.websocket.events import (
    Connection,
    connect_event,
    connection_id,
    disconnect_event,
    message_event,
)
from spillway_cli.local.websocket.frames import GuardedResponse
from spillway_cli.local.websocket.management import ConnectionsApi, api_error
from spillway_cli.local.websocket.throttle import (
    TokenBucket,
    new_connection_quota,
    stage_throttle,
)

log = logging.getLogger("spillway.websocket")

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
CONNECTION_WORKERS = 4
"""Invocations one connection runs at once; its other messages wait their turn."""
MAX_QUEUED = 64
"""Messages of one connection waiting for a thread; past it: ``Too Many Requests``. On AWS
nothing waits (each invocation runs at once, or is throttled): a client may send
``WS_MAX_IN_FLIGHT`` (32) frames at once and none waits long, not a flood's thousand."""
FUNCTION_NAME = "spillway-local-websocket"


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
        self.throttle = throttle or stage_throttle()
        self.new_connections = new_connections or new_connection_quota()
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="ws-invoke")
        # $connect and $disconnect never wait behind messages (each is its own invocation)
        self.route_pool = ThreadPoolExecutor(16, thread_name_prefix="ws-connect")
        self.connections: dict[str, Connection] = {}
        self._opening = 0
        self._busy = 0
        self._line: deque[Connection] = deque()

    def app(self) -> web.Application:
        """The aiohttp application: the upgrade on ``/``, ``@connections`` beside it."""
        # a body over WS_POST_BYTES is refused by ``ConnectionsApi`` (aiohttp's own 413 has no
        # error type botocore can read)
        app = web.Application(client_max_size=WS_POST_BYTES + 1)
        app.router.add_get("/", self._upgrade)
        ConnectionsApi(self.connections, self.write_timeout_s).add_routes(app)
        app.on_shutdown.append(self._shutdown)
        return app

    async def _invoke(self, event: dict[str, Any], done: Callable[[], None] | None = None) -> Any:
        """The handler's answer to one event, run in a pool (``$default`` in the message
        pool, ``done`` called when its thread is free again); ``TimeoutError`` past the
        integration timeout, logged with how long it waited for a thread and where the
        handler is (the call itself runs on here; Lambda would stop it at the function's
        own timeout)."""
        context = LambdaContext(FUNCTION_NAME, self.timeout_s)
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
            return api_error(429, "LimitExceededException", "too many connections")
        if not (self.new_connections.take() and self.throttle.take()):
            return api_error(429, "TooManyRequestsException", "Too Many Requests")
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
            return api_error(504, None, "Endpoint request timed out")
        except Exception:
            log.exception("$connect of %s: the handler raised", connection.id)
            return api_error(500, None, "Internal server error")
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

    async def _shutdown(self, _: web.Application) -> None:
        for connection in list(self.connections.values()):
            await connection.socket.close(code=WSCloseCode.GOING_AWAY, message=b"Going away")


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
