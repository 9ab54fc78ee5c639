"""The GPU service's HTTP/1.1 server, driven in this process with no socket.

Each test builds the server's connection protocol over a fake transport (as uvicorn's
own tests do): the test hands it the client's bytes, in one piece or a byte at a time,
reads back exactly what it wrote, and plays the socket's side of flow control (how much
of the written bytes the client has taken). The server's clock is the test's: a test
moves it and runs the sweep the server would run once a second, so no time limit waits
for real time. Requests go to the service's real HTTP app over a data plane serving a
tiny model (``y = x + 1``), except where a test is about the server's own rules
(answer order, flow control, limits on what it starts): there a fake app answers when
the test says so and counts what it was asked to do.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpu_service.dataplane import DataPlane
from gpu_service.http import Exchange, GpuServiceApp, Headers, Response
from gpu_service.http_connection import _MAX_RUNNING, MAX_PIPELINED, Handler
from gpu_service.http_connection import Connection as _Connection
from gpu_service.registry import ModelRegistry
from gpu_service.settings import GpuSettings
from gpu_service.transport import HttpServer
from spillway.protocol.errors import SpillwayError
from tests.fakes import MB, FakeRepository
from tests.unit.test_router import Clock
from tests.unit.test_stats import plus_loader

KIB = 1024
LIMITS: dict[str, Any] = {
    "header_timeout_s": 10.0,
    "body_timeout_s": 10.0,
    "body_min_bytes_per_s": 16 * KIB,
    "write_timeout_s": 30.0,
    "keep_alive_s": 75.0,
    "output_buffer_bytes": 64 * KIB,
}
"""The time limits the tests move the clock past (the defaults but the output buffer,
spelled out), and a small output buffer."""

SETTLE_GUARD_S = 10.0
"""The longest ``settle`` waits for answers before the test fails."""
INFER = "/v2/models/m/infer"
SERVER_METADATA = (
    b'{"name":"spillway-gpu","version":"0.1.0","extensions":["binary_tensor_data",'
    b'"statistics","model_configuration","schedule_policy"]}'
)


def infer_body(value: float) -> bytes:
    tensor = {"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [value]}
    return json.dumps({"inputs": [tensor]}).encode()


def infer_answer(value: float) -> bytes:
    """What the model answers to ``infer_body(value)``: ``value + 1``."""
    output = {"name": "y", "datatype": "FP32", "shape": [1, 1], "data": [value + 1]}
    answer = {"model_name": "m", "model_version": "1", "outputs": [output]}
    return json.dumps(answer, separators=(",", ":")).encode()


def request(method: str, path: str, body: bytes = b"", *headers: str, host: bool = True) -> bytes:
    """An HTTP/1.1 request with ``Content-Length`` (when it has a body)."""
    lines = [f"{method} {path} HTTP/1.1", *(["Host: test"] if host else []), *headers]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def chunked(path: str, pieces: list[bytes], *headers: str) -> bytes:
    head = "\r\n".join([f"POST {path} HTTP/1.1", "Host: test", "Transfer-Encoding: chunked"])
    framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    return (
        (head + "".join(f"\r\n{h}" for h in headers) + "\r\n\r\n").encode()
        + framed
        + (b"0\r\n\r\n")
    )


def error(message: str, code: str) -> bytes:
    return json.dumps({"error": message, "code": code}, separators=(",", ":")).encode()


def answer(status: str, body: bytes, *headers: str, close: bool = False) -> bytes:
    """A whole answer as the server writes it (its ``Date`` written ``D``)."""
    lines = [f"HTTP/1.1 {status}", *headers, f"content-length: {len(body)}", "date: D"]
    lines += ["connection: close"] * close
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


JSON = "content-type: application/json"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
HEAD_LATE = error("the request line and headers did not arrive in time", "request_timeout")
BODY_LATE = error("the request body did not arrive in time", "request_timeout")
NO_HOST = error("a request needs exactly one Host header", "invalid_input")


# -- a transport with no socket ----------------------------------------------------------


class FakeTransport(asyncio.Transport):
    """A socket transport as the protocol sees it. The client's bytes wait here while
    reading is paused, as a socket's would; with ``high_water`` the client takes written
    bytes only when the test says (``take``), and the transport calls ``pause_writing``
    past the mark and ``resume_writing`` once a quarter of it is left, as asyncio's do.
    ``close`` (once the written bytes are taken) and ``abort`` call ``connection_lost``
    on the next turn of the loop."""

    def __init__(self, high_water: int | None = None) -> None:
        super().__init__()
        self.protocol: asyncio.Protocol | None = None
        self.written = bytearray()
        self.taken = 0
        self.high_water = high_water
        self.writing_paused = False
        self.reading = True
        self.inbox: list[bytes] = []
        self.closed = False
        self.aborted = False
        self.lost = False
        self.written_after_close = 0

    # What the protocol calls.
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.closed:
            self.written_after_close += len(data)
        self.written += data
        if self.high_water is None:
            self.taken = len(self.written)
        elif not self.writing_paused and self.get_write_buffer_size() > self.high_water:
            self.writing_paused = True
            self._protocol().pause_writing()

    def writelines(self, parts: Any) -> None:
        for part in parts:
            self.write(part)

    def get_write_buffer_size(self) -> int:
        return len(self.written) - self.taken

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True
        asyncio.get_running_loop().call_soon(self._deliver)

    def is_reading(self) -> bool:
        return self.reading

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True
        if not self.get_write_buffer_size():
            asyncio.get_running_loop().call_soon(self._lose)

    def abort(self) -> None:
        self.closed = self.aborted = True
        asyncio.get_running_loop().call_soon(self._lose)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8001)}.get(
            name, default
        )

    # What the test (the client and its socket) does.
    def feed(self, data: bytes) -> None:
        """The client's bytes arrive (handed over while the server reads)."""
        self.inbox.append(data)
        self._deliver()

    def take(self, size: int | None = None) -> None:
        """The client reads ``size`` more of the written bytes (all when None)."""
        left = self.get_write_buffer_size()
        self.taken += left if size is None else min(size, left)
        high = self.high_water or 0
        if self.writing_paused and self.get_write_buffer_size() <= high // 4:
            self.writing_paused = False
            self._protocol().resume_writing()
        if self.closed and not self.get_write_buffer_size():
            asyncio.get_running_loop().call_soon(self._lose)

    def _deliver(self) -> None:
        while self.reading and self.inbox and not self.lost:
            self._protocol().data_received(self.inbox.pop(0))

    def _lose(self) -> None:
        if not self.lost:
            self.lost = True
            self._protocol().connection_lost(None)

    def _protocol(self) -> asyncio.Protocol:
        assert self.protocol is not None
        return self.protocol


