"""Python's HTTP floor: a bare app that reads the body and answers 4 KB (an mlp-bench
response's size), measured by the same client in the same run as the service.

* ``asgi`` (the default): an ASGI app under uvicorn (httptools, uvloop), the common
  Python serving stack and the floor the service's goals are read against.
* ``native``: the same answer from an ``asyncio.Protocol`` over httptools on uvloop, the
  way the service's own server (``gpu_service/transport.py``) is built: what that server
  could answer at most if the service did nothing else.

    .venv/bin/python -m bench.http_floor PORT [asgi|native]
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

PAYLOAD = b"\0" * 4096
_HEADERS = [
    (b"content-type", b"application/octet-stream"),
    (b"content-length", str(len(PAYLOAD)).encode()),
]


async def app(
    scope: dict[str, Any],
    receive: Callable[[], Awaitable[dict[str, Any]]],
    send: Callable[[dict[str, Any]], Awaitable[None]],
) -> None:
    """Read the whole body, answer 4 KB."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    await send({"type": "http.response.body", "body": PAYLOAD})


class NativeFloor(asyncio.Protocol):
    """The floor as an ``asyncio.Protocol``: parse, drop the body, answer."""

    _ANSWER = (
        b"HTTP/1.1 200 OK\r\n"
        + b"".join(k + b": " + v + b"\r\n" for k, v in _HEADERS)
        + b"\r\n"
        + PAYLOAD
    )

    def __init__(self) -> None:
        import httptools

        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        if self.transport is not None:
            self.transport.write(self._ANSWER)


def native(port: int) -> None:
    import uvloop

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(NativeFloor, "127.0.0.1", port, backlog=2048)
        await server.serve_forever()

    uvloop.run(serve())


def main() -> None:
    if sys.argv[2:] == ["native"]:
        native(int(sys.argv[1]))
        return
    import uvicorn

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        http="httptools",
        loop="uvloop",
        lifespan="off",
        access_log=False,
        proxy_headers=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
