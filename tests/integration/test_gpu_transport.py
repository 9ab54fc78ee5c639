"""The service's own HTTP/1.1 server, on raw sockets: keep-alive, pipelined requests
answered in order, chunked bodies, ``Expect: 100-continue``, ``HEAD``, connection close,
and each protocol-level refusal with its status, code and what becomes of the connection."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support import Service, gpu_service, link_model, write_slow_model

_SLOW_BODY = json.dumps(
    {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [0.5]}]}
).encode()


class Conn:
    """One client connection that reads answers one at a time."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def answer(self, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        """The next answer: status, headers (lower-case names), body."""
        while b"\r\n\r\n" not in self.buffer:
            if not self._fill():
                raise ConnectionError("closed before an answer")
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = 0 if head_only or status == 100 else int(headers["content-length"])
        while len(self.buffer) < length:
            if not self._fill():
                raise ConnectionError("closed mid-body")
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return status, headers, body

    def closed(self) -> bool:
        """Whether the server closed the connection (after any pending bytes)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def _request(method: str, path: str, body: bytes = b"", *headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *headers]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@pytest.fixture
def conn(service: Service) -> Iterator[Conn]:
    connection = Conn(service.port)
    yield connection
    connection.close()


def test_keep_alive_serves_several_requests_on_one_connection(conn: Conn) -> None:
    for _ in range(3):
        conn.send(_request("POST", "/v2/models/slow/infer", _SLOW_BODY))
        status, headers, body = conn.answer()
        assert status == 200
        assert json.loads(body)["outputs"][0]["data"] == [0.5]
        assert "date" in headers
        assert "connection" not in headers


def test_pipelined_requests_are_answered_in_order(conn: Conn) -> None:
    # GIVEN a slow infer, then two instant requests, in one write
    conn.send(
        _request("POST", "/v2/models/slow/infer", _SLOW_BODY)
        + _request("GET", "/v2/models/digits")
        + _request("GET", "/v2/health/live")
    )
    # THEN the answers come in the order asked, though the later ones were ready first
    first, second, third = conn.answer(), conn.answer(), conn.answer()
    assert (first[0], json.loads(first[2])["model_name"]) == (200, "slow")
    assert (second[0], json.loads(second[2])["name"]) == (200, "digits")
    assert (third[0], third[2]) == (200, b"")


def test_a_chunked_body_gives_the_same_answer(conn: Conn) -> None:
    conn.send(_request("POST", "/v2/models/slow/infer", _SLOW_BODY))
    plain = conn.answer()
    half = len(_SLOW_BODY) // 2
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(part), part) for part in (_SLOW_BODY[:half], _SLOW_BODY[half:])
    )
    conn.send(
        b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunks
        + b"0\r\n\r\n"
    )
    chunked = conn.answer()
    assert chunked[0] == plain[0] == 200
    assert json.loads(chunked[2])["outputs"] == json.loads(plain[2])["outputs"]


@pytest.mark.parametrize("expect", ["100-continue", "100-Continue"])
def test_expect_continue_is_answered_before_the_body(conn: Conn, expect: str) -> None:
    head = _request("POST", "/v2/models/slow/infer", b"", f"Expect: {expect}")
    conn.send(head.replace(b"Content-Length: 0", f"Content-Length: {len(_SLOW_BODY)}".encode()))
    assert conn.answer()[0] == 100
    conn.send(_SLOW_BODY)
    assert conn.answer()[0] == 200


def test_a_refused_expect_continue_request_is_answered_at_once_and_closed(conn: Conn) -> None:
    head = _request("POST", "/v2/models/nosuch/infer", b"", "Expect: 100-continue")
    conn.send(head.replace(b"Content-Length: 0", b"Content-Length: 5000"))
    status, headers, body = conn.answer()
    assert (status, json.loads(body)["code"]) == (404, "model_not_found")
    assert headers["connection"] == "close"
    assert conn.closed()


def test_a_refused_request_with_a_small_body_keeps_its_connection(conn: Conn) -> None:
    conn.send(_request("POST", "/v2/models/nosuch/infer", _SLOW_BODY))
    assert conn.answer()[0] == 404
    conn.send(_request("GET", "/v2/health/live"))
    assert conn.answer()[0] == 200


def test_head_gets_headers_without_a_body(conn: Conn) -> None:
    conn.send(_request("GET", "/v2/models/digits"))
    _, _, body = conn.answer()
    conn.send(_request("HEAD", "/v2/models/digits"))
    status, headers, _ = conn.answer(head_only=True)
    # THEN the GET answer's status and length, and no body
    assert status == 200
    assert int(headers["content-length"]) == len(body) > 0
    # No body bytes were sent: the next answer parses from the first byte.
    conn.send(_request("GET", "/v2/health/live"))
    assert conn.answer()[0] == 200


@pytest.mark.parametrize(
    ("request_line", "extra"),
    [("GET /v2/health/live HTTP/1.1", "Connection: close"), ("GET /v2/health/live HTTP/1.0", "")],
    ids=["connection-close", "http-1.0"],
)
def test_the_connection_closes_when_the_client_asks(
    conn: Conn, request_line: str, extra: str
) -> None:
    conn.send(f"{request_line}\r\nHost: x\r\n{extra}\r\n\r\n".encode())
    status, headers, _ = conn.answer()
    assert status == 200
    assert headers["connection"] == "close"
    assert conn.closed()


def test_a_malformed_request_is_a_400_and_closes(conn: Conn) -> None:
    conn.send(b"GARBAGE\x00 / HTTP/1.1\r\n\r\n")
    status, _headers, body = conn.answer()
    assert (status, json.loads(body)["code"]) == (400, "invalid_input")
    assert conn.closed()