@dataclass
class Client:
    """One connection: the server's protocol object and the fake transport under it."""

    connection: _Connection
    transport: FakeTransport

    def send(self, data: bytes) -> None:
        self.transport.feed(data)

    def drip(self, data: bytes) -> None:
        """``data`` a byte at a time, one ``data_received`` each."""
        for i in range(len(data)):
            self.transport.feed(data[i : i + 1])

    async def settle(self) -> None:
        """Until every request this connection started is answered, and what that set
        off (the next requests, a close) has run."""
        while True:
            running = [t for t in self.connection.tasks if not t.done()]
            if running:
                # A guard, not a wait: an answer the test holds would hang the test.
                _, pending = await asyncio.wait(running, timeout=SETTLE_GUARD_S)
                assert not pending, f"{len(pending)} answers never came"
            await turns()  # done callbacks, a resumed read, connection_lost
            if not any(not t.done() for t in self.connection.tasks):
                return

    @property
    def written(self) -> bytes:
        """Everything written, its ``Date`` headers written ``D``."""
        return re.sub(rb"date: [^\r]*\r\n", b"date: D\r\n", bytes(self.transport.written))

    def answers(self) -> list[tuple[int, dict[str, str], bytes]]:
        """The answers written so far (``100 Continue`` left out), parsed."""
        data, found = self.written, []
        while b"\r\n\r\n" in data:
            head, data = data.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            if status == 100:
                continue
            headers = dict(line.split(": ", 1) for line in lines[1:])
            length = int(headers["content-length"])
            found.append((status, headers, data[:length]))
            data = data[length:]
        return found

    @property
    def open(self) -> bool:
        return not self.transport.closed


