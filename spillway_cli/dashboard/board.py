"""The dashboard's state: request events, circuit sightings and GPU scrapes folded into
per-second series over a sliding window plus running totals, and the JSON the page draws.

Totals (requests, errors, fallbacks, spills, cost per route) count every event since the
dashboard started reading, as ``spillway cost report`` counts the same lines; latency
quantiles use the nearest rank over the last ``keep_latencies`` requests of a backend or
route, so memory stays bounded however long it runs. Series hold one point per second of
the last ``window_s`` seconds; the per-second p50/p99 are taken over the trailing
``smooth_s`` seconds so that a second with two requests does not draw a spike.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from spillway.routing.accounting import RouteEvent, RouteTotals, combined, nearest_rank
from spillway_cli.dashboard.sources import BreakerSighting, GpuReading


@dataclass
class _Second:
    """What happened in one wall-clock second."""

    requests: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    rules: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    fallbacks: int = 0
    spills: int = 0
    cost_usd: float = 0.0


def _figures(totals: RouteTotals) -> dict[str, float]:
    return {
        "requests": totals.requests,
        "errors": totals.errors,
        "error_rate": totals.error_rate,
        "fallbacks": totals.fallbacks,
        "spills": totals.spills,
        "cost_usd": totals.cost_usd,
        "usd_per_1k": totals.usd_per_1k,
        "p50_ms": totals.latency_ms(0.5),
        "p99_ms": totals.latency_ms(0.99),
    }


@dataclass
class Board:
    """Everything the page shows, updated by the poller and read by the HTTP handler."""

    window_s: int = 300
    smooth_s: int = 5
    keep_latencies: int = 100_000
    clock: Callable[[], float] = time.time
    seconds: dict[int, _Second] = field(default_factory=dict)
    backends: dict[str, RouteTotals] = field(default_factory=dict)
    routes: dict[tuple[str, str], RouteTotals] = field(default_factory=dict)
    rules: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    breakers: dict[str, BreakerSighting] = field(default_factory=dict)
    gpu: deque[tuple[GpuReading, GpuReading | None]] = field(default_factory=deque)
    gpu_up: bool = False
    events_read: int = 0
    first_second: int | None = None
    min_span_s: int = 30

    def add_events(self, events: Iterable[RouteEvent]) -> None:
        """Fold request events into the totals and, when recent, the series."""
        oldest = int(self.clock()) - self.window_s
        for event in events:
            self.events_read += 1
            self._totals(self.backends, event.backend).add(event)
            self._totals(self.routes, (event.rule, event.backend)).add(event)
            self.rules[event.rule] += event.requests
            second = int(event.at)
            if second <= oldest:
                continue
            if self.first_second is None or second < self.first_second:
                self.first_second = second
            bucket = self.seconds.setdefault(second, _Second())
            bucket.requests[event.backend] += event.requests
            bucket.errors[event.backend] += event.errors
            bucket.latencies[event.backend].extend(event.latencies_ms)
            bucket.rules[event.rule] += event.requests
            bucket.fallbacks += event.fallbacks
            bucket.spills += event.spills
            bucket.cost_usd += event.cost_usd
        for second in [s for s in self.seconds if s <= oldest]:
            del self.seconds[second]

    def _totals(self, table: dict[Any, RouteTotals], key: Any) -> RouteTotals:
        if key not in table:
            table[key] = RouteTotals.keeping(self.keep_latencies)
        return table[key]

    def add_sightings(self, sightings: Iterable[BreakerSighting]) -> None:
        """Keep each backend's most recent circuit sighting."""
        for sighting in sightings:
            known = self.breakers.get(sighting.backend)
            if known is None or sighting.at >= known.at:
                self.breakers[sighting.backend] = sighting

    def add_gpu(self, reading: GpuReading | None) -> None:
        """One scrape of the GPU service (``None``: it did not answer)."""
        self.gpu_up = reading is not None
        if reading is None:
            return
        previous = self.gpu[-1][0] if self.gpu else None
        self.gpu.append((reading, previous))
        while self.gpu and self.gpu[0][0].at <= reading.at - self.window_s:
            self.gpu.popleft()

    # --- the page's JSON ---------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The whole view at this moment, as plain data."""
        now = self.clock()
        axis = list(range(self._axis_start(int(now)), int(now) + 1))
        names = sorted(self.backends)
        return {
            "now": now,
            "window_s": self.window_s,
            "events_read": self.events_read,
            "t": axis,
            "series": self._series(axis, names),
            "backends": {b: self._backend(b, now) for b in names},
            "rules": dict(sorted(self.rules.items())),
            "routes": self._routes(),
            "totals": self._grand_totals(now),
            "breakers": {
                b: {"state": s.state, "outcome": s.outcome, "age_s": max(0.0, now - s.at)}
                for b, s in sorted(self.breakers.items())
            },
            "gpu": self._gpu(),
        }

    def _axis_start(self, now: int) -> int:
        """The window, cut to start shortly before the first request (at least
        ``min_span_s`` long), so a fresh dashboard is not mostly empty space."""
        start = now - self.window_s + 1
        if self.first_second is not None:
            start = max(start, min(self.first_second - 2, now - self.min_span_s + 1))
        return start

    def _series(self, axis: list[int], names: list[str]) -> dict[str, Any]:
        empty = _Second()
        buckets = [self.seconds.get(s, empty) for s in axis]
        smooth = self.smooth_s

        def quantile(backend: str, index: int, q: float) -> float | None:
            recent = [
                v
                for b in buckets[max(0, index - smooth + 1) : index + 1]
                for v in b.latencies[backend]
            ]
            return round(nearest_rank(recent, q), 3) if recent else None

        def error_rate(bucket: _Second, backend: str) -> float | None:
            count = bucket.requests.get(backend, 0)
            return bucket.errors.get(backend, 0) / count if count else None

        rules = sorted({r for b in buckets for r in b.rules})
        return {
            "rps": {b: [x.requests.get(b, 0) for x in buckets] for b in names},
            "p50": {b: [quantile(b, i, 0.5) for i in range(len(axis))] for b in names},
            "p99": {b: [quantile(b, i, 0.99) for i in range(len(axis))] for b in names},
            "error_rate": {b: [error_rate(x, b) for x in buckets] for b in names},
            "rules": {r: [x.rules.get(r, 0) for x in buckets] for r in rules},
            "fallbacks": [x.fallbacks for x in buckets],
            "spills": [x.spills for x in buckets],
            "cost_usd": [x.cost_usd for x in buckets],
        }

    def _recent_rate(self, now: float, backend: str | None, span_s: int = 10) -> float:
        """Requests per second over the last ``span_s`` complete seconds."""
        seconds = range(int(now) - span_s, int(now))
        buckets = [self.seconds[s] for s in seconds if s in self.seconds]
        if backend is None:
            return sum(sum(b.requests.values()) for b in buckets) / span_s
        return sum(b.requests.get(backend, 0) for b in buckets) / span_s

    def _backend(self, backend: str, now: float) -> dict[str, Any]:
        figures = _figures(self.backends[backend])
        figures["rps"] = self._recent_rate(now, backend)
        return figures

    def _routes(self) -> list[dict[str, Any]]:
        rows = [
            {"rule": rule, "backend": backend, **_figures(totals)}
            for (rule, backend), totals in self.routes.items()
        ]
        return sorted(rows, key=lambda r: (-r["cost_usd"], r["rule"], r["backend"]))

    def _grand_totals(self, now: float) -> dict[str, float]:
        total = combined(self.backends.values())
        return {
            "requests": total.requests,
            "errors": total.errors,
            "error_rate": total.error_rate,
            "fallbacks": total.fallbacks,
            "spills": total.spills,
            "cost_usd": total.cost_usd,
            "usd_per_1k": total.usd_per_1k,
            "rps": self._recent_rate(now, None),
        }

    def _gpu(self) -> dict[str, Any]:
        points = [_gpu_point(now, before) for now, before in self.gpu]
        latest = self.gpu[-1][0] if self.gpu else None
        return {
            "up": self.gpu_up,
            "t": [p["at"] for p in points],
            "rps": [p["rps"] for p in points],
            "queue_depth": [p["queue_depth"] for p in points],
            "mean_batch": [p["mean_batch"] for p in points],
            "busy": [p["busy"] for p in points],
            "success": latest.success if latest else None,
            "failure": latest.failure if latest else None,
            "rejected": latest.rejected if latest else None,
            "batches": latest.batches if latest else None,
            "mean_batch_total": latest.batch_rows / latest.batches
            if latest and latest.batches
            else None,
            "queue_depth_now": latest.queue_depth if latest else None,
            "busy_now": latest.busy if latest else None,
        }


def _gpu_point(now: GpuReading, before: GpuReading | None) -> dict[str, Any]:
    """Rates between two scrapes; a restarted service (counters went down) counts from 0."""
    restarted = before is None or now.success < before.success or now.batches < before.batches
    base = GpuReading(now.at, 0, 0, 0, 0, 0, 0, 0) if restarted or before is None else before
    span = now.at - before.at if before is not None and now.at > before.at else 1.0
    batches = now.batches - base.batches
    return {
        "at": now.at,
        "rps": (now.success - base.success) / span if not restarted else None,
        "queue_depth": now.queue_depth,
        "mean_batch": (now.batch_rows - base.batch_rows) / batches if batches > 0 else None,
        "busy": now.busy,
    }
