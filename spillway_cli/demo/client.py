"""The demo's client of the router: V2 requests from several threads on kept-alive
connections, each recorded as the client saw it (status, backend, latency, cost,
fallback), load while something happens to the platform, and the check every section
makes of its records: none failed."""

from __future__ import annotations

import http.client
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spillway.protocol.codec import decode_response, encode_request
from spillway.protocol.framing import parse_header_length
from spillway_cli.console import Check

log = logging.getLogger("spillway.demo")

REQUEST_TIMEOUT_S = 300.0
"""How long a request may wait for its answer: a router instance started for it (a
Lambda cold start, a Python process importing the router) takes a minute on a loaded
2-core machine, and that is slow, not failed."""


@dataclass
class Record:
    """One request as the client saw it."""

    at: float
    scenario: str
    status: int
    backend: str
    latency_ms: float
    cost_usd: float
    fallback: str | None


@dataclass
class Client:
    """Sends V2 requests to the router and records what happened."""

    port: int
    headers: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    records: list[Record] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    local: threading.local = field(default_factory=threading.local)

    def _conn(self) -> http.client.HTTPConnection:
        if getattr(self.local, "conn", None) is None:
            self.local.conn = http.client.HTTPConnection(
                "127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S
            )
        conn: http.client.HTTPConnection = self.local.conn
        return conn

    def _post(
        self, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        # A kept-alive connection the server closed while idle fails before any answer:
        # that one case is retried once on a new connection, as HTTP clients do.
        for attempt in (1, 2):
            reused = getattr(self.local, "conn", None) is not None
            try:
                conn = self._conn()
                conn.request("POST", path, body=body, headers=headers)
                response = conn.getresponse()
                raw = response.read()
                return response.status, {k.lower(): v for k, v in response.getheaders()}, raw
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                self.local.conn = None
                if not reused or attempt == 2:
                    log.info("no answer from the router to %s: %r", path, exc)
                    break
            except (OSError, http.client.HTTPException) as exc:
                self.local.conn = None
                log.info("no answer from the router to %s: %r", path, exc)
                break
        return 599, {}, b""

    def unrecorded(
        self, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        """``POST path`` with this client's headers and ``headers`` over them; the answer is
        no section's record."""
        return self._post(path, body, {**self.headers, **headers})

    def infer(
        self,
        scenario: str,
        model: str,
        inputs: dict[str, np.ndarray],
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        body, length = encode_request(inputs, binary=True, binary_outputs=True)
        sent = {"Content-Type": "application/octet-stream", **self.headers, **(headers or {})}
        if length is not None:
            sent["Inference-Header-Content-Length"] = str(length)
        started = time.monotonic()
        status, got, raw = self._post(f"/v2/models/{model}/infer", body, sent)
        elapsed = (time.monotonic() - started) * 1e3
        self._record(scenario, status, got, elapsed)
        if status != 200:
            # The demo's own log file (the terminal shows the checks): what the router said.
            log.info("%s request answered %d: %s", scenario, status, raw[:300])
            return status, got, raw
        length_out = parse_header_length(got.get("inference-header-content-length"))
        return status, got, decode_response(raw, length_out)[1]

    def _record(self, scenario: str, status: int, headers: dict[str, str], ms: float) -> None:
        record = Record(
            time.monotonic() - self.started,
            scenario,
            status,
            headers.get("x-spillway-backend", "none"),
            ms,
            float(headers.get("x-spillway-cost-usd", 0.0)),
            headers.get("x-spillway-fallback"),
        )
        with self.lock:
            self.records.append(record)


def under_load(
    client: Client, scenario: str, count: int, threads: int, during: Callable[[], None]
) -> list[Record]:
    """``count`` digits requests from ``threads`` clients while ``during`` runs; the
    section's records (its warm-up requests, scenario ``warm-up``, apart).

    Every client's first request is answered before the load starts: a router that
    starts an instance for each concurrent request it cannot give to an idle one
    (serverless-offline, as Lambda does) has started them by then, so the section does
    not race their start-up (a Python process importing the router: up to a minute on a
    loaded 2-core machine). ``during`` runs once a quarter of the requests are answered:
    counted, not timed.
    """
    images = np.random.default_rng(3).random((count, 1, 8, 8)).astype(np.float32) * 16
    started = threading.Barrier(threads)
    before = len(client.records)

    def worker(offset: int) -> None:
        client.infer("warm-up", "digits", {"image": images[offset]})
        started.wait()
        for i in range(offset, count, threads):
            client.infer(scenario, "digits", {"image": images[i]})

    def answered() -> int:
        with client.lock:
            return sum(r.scenario == scenario for r in client.records[before:])

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(worker, t) for t in range(threads)]
        while answered() < count // 4 and not all(f.done() for f in futures):
            time.sleep(0.01)
        during()
        for future in futures:
            future.result()
    return [r for r in client.records[before:] if r.scenario == scenario]


def failed(records: list[Record]) -> Check:
    """Every request of ``records`` answered 200; the figure names the failed statuses
    (599: no answer reached the client)."""
    statuses = Counter(r.status for r in records if r.status != 200)
    detail = ", ".join(f"{status} x{n}" for status, n in sorted(statuses.items()))
    count = sum(statuses.values())
    figure = f"{count} of {len(records)}" + (f" ({detail})" if detail else "")
    return Check("requests that failed", figure, f"= 0 of {len(records)}", count == 0)