class Harness:
    """An ``HttpServer`` over ``app`` on the test's clock, and connections to it."""

    def __init__(self, app: Handler, **settings: Any) -> None:
        self.app = app
        self.clock = Clock()
        self.server = HttpServer(app, GpuSettings(**{**LIMITS, **settings}), self.clock)
        self.server.sweep()  # the cached time and Date header, as ``start`` sets them

    def connect(self, high_water: int | None = None) -> Client:
        transport = FakeTransport(high_water)
        connection = _Connection(self.server)
        transport.protocol = connection
        connection.connection_made(transport)
        return Client(connection, transport)

    def advance(self, seconds: float) -> None:
        """Move the clock, then run the sweep as its once-a-second timer would."""
        self.clock.now += seconds
        self.server.sweep()


# -- the real app over a tiny model (``y = x + version``) -------------------------


@asynccontextmanager
async def service(tmp_path: Path, **settings: Any) -> AsyncIterator[Harness]:
    """The service's HTTP app over a data plane serving model ``m`` (``y = x + 1``)."""
    repository = FakeRepository(tmp_path)
    repository.add("m", 1)
    gpu = GpuSettings(**{**LIMITS, **settings})
    registry = ModelRegistry(repository, gpu, loader=plus_loader)
    await registry.start()
    plane = DataPlane(registry, gpu)
    try:
        yield Harness(GpuServiceApp(plane), **settings)
    finally:
        await registry.stop(5)
        plane.close()


def on_service(
    tmp_path: Path, scenario: Callable[[Harness, Client], Awaitable[None]], **settings: Any
) -> None:
    """Run ``scenario`` on one connection to the service (``service``)."""

    async def main() -> None:
        async with service(tmp_path, **settings) as harness:
            await scenario(harness, harness.connect())

    asyncio.run(main())


def body_bytes_held(harness: Harness) -> int:
    app = harness.app
    assert isinstance(app, GpuServiceApp)
    return app.bodies.in_use


async def turns() -> None:
    """Let what is ready run: a few turns of the loop, no time passing."""
    for _ in range(3):
        await asyncio.sleep(0)


# -- a fake app for the server's own rules ----------------------------------------------


class TestApp:
    """Answers each request ``<path>:<body>`` padded to ``answer_bytes``; with ``hold``,
    only once the test releases it (``release``). Counts what it was asked to do."""

    __test__ = False

    def __init__(self, answer_bytes: int = 0, hold: bool = False) -> None:
        self.answer_bytes = answer_bytes
        self.hold = hold
        self.begun = 0
        self.started = 0
        self.finished = 0
        self.cancelled = 0
        self.abandoned = 0
        self.waiting: list[asyncio.Future[None]] = []

    def begin(self, method: str, path: str, headers: Headers, http_version: str) -> Exchange:
        self.begun += 1
        return Exchange(method, path, headers, None, None, MB)

    def took(self, exchange: Exchange, size: int, received: int) -> None:
        exchange.held += size

    async def finish(self, exchange: Exchange, body: bytes) -> Response:
        self.started += 1
        try:
            if self.hold:
                release = asyncio.get_running_loop().create_future()
                self.waiting.append(release)
                await release
            else:
                await asyncio.sleep(0)  # an answer takes at least one turn of the loop
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished += 1
        text = f"{exchange.path}:".encode() + body
        return 200, text.ljust(self.answer_bytes, b"."), [(b"content-type", b"text/plain")]

    def abandon(self, exchange: Exchange) -> None:
        self.abandoned += 1

    def refusal(self, error: SpillwayError, method: str, path: str) -> Response:
        return error.status, error.code.encode(), []

    def release(self, index: int) -> None:
        self.waiting[index].set_result(None)


def on_app(
    app: TestApp,
    scenario: Callable[[Harness, Client], Awaitable[None]],
    high_water: int | None = None,
    **settings: Any,
) -> None:
    """Run ``scenario`` on one connection to a server over ``app``."""

    async def main() -> None:
        harness = Harness(app, **settings)
        await scenario(harness, harness.connect(high_water))

    asyncio.run(main())


def counts(app: TestApp) -> tuple[int, int, int, int, int]:
    """Begun, started, finished, cancelled, abandoned."""
    return app.begun, app.started, app.finished, app.cancelled, app.abandoned


