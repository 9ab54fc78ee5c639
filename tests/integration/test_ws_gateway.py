"""``spillway serve websocket`` with a small handler (``tests.integration.ws_echo``): the
events API Gateway's WebSocket API would send it, concurrent invocations for one
connection, a binary frame closed with 1003 and never invoked, a refused upgrade, and the
management API as boto3's ``apigatewaymanagementapi`` client calls it. The size and time
limits: ``test_ws_gateway_limits``."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import boto3
import pytest
from aiohttp import WSMsgType, web
from botocore.exceptions import ClientError

from spillway_cli.local import procs
from spillway_cli.local.websocket.gateway import WebSocketGateway
from tests.fakes import eventually

ROOT = Path(__file__).resolve().parents[2]
Connected = Callable[[aiohttp.ClientWebSocketResponse], Awaitable[Any]]


class Gateway:
    def __init__(self, url: str, events: Path, child: procs.Child) -> None:
        self.url, self.events, self.child = url, events, child
        self.management = boto3.client(
            "apigatewaymanagementapi",
            endpoint_url=url,
            region_name="us-east-1",
            aws_access_key_id="local",
            aws_secret_access_key="local",  # noqa: S106 - the gateway checks no signature
        )

    def recorded(self, connection: str) -> list[dict[str, Any]]:
        """The events the handler got for one connection, in order."""
        lines = self.events.read_text(encoding="utf-8").splitlines() if self.events.exists() else []
        events = [json.loads(line) for line in lines]
        return [e for e in events if e["requestContext"]["connectionId"] == connection]

    def closed(self, connection: str) -> list[dict[str, Any]] | None:
        """The connection's events once ``$disconnect`` is among them."""
        events = self.recorded(connection)
        disconnected = events and events[-1]["requestContext"]["routeKey"] == "$disconnect"
        return events if disconnected else None

    def session(self, connected: Connected, headers: dict[str, str] | None = None) -> Any:
        """Run ``connected`` on a new connection (``x-echo-allow`` by default)."""

        async def run() -> Any:
            async with (
                aiohttp.ClientSession() as session,
                session.ws_connect(
                    self.url.replace("http", "ws", 1) + "/?tenant=acme",
                    headers={"x-echo-allow": "1"} if headers is None else headers,
                    max_msg_size=0,
                ) as ws,
            ):
                return await connected(ws)

        return asyncio.run(asyncio.wait_for(run(), 60))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    folder = tmp_path_factory.mktemp("ws-gateway")
    port = procs.free_port()
    env = {
        "ECHO_EVENTS": str(folder / "events.jsonl"),
        "PYTHONPATH": str(ROOT),
        "AWS_ACCESS_KEY_ID": "local",
        "AWS_SECRET_ACCESS_KEY": "local",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    argv = [sys.executable, "-m", "spillway_cli.main", "serve", "websocket", "--port", str(port)]
    argv += ["--handler", "tests.integration.ws_echo.handler", "--workers", "8"]
    child = procs.start("websocket", argv, folder, env)
    try:
        eventually(lambda: _accepts(port, child), "the gateway listens", timeout_s=60)
        yield Gateway(f"http://127.0.0.1:{port}", folder / "events.jsonl", child)
    finally:
        child.stop()
    log = child.log_path.read_text()
    # the one traceback is the failing handler's
    assert log.count("Traceback") == log.count("RuntimeError: the handler failed") == 1, log


def _accepts(port: int, child: procs.Child) -> bool:
    assert child.proc.poll() is None, child.log_tail()
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


async def _ask(ws: aiohttp.ClientWebSocketResponse, message: dict[str, Any]) -> Any:
    await ws.send_json(message)
    return json.loads(await ws.receive_str(timeout=30))


def test_events_have_api_gateways_shape(gateway: Gateway) -> None:
    async def connected(ws: aiohttp.ClientWebSocketResponse) -> Any:
        echoed = await _ask(ws, {"op": "echo", "n": 1})
        return echoed, await _ask(ws, {"op": "event"})

    # WHEN a client connects, sends two text messages and closes
    echoed, event = gateway.session(connected)
    # THEN the first message came back through post_to_connection
    assert echoed == {"op": "echo", "n": 1}
    # AND the message's event is API Gateway's $default shape
    context = event["requestContext"]
    connection = context["connectionId"]
    assert (context["routeKey"], context["eventType"], context["messageDirection"]) == (
        "$default",
        "MESSAGE",
        "IN",
    )
    assert (context["stage"], context["domainName"], context["apiId"]) == (
        "local",
        "127.0.0.1",
        "local",
    )
    assert len(connection) == 16
    assert connection.endswith("=")
    assert context["identity"]["sourceIp"] == "127.0.0.1"
    assert context["identity"]["userAgent"].startswith("Python")
    assert {"requestId", "extendedRequestId", "messageId", "requestTime"} <= set(context)
    assert context["requestTimeEpoch"] >= context["connectedAt"] > 0
    assert (event["body"], event["isBase64Encoded"]) == ('{"op": "event"}', False)
    assert "headers" not in event
    assert "queryStringParameters" not in event
    # AND $connect carried the headers and query string, $disconnect came last
    events = eventually(lambda: gateway.closed(connection), "the handler saw $disconnect")
    assert [e["requestContext"]["routeKey"] for e in events] == [
        "$connect",
        "$default",
        "$default",
        "$disconnect",
    ]
    connect, disconnect = events[0], events[-1]
    assert connect["requestContext"]["eventType"] == "CONNECT"
    assert connect["headers"]["x-echo-allow"] == "1"
    assert connect["multiValueHeaders"]["x-echo-allow"] == ["1"]
    assert connect["queryStringParameters"] == {"tenant": "acme"}
    assert connect["isBase64Encoded"] is False
    assert disconnect["requestContext"]["eventType"] == "DISCONNECT"
    assert disconnect["requestContext"]["disconnectStatusCode"] == 1000
    assert connect["requestContext"]["connectedAt"] == context["connectedAt"]


def test_messages_of_one_connection_are_invoked_concurrently(gateway: Gateway) -> None:
    async def connected(ws: aiohttp.ClientWebSocketResponse) -> Any:
        # each invocation waits for the other at a barrier: they must overlap
        await ws.send_json({"op": "meet", "tag": "a"})
        await ws.send_json({"op": "meet", "tag": "b"})
        return [json.loads(await ws.receive_str(timeout=30)) for _ in range(2)]

    answers = gateway.session(connected)
    assert sorted(a["met"] for a in answers) == ["a", "b"]


def test_a_binary_frame_closes_the_connection_with_1003_and_invokes_nothing(
    gateway: Gateway,
) -> None:
    # GIVEN a connection whose first message is text
    async def connected(ws: aiohttp.ClientWebSocketResponse) -> Any:
        event = await _ask(ws, {"op": "event"})
        # WHEN the client sends a binary frame
        await ws.send_bytes(bytes([0xFF, 0x00, 0x80, 0x01, 0xFE]))
        closed = await ws.receive(timeout=30)
        return event["requestContext"]["connectionId"], closed.type, ws.close_code

    connection, kind, code = gateway.session(connected)
    # THEN API Gateway's close: 1003, unsupported data
    assert (kind, code) == (aiohttp.WSMsgType.CLOSE, 1003)
    # AND the handler never saw the binary message: $connect, the text one, $disconnect
    events = eventually(lambda: gateway.closed(connection), "the handler saw $disconnect")
    assert [e["requestContext"]["routeKey"] for e in events] == [
        "$connect",
        "$default",
        "$disconnect",
    ]
    assert all(e["isBase64Encoded"] is False for e in events)
    assert events[-1]["requestContext"]["disconnectStatusCode"] == 1003
    # AND the gateway logged why
    eventually(
        lambda: (
            f"connection {connection} refused: Binary frames" in gateway.child.log_path.read_text()
        ),
        "the refusal's log line",
    )


def test_a_refused_connect_is_an_http_answer_with_its_status(gateway: Gateway) -> None:
    async def connected(ws: aiohttp.ClientWebSocketResponse) -> Any:
        raise AssertionError("the upgrade was accepted")

    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        gateway.session(connected, headers={})
    assert refused.value.status == 401


def test_a_handler_error_is_api_gateways_internal_server_error_frame(gateway: Gateway) -> None:
    async def connected(ws: aiohttp.ClientWebSocketResponse) -> Any:
        failed = await _ask(ws, {"op": "raise"})
        return failed, await _ask(ws, {"op": "echo", "after": "error"})

    failed, after = gateway.session(connected)
    assert failed["message"] == "Internal server error"
    assert set(failed) == {"message", "connectionId", "requestId"}
    assert after == {"op": "echo", "after": "error"}  # the connection stays open


def test_management_api_through_boto3_then_gone_after_close(gateway: Gateway) -> None:
    management = gateway.management

    async def connected(ws: aiohttp.ClientWebSocketResponse) -> Any:
        connection = (await _ask(ws, {"op": "event"}))["requestContext"]["connectionId"]
        loop = asyncio.get_running_loop()
        described = await loop.run_in_executor(
            None, lambda: management.get_connection(ConnectionId=connection)
        )
        await loop.run_in_executor(
            None,
            lambda: management.post_to_connection(ConnectionId=connection, Data=b'{"pushed": 1}'),
        )
        pushed = await ws.receive_str(timeout=30)
        await loop.run_in_executor(
            None, lambda: management.delete_connection(ConnectionId=connection)
        )
        closed = await ws.receive(timeout=30)
        return connection, described, pushed, closed.type

    connection, described, pushed, closed = gateway.session(connected)
    assert described["Identity"]["SourceIp"] == "127.0.0.1"
    assert described["Identity"]["UserAgent"].startswith("Python")
    assert described["LastActiveAt"] >= described["ConnectedAt"]
    assert pushed == '{"pushed": 1}'
    assert closed == aiohttp.WSMsgType.CLOSE
    # WHEN the closed connection is posted to, got or deleted THEN botocore raises
    # GoneException, as API Gateway answers
    calls: dict[str, Callable[[], Any]] = {
        "post": lambda: management.post_to_connection(ConnectionId=connection, Data=b"x"),
        "get": lambda: management.get_connection(ConnectionId=connection),
        "delete": lambda: management.delete_connection(ConnectionId=connection),
    }
    for name, call in calls.items():
        with pytest.raises(ClientError) as gone:
            call()
        assert gone.value.response["Error"]["Code"] == "GoneException", name
        assert gone.value.response["ResponseMetadata"]["HTTPStatusCode"] == 410
    assert isinstance(gone.value, management.exceptions.GoneException)


def test_a_push_to_a_client_that_reads_nothing_is_gone_after_the_write_timeout() -> None:
    # GIVEN a gateway whose pushes may wait 0.5 s on a client, and a client that connects
    # and then reads nothing
    opened: list[str] = []

    def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
        if event["requestContext"]["routeKey"] == "$connect":
            opened.append(event["requestContext"]["connectionId"])
        return {"statusCode": 200}

    async def scenario() -> tuple[list[int], bool]:
        gateway = WebSocketGateway(handler, workers=2, write_timeout_s=0.5)
        runner = web.AppRunner(gateway.app())
        await runner.setup()
        port = procs.free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        statuses: list[int] = []
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.ws_connect(f"ws://127.0.0.1:{port}/") as ws,
            ):
                url = f"http://127.0.0.1:{port}/@connections/{opened[0]}"
                chunk = b"x" * (120 * 1024)
                # WHEN pushes go on until the buffers between them are full (at most 60 MB)
                for _ in range(500):
                    async with session.post(url, data=chunk) as response:
                        statuses.append(response.status)
                    if response.status != 200:
                        break
                # AND the client then reads: what was queued, then the end of the stream
                for _ in range(len(statuses) + 1):
                    message = await ws.receive(timeout=10)
                    if message.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.ERROR):
                        return statuses, True
                return statuses, False
        finally:
            await runner.cleanup()

    statuses, ended = asyncio.run(asyncio.wait_for(scenario(), 120))
    # THEN the push that waited is answered 410 Gone, the earlier ones were delivered, and
    # the connection is dropped
    assert statuses[-1] == 410, statuses[-5:]
    assert set(statuses[:-1]) == {200}
    assert ended


