"""The dashboard's HTTP side: a static page, its vendored charting library, and
``/api/snapshot``, refreshed by one poller thread every ``interval_s``.

The poller is the only owner of the ``Board``: each round it reads what the router's logs
gained, scrapes the GPU service's ``/metrics``, every ``operator_every`` rounds reads the
operator's stores (canaries, versions, policy, async backlog, jobs), and publishes the
snapshot as JSON bytes that the request threads hand out unchanged. Everything is served
from this package; the page loads nothing from elsewhere.
"""

from __future__ import annotations

import json
import logging
import mimetypes
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

from spillway_cli.dashboard.board import Board
from spillway_cli.dashboard.operator import Operator
from spillway_cli.dashboard.sources import GpuReading, RouterLogs, parse_prometheus, scrape

log = logging.getLogger("spillway.dashboard")
STATIC = Path(__file__).resolve().parent / "static"
StartResponse = Callable[[str, list[tuple[str, str]]], Any]
_SECURITY_HEADERS = [
    ("cache-control", "no-store"),
    ("x-content-type-options", "nosniff"),
    # The page may load only from here: a reference to a CDN fails loudly in the browser.
    ("content-security-policy", "default-src 'self'; img-src 'self' data:"),
]


@dataclass
class Poller:
    """Reads the sources every ``interval_s`` and publishes the snapshot."""

    board: Board
    logs: RouterLogs
    gpu_metrics_url: str | None
    interval_s: float = 1.0
    operator: Operator | None = None
    operator_every: int = 5
    """Rounds between two reads of the operator's stores (tables, queues, policy)."""
    published: bytes = b"{}"
    rounds: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def poll(self) -> None:
        """One round: new log lines, one scrape, the operator's stores when due, a fresh
        snapshot."""
        found = self.logs.read()
        self.board.add_requests(found.requests)
        self.board.add_sightings(found.sightings)
        self.board.add_cold_starts(found.cold_starts)
        if self.operator is not None and self.rounds % self.operator_every == 0:
            self.board.operator = self.operator.read(self.board.seen_models())
        if self.gpu_metrics_url is not None:
            text = scrape(self.gpu_metrics_url)
            at = self.board.clock()
            self.board.add_gpu(GpuReading.of(parse_prometheus(text), at) if text else None)
        snapshot = self.board.snapshot()
        self.rounds += 1
        snapshot["round"] = self.rounds
        snapshot["sources"] = {
            "logs": [str(p) for p in self.logs.paths],
            "lines_read": self.logs.lines_read,
            "gpu_metrics": self.gpu_metrics_url,
            "interval_s": self.interval_s,
            "operator_every_s": self.interval_s * self.operator_every,
        }
        self.published = json.dumps(snapshot, separators=(",", ":")).encode()

    def start(self) -> None:
        """Poll in a background thread until ``stop``."""
        self.poll()
        self._thread = threading.Thread(target=self._run, name="dashboard-poller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except OSError:
                log.exception("dashboard poll failed; the next round tries again")

    def stop(self) -> None:
        """End the background thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class DashboardApp:
    """WSGI: ``/`` the page, ``/static/...`` its files, ``/api/snapshot`` the data."""

    def __init__(self, poller: Poller) -> None:
        self.poller = poller
        self.files = {
            f"/static/{p.relative_to(STATIC).as_posix()}": p
            for p in STATIC.rglob("*")
            if p.is_file()
        }

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            return answer(start_response, 405, "text/plain", b"GET only\n")
        if path in ("/", "/dashboard", "/dashboard/"):
            return answer(start_response, 200, "text/html", (STATIC / "index.html").read_bytes())
        if path == "/api/snapshot":
            return answer(start_response, 200, "application/json", self.poller.published)
        if path == "/api/health":
            return answer(start_response, 200, "application/json", b'{"live":true}')
        file = self.files.get(path)  # only files that exist in the package, by exact name
        if file is None:
            return answer(start_response, 404, "text/plain", b"not found\n")
        kind = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
        return answer(start_response, 200, kind, file.read_bytes())


def answer(start_response: StartResponse, status: int, kind: str, body: bytes) -> list[bytes]:
    """One whole answer of this package's servers (the dashboard, the trace view): its
    length, a charset on text, and the security headers (no caching, nothing loaded from
    elsewhere)."""
    charset = "; charset=utf-8" if kind.startswith("text/") or kind.endswith("json") else ""
    headers = [("content-type", kind + charset), ("content-length", str(len(body)))]
    start_response(f"{status} {HTTPStatus(status).phrase}", headers + _SECURITY_HEADERS)
    return [body]