# -- keep-alive and pipelining ------------------------------------------------------------


def test_pipelined_requests_are_answered_in_order_on_one_kept_connection(tmp_path: Path) -> None:
    async def main(harness: Harness, client: Client) -> None:
        # GIVEN three requests sent in one piece: health, an infer, server metadata
        client.send(
            request("GET", "/v2/health/live")
            + request("POST", INFER, infer_body(0.5))
            + request("GET", "/v2")
        )
        await client.settle()
        # THEN three answers, in the order asked, and the connection stays open
        (live, inferred, metadata) = client.answers()
        assert live == (200, {"content-type": "application/json", **_meta(0)}, b"")
        assert (inferred[0], inferred[2]) == (200, infer_answer(0.5))
        assert inferred[1]["x-spillway-model-version"] == "1"
        assert "connection" not in inferred[1]
        assert metadata[2] == SERVER_METADATA
        assert client.open
        assert client.connection in harness.server.connections
        # WHEN a fourth request comes on the same connection THEN it is answered too
        client.send(request("POST", INFER, infer_body(2.0)))
        await client.settle()
        assert [a[2] for a in client.answers()][3:] == [infer_answer(2.0)]
        assert body_bytes_held(harness) == 0

    on_service(tmp_path, main)


def _meta(length: int) -> dict[str, str]:
    return {"content-length": str(length), "date": "D"}


def test_answers_finished_out_of_order_are_written_in_request_order() -> None:
    app = TestApp(hold=True)

    async def main(harness: Harness, client: Client) -> None:
        client.send(b"".join(request("POST", f"/{n}", b"%d" % n) for n in range(3)))
        await turns()
        assert counts(app)[1] == 3  # all three computing
        # WHEN the third and then the second are ready THEN nothing is written yet
        app.release(2)
        app.release(1)
        await turns()
        assert client.written == b""
        # WHEN the first is ready THEN all three are written, in request order
        app.release(0)
        await client.settle()
        assert [a[2] for a in client.answers()] == [b"/0:0", b"/1:1", b"/2:2"]
        assert client.open

    on_app(app, main)


# -- bodies in pieces ------------------------------------------------------------------


def test_a_request_sent_a_byte_at_a_time_with_content_length_is_answered(tmp_path: Path) -> None:
    async def main(harness: Harness, client: Client) -> None:
        client.drip(request("POST", INFER, infer_body(0.25)))
        await client.settle()
        assert [(s, b) for s, _, b in client.answers()] == [(200, infer_answer(0.25))]
        assert body_bytes_held(harness) == 0

    on_service(tmp_path, main)


def test_a_chunked_request_sent_a_byte_at_a_time_is_answered(tmp_path: Path) -> None:
    async def main(harness: Harness, client: Client) -> None:
        payload = infer_body(3.0)
        pieces = [payload[i : i + 7] for i in range(0, len(payload), 7)]
        # GIVEN a chunked body in 7-byte chunks, every byte of it its own read
        client.drip(chunked(INFER, pieces))
        await client.settle()
        # THEN the model got the body whole
        assert [(s, b) for s, _, b in client.answers()] == [(200, infer_answer(3.0))]
        assert body_bytes_held(harness) == 0

    on_service(tmp_path, main)


def test_a_chunked_body_past_the_limit_is_413_and_closes(tmp_path: Path) -> None:
    async def main(harness: Harness, client: Client) -> None:
        client.send(chunked(INFER, [b" " * 1000, b" " * 25]))
        await client.settle()
        limit = error("request body exceeds the limit of 1024 bytes", "payload_too_large")
        assert client.written == answer("413 Request Entity Too Large", limit, JSON, close=True)
        assert not client.open
        assert client.transport.lost
        assert body_bytes_held(harness) == 0

    on_service(tmp_path, main, max_body_bytes=1024)


# -- malformed requests, Host, HEAD, Expect ---------------------------------------------