def test_a_handler_past_the_integration_timeout_gets_the_timeout_frame_and_is_located(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # GIVEN a gateway whose integration timeout is 0.5 s and a handler whose $default
    # waits (in a function of its own) until told to go on
    go = threading.Event()

    def stuck_on_something() -> None:
        assert go.wait(30)

    def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
        if event["requestContext"]["routeKey"] == "$default":
            stuck_on_something()
        return {"statusCode": 200}

    async def scenario() -> dict[str, Any]:
        gateway = WebSocketGateway(handler, workers=2, timeout_s=0.5)
        runner = web.AppRunner(gateway.app())
        await runner.setup()
        port = procs.free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.ws_connect(f"ws://127.0.0.1:{port}/") as ws,
            ):
                # WHEN a message's invocation runs past it
                await ws.send_str('{"id": "f0"}')
                frame: dict[str, Any] = json.loads(await ws.receive_str(timeout=30))
                return frame
        finally:
            go.set()
            await runner.cleanup()

    caplog.set_level(logging.ERROR, logger="spillway.websocket")
    frame = asyncio.run(asyncio.wait_for(scenario(), 60))
    # THEN the client gets API Gateway's frame, without an id
    assert frame["message"] == "Endpoint request timed out"
    assert set(frame) == {"message", "connectionId", "requestId"}
    # AND the log says where the handler was: in the function it waits in
    (located,) = [r.getMessage() for r in caplog.records if "integration timeout" in r.getMessage()]
    connection = frame["connectionId"]
    assert located.startswith(f"$default on {connection}: the handler ran past the 0.5 s integ")
    assert "in stuck_on_something" in located
