"""The service's own HTTP/1.1 server: httptools on the event loop, no ASGI layer between.

The service answers many small requests, so the server's cost per request bounds its
throughput once the model is fast (on a GPU, always). A bare ASGI app under uvicorn
answered 43,001 requests/s on the benchmark machine and the same answer from an
``asyncio.Protocol`` over httptools 188,596 (c64, one run, docs/benchmarks.md): the ASGI
messages and uvicorn's per-request task and flow-control objects cost about 3.4 times
what parsing and writing do. This server parses with httptools, routes with
``GpuServiceApp.begin`` as soon as the headers are in (so a refusal comes before the
body is read), charges the body to the body budget as it arrives (``took``) and answers
with ``GpuServiceApp.finish``.

HTTP/1.1 as clients use it: keep-alive, pipelined requests answered in order, chunked
bodies, ``Expect: 100-continue``, ``HEAD``, ``Connection: close`` and HTTP/1.0; an
``Upgrade`` (WebSocket, h2c) is ignored and the connection closes after the answer.

Limits, so that no slow or greedy client holds the service (each closes the connection):

* size: a body past its exchange's limit is a 413; request line and headers past
  ``MAX_HEAD_BYTES`` a 431; connections past ``GPU_MAX_CONNECTIONS`` a 503; a
  malformed request a 400.
* time (checked by one sweep a second, no timer per request; arrival times are read as
  bytes come, not from the sweep's cached time): the head must arrive
  within ``GPU_HEADER_TIMEOUT_S`` of its first byte (of the connection's opening, for
  its first request), and a body may pause at most ``GPU_BODY_TIMEOUT_S`` and must keep
  an average of ``GPU_BODY_MIN_BYTES_PER_S`` after that, else 408; an idle connection
  closes after ``GPU_KEEP_ALIVE_S``; a client that takes none of its answers' bytes for
  ``GPU_WRITE_TIMEOUT_S`` is disconnected. Time the server itself stops reading a
  connection (pipelining cap, output above its mark) never counts against its client.
* output: at most ``MAX_PIPELINED`` requests of a connection wait for answers before its
  reading pauses, at most ``_MAX_RUNNING`` of them compute at once, and once its unsent
  answers pass ``GPU_OUTPUT_BUFFER_BYTES`` no more of its requests are started (they are
  still read, up to ``MAX_PIPELINED``); once the socket stops draining no more are read.
* a client that disconnects cancels its requests' work: queued rows leave the batcher
  without being computed, and what their bodies held is given back.

Stopping (SIGTERM or SIGINT): readiness turns false and new infer requests get 503 at
once, the listener closes, idle connections close, requests in flight are answered
(their connections then close), and once none is left, or ``drain_timeout_s`` has
passed, the app shuts down (async consumer, batchers) and the process exits 0.

This module is the server (listener, sweep, stopping). One client connection, where
requests are parsed and answered and these limits are kept, is
``gpu_service.http_connection``; what a head says and the bytes of an answer are
``gpu_service.http_wire``'s.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from email.utils import formatdate

from gpu_service.http import GpuServiceApp
from gpu_service.http_connection import Connection, Handler
from gpu_service.settings import GpuSettings

log = logging.getLogger("spillway.transport")

_SWEEP_S = 1.0


class HttpServer:
    """Serves connections with the settings' limits; ``clock`` is the one time source of
    its time limits (the sweep reads it once a second)."""

    def __init__(
        self,
        app: Handler,
        settings: GpuSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.settings = settings
        self.output_limit = settings.output_buffer_bytes
        self.clock = clock
        self.connections: set[Connection] = set()
        self.stopping = False
        self.now = clock()
        self.date_header = b""
        self.loop = asyncio.get_running_loop()

    async def start(self, host: str, port: int) -> asyncio.Server:
        """Listen, and sweep once a second from now on."""
        listener = await self.loop.create_server(
            lambda: Connection(self), host, port, backlog=2048, reuse_address=True
        )
        self._tick()
        return listener

    def read_clock(self) -> float:
        """The clock read now (and cached for what follows in this turn of the loop)."""
        self.now = self.clock()
        return self.now

    def _tick(self) -> None:
        self.sweep()
        self.loop.call_later(_SWEEP_S, self._tick)

    def sweep(self) -> None:
        """The cached time and ``Date`` header, and every connection's time limits."""
        self.now = now = self.clock()
        self.date_header = b"date: %s\r\n" % formatdate(usegmt=True).encode()
        for connection in list(self.connections):
            connection.check(now)

    def stop_now(self) -> None:
        """Drop every connection and its work (a second interrupt)."""
        for connection in list(self.connections):
            connection.abort()

    async def drain(self, listener: asyncio.Server, timeout_s: float) -> None:
        """Stop listening; answer the requests in flight, up to ``timeout_s``; close."""
        self.stopping = True
        listener.close()
        deadline = time.monotonic() + timeout_s
        while True:
            for connection in list(self.connections):
                if connection.idle():
                    connection.close()
            if not self.connections or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        for connection in list(self.connections):
            connection.close()


async def serve(app: GpuServiceApp, settings: GpuSettings) -> int:
    """Serve ``app`` until a signal; the process's exit status."""
    loop = asyncio.get_running_loop()
    server = HttpServer(app, settings)
    stop = asyncio.Event()
    signals = 0

    def request_stop(sig: int) -> None:
        nonlocal signals
        signals += 1
        if signals > 1 and sig == signal.SIGINT:
            log.warning("second interrupt: stopping without draining")
            server.stop_now()
        app.plane.start_draining(f"signal {sig}")
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, request_stop, sig)
    try:
        await app.startup()
    except Exception:
        log.exception("start-up failed")
        return 3
    listener = await server.start(settings.host, settings.port)
    ports = sorted({s.getsockname()[1] for s in listener.sockets})
    log.info("listening on http://%s:%s", settings.host, ",".join(map(str, ports)))
    await stop.wait()
    await server.drain(listener, settings.drain_timeout_s)
    await app.shutdown()
    log.info("stopped")
    return 0


def run(app: GpuServiceApp, settings: GpuSettings) -> int:
    """Serve ``app`` on uvloop until a signal; returns the exit status."""
    import uvloop

    return uvloop.run(serve(app, settings))
