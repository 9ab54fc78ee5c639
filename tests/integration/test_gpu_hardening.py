"""The GPU service under big and hostile bodies: refused before they are read, parsed off
the event loop, bounded in how many bytes are held at once, logged as JSON fields."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import Service, gpu_service, link_model


@pytest.fixture(scope="module")
def repo(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hardening-repo")
    link_model(models_dir, root, "digits")
    link_model(models_dir, root, "minilm")
    return root


@pytest.fixture(scope="module")
def service(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    logs = tmp_path_factory.mktemp("hardening-logs")
    # Room for one 32 MiB body and a few small ones at a time.
    with gpu_service(repo, logs, max_body_bytes_in_flight=str(40 * 1024 * 1024)) as svc:
        yield svc


def _head_only(service: Service, path: str, length: int) -> tuple[int, dict[str, str], bytes]:
    """Send request headers announcing ``length`` body bytes, but no body; the answer."""
    with socket.create_connection(("127.0.0.1", service.port), timeout=30) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n"
        )
        sock.sendall(head.encode())
        raw = b""
        while b"\r\n\r\n" not in raw:
            chunk = sock.recv(65536)
            assert chunk, "the service closed the connection without answering"
            raw += chunk
        header_block, _, rest = raw.partition(b"\r\n\r\n")
        lines = header_block.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        headers = {k.lower(): v for k, v in headers.items()}
        body_length = int(headers.get("content-length", "0"))
        while len(rest) < body_length:
            rest += sock.recv(65536)
        return int(lines[0].split()[1]), headers, rest


def test_an_unknown_model_is_refused_before_its_body_is_read(service: Service) -> None:
    # GIVEN a request announcing a 16 MB body for a model that does not exist
    # WHEN only its headers have been sent
    status, _, body = _head_only(service, "/v2/models/nosuch/infer", 16 * 1024 * 1024)
    # THEN the 404 comes back at once: the body was never waited for, let alone decoded
    assert status == 404
    assert json.loads(body)["code"] == "model_not_found"


def test_an_oversized_body_is_refused_before_it_is_read(service: Service) -> None:
    # GIVEN a request announcing more than the 32 MiB body cap WHEN its headers arrive
    status, _, body = _head_only(service, "/v2/models/digits/infer", 33 * 1024 * 1024)
    # THEN 413 without reading it
    assert status == 413
    assert json.loads(body)["code"] == "payload_too_large"


def test_bodies_past_the_in_flight_budget_get_503_with_retry_after(service: Service) -> None:
    # GIVEN one connection that has sent 30 MiB of a 32 MiB body (the budget is charged
    # by bytes received: an announced size alone holds nothing)
    with socket.create_connection(("127.0.0.1", service.port), timeout=30) as holder:
        holder.sendall(
            b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 33554432\r\n\r\n" + b"{" * (30 << 20)
        )
        # WHEN another client announces a 16 MiB body (the 40 MiB budget cannot hold both)
        deadline_status = None
        for _ in range(200):  # until the first request's reservation is visible
            status, headers, body = _head_only(service, "/v2/models/digits/infer", 16 << 20)
            if status == 503:
                deadline_status = (status, headers, body)
                break
        # THEN it is refused before its body is read, with a retry hint
        assert deadline_status is not None, "the in-flight budget never refused a body"
        status, headers, body = deadline_status
        assert json.loads(body)["code"] == "unavailable"
        assert int(headers["retry-after"]) >= 1
    # AND once the holder is gone, a small request is served again
    small = json.dumps(
        {"inputs": [{"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": [0.0] * 64}]}
    ).encode()
    for _ in range(200):  # the server notices the closed connection asynchronously
        request = urllib.request.Request(f"{service.base}/v2/models/digits/infer", small)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200
                break
        except urllib.error.HTTPError as error:
            refused = error.code
            assert refused == 503
    else:
        raise AssertionError("the budget was never given back")


def _big_json_digits() -> tuple[str, bytes]:
    # A 30 MB JSON request: a second or more of pure parsing.
    rows = 30 * 1024 * 1024 // (64 * 6)
    data = [0.25] * (rows * 64)
    tensor = {"name": "image", "shape": [rows, 8, 8], "datatype": "FP32", "data": data}
    return "digits", json.dumps({"inputs": [tensor]}).encode()


def _long_texts() -> tuple[str, bytes]:
    # 64 texts of about 65 KB each: seconds of tokenising after a short parse; a 1 µs
    # timeout then answers 504 at admission, so the request's time is mostly tokenising.
    words = " ".join(f"word{i % 977}" for i in range(8_000))[:64_000]
    texts = [f"{i} {words}" for i in range(64)]
    tensor = {"name": "text", "shape": [64, 1], "datatype": "BYTES", "data": texts}
    return "minilm", json.dumps({"parameters": {"timeout": 1}, "inputs": [tensor]}).encode()


@pytest.mark.parametrize("make", [_big_json_digits, _long_texts], ids=["json-30mb", "texts"])
def test_health_answers_while_a_big_body_is_parsed(
    service: Service, make: Callable[[], tuple[str, bytes]]
) -> None:
    # GIVEN a big request
    model, body = make()
    done = threading.Event()
    took: list[float] = []

    def big() -> None:
        request = urllib.request.Request(f"{service.base}/v2/models/{model}/infer", body)
        started = time.monotonic()
        try:
            urllib.request.urlopen(request, timeout=120).read()
        except urllib.error.HTTPError as error:
            error.read()  # 400: a batch past max_batch_size, found after the decode
        took.append(time.monotonic() - started)
        done.set()

    thread = threading.Thread(target=big)
    thread.start()
    # WHEN health is probed for as long as the big request takes
    probes: list[float] = []
    while not done.is_set():
        started = time.monotonic()
        with urllib.request.urlopen(f"{service.base}/v2/health/live", timeout=30) as response:
            assert response.status == 200
        probes.append(time.monotonic() - started)
    thread.join(120)
    # THEN no probe waited for a large part of the big request: the event loop never ran
    # the decode (relative to the big request's own time, so a slow machine is no excuse)
    assert len(probes) >= 3, (probes, took)
    assert max(probes) < took[0] / 4, (max(probes), took)


def test_log_lines_are_json_with_request_data_as_fields(service: Service) -> None:
    # GIVEN a request whose path carries an encoded newline and a fake log line
    forged = "/v2/models/x%0a%7B%22level%22%3A%22ERROR%22%7D/infer"
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(urllib.request.Request(service.base + forged, b"{}"), timeout=30)
    assert caught.value.code in (400, 404)
    # WHEN the service's log is read THEN every line is one JSON object, none forged
    lines = [line for line in service.child.log_tail(400).splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]
    assert all({"timestamp", "level", "logger", "message"} <= e.keys() for e in entries)
    assert not any(e.get("level") == "ERROR" and e.get("message") is None for e in entries)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b'{"inputs": [' + b" " * 200_000 + b"oops", "invalid_input"),
        (json.dumps({"inputs": [{"name": "image", "shape": [1, 8, 8], "datatype": "FP32",
                                 "data": ["x"] * 70_000}]}).encode(), "invalid_input"),
        (json.dumps({"inputs": [{"name": "image", "shape": [1] * 40, "datatype": "FP32",
                                 "data": [0.5] * 70_000}]}).encode(), "invalid_input"),
    ],
    ids=["broken", "strings-for-floats", "too-many-dimensions"],
)  # fmt: skip
def test_big_malformed_json_parsed_off_the_loop_is_still_a_400(
    service: Service, body: bytes, code: str
) -> None:
    # GIVEN a malformed JSON body big enough to be parsed in a parse process
    assert len(body) > 64 * 1024
    # WHEN posted THEN the client error crosses back intact: 400 with its code, not a 500
    request = urllib.request.Request(f"{service.base}/v2/models/digits/infer", body)
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == 400
    assert json.loads(caught.value.read())["code"] == code