def test_a_malformed_request_gets_400_after_the_answers_before_it_and_closes(
    tmp_path: Path,
) -> None:
    async def main(harness: Harness, client: Client) -> None:
        client.send(request("GET", "/v2/health/live") + b"GET / HTTP/1.1\r\nBad Header\r\n\r\n")
        await client.settle()
        malformed = error("malformed HTTP request", "invalid_input")
        assert client.written == answer("200 OK", b"", JSON) + answer(
            "400 Bad Request", malformed, JSON, close=True
        )
        # AND the server reads nothing more and lets the connection go
        assert not client.transport.reading
        assert client.transport.lost
        assert client.connection not in harness.server.connections
        client.send(request("GET", "/v2/health/live"))
        assert client.transport.written_after_close == 0

    on_service(tmp_path, main)


def test_an_http11_request_without_one_host_is_400_and_the_connection_kept(
    tmp_path: Path,
) -> None:
    async def main(harness: Harness, client: Client) -> None:
        # GIVEN a request with no Host, one with two, then a proper one
        client.send(
            request("GET", "/v2", host=False)
            + request("GET", "/v2", b"", "Host: a", "Host: b", host=False)
            + request("GET", "/v2")
        )
        await client.settle()
        # THEN 400, 400, and the third answered on the same connection
        assert client.written == (
            answer("400 Bad Request", NO_HOST, JSON) * 2 + answer("200 OK", SERVER_METADATA, JSON)
        )
        assert client.open

    on_service(tmp_path, main)


def test_an_http10_request_may_omit_host_and_its_connection_closes(tmp_path: Path) -> None:
    async def main(harness: Harness, client: Client) -> None:
        client.send(b"GET /v2 HTTP/1.0\r\n\r\n")
        await client.settle()
        assert client.written == answer("200 OK", SERVER_METADATA, JSON, close=True)
        assert client.transport.lost

    on_service(tmp_path, main)


def test_head_is_answered_with_gets_head_and_no_body(tmp_path: Path) -> None:
    async def main(harness: Harness, client: Client) -> None:
        client.send(request("HEAD", "/v2") + request("GET", "/v2"))
        await client.settle()
        got = answer("200 OK", SERVER_METADATA, JSON)
        head = got[: got.index(b"\r\n\r\n") + 4]
        # THEN HEAD's answer is GET's head (its content-length included), body-less
        assert client.written == head + got

    on_service(tmp_path, main)


def test_expect_100_continue_is_answered_before_the_body(tmp_path: Path) -> None:
    async def main(harness: Harness, client: Client) -> None:
        payload = infer_body(1.0)
        whole = request("POST", INFER, payload, "Expect: 100-continue")
        # GIVEN the head alone THEN 100 Continue and nothing else
        client.send(whole[: -len(payload)])
        await client.settle()
        assert client.written == CONTINUE
        # WHEN the body follows THEN the answer
        client.send(payload)
        await client.settle()
        assert client.written.startswith(CONTINUE + b"HTTP/1.1 200 OK\r\n")
        assert [(s, b) for s, _, b in client.answers()] == [(200, infer_answer(1.0))]

    on_service(tmp_path, main)


def test_a_refused_request_expecting_100_continue_gets_no_continue_and_closes(
    tmp_path: Path,
) -> None:
    async def main(harness: Harness, client: Client) -> None:
        head = request("POST", "/v2/models/nope/infer", b"{}", "Expect: 100-continue")
        client.send(head[:-2])
        await client.settle()
        # THEN the refusal at once, no 100, and the body never read
        (status, headers, body) = client.answers()[0]
        assert (status, json.loads(body)["code"], headers["connection"]) == (
            404,
            "model_not_found",
            "close",
        )
        assert CONTINUE not in client.written
        assert client.transport.lost

    on_service(tmp_path, main)


# -- time limits, on the test's clock -------------------------------------------------------


def test_the_first_head_must_arrive_within_the_header_timeout_of_the_opening() -> None:
    app = TestApp()

    async def main(harness: Harness, client: Client) -> None:
        # GIVEN a connection whose first byte comes 5 s after it opened
        harness.advance(5)
        client.send(b"G")
        # WHEN 10 s have passed since the opening THEN it still stands
        harness.advance(5)
        assert client.written == b""
        assert client.open
        # WHEN more than 10 s have THEN 408 and close
        harness.advance(0.5)
        await client.settle()
        assert client.written == answer("408 Request Timeout", HEAD_LATE, JSON, close=True)
        assert client.transport.lost
        assert counts(app) == (0, 0, 0, 0, 0)

    on_app(app, main)


