"""The ``@connections`` management API of the local WebSocket API, on the gateway's port:
``POST``/``GET``/``DELETE /@connections/{id}``, which boto3's
``apigatewaymanagementapi`` client calls with the gateway's URL as its
``endpoint_url``; a request's signature is not checked. An unknown connection answers
410 ``GoneException``, a post over 128 KiB 413 ``PayloadTooLargeException``
(``WS_POST_BYTES``), as API Gateway does
(https://docs.aws.amazon.com/apigateway/latest/developerguide/apigateway-how-to-call-websocket-api-connections.html).
A push to a client that reads nothing waits ``write_timeout_s`` at most; then the
connection is dropped and the push answered 410.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import WSCloseCode, web

from spillway.aws.limits import WS_POST_BYTES
from spillway_cli.local.websocket.events import Connection

log = logging.getLogger("spillway.websocket")
PATH = "/@connections/{connection_id}"


class ConnectionsApi:
    """``PostToConnection``, ``GetConnection`` and ``DeleteConnection`` over the
    gateway's open connections (the gateway's own dict, read as it changes)."""

    def __init__(self, connections: dict[str, Connection], write_timeout_s: float) -> None:
        self.connections = connections
        self.write_timeout_s = write_timeout_s

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(PATH, self._post)
        app.router.add_get(PATH, self._get)
        app.router.add_delete(PATH, self._delete)

    async def _post(self, request: web.Request) -> web.Response:
        """``PostToConnection``: over ``WS_POST_BYTES``, 413 ``PayloadTooLargeException``
        (refused before the body is read when its length is announced)."""
        connection = self._connection(request)
        if (request.content_length or 0) > WS_POST_BYTES:
            return _too_large()
        try:
            data = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _too_large()
        try:
            text: str | None = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        socket = connection.socket
        send = socket.send_str(text) if text is not None else socket.send_bytes(data)
        try:
            await asyncio.wait_for(send, self.write_timeout_s)
        except ConnectionError:
            raise _gone(connection.id) from None
        except TimeoutError:
            log.warning(
                "connection %s dropped: it read nothing for %.1f s",
                connection.id,
                self.write_timeout_s,
            )
            if connection.transport is not None:
                connection.transport.abort()
            raise _gone(connection.id) from None
        connection.last_active_at, connection.active_at = time.time(), time.monotonic()
        return web.Response(status=200)

    async def _get(self, request: web.Request) -> web.Response:
        return web.json_response(self._connection(request).described())

    async def _delete(self, request: web.Request) -> web.Response:
        connection = self._connection(request)
        await connection.socket.close(code=WSCloseCode.OK, message=b"Connection deleted")
        return web.Response(status=204)

    def _connection(self, request: web.Request) -> Connection:
        wanted = request.match_info["connection_id"]
        connection = self.connections.get(wanted)
        if connection is None or connection.socket.closed:
            raise _gone(wanted)
        return connection


def api_error(status: int, error_type: str | None, message: str) -> web.Response:
    """An error in API Gateway's shape: ``{"message"}`` and the type botocore reads."""
    headers = {"x-amzn-errortype": error_type} if error_type else {}
    return web.json_response({"message": message}, status=status, headers=headers)


def _too_large() -> web.Response:
    return api_error(
        413,
        "PayloadTooLargeException",
        f"Request entity too large: a message is at most {WS_POST_BYTES} bytes",
    )


def _gone(connection: str) -> web.HTTPException:
    return web.HTTPGone(
        text=json.dumps({"message": f"connection {connection[:32]} is gone"}),
        content_type="application/json",
        headers={"x-amzn-errortype": "GoneException"},
    )
