"""Python's HTTP floor: a bare ASGI app under uvicorn (httptools, uvloop), as the GPU
service runs, that reads the body and answers 4 KB (an mlp-bench response's size).

No service can answer faster on the same server stack, so the service's requests per
second are read against this app's, measured by the same client in the same run.

    .venv/bin/python -m bench.http_floor PORT
"""

from __future__ import annotations

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


def main() -> None:
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