def test_a_later_head_has_the_header_timeout_from_its_first_byte() -> None:
    app = TestApp()

    async def main(harness: Harness, client: Client) -> None:
        client.send(request("GET", "/a"))
        await client.settle()
        first = client.written
        # GIVEN a kept connection idle for 50 s, then a head that stops after a byte
        harness.advance(50)
        client.send(b"G")
        harness.advance(10)
        assert client.written == first
        assert client.open
        harness.advance(0.5)
        await client.settle()
        assert client.written == first + answer("408 Request Timeout", HEAD_LATE, JSON, close=True)

    on_app(app, main)


def test_a_head_dripped_a_byte_a_second_still_gets_408_at_the_header_timeout() -> None:
    app = TestApp()

    async def main(harness: Harness, client: Client) -> None:
        whole = request("POST", "/a", b"{}")
        sent = 0
        while client.written == b"" and sent < len(whole):
            client.send(whole[sent : sent + 1])
            sent += 1
            harness.advance(1)
        # THEN progress does not extend the head's time: cut at the 11th second
        assert sent == 11
        await client.settle()
        assert client.answers()[0][0] == 408

    on_app(app, main)


def test_a_new_connection_that_sends_nothing_closes_silently_at_the_header_timeout() -> None:
    app = TestApp()

    async def main(harness: Harness, client: Client) -> None:
        harness.advance(10)
        assert client.open
        harness.advance(0.5)
        await client.settle()
        assert (client.written, client.transport.lost) == (b"", True)

    on_app(app, main)


def test_an_idle_kept_connection_closes_after_the_keep_alive_time() -> None:
    app = TestApp()

    async def main(harness: Harness, client: Client) -> None:
        client.send(request("GET", "/a"))
        await client.settle()
        written = client.written
        harness.advance(75)
        assert client.open
        harness.advance(0.5)
        await client.settle()
        assert (client.written, client.transport.lost) == (written, True)

    on_app(app, main)


def test_a_body_that_stalls_gets_408_and_its_bytes_are_given_back(tmp_path: Path) -> None:
    async def main(harness: Harness, client: Client) -> None:
        # GIVEN an infer request that announces 100 bytes and sends 10
        client.send(request("POST", INFER, b" " * 100)[:-90])
        assert body_bytes_held(harness) == 10
        harness.advance(10)
        assert client.written == b""
        assert client.open
        # WHEN the body timeout passes THEN 408, closed, and the 10 bytes given back
        harness.advance(0.5)
        await client.settle()
        assert client.written == answer("408 Request Timeout", BODY_LATE, JSON, close=True)
        assert client.transport.lost
        assert body_bytes_held(harness) == 0

    on_service(tmp_path, main)


def test_bytes_that_come_just_before_a_late_sweep_are_not_counted_late() -> None:
    app = TestApp()

    async def main(harness: Harness, client: Client) -> None:
        # GIVEN a loop busy past its once-a-second sweep: the clock moves 10.5 s (past
        # the body timeout) and no sweep runs
        harness.clock.now += 10.5
        # WHEN a request's head arrives then, its body in a later packet (as http.client
        # sends them), and the late sweep runs between the two
        message = request("POST", "/a", b"{}")
        client.send(message[:-2])
        harness.advance(0.0)
        # THEN the head counts as just arrived: no 408; the body completes the request
        assert client.written == b""
        assert client.open
        client.send(message[-2:])
        await client.settle()
        assert [status for status, _, _ in client.answers()] == [200]
        assert client.open

    on_app(app, main)


def test_expect_continue_then_silence_gets_408_at_the_body_timeout() -> None:
    app = TestApp()

    async def main(harness: Harness, client: Client) -> None:
        client.send(request("POST", "/a", b"{}", "Expect: 100-continue")[:-2])
        assert client.written == CONTINUE
        harness.advance(10)
        assert client.written == CONTINUE
        harness.advance(0.5)
        await client.settle()
        assert client.written == CONTINUE + answer(
            "408 Request Timeout", BODY_LATE, JSON, close=True
        )
        assert counts(app) == (1, 0, 0, 0, 1)

    on_app(app, main)


