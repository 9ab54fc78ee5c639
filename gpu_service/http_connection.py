"""One client connection of the service's HTTP/1.1 server: requests read, answered in order.

httptools parses; a request is routed and admitted by the app (``Handler.begin``) as soon
as its headers are in, so a refusal comes before its body is read; its body is charged as
it arrives (``took``) and the answer (``finish``) waits for the ones before it. The
connection enforces its own limits (head size, pipelining, requests computing at once,
unsent output) and, when the server's sweep calls ``check`` once a second, its time
limits; the list is in ``gpu_service.transport``. What a head says and the bytes of an
answer are ``gpu_service.http_wire``'s.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import deque
from typing import Protocol

import httptools

from gpu_service.http import Exchange, Headers, Response, encoded
from gpu_service.http_wire import (
    BODY_LATE,
    CONTINUE,
    HEAD_LATE,
    HEAD_TOO_LARGE,
    MALFORMED,
    TOO_MANY,
    body_worth_reading,
    expects_continue,
    request_path,
    response_bytes,
)
from gpu_service.settings import GpuSettings
from spillway.protocol.errors import SpillwayError
from spillway.protocol.replies import unhandled

log = logging.getLogger("spillway.transport")

MAX_HEAD_BYTES = 64 * 1024
"""Request line plus headers; more is a 431."""
MAX_PIPELINED = 32
"""Requests of one connection awaiting their answers before reading pauses."""
_MAX_RUNNING = 8
"""Requests of one connection computing at once; later pipelined ones wait their turn,
so a client that sends many and reads none holds few answers."""

_RESET_ON_CLOSE = struct.pack("ii", 1, 0)
"""``SO_LINGER`` on, zero seconds: closing sends a reset and drops unsent bytes."""


class Handler(Protocol):
    """What the server asks of the service for each request (``GpuServiceApp``)."""

    def begin(self, method: str, path: str, headers: Headers, http_version: str) -> Exchange:
        """Route and admit a request on its head; raises ``SpillwayError`` to refuse it."""

    def took(self, exchange: Exchange, size: int, received: int) -> None:
        """Charge body bytes as they arrive; raises ``SpillwayError`` to end the request."""

    async def finish(self, exchange: Exchange, body: bytes) -> Response:
        """The answer to a request whose body has arrived; never raises."""

    def abandon(self, exchange: Exchange) -> None:
        """Give back what a request holds that will never be finished."""

    def refusal(self, error: SpillwayError, method: str, path: str) -> Response:
        """The answer to a refused request, logged."""


class Server(Protocol):
    """What a connection shares with its server (``transport.HttpServer``)."""

    app: Handler
    settings: GpuSettings
    output_limit: int
    """Unsent answer bytes past which no more of a connection's requests start."""
    connections: set[Connection]
    stopping: bool
    now: float
    """The clock as last read (by the sweep, or by ``read_clock``)."""
    date_header: bytes
    loop: asyncio.AbstractEventLoop

    def read_clock(self) -> float:
        """The clock read now (and cached for what follows in this turn of the loop)."""


class _Slot:
    """One request's place in its connection's answer order."""

    __slots__ = ("head_only", "keep_alive", "response")

    def __init__(self, keep_alive: bool, head_only: bool) -> None:
        self.response: Response | None = None
        self.keep_alive = keep_alive
        self.head_only = head_only


_Parked = tuple[_Slot, Exchange, bytes]


