"""The service's own HTTP/1.1 server: httptools on the event loop, no ASGI layer between.

The service answers many small requests, so the server's cost per request bounds its
throughput once the model is fast (on a GPU, always). A bare ASGI app under uvicorn
answered 43,001 requests/s on the benchmark machine and the same answer from an
``asyncio.Protocol`` over httptools 188,596 (c64, one run, docs/benchmarks.md): the ASGI
messages and uvicorn's per-request task and flow-control objects cost about 3.4 times
what parsing and writing do. This server parses with httptools, routes
with ``GpuServiceApp.begin`` as soon as the headers are in (so a refusal comes before the
body is read), buffers the body within the exchange's limit and answers with
``GpuServiceApp.finish``.

HTTP/1.1 as clients use it: keep-alive (idle connections close after
``GPU_KEEP_ALIVE_S``), pipelined requests answered in order, chunked bodies,
``Expect: 100-continue``, ``HEAD``, ``Connection: close`` and HTTP/1.0; an ``Upgrade``
(WebSocket, h2c) is ignored and the connection closes after the answer. Limits: a body
past its exchange's limit is a 413 and the connection closes; request line and headers
past ``MAX_HEAD_BYTES`` a 431; connections past ``GPU_MAX_CONNECTIONS`` a 503; a
malformed request a 400 (each closes the connection).

Stopping (SIGTERM or SIGINT): readiness turns false and new infer requests get 503 at
once, the listener closes, idle connections close, requests in flight are answered
(their connections then close), and once none is left, or ``drain_timeout_s`` has
passed, the app shuts down (async consumer, batchers) and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import deque
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import unquote

import httptools

from gpu_service.http import Exchange, GpuServiceApp, Response, encoded
from gpu_service.settings import GpuSettings
from spillway.errors import PayloadTooLargeError, SpillwayError, UnavailableError
from spillway.wire import INTERNAL_ERROR, error_reply

log = logging.getLogger("spillway.transport")

MAX_HEAD_BYTES = 64 * 1024
"""Request line plus headers; more is a 431."""
MAX_PIPELINED = 32
"""Requests of one connection awaiting their answers before reading pauses."""
_SWEEP_S = 1.0
_DROP_BODY_BYTES = 1024 * 1024
"""A refused request's body is read and dropped up to this size, else the connection
closes after the refusal."""
_INLINE_BODY = 64 * 1024
"""A response body up to this size is joined to its head (one write, one copy)."""

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))


_STATUS_LINES = {status: _status_line(status) for status in _REASONS}


def _plain(status: int, code: str, message: str) -> Response:
    """A protocol-level error, shaped like every other error answer."""
    body = b'{"error":"%s","code":"%s"}' % (message.encode(), code.encode())
    return status, body, [(b"content-type", b"application/json")]


_MALFORMED = _plain(400, "invalid_input", "malformed HTTP request")
_HEAD_TOO_LARGE = _plain(431, "invalid_input", "request line and headers are too large")
_TOO_MANY = encoded(
    error_reply(UnavailableError("too many connections; retry shortly", retry_after_s=1.0))
)
_INTERNAL = encoded(INTERNAL_ERROR)


class _Slot:
    """One request's place in its connection's answer order."""

    __slots__ = ("head_only", "keep_alive", "response")

    def __init__(self, keep_alive: bool, head_only: bool) -> None:
        self.response: Response | None = None
        self.keep_alive = keep_alive
        self.head_only = head_only


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, answers them in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.app = server.app
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.slots: deque[_Slot] = deque()
        self.last_active = server.now
        self.closing = False
        self.broken = False  # a request ended the connection: parse nothing more
        self.read_paused = False
        self.write_paused = False
        # The request being parsed.
        self.in_message = False
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.body: list[bytes] = []
        self.size = 0
        self.exchange: Exchange | None = None
        self.refused: Response | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        server.connections.add(self)
        if len(server.connections) > server.max_connections or server.stopping:
            self._fail(_TOO_MANY)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.closing = True
        if self.exchange is not None:
            self.app.abandon(self.exchange)
            self.exchange = None
        self.slots.clear()

    def data_received(self, data: bytes) -> None:
        self.last_active = self.server.now
        if self.broken:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # The request was answered as plain HTTP (the upgrade ignored, as RFC 9110
            # allows); what follows it is another protocol's, so the connection ends.
            self.broken = True
            if self.slots:
                self.slots[-1].keep_alive = False
            else:
                self._close()
        except httptools.HttpParserCallbackError:
            log.exception("request handling failed in the parser")
            self._fail(_INTERNAL)
        except httptools.HttpParserError:
            self._fail(_MALFORMED)

    def pause_writing(self) -> None:
        self.write_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._resume_reading()

    # -- httptools callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.broken:
            return
        self.in_message = True
        self.url = b""
        self.headers = []
        self.head_bytes = 0
        self.body = []
        self.size = 0
        self.exchange = None
        self.refused = None

    def on_url(self, url: bytes) -> None:
        if self._head_grows(len(url)):
            self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head_grows(len(name) + len(value) + 4):
            self.headers.append((name.lower(), value))

    def _head_grows(self, size: int) -> bool:
        """Count request-line and header bytes; past the cap, a 431 ends the connection
        (nothing more of the head is kept)."""
        if self.broken:
            return False
        self.head_bytes += size
        if self.head_bytes > MAX_HEAD_BYTES:
            self._fail(_HEAD_TOO_LARGE)
            return False
        return True

    def _expects_continue(self) -> bool:
        expect = _header(self.headers, b"expect")
        return expect is not None and expect.strip().lower() == "100-continue"

    def on_headers_complete(self) -> None:
        if self.broken:
            return
        method = self.parser.get_method().decode("ascii", "replace")
        try:
            path = _path(self.url)
            self.exchange = self.app.begin(method, path, self.headers)
        except SpillwayError as error:
            self.refused = self.app.refusal(error, method, self.url[:200].decode("latin-1"))
        except (httptools.HttpParserError, UnicodeDecodeError):
            self.refused = _MALFORMED  # a URL httptools or ASCII cannot read: the client's
        except Exception:
            log.exception("unhandled error on %s", method)
            self.refused = _INTERNAL
        if self.refused is not None:
            self._refuse_now(self.refused)
        elif self.transport is not None and self._expects_continue():
            self.transport.write(_CONTINUE)

    def _refuse_now(self, response: Response) -> None:
        """Answer a refused request at once, before its body: a small body that follows
        is read and dropped and the connection kept; an unknown or big one is not worth
        reading (nor is one a client holds back for ``Expect: 100-continue``), so the
        connection closes after the answer."""
        follows = _header(self.headers, b"content-length")
        small = follows is None and _header(self.headers, b"transfer-encoding") is None
        small = small or (
            follows is not None and follows.isdigit() and int(follows) <= _DROP_BODY_BYTES
        )
        if not small or self._expects_continue():
            self._fail(response)
            return
        slot = _Slot(self.parser.should_keep_alive(), self.parser.get_method() == b"HEAD")
        slot.response = response
        self.slots.append(slot)
        self._flush()

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        self.size += len(body)
        if exchange is None:
            return  # refused and answered: the (small) body is dropped
        if self.size > exchange.limit:
            self.app.abandon(exchange)
            self.exchange = None
            error = PayloadTooLargeError(
                f"request body exceeds the limit of {exchange.limit} bytes"
            )
            self._fail(self.app.refusal(error, exchange.method, exchange.path))
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.in_message = False
        if self.broken or self.closing:
            return
        exchange, self.exchange = self.exchange, None
        if exchange is None:
            return  # refused: answered when its headers were in
        slot = _Slot(self.parser.should_keep_alive(), self.parser.get_method() == b"HEAD")
        self.slots.append(slot)
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body = []
        task = self.server.loop.create_task(self._answer(slot, exchange, body))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)
        if len(self.slots) >= MAX_PIPELINED:
            self._pause_reading()

    # -- answering -------------------------------------------------------------------------

    async def _answer(self, slot: _Slot, exchange: Exchange, body: bytes) -> None:
        slot.response = await self.app.finish(exchange, body)
        if not self.closing:
            self._flush()

    def _flush(self) -> None:
        """Write every answer that is next in order; close after a last one."""
        transport = self.transport
        slots = self.slots
        while slots and slots[0].response is not None and not self.closing:
            slot = slots.popleft()
            keep_alive = slot.keep_alive and not self.server.stopping
            self._write(slot.response, keep_alive, slot.head_only)  # type: ignore[arg-type]
            if not keep_alive:
                self._close()
        if self.read_paused and len(slots) < MAX_PIPELINED // 2:
            self._resume_reading()
        if transport is not None and self.server.stopping and not slots and not self.in_message:
            self._close()

    def _write(self, response: Response, keep_alive: bool, head_only: bool = False) -> None:
        status, body, headers = response
        parts = [_STATUS_LINES.get(status) or _status_line(status)]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(b"content-length: %d\r\n" % len(body))
        parts.append(self.server.date_header)
        if not keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        transport = self.transport
        if transport is None:
            return
        if head_only or not body:
            transport.write(b"".join(parts))
        elif len(body) <= _INLINE_BODY:
            parts.append(body)
            transport.write(b"".join(parts))
        else:
            transport.writelines([b"".join(parts), body])

    def _fail(self, response: Response) -> None:
        """Answer a request that ends the connection (after the answers before it)."""
        if self.broken or self.closing or self.transport is None:
            return
        self.broken = True
        self.in_message = False
        if self.exchange is not None:
            self.app.abandon(self.exchange)
            self.exchange = None
        slot = _Slot(keep_alive=False, head_only=False)
        slot.response = response
        self.slots.append(slot)
        # Earlier answers may still be computing: read nothing more, answer in order.
        self._pause_reading()
        self._flush()

    def _close(self) -> None:
        self.closing = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _pause_reading(self) -> None:
        if not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing() or self.broken:
            return
        if self.read_paused and not self.write_paused and len(self.slots) < MAX_PIPELINED:
            self.read_paused = False
            transport.resume_reading()

    def idle(self) -> bool:
        return not self.slots and not self.in_message


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def _path(url: bytes) -> str:
    """The request's path, percent-decoded (as ASGI servers give it); ``/`` for an
    absolute URL without one. Raises ``HttpParserError`` or ``UnicodeDecodeError`` for
    a URL that is not one."""
    path = (httptools.parse_url(url).path or b"/").decode("ascii")
    return unquote(path) if "%" in path else path


class HttpServer:
    """Listens, serves connections, drains on a signal."""

    def __init__(
        self, app: GpuServiceApp, host: str, port: int, max_connections: int, keep_alive_s: float
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.keep_alive_s = keep_alive_s
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self.now = time.monotonic()
        self.date_header = b""
        self._stop = asyncio.Event()
        self._signals = 0
        self.loop = asyncio.get_running_loop()
        self._tick()

    def _tick(self) -> None:
        """Once a second: the cached ``Date`` header, and idle connections closed."""
        self.now = time.monotonic()
        self.date_header = b"date: %s\r\n" % formatdate(usegmt=True).encode()
        for connection in list(self.connections):
            if connection.idle() and self.now - connection.last_active > self.keep_alive_s:
                connection._close()
        self.loop.call_later(_SWEEP_S, self._tick)

    def request_stop(self, sig: int = signal.SIGTERM) -> None:
        """Start draining (a second SIGINT stops without waiting)."""
        self._signals += 1
        if self._signals > 1 and sig == signal.SIGINT:
            log.warning("second interrupt: stopping without draining")
            for connection in list(self.connections):
                connection._close()
            for task in list(self.tasks):
                task.cancel()
        self.app.plane.start_draining(f"signal {sig}")
        self._stop.set()

    async def run(self) -> int:
        """Serve until stopped; the process's exit status."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.request_stop, sig)
        try:
            await self.app.startup()
        except Exception:
            log.exception("start-up failed")
            return 3
        listener = await self.loop.create_server(
            lambda: _Connection(self), self.host, self.port, backlog=2048, reuse_address=True
        )
        ports = sorted({s.getsockname()[1] for s in listener.sockets})
        log.info("listening on http://%s:%s", self.host, ",".join(map(str, ports)))
        await self._stop.wait()
        await self._drain(listener)
        await self.app.shutdown()
        log.info("stopped")
        return 0

    async def _drain(self, listener: asyncio.Server) -> None:
        self.stopping = True
        listener.close()
        for connection in list(self.connections):
            if connection.idle():
                connection._close()
        deadline = time.monotonic() + self.app.plane.settings.drain_timeout_s
        while (self.tasks or self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            for connection in list(self.connections):
                if connection.idle():
                    connection._close()
        for connection in list(self.connections):
            connection._close()


def run(app: GpuServiceApp, settings: GpuSettings) -> int:
    """Serve ``app`` on uvloop until a signal; returns the exit status."""
    import uvloop

    async def main() -> int:
        return await HttpServer(
            app, settings.host, settings.port, settings.max_connections, settings.keep_alive_s
        ).run()

    return uvloop.run(main())