def test_a_body_below_the_minimum_rate_is_cut_once_it_falls_behind() -> None:
    app = TestApp()

    async def main(harness: Harness, client: Client) -> None:
        # GIVEN a 1 MiB body sent at 1 KiB a second (the minimum is 16 KiB/s)
        client.send(request("POST", "/a", b" " * MB)[:-MB])
        seconds = 0
        while client.open and seconds < 60:
            client.send(b" " * KIB)
            harness.advance(1)
            seconds += 1
        # THEN it is cut once it has taken more than 10 s + size / 16 KiB/s: at 11 s
        assert seconds == 11
        await client.settle()
        assert client.answers() == [(408, {**_close_json(len(BODY_LATE))}, BODY_LATE)]
        assert counts(app) == (1, 0, 0, 0, 1)

    on_app(app, main)


def _close_json(length: int) -> dict[str, str]:
    return {"content-type": "application/json", **_meta(length), "connection": "close"}


def test_a_body_at_a_steady_pace_above_the_minimum_is_not_cut() -> None:
    app = TestApp()

    async def main(harness: Harness, client: Client) -> None:
        size = 600 * KIB
        # GIVEN a 600 KiB body at 20 KiB a second, for 30 s
        client.send(request("POST", "/a", b" " * size)[:-size])
        for _ in range(30):
            client.send(b" " * (20 * KIB))
            harness.advance(1)
        await client.settle()
        # THEN answered
        assert [(s, len(b)) for s, _, b in client.answers()] == [(200, len("/a:") + size)]
        assert client.open

    on_app(app, main)


# -- back-pressure and bounded output ---------------------------------------------------


def test_a_socket_that_backs_up_pauses_reading_until_it_drains() -> None:
    app = TestApp(answer_bytes=40 * KIB)

    async def main(harness: Harness, client: Client) -> None:
        # GIVEN two answers of 40 KiB the client does not read: past the 64 KiB mark
        client.send(request("GET", "/0") + request("GET", "/1"))
        await client.settle()
        assert client.transport.writing_paused
        assert not client.transport.reading
        # WHEN two more requests come THEN they are not read
        client.send(request("GET", "/2") + request("GET", "/3"))
        await client.settle()
        assert counts(app)[0] == 2
        # WHEN the client reads what was written THEN the rest are read and answered
        client.transport.take()
        await client.settle()
        client.transport.take()
        assert counts(app)[:3] == (4, 4, 4)
        assert [a[2][:3] for a in client.answers()] == [b"/0:", b"/1:", b"/2:", b"/3:"]
        assert client.transport.reading

    on_app(app, main, high_water=64 * KIB)


def test_answers_held_behind_a_slow_one_past_the_output_buffer_start_nothing_more() -> None:
    app = TestApp(answer_bytes=40 * KIB, hold=True)

    async def main(harness: Harness, client: Client) -> None:
        # GIVEN a first request still computing and two answered behind it (80 KiB unsent)
        client.send(request("GET", "/0") + request("GET", "/1") + request("GET", "/2"))
        await turns()
        app.release(1)
        app.release(2)
        await turns()
        assert client.connection.unsent == 2 * 40 * KIB
        # WHEN two more come THEN they are read but not started (unsent > 64 KiB)
        client.send(request("GET", "/3") + request("GET", "/4"))
        await turns()
        assert counts(app)[:2] == (5, 3)
        assert client.written == b""
        # WHEN the first is answered THEN all three are written and the two start
        app.release(0)
        await turns()
        assert counts(app)[:2] == (5, 5)
        app.release(3)
        app.release(4)
        await client.settle()
        assert [a[2][:3] for a in client.answers()] == [b"/0:", b"/1:", b"/2:", b"/3:", b"/4:"]

    on_app(app, main)


