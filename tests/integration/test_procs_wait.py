"""Waiting for a started service: one probe at a time, however slow its first answer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from spillway_cli.local import procs

FIRST_ANSWER_S = 3.0
"""A first answer slower than a short probe timeout (2 s): a worker started on demand."""


@contextmanager
def slow_first_answer() -> Iterator[tuple[str, list[int]]]:
    """A server on 127.0.0.1 that answers its first request once a second one arrives or
    ``FIRST_ANSWER_S`` has passed (as serverless-offline starts a worker per request it
    cannot give to an idle one); its URL and the number of requests it received."""
    received: list[int] = []
    second = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            received.append(1)
            if len(received) == 1:
                second.wait(FIRST_ANSWER_S)
            else:
                second.set()
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/health", received
    finally:
        second.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_slow_first_answer_gets_one_probe_not_one_per_timeout() -> None:
    # GIVEN a service whose first answer takes longer than a short probe timeout
    with slow_first_answer() as (url, received):
        # WHEN the stack waits for it to be healthy
        procs.wait_http(url, 30)
        # THEN it was asked once (each extra probe would have started another worker)
        assert len(received) == 1


def test_a_service_that_never_answers_fails_at_the_deadline() -> None:
    # GIVEN a port nothing listens on
    port = procs.free_port()
    # WHEN the stack waits for it  THEN it fails within the deadline, naming the URL
    with pytest.raises(TimeoutError, match=f"127.0.0.1:{port}/health was not healthy"):
        procs.wait_http(f"http://127.0.0.1:{port}/health", 1.0)
