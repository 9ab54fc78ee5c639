"""A chunked body within the limit reaches the service whole, through the GPU service's
own HTTP server; one byte past it is a 413. The server runs in this process on a clock
the test holds (``test_transport_defence``'s rig); the limit is the service's own check
(``GpuServiceApp.took``) over a real body budget."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpu_service.dataplane import BodyBudget
from gpu_service.http import Exchange, GpuServiceApp, Response
from gpu_service.settings import GpuSettings
from tests.integration.test_transport_defence import SHORT, FakeService, InProcess

LIMIT = 64 * 1024


class RecordingService(FakeService):
    """Takes bodies of up to ``LIMIT`` bytes, charged to a real body budget, with the
    service's own limit check; answers with the body's length and records each body."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies = BodyBudget(10 * LIMIT, 1.0)
        self.received: list[bytes] = []

    def begin(self, method: str, path: str, headers: Any, http_version: str) -> Exchange:
        self.begun += 1
        return Exchange(method, path, headers, None, None, LIMIT)

    def took(self, exchange: Exchange, size: int, received: int) -> None:
        GpuServiceApp.took(self, exchange, size, received)  # type: ignore[arg-type]

    def abandon(self, exchange: Exchange) -> None:
        GpuServiceApp.abandon(self, exchange)  # type: ignore[arg-type]

    async def finish(self, exchange: Exchange, body: bytes) -> Response:
        self.received.append(body)
        self.finished += 1
        GpuServiceApp.abandon(self, exchange)  # type: ignore[arg-type]
        answer = json.dumps({"bytes": len(body)}).encode()
        return 200, answer, [(b"content-type", b"application/json")]

    def refusal(self, error: Any, method: str, path: str) -> Response:
        return GpuServiceApp.refusal(self, error, method, path)  # type: ignore[arg-type]


def _chunked_post(pieces: list[bytes]) -> bytes:
    head = "POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p)
    return head.encode() + body + b"0\r\n\r\n"


def _pieces(size: int, piece: int) -> list[bytes]:
    data = bytes(i % 251 for i in range(size))
    return [data[i : i + piece] for i in range(0, size, piece)]


@pytest.mark.parametrize(
    ("size", "piece"),
    [(LIMIT, 4096), (LIMIT, 1000), (LIMIT - 1, 7919), (1, 1), (0, 1)],
)
def test_a_chunked_body_within_the_limit_is_accepted_whole(size: int, piece: int) -> None:
    service = RecordingService()
    served = InProcess(service, GpuSettings.model_validate(SHORT))
    try:
        # GIVEN a chunked request of up to exactly the limit, in pieces of any size
        pieces = _pieces(size, piece)
        client = served.client()
        client.send(_chunked_post(pieces))
        # THEN it is answered 200 and the service got every byte, in order
        status, _, answer = client.answer()
        assert status == 200
        assert json.loads(answer) == {"bytes": size}
        assert service.received == [b"".join(pieces)]
        # AND the body budget it was charged to is given back
        assert served.call(lambda: service.bodies.in_use) == 0
        client.close()
    finally:
        served.close()


def test_a_chunked_body_one_byte_past_the_limit_is_413() -> None:
    service = RecordingService()
    served = InProcess(service, GpuSettings.model_validate(SHORT))
    try:
        client = served.client()
        client.send(_chunked_post(_pieces(LIMIT + 1, 4096)))
        status, _, answer = client.answer()
        assert status == 413
        assert json.loads(answer)["code"] == "payload_too_large"
        assert service.received == []
        assert served.call(lambda: service.bodies.in_use) == 0
        client.close()
    finally:
        served.close()