def test_at_most_max_running_compute_and_reading_pauses_at_max_pipelined() -> None:
    app = TestApp(hold=True)

    async def main(harness: Harness, client: Client) -> None:
        # GIVEN a client that pipelines more requests than the server takes at once
        for n in range(MAX_PIPELINED + 4):
            client.send(request("GET", f"/{n}"))  # each its own read from the socket
        await turns()
        # THEN 32 are read, 8 of them compute, and reading pauses
        assert counts(app)[:2] == (MAX_PIPELINED, _MAX_RUNNING)
        assert not client.transport.reading
        # WHEN the held answers come, and every later one at once
        app.hold = False
        for waiting in app.waiting:
            waiting.set_result(None)
        await client.settle()
        # THEN all are answered, in order, and reading is on again
        assert counts(app) == (MAX_PIPELINED + 4,) * 3 + (0, 0)
        assert [a[2] for a in client.answers()] == [
            f"/{n}:".encode() for n in range(MAX_PIPELINED + 4)
        ]
        assert client.transport.reading

    on_app(app, main)


def test_a_client_that_takes_none_of_its_answers_is_cut_at_the_write_timeout() -> None:
    app = TestApp(answer_bytes=100 * KIB)

    async def main(harness: Harness, client: Client) -> None:
        client.send(request("GET", "/0"))
        await client.settle()
        assert client.transport.writing_paused
        # GIVEN it takes nothing for 30 s THEN it stands
        harness.advance(30)
        assert not client.transport.aborted
        # WHEN it takes a little THEN the next sweep sees progress: the timeout restarts
        client.transport.take(KIB)
        harness.advance(1)
        harness.advance(30)
        assert not client.transport.aborted
        # WHEN it then takes nothing for more than 30 s THEN the connection is reset
        harness.advance(0.5)
        await client.settle()
        assert client.transport.aborted
        assert client.transport.lost
        assert client.connection not in harness.server.connections

    on_app(app, main, high_water=64 * KIB)


# -- a client that goes away -------------------------------------------------------------


def test_a_client_that_goes_away_cancels_running_and_waiting_work() -> None:
    app = TestApp(hold=True)

    async def main(harness: Harness, client: Client) -> None:
        # GIVEN 10 requests read (8 computing, 2 waiting) and an 11th mid-body
        requests = b"".join(request("POST", f"/{n}", b"{}") for n in range(11))
        client.send(requests[:-1])
        await turns()
        assert counts(app) == (11, _MAX_RUNNING, 0, 0, 0)
        # WHEN the connection is lost
        client.connection.connection_lost(ConnectionResetError())
        await client.settle()
        # THEN the 8 computing are cancelled, the 2 waiting and the 11th given back
        assert counts(app) == (11, _MAX_RUNNING, 0, _MAX_RUNNING, 3)
        assert client.written == b""
        assert harness.server.connections == set()

    on_app(app, main)


def test_a_client_that_goes_away_mid_body_gives_its_body_bytes_back(tmp_path: Path) -> None:
    async def main(harness: Harness, client: Client) -> None:
        client.send(request("POST", INFER, b" " * 1000)[:-400])
        assert body_bytes_held(harness) == 600
        client.connection.connection_lost(None)
        assert body_bytes_held(harness) == 0

    on_service(tmp_path, main)


# -- connection limits ---------------------------------------------------------------------


def test_connections_past_the_limit_get_503_and_close() -> None:
    async def main(harness: Harness, first: Client) -> None:
        second = harness.connect()
        await second.settle()
        (status, headers, body) = second.answers()[0]
        assert (status, headers["retry-after"], headers["connection"]) == (503, "1", "close")
        assert json.loads(body)["code"] == "unavailable"
        assert second.transport.lost
        assert first.open

    on_app(TestApp(), main, max_connections=1)


@pytest.mark.parametrize("head_bytes", [60 * KIB, 70 * KIB])
def test_a_head_past_64_kib_is_431(head_bytes: int) -> None:
    app = TestApp()

    async def main(harness: Harness, client: Client) -> None:
        client.send(request("GET", "/a", b"", "X-Pad: " + "p" * head_bytes))
        await client.settle()
        assert client.answers()[0][0] == (200 if head_bytes < 64 * KIB else 431)

    on_app(app, main)


def test_an_upgrade_is_answered_as_plain_http_then_the_connection_closes() -> None:
    app = TestApp()

    async def main(harness: Harness, client: Client) -> None:
        client.send(
            request("GET", "/a", b"", "Connection: Upgrade", "Upgrade: websocket") + b"\x81\x00"
        )
        await client.settle()
        assert client.written == answer("200 OK", b"/a:", "content-type: text/plain", close=True)
        assert client.transport.lost

    on_app(app, main)
