"""What the dashboard reads: the services' own metrics, nothing it computes on the side.

* The router's log files: its EMF metric lines (one per request: rule, backend, model,
  status, latency, cost, fallback, spill; the same lines ``spillway cost report`` reads) and
  its ``routed`` decision lines, whose attempt outcomes (``gpu:circuit_open``,
  ``cpu:status_200``) show each backend's circuit as the last request found it. A file may
  hold either kind or both: the WSGI router writes metrics to ``ROUTER_METRICS_LOG`` and
  decisions to its log, under serverless-offline both reach the log. Powertools'
  ``ColdStart`` EMF lines of the Lambda functions (on AWS, under serverless-offline or
  ``sam local``) in any of these files count as cold starts of their function.
* The GPU service's Prometheus ``/metrics``: request and batch counters, queue depth and
  busy fraction per model version.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from spillway.policy.accounting import RouteEvent, route_document

MAX_READ_BYTES = 8 * 1024 * 1024
"""Most bytes read from one file per poll, so a huge backlog is taken in slices."""
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


class LineTail:
    """The complete lines appended to a file since the last read. A file that shrank
    (rotated or truncated) is read again from its start; a missing file reads as empty."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read(self) -> list[str]:
        """New complete lines (a line still being written waits for its newline)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self._offset:
            self._offset, self._partial = 0, b""
        with self.path.open("rb") as handle:
            handle.seek(self._offset)
            data = handle.read(MAX_READ_BYTES)
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return [line.decode("utf-8", "replace") for line in lines]


@dataclass(frozen=True)
class BreakerSighting:
    """What one request found a backend's circuit to be."""

    at: float
    backend: str
    state: str
    """``open`` (skipped), ``failing`` (no answer or a server fault), ``busy`` (429, 503,
    504: no verdict) or ``closed`` (it answered)."""
    outcome: str


_FAILING = frozenset({"connect_error", "timeout", "connection_lost", "error", "bad_gateway"})
_BUSY = frozenset({"overloaded", "unavailable", "deadline"})


def breaker_state(outcome: str) -> str | None:
    """The circuit state an attempt outcome shows (``None``: it says nothing)."""
    if outcome == "circuit_open":
        return "open"
    if outcome in _FAILING:
        return "failing"
    if outcome in _BUSY:
        return "busy"
    if outcome.startswith("status_"):
        return "closed"
    return None


def breaker_sightings(document: dict[str, Any]) -> list[BreakerSighting]:
    """The sightings in one ``routed`` log document (none for any other document)."""
    if document.get("message") != "routed" or not isinstance(document.get("attempts"), list):
        return []
    at = _log_time(document.get("timestamp"))
    sightings = []
    for attempt in document["attempts"]:
        backend, _, outcome = str(attempt).partition(":")
        state = breaker_state(outcome)
        if state is not None:
            sightings.append(BreakerSighting(at, backend, state, outcome))
    return sightings


def _log_time(stamp: object) -> float:
    """Seconds since the epoch of a Powertools log timestamp (``2026-11-30 21:30:28,140+0000``)."""
    if not isinstance(stamp, str):
        return 0.0
    try:
        return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f%z").timestamp()
    except ValueError:
        return 0.0


@dataclass(frozen=True)
class Request:
    """One request of the router's metric lines, with the status its client got (the
    event's ``errors`` count only server faults; a 404 is a client's error)."""

    event: RouteEvent
    status: int

    @classmethod
    def of(cls, document: dict[str, Any]) -> Request:
        """The request of a document ``route_document`` accepted (a line without a status,
        from an older router, is a 500 when it counted an error, else a 200)."""
        event = RouteEvent.of(document)
        status = document.get("status")
        if not isinstance(status, int) or isinstance(status, bool):
            status = 500 if event.errors else 200
        return cls(event, status)


@dataclass(frozen=True)
class ColdStart:
    """A Powertools ``ColdStart`` metric line: one function instance started."""

    at: float
    function: str


def cold_start(document: dict[str, Any]) -> ColdStart | None:
    """The cold start an EMF document records (``None``: it records none)."""
    if not isinstance(document.get("_aws"), dict) or "ColdStart" not in document:
        return None
    stamp = document["_aws"].get("Timestamp", 0)
    at = float(stamp) / 1000 if isinstance(stamp, int | float) else 0.0
    name = document.get("function_name") or document.get("service") or "-"
    return ColdStart(at, str(name))


@dataclass
class LogRead:
    """What one read of the router's logs found."""

    requests: list[Request] = field(default_factory=list)
    sightings: list[BreakerSighting] = field(default_factory=list)
    cold_starts: list[ColdStart] = field(default_factory=list)


@dataclass
class RouterLogs:
    """Every request, circuit sighting and cold start in the router's log files, as they
    grow."""

    paths: list[Path]
    tails: list[LineTail] = field(init=False)
    lines_read: int = 0

    def __post_init__(self) -> None:
        self.tails = [LineTail(path) for path in self.paths]

    def read(self) -> LogRead:
        """What was appended since the last call."""
        found = LogRead()
        for tail in self.tails:
            for line in tail.read():
                self.lines_read += 1
                document = route_document(line)
                if document is not None:
                    found.requests.append(Request.of(document))
                elif '"routed"' in line:
                    found.sightings += breaker_sightings(_json_object(line))
                elif '"ColdStart"' in line and (start := cold_start(_json_object(line))):
                    found.cold_starts.append(start)
        return found


def _json_object(line: str) -> dict[str, Any]:
    """The JSON object a log line holds (serverless-offline may prefix it), else ``{}``."""
    start = line.find("{")
    if start < 0:
        return {}
    try:
        document = json.loads(line[start:])
    except ValueError:
        return {}
    return document if isinstance(document, dict) else {}


@dataclass(frozen=True)
class Sample:
    """One Prometheus sample."""

    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """The samples of a text exposition (comments and malformed lines are skipped)."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None:
            continue
        name, labels, raw = match.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if math.isfinite(value):
            samples.append(Sample(name, dict(_LABEL.findall(labels or "")), value))
    return samples


@dataclass(frozen=True)
class GpuReading:
    """The GPU service's totals at one scrape, summed over model versions."""

    at: float
    success: float
    failure: float
    rejected: float
    batches: float
    batch_rows: float
    queue_depth: float
    busy: float
    """The busiest version's share of the last 10 s spent computing."""

    @classmethod
    def of(cls, samples: list[Sample], at: float) -> GpuReading:
        """Fold the samples of one scrape."""

        def total(name: str) -> float:
            return sum(s.value for s in samples if s.name == name)

        busy = [s.value for s in samples if s.name == "spillway_busy_fraction"]
        return cls(
            at=at,
            success=total("nv_inference_request_success"),
            failure=total("nv_inference_request_failure"),
            rejected=total("spillway_rejected_total"),
            batches=total("spillway_batch_size_count"),
            batch_rows=total("spillway_batch_size_sum"),
            queue_depth=total("spillway_queue_depth"),
            busy=max(busy, default=0.0),
        )


def scrape(url: str, timeout_s: float = 1.0) -> str | None:
    """The text of ``url`` (the GPU service's ``/metrics``), ``None`` when it is down."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - our own setting
            body: bytes = response.read()
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return body.decode("utf-8", "replace")
