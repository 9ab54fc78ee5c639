"""The dashboard's state: requests, circuit sightings, cold starts and GPU scrapes folded
into per-second series over a sliding window plus running totals, the operator's view
(``operator.Operator``) as last read, and the JSON the page draws.

Totals (requests, 5xx and 4xx, fallbacks, spills, cost per backend, route and model)
count every request since the dashboard started reading, as ``spillway cost report``
counts the same lines; latency quantiles use the nearest rank over the last
``keep_latencies`` requests of a backend, route or model. Series hold one point per
*complete* second of the last ``window_s`` seconds (an hour by default): the second still
running is left out, so a rate never dips at the right edge. The per-second p50/p99 are
taken over the trailing ``smooth_s`` seconds, so that a second with two requests does not
draw a spike; a second's quantiles are fixed once it is ``LATE_S`` old (a request logged
later than that still counts everywhere else) and its latencies are dropped then.

Memory is bounded whatever the load or uptime: at most ``window_s`` per-second buckets of
counters, raw latencies only for the last ``LATE_S + smooth_s`` seconds and at most
``keep_per_second`` of them per backend and second (a uniform sample beyond that), the
last ``keep_latencies`` per backend, route and model for the totals' quantiles, and GPU
scrapes of the last ``window_s`` seconds.
"""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from spillway.policy.accounting import RouteEvent, RouteTotals, combined, nearest_rank
from spillway_cli.dashboard.sources import BreakerSighting, ColdStart, GpuReading, Request

LATE_S = 10
"""Seconds after which a second's latency quantiles are fixed and its latencies dropped."""
RATE_SPAN_S = 10
"""The tiles' rates are over this many complete seconds."""


@dataclass
class _Second:
    """What happened in one wall-clock second."""

    requests: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    client_errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    busy_ms: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    seen: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    quantiles: dict[str, tuple[float, float]] | None = None
    rules: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    fallbacks: int = 0
    spills: int = 0
    cost_usd: float = 0.0


@dataclass
class _Counts:
    """What ``RouteTotals`` does not count: client errors and each status."""

    client_errors: int = 0
    statuses: Counter[int] = field(default_factory=Counter)

    def add(self, status: int) -> None:
        self.client_errors += 400 <= status < 500
        self.statuses[status] += 1


