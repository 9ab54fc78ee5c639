"""The GPU service's HTTP server defends itself against slow and greedy clients.

Time limits (head, body progress, ``Expect: 100-continue`` then silence, answers never
read) and bounded output buffering are driven here on a server in this process whose
clock the test holds: a test moves the clock and runs the once-a-second sweep itself,
so nothing waits for real seconds. The service's own behaviour (body budget charged by
bytes received, readiness, a client's disconnect cancelling its queued work, routing on
the raw path, ``HEAD``, ``Host``) is checked on a real service process, under the
service's own server and under uvicorn alike.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gpu_service.http import Exchange, Response
from gpu_service.http_connection import _MAX_RUNNING, MAX_PIPELINED
from gpu_service.settings import GpuSettings
from gpu_service.transport import HttpServer
from spillway.protocol.errors import SpillwayError
from tests.fakes import eventually
from tests.support import Service, gpu_service, link_model, write_slow_model

T = TypeVar("T")
WAIT_S = 20.0
"""The longest a test waits for a condition before it fails."""
MIB = 1 << 20


# -- a server in this process, on a clock the test holds -----------------------------------


class Clock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeService:
    """The service as the server sees it: every request is answered with ``answer_bytes``
    bytes; it counts the requests begun, answered and cancelled mid-way."""

    def __init__(self, answer_bytes: int = 2, hold: bool = False) -> None:
        self.answer = b"x" * answer_bytes
        self.hold = hold
        """Answers never come (until the request is cancelled)."""
        self.begun = 0
        self.finished = 0
        self.cancelled = 0
        self.abandoned = 0

    def begin(self, method: str, path: str, headers: Any, http_version: str) -> Exchange:
        self.begun += 1
        return Exchange(method, path, headers, None, None, 32 * MIB)

    def took(self, exchange: Exchange, size: int, received: int) -> None:
        exchange.held += size

    async def finish(self, exchange: Exchange, body: bytes) -> Response:
        try:
            await asyncio.sleep(0)  # an answer takes at least one turn of the loop
            if self.hold:
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished += 1
        return 200, self.answer, [(b"content-type", b"application/octet-stream")]

    def abandon(self, exchange: Exchange) -> None:
        self.abandoned += 1

    def refusal(self, error: SpillwayError, method: str, path: str) -> Response:
        return error.status, b"{}", []


class InProcess:
    """An ``HttpServer`` over a ``FakeService`` on its own event-loop thread."""

    def __init__(self, service: FakeService, settings: GpuSettings) -> None:
        self.service = service
        self.clock = Clock()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> tuple[HttpServer, asyncio.Server]:
            server = HttpServer(service, settings, self.clock)
            return server, await server.start("127.0.0.1", 0)

        self.server, self.listener = self._wait(
            asyncio.run_coroutine_threadsafe(start(), self.loop)
        )
        self.port = self.listener.sockets[0].getsockname()[1]

    @staticmethod
    def _wait(future: Future[T]) -> T:
        return future.result(WAIT_S)

    def call(self, function: Callable[[], T]) -> T:
        """``function()`` run on the server's loop (its state is the loop's alone)."""

        async def run() -> T:
            return function()

        return self._wait(asyncio.run_coroutine_threadsafe(run(), self.loop))

    def advance(self, seconds: float) -> None:
        """Move the clock and run the sweep, as its once-a-second timer would."""
        self.clock.now += seconds
        self.call(self.server.sweep)

    def until(self, condition: Callable[[], bool], what: str) -> None:
        """Wait until ``condition`` (read on the loop) holds."""
        eventually(lambda: self.call(condition), what, timeout_s=WAIT_S, interval_s=0.01)

    def client(self, receive_buffer: int | None = None) -> Client:
        """A new connection, once the server has taken it."""
        before = self.call(lambda: len(self.server.connections))
        client = Client(self.port, receive_buffer)
        self.until(lambda: len(self.server.connections) > before, "the connection was taken")
        return client

    def close(self) -> None:
        async def stop() -> None:
            self.listener.close()
            self.server.stop_now()

        self._wait(asyncio.run_coroutine_threadsafe(stop(), self.loop))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)
        self.loop.close()


SHORT = {
    "header_timeout_s": 10.0,
    "body_timeout_s": 10.0,
    "body_min_bytes_per_s": 16 * 1024,
    "write_timeout_s": 30.0,
    "keep_alive_s": 75.0,
}
"""The defaults, spelled out: the tests move the clock past them."""


@contextmanager
def in_process(answer_bytes: int = 2, hold: bool = False, **settings: Any) -> Iterator[InProcess]:
    service = FakeService(answer_bytes, hold)
    served = InProcess(service, GpuSettings(**{**SHORT, **settings}))
    try:
        yield served
    finally:
        served.close()


class Client:
    """A raw client connection; ``answer`` reads one response."""

    def __init__(self, port: int, receive_buffer: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:  # a small window: the server's writes back up soon
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.settimeout(WAIT_S)
        self.sock.connect(("127.0.0.1", port))
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed before an answer")
            self.buffer += chunk
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])
        }
        length = int(headers.get("content-length", "0")) if int(lines[0].split()[1]) >= 200 else 0
        while len(self.buffer) < length:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("closed mid-answer")
            self.buffer += chunk
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(lines[0].split()[1]), headers, body

    def closed(self) -> bool:
        """Whether the server has closed the connection (after any answer bytes)."""
        try:
            while chunk := self.sock.recv(1 << 20):
                self.buffer += chunk
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()


def _post(path: str = "/x", body: bytes = b"{}", *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _ended(served: InProcess) -> bool:
    """Whether the one connection has been ended by the server (or is gone)."""
    return not served.server.connections or _state(served).broken


def _received(served: InProcess, size: int) -> Callable[[], bool]:
    return lambda: bool(_state(served).size == size)


def _drained_past(served: InProcess, size: int) -> Callable[[], bool]:
    return lambda: bool(_state(served)._drained() > size)


def _state(served: InProcess) -> Any:
    """The one connection's state (read on the server's loop)."""
    (connection,) = served.server.connections
    return connection


# -- time limits ------------------------------------------------------------------------


def test_a_head_that_stops_after_one_byte_gets_408_at_the_header_timeout() -> None:
    with in_process() as served:
        # GIVEN a client that sends one byte of a request line and nothing more
        client = served.client()
        client.send(b"P")
        served.until(lambda: _state(served).in_message, "the byte arrived")
        # WHEN the header timeout has not yet passed THEN the connection stays
        served.advance(9)
        assert served.call(lambda: len(served.server.connections)) == 1
        # WHEN it passes THEN 408 request_timeout, and the connection closes
        served.advance(2)
        status, headers, body = client.answer()
        assert (status, json.loads(body)["code"]) == (408, "request_timeout")
        assert headers["connection"] == "close"
        assert client.closed()
        served.until(lambda: not served.server.connections, "the server let it go")


def test_headers_dripped_a_byte_a_second_get_408_at_the_header_timeout() -> None:
    with in_process() as served:
        # GIVEN a client dripping its headers: every byte within a second of the last
        client = served.client()
        request = _post()
        sent = 0
        for sent in range(1, 13):
            client.send(request[sent - 1 : sent])
            served.until(lambda: _state(served).last_active == served.clock.now, "a byte")
            served.advance(1)
            if served.call(lambda: _ended(served)):
                break
        # THEN progress does not extend the head's time: 408 once 10 s have passed
        assert sent == 11
        assert client.answer()[0] == 408
        assert client.closed()


def test_a_new_connection_that_sends_nothing_is_closed_at_the_header_timeout() -> None:
    with in_process() as served:
        client = served.client()
        served.advance(9)
        assert served.call(lambda: len(served.server.connections)) == 1
        served.advance(2)
        # THEN closed without an answer (no request began)
        assert client.closed()
        assert client.buffer == b""


def test_expect_continue_then_silence_gets_408_at_the_body_timeout() -> None:
    with in_process() as served:
        # GIVEN a client that asks for 100 Continue, gets it, and sends no body
        client = served.client()
        client.send(_post("/x", b"", "Expect: 100-continue").replace(b"Length: 0", b"Length: 99"))
        assert client.answer()[0] == 100
        served.advance(9)
        assert served.call(lambda: len(served.server.connections)) == 1
        # WHEN the body timeout passes THEN 408 and closed
        served.advance(2)
        assert client.answer()[0] == 408
        assert client.closed()
        assert served.service.finished == 0


def test_a_body_that_stalls_gets_408_at_the_body_timeout() -> None:
    with in_process() as served:
        client = served.client()
        client.send(_post("/x", b"").replace(b"Length: 0", b"Length: 1000") + b"{" * 10)
        served.until(lambda: _state(served).size == 10, "the first bytes arrived")
        served.advance(11)
        status, _, body = client.answer()
        assert (status, json.loads(body)["code"]) == (408, "request_timeout")
        assert client.closed()
        # AND what the request held was given back
        assert served.service.abandoned == 1


def test_a_body_dripped_below_the_minimum_rate_gets_408() -> None:
    with in_process() as served:
        # GIVEN a body whose bytes each come within the body timeout of the last
        client = served.client()
        client.send(_post("/x", b"").replace(b"Length: 0", b"Length: 1000"))
        served.until(lambda: _state(served).head_done, "the headers arrived")
        ticks = 0
        while not served.call(lambda: _ended(served)) and ticks < 10:
            client.send(b"{")
            served.until(_received(served, ticks + 1), "a byte")
            served.advance(9)
            ticks += 1
        # THEN cut once it has taken longer than 10 s + bytes / 16 KiB/s: after 18 s
        assert ticks == 2
        assert client.answer()[0] == 408


def test_a_big_body_at_a_steady_pace_is_not_cut() -> None:
    with in_process() as served:
        # GIVEN a 600 KiB body sent at 20 KiB/s (above the 16 KiB/s minimum), for 30 s
        client = served.client()
        size = 600 * 1024
        client.send(_post("/x", b"").replace(b"Length: 0", f"Length: {size}".encode()))
        for part in range(6):
            client.send(b" " * (100 * 1024))
            served.until(_received(served, (part + 1) * 100 * 1024), "a part")
            if part < 5:
                served.advance(5)
        # THEN it is answered
        assert client.answer()[0] == 200
        assert served.service.finished == 1


def test_time_the_server_is_not_reading_does_not_count_against_the_client() -> None:
    with in_process() as served:
        # GIVEN a connection whose reading the server paused (32 answers not yet sent)
        client = served.client()
        connection = served.call(lambda: _state(served))
        served.call(connection._pause_reading)
        client.send(b"P")
        served.advance(30)
        assert served.call(lambda: len(served.server.connections)) == 1
        # WHEN reading resumes THEN the head's time starts then
        served.call(connection._resume_reading)
        served.until(lambda: connection.in_message, "the byte arrived")
        served.advance(9)
        assert served.call(lambda: connection.broken) is False
        served.advance(2)
        assert client.answer()[0] == 408


def test_an_idle_connection_still_closes_after_the_keep_alive_time() -> None:
    with in_process() as served:
        client = served.client()
        client.send(_post())
        assert client.answer()[0] == 200
        served.advance(74)
        assert served.call(lambda: len(served.server.connections)) == 1
        served.advance(2)
        assert client.closed()


# -- bounded output -----------------------------------------------------------------------


def test_a_pipelining_client_that_reads_nothing_holds_few_answers_then_is_cut() -> None:
    answer = 4 * MIB
    with in_process(answer_bytes=answer) as served:
        # GIVEN a client that pipelines 32 requests with 4 MiB answers and reads none
        client = served.client(4096)
        client.send(_post() * MAX_PIPELINED)
        served.until(lambda: served.service.begun == MAX_PIPELINED, "all requests read")
        served.until(lambda: _state(served).write_paused, "the socket backed up")
        served.until(lambda: not _state(served).tasks, "the started ones answered")
        # THEN only the requests started before the socket backed up were computed: the
        # first few (the kernel's buffers take at most an answer or two of 4 MiB), not 32
        computed = served.service.finished
        assert computed <= _MAX_RUNNING + 2
        held = served.call(
            lambda: _state(served).transport.get_write_buffer_size() + _state(served).unsent
        )
        assert held <= computed * answer
        # WHEN it still reads nothing for the write timeout
        served.advance(29)
        assert served.call(lambda: len(served.server.connections)) == 1
        served.advance(2)
        # THEN it is disconnected: its answers dropped, the rest never started
        served.until(lambda: not served.server.connections, "the connection was dropped")
        assert served.service.finished == computed
        assert served.service.abandoned == MAX_PIPELINED - computed
        print(json.dumps({"computed": computed, "held_mib": round(held / MIB, 1)}))
        client.close()


def test_a_pipelining_client_that_reads_gets_every_big_answer_in_order() -> None:
    with in_process(answer_bytes=MIB) as served:
        client = served.client(4096)
        client.send(_post() * MAX_PIPELINED)
        answers = [client.answer() for _ in range(MAX_PIPELINED)]
        assert [(s, len(b)) for s, _, b in answers] == [(200, MIB)] * MAX_PIPELINED
        assert served.service.finished == MAX_PIPELINED


def test_a_client_that_reads_slowly_is_not_cut() -> None:
    with in_process(answer_bytes=4 * MIB) as served:
        # GIVEN a client that backs the socket up, then reads a little every 20 s
        client = served.client(4096)
        client.send(_post() * 4)
        served.until(lambda: _state(served).write_paused, "the socket backed up")
        for _ in range(3):
            seen = served.call(lambda: _state(served)._drained())
            taken = 0
            while taken < MIB:
                taken += len(client.sock.recv(MIB))
            served.until(_drained_past(served, seen), "the socket took more")
            served.advance(20)
        # THEN it is still served: progress resets the write timeout
        assert served.call(lambda: len(served.server.connections)) == 1


def test_a_client_that_goes_away_cancels_its_requests() -> None:
    with in_process(hold=True) as served:
        # GIVEN three requests being answered when their client disconnects
        client = served.client()
        client.send(_post() * 3)
        served.until(lambda: served.service.begun == 3, "the requests were read")
        served.until(lambda: len(_state(served).tasks) == 3, "the requests started")
        client.close()
        served.until(lambda: not served.server.connections, "the server saw it go")
        # THEN their work is cancelled
        served.until(lambda: served.service.cancelled == 3, "the work was cancelled")
        assert served.service.finished == 0


# -- the service: body budget, readiness, cancelling queued work, routing, HEAD, Host -------


SLOW = json.dumps(
    {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [0.5]}]}
).encode()


@pytest.fixture(scope="module")
def repo(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("defence-repo")
    link_model(models_dir, root, "digits")
    # One request computes at a time (batch of 1), so the next ones wait in the queue.
    write_slow_model(root, max_batch_size=1, max_queue_size=8)
    return root


@pytest.fixture(scope="module", params=["native", "uvicorn"])
def served(
    request: pytest.FixtureRequest, repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    logs = tmp_path_factory.mktemp(f"defence-{request.param}")
    with gpu_service(
        repo,
        logs,
        http_server=request.param,
        model_control_mode="explicit",
        instance_count="1",
        max_body_bytes=str(256 * 1024),
        max_body_bytes_in_flight=str(512 * 1024),
    ) as svc:
        yield svc


def _exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    client = Client(port)
    try:
        client.send(raw)
        if raw.startswith(b"HEAD "):
            client.buffer = b""
            while b"\r\n\r\n" not in client.buffer:
                client.buffer += client.sock.recv(65536)
            head, client.buffer = client.buffer.split(b"\r\n\r\n", 1)
            lines = head.decode().split("\r\n")
            headers = {
                k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])
            }
            return int(lines[0].split()[1]), headers, client.buffer
        return client.answer()
    finally:
        client.close()


def _get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    return _exchange(
        port, f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    )


def _digits_body() -> bytes:
    tensor = {"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": [0.0] * 64}
    return json.dumps({"inputs": [tensor]}).encode()


def _ready(port: int) -> int:
    return _get(port, "/v2/health/ready")[0]


def _until(condition: Callable[[], bool], what: str) -> None:
    eventually(condition, what, timeout_s=WAIT_S, interval_s=0.05)


def test_clients_that_announce_big_bodies_and_send_none_hold_no_budget(served: Service) -> None:
    # GIVEN four connections that announce a full body (or a chunked one) and send nothing
    holders = []
    for chunked in (False, False, True, True):
        holder = Client(served.port)
        framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {256 * 1024}"
        holder.send(
            f"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\n{framing}\r\n\r\n".encode()
        )
        holders.append(holder)
    try:
        # WHEN another client sends a small request
        body = _digits_body()
        status, _, answer = _exchange(served.port, _post("/v2/models/digits/infer", body))
        # THEN it is served, and the service stays ready
        assert status == 200, answer
        assert _ready(served.port) == 200
    finally:
        for holder in holders:
            holder.close()


def test_readiness_is_false_while_received_bodies_fill_the_budget(served: Service) -> None:
    # GIVEN two clients that have each sent 250 KiB of a 256 KiB body (500 of 512 KiB)
    holders = []
    for _ in range(2):
        holder = Client(served.port)
        holder.send(
            _post("/v2/models/digits/infer", b"").replace(b"Length: 0", b"Length: 262144")
            + b" " * (250 * 1024)
        )
        holders.append(holder)
    try:
        # THEN readiness turns false (a balancer sends work elsewhere)
        _until(lambda: _ready(served.port) == 400, "readiness turned false")
        # AND a body that does not fit beside them gets 503 with a retry hint
        status, headers, body = _exchange(
            served.port, _post("/v2/models/digits/infer", b" " * (64 * 1024))
        )
        assert (status, json.loads(body)["code"]) == (503, "unavailable")
        assert int(headers["retry-after"]) >= 1
    finally:
        for holder in holders:
            holder.close()
    # AND once they are gone the service is ready again
    _until(lambda: _ready(served.port) == 200, "readiness came back")


def _metric(port: int, name: str, model: str) -> float:
    text = _get(port, "/metrics")[2].decode()
    match = re.search(rf'^{name}{{[^}}]*model="{model}"[^}}]*}} (\S+)$', text, re.M)
    assert match is not None, text[:2000]
    return float(match[1])


def test_a_client_that_goes_away_leaves_its_queued_work_uncomputed(served: Service) -> None:
    port = served.port
    before = json.loads(_get(port, "/v2/models/slow/stats")[2])["model_stats"][0]
    # GIVEN one request computing on the slow model and two more queued behind it
    first = Client(port)
    first.send(_post("/v2/models/slow/infer", SLOW))
    _until(lambda: _metric(port, "nv_inference_pending_request_count", "slow") == 1, "A computing")
    queued = []
    for _ in range(2):
        client = Client(port)
        client.send(_post("/v2/models/slow/infer", SLOW))
        queued.append(client)
    _until(lambda: _metric(port, "spillway_queue_depth", "slow") == 2, "B and C queued")
    # WHEN the two queued clients go away
    for client in queued:
        client.close()
    # THEN their rows leave the queue without being computed
    _until(lambda: _metric(port, "spillway_queue_depth", "slow") == 0, "the queue emptied")
    assert first.answer()[0] == 200
    first.close()
    _until(lambda: _metric(port, "nv_inference_pending_request_count", "slow") == 0, "all done")
    after = json.loads(_get(port, "/v2/models/slow/stats")[2])["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 1


def test_an_encoded_slash_is_never_a_path_separator(served: Service) -> None:
    # GIVEN explicit model control, where /v2/repository/models/digits/unload unloads
    # WHEN the separators of that path are percent-encoded
    status, _, body = _exchange(
        served.port, _post("/v2/repository%2fmodels%2fdigits%2funload", b"")
    )
    # THEN no route: nothing was unloaded
    assert (status, json.loads(body)["code"]) == (404, "not_found")
    assert _get(served.port, "/v2/models/digits/ready")[0] == 200
    # AND in a model's place, an encoded slash makes an invalid name
    status, _, body = _get(served.port, "/v2/models/digits%2Fready")
    assert (status, json.loads(body)["code"]) == (400, "invalid_model_name")
    # AND other escapes still decode
    assert _get(served.port, "/v2/models/dig%69ts/ready")[0] == 200


def test_head_is_served_wherever_get_is(served: Service) -> None:
    status, headers, body = _get(served.port, "/v2/models/digits")
    assert status == 200
    head_status, head_headers, rest = _get(served.port, "/v2/models/digits", "HEAD")
    # THEN the GET answer's status and length, and no body
    assert head_status == 200
    assert int(head_headers["content-length"]) == len(body) > 0
    assert rest == b""
    assert _get(served.port, "/v2/health/ready", "HEAD")[0] == 200
    # AND a POST route refuses HEAD, naming the method it takes
    status, headers, _ = _get(served.port, "/v2/models/digits/infer", "HEAD")
    assert (status, headers["allow"]) == (405, "POST")
    # AND a GET route names both methods it takes
    status, headers, _ = _get(served.port, "/v2/health/live", "DELETE")
    assert (status, headers["allow"]) == (405, "GET, HEAD")


@pytest.mark.parametrize(
    ("request_head", "status"),
    [
        (b"GET /v2/health/live HTTP/1.1\r\n", 400),
        (b"GET /v2/health/live HTTP/1.1\r\nHost: a\r\nHost: b\r\n", 400),
        (b"GET /v2/health/live HTTP/1.0\r\nHost: a\r\nHost: b\r\n", 400),
        (b"GET /v2/health/live HTTP/1.0\r\n", 200),
        (b"GET /v2/health/live HTTP/1.1\r\nHost: a\r\n", 200),
    ],
    ids=["1.1-no-host", "1.1-two-hosts", "1.0-two-hosts", "1.0-no-host", "1.1-one-host"],
)
def test_a_request_needs_exactly_one_host_header(
    served: Service, request_head: bytes, status: int
) -> None:
    got, _, body = _exchange(served.port, request_head + b"Connection: close\r\n\r\n")
    assert got == status, body
    if status == 400:
        assert json.loads(body)["code"] == "invalid_input"


def test_a_stalled_body_under_uvicorn_gets_408(repo: Path, tmp_path: Path) -> None:
    # uvicorn has no body timeout; the app sets its own between two pieces of body
    with gpu_service(repo, tmp_path, http_server="uvicorn", body_timeout_s="1") as svc:
        client = Client(svc.port)
        client.send(_post("/v2/models/digits/infer", b"").replace(b"Length: 0", b"Length: 99"))
        status, headers, body = client.answer()
        assert (status, json.loads(body)["code"]) == (408, "request_timeout")
        assert headers["connection"] == "close"
        assert client.closed()
        client.close()


def test_every_service_answer_still_parses(served: Service) -> None:
    # A plain client (urllib) is served as before: Host sent, answers complete.
    with urllib.request.urlopen(f"{served.base}/v2/models/digits", timeout=WAIT_S) as response:
        assert json.loads(response.read())["name"] == "digits"