class Connection(asyncio.Protocol):
    """One client connection: parses requests, answers them in order."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.app = server.app
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.slots: deque[_Slot] = deque()
        self.tasks: set[asyncio.Task[None]] = set()
        self.parked: deque[_Parked] = deque()
        """Requests read but not started (``_MAX_RUNNING`` computing, or output above
        its mark), in order."""
        self.unsent = 0
        """Bytes of answers ready but waiting for an earlier one."""
        self.closing = False
        self.broken = False  # a request ended the connection: parse nothing more
        self.read_paused = False
        self.write_paused = False
        # Clocks (the server's cached ``now``), read by the once-a-second sweep.
        self.last_active = server.now  # bytes last arrived
        self.head_at = server.now  # the current head began; -1 between requests
        self.body_at = 0.0  # the current request's headers were in
        self.paused_at = 0.0  # the server stopped reading
        self.write_at = 0.0  # the client last took bytes while writing was paused
        self.written = 0  # bytes handed to the transport
        self.drained = 0  # of them, taken by the socket when last looked at
        # The request being parsed.
        self.in_message = False
        self.head_done = False
        self.url = b""
        self.headers: Headers = []
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
        if len(server.connections) > server.settings.max_connections or server.stopping:
            self._fail(TOO_MANY)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.closing = True
        if self.exchange is not None:
            self.app.abandon(self.exchange)
            self.exchange = None
        for _slot, exchange, _body in self.parked:
            self.app.abandon(exchange)
        self.parked.clear()
        # Nobody is left to answer: queued work leaves the batcher without being computed.
        for task in self.tasks:
            task.cancel()
        self.slots.clear()

    def data_received(self, data: bytes) -> None:
        # Arrival times are read now, not from the sweep's cached time: bytes that come
        # just before a late sweep (a busy loop) would count as a second old, and a
        # request whose head and body arrive apart could be cut as slow.
        self.last_active = self.server.read_clock()
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
                self.close()
        except httptools.HttpParserCallbackError:
            self._fail(encoded(unhandled(log, stage="parser")))
        except httptools.HttpParserError:
            self._fail(MALFORMED)

    def pause_writing(self) -> None:
        self.write_paused = True
        self.write_at = self.server.read_clock()
        self.drained = self._drained()
        self._pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._flush()

    # -- httptools callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.broken:
            return
        self.in_message = True
        self.head_done = False
        if self.head_at < 0:
            self.head_at = self.server.now
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
            self._fail(HEAD_TOO_LARGE)
            return False
        return True

    def on_headers_complete(self) -> None:
        if self.broken:
            return
        self.head_done = True
        self.body_at = self.server.now  # the body's time starts (after any 100 Continue)
        method = self.parser.get_method().decode("ascii", "replace")
        try:
            path = request_path(self.url)
            version = self.parser.get_http_version()
            self.exchange = self.app.begin(method, path, self.headers, version)
        except SpillwayError as error:
            self.refused = self.app.refusal(error, method, self.url[:200].decode("latin-1"))
        except (httptools.HttpParserError, UnicodeDecodeError):
            self.refused = MALFORMED  # a URL httptools or ASCII cannot read: the client's
        except Exception:  # noqa: BLE001 - logged with its traceback by unhandled()
            url = self.url[:200].decode("latin-1")
            self.refused = encoded(unhandled(log, method=method[:16], path=url))
        if self.refused is not None:
            self._refuse_now(self.refused)
        elif self.exchange is not None and self.exchange.settling is not None:
            task = self.server.loop.create_task(self._settle(self.exchange))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif self.transport is not None and expects_continue(self.headers):
            self.transport.write(CONTINUE)

    async def _settle(self, exchange: Exchange) -> None:
        """A model unknown on the headers is looked for (``Exchange.settling``) while the
        body arrives: a 404 before the body is in ends the connection at once (``100
        Continue`` waits for the model to be found)."""
        try:
            await exchange.settling  # type: ignore[misc]
        except SpillwayError as error:
            if self.exchange is exchange:  # else its answer (``finish``) is the 404
                self._fail(self.app.refusal(error, exchange.method, exchange.path))
            return
        if self.exchange is exchange and self.transport and expects_continue(self.headers):
            self.transport.write(CONTINUE)

    def _refuse_now(self, response: Response) -> None:
        """Answer a refused request at once, before its body: a small body that follows
        is read and dropped and the connection kept; an unknown or big one is not worth
        reading (nor is one a client holds back for ``Expect: 100-continue``), so the
        connection closes after the answer."""
        if not body_worth_reading(self.headers) or expects_continue(self.headers):
            self._fail(response)
            return
        slot = _Slot(self.parser.should_keep_alive(), self.parser.get_method() == b"HEAD")
        self.slots.append(slot)
        self._ready(slot, response)

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        self.size += len(body)
        if exchange is None:
            return  # refused and answered: the (small) body is dropped
        try:
            self.app.took(exchange, len(body), self.size)
        except SpillwayError as error:  # past its limit (413) or the body budget (503)
            self.app.abandon(exchange)
            self.exchange = None
            self._fail(self.app.refusal(error, exchange.method, exchange.path))
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.in_message = False
        self.head_at = -1.0  # the next head's time starts at its first byte
        if self.broken or self.closing:
            return
        exchange, self.exchange = self.exchange, None
        if exchange is None:
            return  # refused: answered when its headers were in
        slot = _Slot(self.parser.should_keep_alive(), self.parser.get_method() == b"HEAD")
        self.slots.append(slot)
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body = []
        if (  # ``_may_start``, written out: this runs for every request
            self.parked
            or len(self.tasks) >= _MAX_RUNNING
            or self.write_paused
            or self.unsent > self.server.output_limit
        ):
            self.parked.append((slot, exchange, body))
        else:
            task = self.server.loop.create_task(self._answer(slot, exchange, body))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        if len(self.slots) >= MAX_PIPELINED:
            self._pause_reading()

    # -- answering -------------------------------------------------------------------------

    def _may_start(self) -> bool:
        """Whether another request may start computing: few are, and the client takes
        its answers."""
        return (
            len(self.tasks) < _MAX_RUNNING
            and not self.write_paused
            and self.unsent <= self.server.output_limit
        )

    def _start(self, slot: _Slot, exchange: Exchange, body: bytes) -> None:
        task = self.server.loop.create_task(self._answer(slot, exchange, body))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, slot: _Slot, exchange: Exchange, body: bytes) -> None:
        response = await self.app.finish(exchange, body)
        if not self.closing:
            slot.response = response
            self.unsent += len(response[1])
            self._flush()

    def _ready(self, slot: _Slot, response: Response) -> None:
        slot.response = response
        self.unsent += len(response[1])
        self._flush()

    def _flush(self) -> None:
        """Write every answer that is next in order (close after a last one), start the
        requests that may start, and read on if the client keeps up."""
        slots = self.slots
        while slots and slots[0].response is not None and not self.closing:
            slot = slots.popleft()
            response: Response = slot.response  # type: ignore[assignment]
            self.unsent -= len(response[1])
            keep_alive = slot.keep_alive and not self.server.stopping
            self._write(response, keep_alive, slot.head_only)
            if not keep_alive:
                self.close()
        parked = self.parked
        while parked and not self.closing:
            # The next answer's request always starts: the ones behind it wait on it.
            if not self._may_start() and (self.write_paused or parked[0][0] is not slots[0]):
                break
            self._start(*parked.popleft())
        if self.read_paused:
            self._resume_reading()
        if self.server.stopping and not slots and not self.in_message:
            self.close()

    def _write(self, response: Response, keep_alive: bool, head_only: bool = False) -> None:
        transport = self.transport
        if transport is None:
            return
        head, body = response_bytes(response, keep_alive, head_only, self.server.date_header)
        # Counted before writing: a write may call ``pause_writing``, which reads it.
        self.written += len(head) + len(body)
        if body:
            transport.writelines([head, body])
        else:
            transport.write(head)

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
        self.slots.append(slot)
        # Earlier answers may still be computing: read nothing more, answer in order.
        self._pause_reading()
        self._ready(slot, response)

    def close(self) -> None:
        """Close once what is written has been sent."""
        self.closing = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        """Close now with a reset, dropping what is unsent, the socket's buffers included
        (a plain close would leave them to the kernel until the client reads);
        ``connection_lost`` cancels the work."""
        self.closing = True
        transport = self.transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
            transport.abort()

    def _pause_reading(self) -> None:
        if not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.paused_at = self.server.now
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing() or self.broken:
            return
        if (
            self.read_paused
            and not self.write_paused
            and len(self.slots) < MAX_PIPELINED // 2
            and self.unsent <= self.server.output_limit
        ):
            self.read_paused = False
            # Time the server spent not reading is not the client's delay.
            now = self.server.now
            paused = now - self.paused_at
            if self.head_at >= 0:
                self.head_at += paused
            self.body_at += paused
            self.last_active = max(self.last_active, now)
            transport.resume_reading()

    # -- time limits -------------------------------------------------------------------

    def check(self, now: float) -> None:
        """End the connection if its client stalled past a time limit (the sweep's,
        once a second)."""
        limits = self.server.settings
        if self.closing:
            return
        if self.write_paused:
            self._check_writing(now, limits.write_timeout_s)
        elif self.read_paused:
            return  # the server stopped reading: the client is not late
        elif self.in_message:
            if not self.head_done:
                if now - self.head_at > limits.header_timeout_s:
                    self._time_out(HEAD_LATE, now - self.head_at)
            elif now - self.last_active > limits.body_timeout_s or (
                now - self.body_at > limits.body_timeout_s + self.size / limits.body_min_bytes_per_s
            ):
                self._time_out(BODY_LATE, now - self.body_at)
        elif not self.slots:
            if self.head_at >= 0:  # a new connection that has sent nothing
                if now - self.head_at > limits.header_timeout_s:
                    self.close()
            elif now - self.last_active > limits.keep_alive_s:
                self.close()

    def _drained(self) -> int:
        """Bytes written so far that the socket has taken."""
        return self.written - (self.transport.get_write_buffer_size() if self.transport else 0)

    def _check_writing(self, now: float, timeout_s: float) -> None:
        drained = self._drained()
        if drained > self.drained:  # the client took some: it is reading
            self.drained, self.write_at = drained, now
        elif now - self.write_at > timeout_s:
            log.info(
                "client took none of its answers: disconnected",
                extra={"unsent_bytes": self.written - drained + self.unsent},
            )
            self.abort()

    def _time_out(self, response: Response, after_s: float) -> None:
        log.info(
            "request timed out",
            extra={"status": 408, "code": "request_timeout", "after_s": round(after_s, 1)},
        )
        self._fail(response)

    def idle(self) -> bool:
        return not self.slots and not self.in_message
