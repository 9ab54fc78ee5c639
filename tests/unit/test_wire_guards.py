"""The server-fault mark (``x-spillway-fault``) on every transport, and the body limit.

The router's circuit breakers and the canary's rollback count a 5xx against a backend
only when the answer carries ``x-spillway-fault: server``; a 504 (deadline passed in a
busy queue) and every 4xx must never carry it. Checked on the one mapping
(``spillway.protocol.replies.error_reply``), on the GPU service's encoding of a refusal, on
the CPU fallback's WSGI and direct-invoke answers, and on the router's reading of it."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace
from typing import Any

import pytest
from werkzeug.test import Client

from gpu_service.http import GpuServiceApp, encoded
from spillway.fallback.app import CpuApp
from spillway.fallback.direct import handle_direct
from spillway.protocol.errors import (
    DeadlineExceededError,
    InferenceError,
    InvalidInputError,
    MethodNotAllowedError,
    ModelLoadError,
    ModelNotFoundError,
    ModelNotReadyError,
    OverloadedError,
    PayloadTooLargeError,
    SpillwayError,
    UnavailableError,
)
from spillway.protocol.replies import FAULT_HEADER, INTERNAL_ERROR, error_reply
from spillway.protocol.wire import read_wsgi_body
from tests.unit.test_router import SERVER_FAULT, make_stack, ok

SERVER_ERRORS: list[SpillwayError] = [
    InferenceError("the model failed"),
    ModelLoadError("the model did not load"),
    UnavailableError("shutting down"),
    ModelNotReadyError("still loading"),
]
NOT_SERVER_ERRORS: list[SpillwayError] = [
    DeadlineExceededError("deadline passed in the queue"),
    InvalidInputError("bad tensor"),
    ModelNotFoundError("no such model"),
    PayloadTooLargeError("too big"),
    OverloadedError("queue full", retry_after_s=2.0),
    MethodNotAllowedError("GET is not allowed", allow="POST"),
]


def _ids(errors: list[SpillwayError]) -> list[str]:
    return [f"{type(e).__name__}-{e.status}" for e in errors]


# -- the one mapping ------------------------------------------------------------------------


@pytest.mark.parametrize("error", SERVER_ERRORS, ids=_ids(SERVER_ERRORS))
def test_a_server_error_is_marked_as_the_servers_fault(error: SpillwayError) -> None:
    # WHEN a 5xx the server knows is its own is answered
    reply = error_reply(error)
    # THEN it carries the mark, exactly once, with the value the router reads
    assert reply.status >= 500
    assert [v for k, v in reply.headers if k == FAULT_HEADER] == ["server"]


@pytest.mark.parametrize("error", NOT_SERVER_ERRORS, ids=_ids(NOT_SERVER_ERRORS))
def test_a_deadline_or_a_client_error_is_never_marked(error: SpillwayError) -> None:
    # WHEN a 504 (busy, not broken) or a 4xx (the request's fault) is answered
    reply = error_reply(error)
    # THEN it has no fault mark, so no breaker or canary counts it
    assert reply.header(FAULT_HEADER) is None
    assert reply.status == 504 or 400 <= reply.status < 500


def test_the_last_resort_answer_carries_no_mark() -> None:
    # An unexpected exception may have been caused by the request: never counted.
    assert INTERNAL_ERROR.status == 500
    assert INTERNAL_ERROR.header(FAULT_HEADER) is None


def test_error_reply_body_and_headers_are_exact() -> None:
    # GIVEN errors with a retry hint (rounded, at least 1 s) and a 405 with its Allow
    busy = error_reply(OverloadedError("queue full", retry_after_s=2.6))
    soon = error_reply(UnavailableError("starting", retry_after_s=0.2))
    wrong = error_reply(MethodNotAllowedError("GET is not allowed", allow="POST"))
    # THEN each answer is exactly the documented one
    assert busy.status == 429
    assert busy.headers == [("content-type", "application/json"), ("retry-after", "3")]
    assert json.loads(busy.body) == {"error": "queue full", "code": OverloadedError.code}
    assert soon.headers == [
        ("content-type", "application/json"),
        (FAULT_HEADER, "server"),
        ("retry-after", "1"),
    ]
    assert wrong.headers == [("content-type", "application/json"), ("allow", "POST")]
    assert wrong.status == 405


# -- the GPU service's encoding --------------------------------------------------------------


def _gpu_refusal(error: SpillwayError) -> tuple[int, dict[bytes, bytes]]:
    # ``refusal`` reads nothing of the app but its logger: no data plane needed.
    app = GpuServiceApp.__new__(GpuServiceApp)
    status, _, headers = app.refusal(error, "POST", "/v2/models/m/infer")
    return status, dict(headers)


@pytest.mark.parametrize("error", SERVER_ERRORS, ids=_ids(SERVER_ERRORS))
def test_the_gpu_service_marks_its_own_5xx(error: SpillwayError) -> None:
    status, headers = _gpu_refusal(error)
    assert status == error.status
    assert headers[FAULT_HEADER.encode()] == b"server"


@pytest.mark.parametrize("error", NOT_SERVER_ERRORS, ids=_ids(NOT_SERVER_ERRORS))
def test_the_gpu_service_never_marks_a_504_or_a_4xx(error: SpillwayError) -> None:
    status, headers = _gpu_refusal(error)
    assert status == error.status
    assert FAULT_HEADER.encode() not in headers


def test_the_gpu_service_encodes_headers_as_bytes_in_order() -> None:
    status, body, headers = encoded(error_reply(InferenceError("boom")))
    assert status == 500
    assert headers == [(b"content-type", b"application/json"), (b"x-spillway-fault", b"server")]
    assert json.loads(body)["error"] == "boom"


# -- the CPU fallback ------------------------------------------------------------------------


class FailingService:
    """A CPU service whose every inference raises ``error``."""

    settings = SimpleNamespace(max_payload_bytes=1 << 20, function_name="cpu")

    def __init__(self, error: SpillwayError) -> None:
        self.error = error

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error


def _cpu_wsgi(error: SpillwayError) -> tuple[int, dict[str, str]]:
    app = CpuApp(FailingService(error))  # type: ignore[arg-type]
    response = Client(app).post("/v2/models/digits/infer", data=b"{}")
    return response.status_code, {k.lower(): v for k, v in response.headers.items()}


def _cpu_direct(error: SpillwayError) -> tuple[int, dict[str, str]]:
    answer = handle_direct(FailingService(error), {"model": "digits", "body": {}})  # type: ignore[arg-type]
    return answer["statusCode"], answer["headers"]


@pytest.mark.parametrize("serve", [_cpu_wsgi, _cpu_direct], ids=["wsgi", "direct"])
@pytest.mark.parametrize("error", SERVER_ERRORS, ids=_ids(SERVER_ERRORS))
def test_the_cpu_fallback_marks_its_own_5xx(serve: Any, error: SpillwayError) -> None:
    status, headers = serve(error)
    assert status == error.status
    assert headers[FAULT_HEADER] == "server"


@pytest.mark.parametrize("serve", [_cpu_wsgi, _cpu_direct], ids=["wsgi", "direct"])
@pytest.mark.parametrize("error", NOT_SERVER_ERRORS, ids=_ids(NOT_SERVER_ERRORS))
def test_the_cpu_fallback_never_marks_a_504_or_a_4xx(serve: Any, error: SpillwayError) -> None:
    status, headers = serve(error)
    assert status == error.status
    assert FAULT_HEADER not in headers


@pytest.mark.parametrize("serve", [_cpu_wsgi, _cpu_direct], ids=["wsgi", "direct"])
def test_the_cpu_fallback_never_marks_an_unexpected_exception(serve: Any) -> None:
    class Broken:
        settings = FailingService.settings

        def infer(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("bug")

    if serve is _cpu_wsgi:
        response = Client(CpuApp(Broken())).post("/v2/models/digits/infer", data=b"{}")  # type: ignore[arg-type]
        status, headers = response.status_code, dict(response.headers)
    else:
        answer = handle_direct(Broken(), {"model": "digits", "body": {}})  # type: ignore[arg-type]
        status, headers = answer["statusCode"], answer["headers"]
    assert status == 500
    assert FAULT_HEADER not in {k.lower() for k in headers}


# -- the router counts a failure only when the backend marks it -----------------------------


@pytest.mark.parametrize("status", [500, 503])
def test_an_unmarked_5xx_never_opens_the_circuit(status: int) -> None:
    # GIVEN a GPU answering a 5xx without the fault mark (maybe caused by the request)
    stack = make_stack(gpu=[ok(status, b'{"error":"x","code":"internal"}')])
    # WHEN more requests than the failure threshold (5) get it
    for _ in range(8):
        stack.post()
    # THEN every one still reached the GPU, and its circuit is closed
    assert len(stack.gpu.requests) == 8
    assert stack.app.router.breakers["gpu"].state == "closed"


@pytest.mark.parametrize("status", [500, 503])
def test_a_marked_5xx_opens_the_circuit_at_the_threshold(status: int) -> None:
    # GIVEN the same answers, marked as the server's own fault
    stack = make_stack(gpu=[ok(status, b'{"error":"x","code":"internal"}', SERVER_FAULT)])
    for _ in range(8):
        stack.post()
    # THEN the fifth opens the circuit and the next three skip the GPU
    assert len(stack.gpu.requests) == 5
    assert stack.app.router.breakers["gpu"].state == "open"


def test_a_marked_504_never_opens_the_circuit() -> None:
    # A 504 means busy, whatever a backend wrote on it.
    stack = make_stack(gpu=[ok(504, b"{}", SERVER_FAULT)])
    for _ in range(8):
        stack.post()
    assert len(stack.gpu.requests) == 8
    assert stack.app.router.breakers["gpu"].state == "closed"


# -- a chunked body within the limit is taken whole -----------------------------------------


def _chunked(body: bytes) -> dict[str, Any]:
    return {"wsgi.input": io.BytesIO(body), "wsgi.input_terminated": True}


@pytest.mark.parametrize("size", [0, 1, 999, 1000])
def test_a_chunked_body_within_the_limit_is_read_whole(size: int) -> None:
    body = bytes(range(256)) * 4
    assert read_wsgi_body(_chunked(body[:size]), limit=1000) == body[:size]


def test_a_chunked_body_one_byte_over_the_limit_is_413() -> None:
    with pytest.raises(PayloadTooLargeError) as caught:
        read_wsgi_body(_chunked(b"x" * 1001), limit=1000)
    assert "1001 bytes" in caught.value.message
    assert "1000 bytes" in caught.value.message


def test_a_declared_body_at_the_limit_is_read_and_one_over_is_413() -> None:
    exact = {"CONTENT_LENGTH": "1000", "wsgi.input": io.BytesIO(b"y" * 1000)}
    assert read_wsgi_body(exact, limit=1000) == b"y" * 1000
    with pytest.raises(PayloadTooLargeError):
        read_wsgi_body({"CONTENT_LENGTH": "1001", "wsgi.input": io.BytesIO(b"")}, limit=1000)


def test_a_body_with_neither_length_nor_chunks_is_empty() -> None:
    assert read_wsgi_body({"wsgi.input": io.BytesIO(b"ignored")}, limit=1000) == b""
