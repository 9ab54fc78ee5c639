"""The local WebSocket gateway refuses what API Gateway refuses, at the documented limits
(``spillway.aws.limits``): a frame over 32 KiB and a message over 128 KiB close
the connection with 1009 (a message up to 128 KiB in frames of 32 KiB is one
invocation), a post to ``@connections`` over 128 KiB is ``PayloadTooLargeException`` for
boto3, and a connection idle too long or open past its lifetime is closed with 1001.
https://docs.aws.amazon.com/apigateway/latest/developerguide/apigateway-execution-service-websocket-limits-table.html
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import boto3
import pytest
from aiohttp import WSMsgType, web

from spillway.aws.limits import WS_FRAME_BYTES, WS_MESSAGE_BYTES, WS_POST_BYTES
from spillway_cli.local import procs
from spillway_cli.local.websocket.gateway import WebSocketGateway
from spillway_cli.stream_drivers import send_text

KiB = 1024


class Recorder:
    """A handler that records each event's route and body length."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, int]] = []
        self.connections: list[str] = []
        self.disconnects: list[int] = []

    def __call__(self, event: dict[str, Any], context: Any) -> dict[str, Any]:
        request = event["requestContext"]
        with self.lock:
            self.events.append((request["routeKey"], len(event.get("body") or "")))
            if request["routeKey"] == "$connect":
                self.connections.append(request["connectionId"])
            if request["routeKey"] == "$disconnect":
                self.disconnects.append(request["disconnectStatusCode"])
        return {"statusCode": 200}

    def messages(self) -> list[int]:
        """The body lengths of the ``$default`` events."""
        with self.lock:
            return [size for route, size in self.events if route == "$default"]


@asynccontextmanager
async def serving(gateway: WebSocketGateway) -> AsyncIterator[str]:
    """The gateway on a free port of 127.0.0.1; its ``http://`` URL."""
    runner = web.AppRunner(gateway.app())
    await runner.setup()
    port = procs.free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


Scenario = Callable[[aiohttp.ClientWebSocketResponse], Awaitable[None]]


def closes(recorder: Recorder, scenario: Scenario, **settings: Any) -> int | None:
    """Run ``scenario`` on a new connection of a gateway with ``settings``, then read
    until the gateway closes it (the scenario may have read the close already); the
    close code. The handler's ``$disconnect`` has run by then."""

    async def run() -> int | None:
        async with (
            serving(WebSocketGateway(recorder, workers=2, **settings)) as url,
            aiohttp.ClientSession() as session,
            session.ws_connect(url.replace("http", "ws", 1)) as ws,
        ):
            await scenario(ws)
            while not ws.closed:
                message = await ws.receive(timeout=30)
                assert message.type in (WSMsgType.CLOSE, WSMsgType.CLOSED), message
            code = ws.close_code
        return code

    code = asyncio.run(asyncio.wait_for(run(), 60))
    assert recorder.disconnects, "the gateway ran no $disconnect"
    return code


def text(size: int) -> str:
    return "x" * size


@pytest.mark.parametrize(
    "size", [WS_FRAME_BYTES + 1, 40 * KiB, 127 * KiB, WS_MESSAGE_BYTES], ids=str
)
def test_a_message_up_to_128_kib_in_frames_of_32_kib_is_one_invocation(size: int) -> None:
    # GIVEN a gateway that closes the connection after 1 s without a message
    recorder = Recorder()

    async def scenario(ws: aiohttp.ClientWebSocketResponse) -> None:
        # WHEN a message of `size` bytes arrives in frames of at most 32 KiB
        await send_text(ws, text(size))

    code = closes(recorder, scenario, idle_timeout_s=1.0)
    # THEN the handler got it whole, as one $default event, and the connection stayed
    # open until it was idle
    assert recorder.messages() == [size]
    assert code == 1001


