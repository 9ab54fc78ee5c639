"""The demo's load sections start once every client has a started router instance: a
router that starts one per concurrent request (serverless-offline, Lambda) does not race
the section's fault (a GPU service killed, a hot swap) with its own start-ups."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from spillway_cli.demo.client import Client, under_load

START_STEP_S = 0.3
"""The k-th instance takes k times this to start: start-ups sharing two loaded cores
finish one after another."""


@dataclass
class InstancePool:
    """A router that gives a request to an idle instance, or starts a new one for it."""

    idle: int = 0
    started: int = 0
    starting: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> float:
        """An instance for a request: the seconds it needs to start first (0: warm)."""
        with self.lock:
            if self.idle:
                self.idle -= 1
                return 0.0
            self.started += 1
            self.starting += 1
            return self.started * START_STEP_S

    def ready(self, was_cold: bool) -> None:
        with self.lock:
            self.starting -= was_cold

    def release(self) -> None:
        with self.lock:
            self.idle += 1


@contextmanager
def pooled_router() -> Iterator[tuple[int, InstancePool]]:
    pool = InstancePool()
    answer = json.dumps({"model_name": "digits", "outputs": []}).encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            start_s = pool.take()
            time.sleep(start_s)  # the instance's start-up (a process importing the router)
            pool.ready(start_s > 0)
            pool.release()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], pool
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_the_fault_waits_until_every_client_has_a_started_instance() -> None:
    # GIVEN a router whose instances start one after another, one per concurrent request
    with pooled_router() as (port, pool):
        client = Client(port)
        seen: dict[str, int] = {}

        def fault() -> None:
            with pool.lock:
                seen.update(started=pool.started, starting=pool.starting)

        # WHEN a load section of 4 clients runs its fault
        records = under_load(client, "fault", 40, 4, fault)
    # THEN no instance was still starting when the fault came, and each client had one
    assert seen == {"started": 4, "starting": 0}
    # AND the section's records are its own 40 requests, all answered
    assert [r.status for r in records] == [200] * 40
    assert sum(r.scenario == "warm-up" for r in client.records) == 4