def _figures(totals: RouteTotals, counts: _Counts | None = None) -> dict[str, Any]:
    client_errors = counts.client_errors if counts else 0
    return {
        "requests": totals.requests,
        "errors": totals.errors,
        "error_rate": totals.error_rate,
        "client_errors": client_errors,
        "client_error_rate": client_errors / totals.requests if totals.requests else 0.0,
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

    window_s: int = 3600
    smooth_s: int = 5
    keep_latencies: int = 100_000
    keep_per_second: int = 2_000
    clock: Callable[[], float] = time.time
    slo: dict[str, Any] | None = None
    """The tuner's SLO file (``routes``: rule → p99 ms, ``default_p99_ms``), if given."""
    seconds: dict[int, _Second] = field(default_factory=dict)
    backends: dict[str, RouteTotals] = field(default_factory=dict)
    routes: dict[tuple[str, str], RouteTotals] = field(default_factory=dict)
    models: dict[str, RouteTotals] = field(default_factory=dict)
    counts: dict[tuple[str, str], _Counts] = field(default_factory=dict)
    """(``backend``|``route``|``model``|``total``, name) → client errors and statuses."""
    rules: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    breakers: dict[str, BreakerSighting] = field(default_factory=dict)
    cold_starts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    gpu: deque[tuple[GpuReading, GpuReading | None]] = field(default_factory=deque)
    gpu_up: bool = False
    operator: dict[str, Any] = field(default_factory=dict)
    events_read: int = 0
    first_second: int | None = None
    min_span_s: int = 30
    _sample: random.Random = field(default_factory=lambda: random.Random(0))  # noqa: S311

    def add_requests(self, requests: Iterable[Request]) -> None:
        """Fold requests into the totals and, when recent, the series."""
        oldest = int(self.clock()) - self.window_s  # the first second of the window
        for request in requests:
            event, status = request.event, request.status
            self.events_read += 1
            self._totals(self.backends, event.backend).add(event)
            self._totals(self.routes, (event.rule, event.backend)).add(event)
            self._totals(self.models, event.model).add(event)
            route = f"{event.rule}\0{event.backend}"
            for key in (("backend", event.backend), ("route", route), ("model", event.model)):
                self.counts.setdefault(key, _Counts()).add(status)
            self.counts.setdefault(("total", ""), _Counts()).add(status)
            self.rules[event.rule] += event.requests
            second = int(event.at)
            if second < oldest:
                continue
            if self.first_second is None or second < self.first_second:
                self.first_second = second
            self._add_to_second(self.seconds.setdefault(second, _Second()), event, status)
        for second in [s for s in self.seconds if s < oldest]:
            del self.seconds[second]

    def add_events(self, events: Iterable[RouteEvent]) -> None:
        """Requests known only by their events: a server fault is a 500, else a 200."""
        self.add_requests(Request(e, 500 if e.errors else 200) for e in events)

    def _add_to_second(self, bucket: _Second, event: RouteEvent, status: int) -> None:
        backend = event.backend
        bucket.requests[backend] += event.requests
        bucket.errors[backend] += event.errors
        bucket.client_errors[backend] += event.requests if 400 <= status < 500 else 0
        bucket.busy_ms[backend] += sum(event.latencies_ms)
        kept = bucket.latencies[backend]
        for value in event.latencies_ms:  # a uniform sample of at most keep_per_second
            bucket.seen[backend] += 1
            if len(kept) < self.keep_per_second:
                kept.append(value)
            elif (slot := self._sample.randrange(bucket.seen[backend])) < self.keep_per_second:
                kept[slot] = value
        bucket.rules[event.rule] += event.requests
        bucket.fallbacks += event.fallbacks
        bucket.spills += event.spills
        bucket.cost_usd += event.cost_usd

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

    def add_cold_starts(self, starts: Iterable[ColdStart]) -> None:
        """Count the functions' ``ColdStart`` metric lines."""
        for start in starts:
            self.cold_starts[start.function] += 1

    def add_gpu(self, reading: GpuReading | None) -> None:
        """One scrape of the GPU service (``None``: it did not answer)."""
        self.gpu_up = reading is not None
        if reading is None:
            return
        previous = self.gpu[-1][0] if self.gpu else None
        self.gpu.append((reading, previous))
        while self.gpu and self.gpu[0][0].at <= reading.at - self.window_s:
            self.gpu.popleft()

    def seen_models(self) -> list[str]:
        """The models the router's lines name (``-``: a request that named none)."""
        return sorted(m for m in self.models if m != "-")

    # --- the page's JSON ---------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The whole view at this moment, as plain data."""
        now = self.clock()
        self._fix_quantiles(int(now))
        axis = list(range(self._axis_start(int(now)), int(now)))  # complete seconds only
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
            "models": {
                m: _figures(t, self.counts.get(("model", m))) | self._statuses("model", m)
                for m, t in sorted(self.models.items())
            },
            "totals": self._grand_totals(now),
            "breakers": {
                b: {"state": s.state, "outcome": s.outcome, "age_s": max(0.0, now - s.at)}
                for b, s in sorted(self.breakers.items())
            },
            "cold_starts": dict(sorted(self.cold_starts.items())),
            "slo": self._slo(),
            "gpu": self._gpu(),
            "operator": self.operator,
        }

    def _statuses(self, kind: str, name: str) -> dict[str, Any]:
        counts = self.counts.get((kind, name))
        statuses = counts.statuses if counts else Counter()
        return {"statuses": {str(s): n for s, n in sorted(statuses.items())}}

    def _axis_start(self, now: int) -> int:
        """The window, cut to start shortly before the first request (at least
        ``min_span_s`` long), so a fresh dashboard is not mostly empty space."""
        start = now - self.window_s
        if self.first_second is not None:
            start = max(start, min(self.first_second - 2, now - self.min_span_s))
        return start

    def _fix_quantiles(self, now: int) -> None:
        """Fix the smoothed quantiles of seconds ``LATE_S`` old, oldest first, then drop
        the latencies no open second's trailing window needs."""
        for second in sorted(s for s in self.seconds if s <= now - LATE_S):
            bucket = self.seconds[second]
            if bucket.quantiles is None:
                trailing = range(second - self.smooth_s + 1, second + 1)
                present = [self.seconds[s] for s in trailing if s in self.seconds]
                backends = {b for other in present for b in other.latencies}
                bucket.quantiles = {
                    b: (q50, q99)
                    for b in sorted(backends)
                    if (q50 := self._smoothed(second, b, 0.5)) is not None
                    and (q99 := self._smoothed(second, b, 0.99)) is not None
                }
        for second in [s for s in self.seconds if s <= now - LATE_S - self.smooth_s]:
            self.seconds[second].latencies.clear()

    def _smoothed(self, second: int, backend: str, q: float) -> float | None:
        recent = [
            v
            for s in range(second - self.smooth_s + 1, second + 1)
            if (bucket := self.seconds.get(s)) is not None
            for v in bucket.latencies.get(backend, ())
        ]
        return round(nearest_rank(recent, q), 3) if recent else None

    def _series(self, axis: list[int], names: list[str]) -> dict[str, Any]:
        empty = _Second()
        buckets = [self.seconds.get(s, empty) for s in axis]

        def quantile(second: int, bucket: _Second, backend: str, index: int) -> float | None:
            if bucket.quantiles is not None:
                fixed = bucket.quantiles.get(backend)
                return fixed[index] if fixed is not None else None
            return self._smoothed(second, backend, (0.5, 0.99)[index])

        def rate(part: dict[str, int], bucket: _Second, backend: str) -> float | None:
            count = bucket.requests.get(backend, 0)
            return part.get(backend, 0) / count if count else None

        rules = sorted({r for b in buckets for r in b.rules})
        pairs = list(zip(axis, buckets, strict=True))
        return {
            "rps": {b: [x.requests.get(b, 0) for x in buckets] for b in names},
            "p50": {b: [quantile(s, x, b, 0) for s, x in pairs] for b in names},
            "p99": {b: [quantile(s, x, b, 1) for s, x in pairs] for b in names},
            "error_rate": {b: [rate(x.errors, x, b) for x in buckets] for b in names},
            "client_error_rate": {b: [rate(x.client_errors, x, b) for x in buckets] for b in names},
            "concurrency": {
                b: [round(x.busy_ms.get(b, 0.0) / 1000, 3) for x in buckets] for b in names
            },
            "rules": {r: [x.rules.get(r, 0) for x in buckets] for r in rules},
            "fallbacks": [x.fallbacks for x in buckets],
            "spills": [x.spills for x in buckets],
            "cost_usd": [x.cost_usd for x in buckets],
        }

    def _recent(self, now: float) -> list[_Second]:
        """The buckets of the last ``RATE_SPAN_S`` complete seconds."""
        seconds = range(int(now) - RATE_SPAN_S, int(now))
        return [self.seconds[s] for s in seconds if s in self.seconds]

    def _recent_rate(self, now: float, backend: str | None) -> float:
        """Requests per second over the last ``RATE_SPAN_S`` complete seconds."""
        buckets = self._recent(now)
        if backend is None:
            return sum(sum(b.requests.values()) for b in buckets) / RATE_SPAN_S
        return sum(b.requests.get(backend, 0) for b in buckets) / RATE_SPAN_S

    def _concurrency(self, now: float, backend: str) -> float:
        """Requests in flight on ``backend``, on average over the last ``RATE_SPAN_S``
        complete seconds: the time its requests took, per second of wall time (Little's
        law; a request counts in the second it ended)."""
        busy_ms = sum(b.busy_ms.get(backend, 0.0) for b in self._recent(now))
        return busy_ms / 1000 / RATE_SPAN_S

    def _backend(self, backend: str, now: float) -> dict[str, Any]:
        figures = _figures(self.backends[backend], self.counts.get(("backend", backend)))
        figures["rps"] = self._recent_rate(now, backend)
        figures["concurrency"] = self._concurrency(now, backend)
        return figures | self._statuses("backend", backend)

    def _routes(self) -> list[dict[str, Any]]:
        rows = []
        for (rule, backend), totals in self.routes.items():
            counts = self.counts.get(("route", f"{rule}\0{backend}"))
            row = {"rule": rule, "backend": backend, **_figures(totals, counts)}
            row["slo_p99_ms"] = self._objective(rule)
            rows.append(row)
        return sorted(rows, key=lambda r: (-r["cost_usd"], r["rule"], r["backend"]))

    def _objective(self, rule: str) -> float | None:
        if self.slo is None:
            return None
        value = self.slo.get("routes", {}).get(rule, self.slo.get("default_p99_ms"))
        return float(value) if value is not None else None

    def _slo(self) -> dict[str, Any] | None:
        """The objectives of the rules seen (of every rule the file names before any
        request), one line each on the latency chart."""
        if self.slo is None:
            return None
        rules = sorted(self.rules) or sorted(self.slo.get("routes", {}))
        lines = {r: v for r in rules if (v := self._objective(r)) is not None}
        return {"lines": lines, "default_p99_ms": self.slo.get("default_p99_ms")}

    def _grand_totals(self, now: float) -> dict[str, Any]:
        total = combined(self.backends.values())
        figures = _figures(total, self.counts.get(("total", "")))
        del figures["p50_ms"], figures["p99_ms"]
        figures["rps"] = self._recent_rate(now, None)
        return figures | self._statuses("total", "")

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