@pytest.mark.parametrize(
    ("what", "send"),
    [
        ("a frame over 32 KiB", lambda ws: ws.send_str(text(WS_FRAME_BYTES + 1))),
        ("129 KiB in frames of 32 KiB", lambda ws: send_text(ws, text(129 * KiB))),
        ("128 KiB and 1 byte", lambda ws: send_text(ws, text(WS_MESSAGE_BYTES + 1))),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_a_frame_or_message_over_api_gateways_limit_closes_with_1009(
    what: str, send: Callable[[aiohttp.ClientWebSocketResponse], Awaitable[None]]
) -> None:
    recorder = Recorder()

    async def scenario(ws: aiohttp.ClientWebSocketResponse) -> None:
        # WHEN a small message arrives, then the one over the limit
        await ws.send_str(text(10))
        await send(ws)

    code = closes(recorder, scenario)
    # THEN the connection is closed with 1009, the message never reaches the handler
    # (the one before it does), and $disconnect carries the code
    assert code == 1009, what
    assert recorder.messages() == [10], what
    assert recorder.disconnects == [1009], what


def test_a_connection_idle_for_the_idle_timeout_is_closed_with_1001() -> None:
    recorder = Recorder()
    waited: list[float] = []

    async def scenario(ws: aiohttp.ClientWebSocketResponse) -> None:
        # GIVEN an idle timeout of 1 s WHEN messages come every 0.4 s for 1.6 s
        for _ in range(4):
            await ws.send_str("{}")
            with pytest.raises(TimeoutError):
                await ws.receive(timeout=0.4)
        waited.append(time.monotonic())

    code = closes(recorder, scenario, idle_timeout_s=1.0)
    # THEN the connection outlived its idle timeout while it was busy, and was closed
    # with 1001 (going away) once it was idle for 1 s
    assert time.monotonic() - waited[0] >= 0.5
    assert code == 1001
    assert len(recorder.messages()) == 4
    assert recorder.disconnects == [1001]


def test_a_busy_connection_is_closed_with_1001_at_the_end_of_its_lifetime() -> None:
    recorder = Recorder()
    opened: list[float] = []

    async def scenario(ws: aiohttp.ClientWebSocketResponse) -> None:
        # GIVEN a lifetime of 1.5 s WHEN a message comes every 0.2 s (never idle)
        opened.append(time.monotonic())
        while not ws.closed:
            await ws.send_str("{}")
            try:
                await ws.receive(timeout=0.2)  # the close, when it comes
            except TimeoutError:
                continue
        opened.append(time.monotonic())

    code = closes(recorder, scenario, lifetime_s=1.5, idle_timeout_s=60.0)
    # THEN the connection is closed with 1001 after its lifetime, not before
    assert code == 1001
    assert 1.5 <= opened[1] - opened[0] < 10
    assert len(recorder.messages()) >= 5
    assert recorder.disconnects == [1001]


def test_a_post_over_128_kib_is_payload_too_large_for_boto3() -> None:
    recorder = Recorder()

    async def run() -> tuple[Any, str | None]:
        async with (
            serving(WebSocketGateway(recorder, workers=2)) as url,
            aiohttp.ClientSession() as session,
            session.ws_connect(url.replace("http", "ws", 1)) as ws,
        ):
            (connection,) = recorder.connections
            client = boto3.client(
                "apigatewaymanagementapi",
                endpoint_url=url,
                region_name="us-east-1",
                aws_access_key_id="local",
                aws_secret_access_key="local",  # noqa: S106 - the gateway checks no signature
            )
            loop = asyncio.get_running_loop()

            def post(size: int) -> Any:
                return client.post_to_connection(ConnectionId=connection, Data=b"x" * size)

            # WHEN a post of 128 KiB, then one of 128 KiB and 1 byte, go to the connection
            await loop.run_in_executor(None, post, WS_POST_BYTES)
            at_limit = await ws.receive(timeout=30)
            try:
                await loop.run_in_executor(None, post, WS_POST_BYTES + 1)
            except client.exceptions.PayloadTooLargeException as refused:
                return at_limit, refused.response["Error"]["Message"]
            return at_limit, None

    at_limit, refused = asyncio.run(asyncio.wait_for(run(), 60))
    # THEN the first is delivered, the second refused as API Gateway refuses it
    assert (at_limit.type, len(at_limit.data)) == (WSMsgType.TEXT, WS_POST_BYTES)
    assert refused is not None
    assert "at most 131072 bytes" in refused