def test_headers_past_the_cap_are_a_431(conn: Conn) -> None:
    big = [f"X-Filler-{i}: {'a' * 1000}" for i in range(70)]
    conn.send(_request("GET", "/v2/health/live", b"", *big))
    status, _headers, body = conn.answer()
    assert (status, json.loads(body)["code"]) == (431, "invalid_input")
    assert conn.closed()


def test_a_request_line_past_the_cap_is_a_431(conn: Conn) -> None:
    conn.send(_request("GET", "/v2/health/live?" + "a" * 70_000))
    status, _, body = conn.answer()
    assert (status, json.loads(body)["code"]) == (431, "invalid_input")
    assert conn.closed()


def test_an_upgrade_is_ignored_and_the_connection_ends(conn: Conn) -> None:
    conn.send(_request("GET", "/v2/health/live", b"", "Connection: Upgrade", "Upgrade: h2c"))
    status, headers, _ = conn.answer()
    assert status == 200
    assert headers["connection"] == "close"
    assert conn.closed()


@pytest.mark.parametrize("url", [b"/v2/health/\xff", b"http://"], ids=["non-ascii", "no-host"])
def test_a_url_that_is_not_one_is_a_400(conn: Conn, url: bytes) -> None:
    # A client's malformed URL is its mistake (400, no server-fault mark), never a 500.
    conn.send(b"GET " + url + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = conn.answer()
    assert (status, json.loads(body)["code"]) == (400, "invalid_input")
    assert "x-spillway-fault" not in headers


def test_an_absolute_url_is_served_by_its_path(conn: Conn) -> None:
    conn.send(_request("GET", "http://127.0.0.1/v2/models/digits"))
    status, _, body = conn.answer()
    assert (status, json.loads(body)["name"]) == (200, "digits")
    conn.send(_request("GET", "http://127.0.0.1"))  # no path: "/", which is no route
    assert conn.answer()[0] == 404


def test_a_percent_encoded_path_is_decoded(conn: Conn) -> None:
    conn.send(_request("GET", "/v2/models/dig%69ts"))
    status, _, body = conn.answer()
    assert (status, json.loads(body)["name"]) == (200, "digits")


# -- limits of a small service ------------------------------------------------------------


@pytest.fixture(scope="module")
def small(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("transport-repo")
    link_model(models_dir, root, "digits")
    write_slow_model(root)
    logs = tmp_path_factory.mktemp("transport-logs")
    with gpu_service(root, logs, max_body_bytes="4096", max_connections="3") as svc:
        yield svc


def test_a_chunked_body_past_the_limit_is_a_413_and_closes(small: Service) -> None:
    conn = Conn(small.port)
    try:
        conn.send(
            b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(3):
            conn.send(b"800\r\n" + b" " * 2048 + b"\r\n")
        status, headers, body = conn.answer()
        assert (status, json.loads(body)["code"]) == (413, "payload_too_large")
        assert headers["connection"] == "close"
        assert conn.closed()
    finally:
        conn.close()
    # AND the service still serves
    other = Conn(small.port)
    try:
        other.send(_request("POST", "/v2/models/slow/infer", _SLOW_BODY))
        assert other.answer()[0] == 200
    finally:
        other.close()


def test_connections_past_the_cap_get_a_503(small: Service) -> None:
    held = [Conn(small.port) for _ in range(3)]
    try:
        for conn in held:  # each is open and served
            conn.send(_request("GET", "/v2/health/live"))
            assert conn.answer()[0] == 200
        extra = Conn(small.port)
        status, _headers, body = extra.answer()
        assert (status, json.loads(body)["code"]) == (503, "unavailable")
        assert extra.closed()
        extra.close()
    finally:
        for conn in held:
            conn.close()
    # Once those closed, a new connection is served again.
    deadline = time.monotonic() + 10
    while True:
        conn = Conn(small.port)
        try:
            conn.send(_request("GET", "/v2/health/live"))
            if conn.answer()[0] == 200:
                break
        except ConnectionError:
            pass
        finally:
            conn.close()
        assert time.monotonic() < deadline, "the service never took connections again"
        time.sleep(0.1)


@contextmanager
def _connected(tmp_path: Path, **settings: Any) -> Iterator[Conn]:
    """A connection to a service of the slow model alone, with these settings."""
    root = tmp_path / "repo"
    write_slow_model(root)
    with gpu_service(root, tmp_path / "logs", **settings) as svc:
        conn = Conn(svc.port)
        try:
            yield conn
        finally:
            conn.close()


def test_an_idle_connection_is_closed_after_the_keep_alive_time(tmp_path: Path) -> None:
    with _connected(tmp_path, keep_alive_s="1") as conn:
        conn.send(_request("GET", "/v2/health/live"))
        assert conn.answer()[0] == 200
        # THEN the server closes it once idle for a second (swept once a second; the
        # socket's 30 s timeout bounds the wait)
        assert conn.closed()


def test_the_same_app_serves_under_uvicorn(tmp_path: Path) -> None:
    with _connected(tmp_path, http_server="uvicorn") as conn:
        conn.send(_request("POST", "/v2/models/slow/infer", _SLOW_BODY))
        status, headers, body = conn.answer()
        assert status == 200
        assert json.loads(body)["outputs"][0]["data"] == [0.5]
        assert "uvicorn" in headers.get("server", "")
        # AND a request for an unknown model is refused on its headers: no body sent
        head = _request("POST", "/v2/models/nosuch/infer")
        conn.send(head.replace(b"Content-Length: 0", b"Content-Length: 5000"))
        status, _, body = conn.answer()
        assert (status, json.loads(body)["code"]) == (404, "model_not_found")
