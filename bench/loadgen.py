"""A bounded async load generator over raw keep-alive HTTP/1.1 connections.

Each of ``concurrency`` connections sends its share of a fixed list of prepared requests
one after another; latency is measured per request from write to the last body byte.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class LoadResult:
    """Latencies (seconds), status counts and the wall time of one run."""

    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    wall_s: float = 0.0

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) if self.latencies else float("nan")

    @property
    def ok(self) -> int:
        return self.statuses.get(200, 0)


def http_request(
    path: str, body: bytes, header_length: int | None = None, content_type: str = "application/json"
) -> bytes:
    """The bytes of one POST request, prepared once and sent many times."""
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
    ]
    if header_length is not None:
        lines.append(f"Inference-Header-Content-Length: {header_length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> int:
    """Send one prepared request on a keep-alive connection, read its whole answer; the
    status."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    await reader.readexactly(length)
    return int(head[9:12])


async def _connection(port: int, requests: list[bytes], result: LoadResult) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for request in requests:
            started = time.perf_counter()
            status = await exchange(reader, writer, request)
            result.latencies.append(time.perf_counter() - started)
            result.statuses[status] = result.statuses.get(status, 0) + 1
    finally:
        writer.close()


async def _run(port: int, requests: list[bytes], concurrency: int) -> LoadResult:
    result = LoadResult()
    shares = [requests[i::concurrency] for i in range(concurrency)]
    started = time.perf_counter()
    await asyncio.gather(*(_connection(port, share, result) for share in shares if share))
    result.wall_s = time.perf_counter() - started
    return result


async def _steady(
    port: int, request: bytes, rate: float, done: asyncio.Future[object], result: LoadResult
) -> None:
    """Send ``request`` ``rate`` times a second until ``done``, whether or not earlier ones
    were answered (an open loop: a slow answer delays no later send), each on a free
    keep-alive connection or a new one; latency counts from its scheduled send."""
    free: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    opened: list[asyncio.StreamWriter] = []
    sending: set[asyncio.Task[None]] = set()

    async def one(scheduled: float) -> None:
        if free:
            connection = free.pop()
        else:
            connection = await asyncio.open_connection("127.0.0.1", port)
            opened.append(connection[1])
        status = await exchange(*connection, request)
        result.latencies.append(time.perf_counter() - scheduled)
        result.statuses[status] = result.statuses.get(status, 0) + 1
        free.append(connection)

    started = next_at = time.perf_counter()
    while not done.done():
        wait = next_at - time.perf_counter()
        if wait > 0:
            await asyncio.wait({done}, timeout=wait)
            continue
        task = asyncio.ensure_future(one(next_at))
        sending.add(task)
        task.add_done_callback(sending.discard)
        next_at += 1.0 / rate
    await asyncio.gather(*sending)
    result.wall_s = time.perf_counter() - started
    for writer in opened:
        writer.close()


def run_steady(
    port: int,
    request: bytes,
    rate: float,
    *,
    seconds: float | None = None,
    beside: tuple[list[bytes], int] | None = None,
) -> tuple[LoadResult, LoadResult | None]:
    """``request`` at a steady ``rate`` for ``seconds``, or for as long as a bounded load
    ``beside`` (requests, concurrency) runs on the same port: the steady stream's result
    and that load's."""
    import uvloop

    async def main() -> tuple[LoadResult, LoadResult | None]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[object] = loop.create_future()
        steady = LoadResult()
        sender = asyncio.ensure_future(_steady(port, request, rate, done, steady))
        other = None
        if beside is not None:
            other = await _run(port, *beside)
        else:
            await asyncio.sleep(seconds or 0.0)
        done.set_result(None)
        await sender
        return steady, other

    return uvloop.run(main())


def run_load(
    port: int,
    requests: list[bytes],
    concurrency: int,
    groups: list[tuple[list[bytes], int]] | None = None,
) -> list[LoadResult]:
    """Run one load (or several groups at once, each with its own result)."""
    import uvloop

    async def main() -> list[LoadResult]:
        if groups is None:
            return [await _run(port, requests, concurrency)]
        return list(await asyncio.gather(*(_run(port, r, c) for r, c in groups)))

    return uvloop.run(main())
