"""The canary guard's judgement: per version, the outcomes of a sliding window, and the
verdict that rolls a canary back.

What counts is what the version did: an answer that succeeded (2xx), and one that failed
by the version's own fault (a 5xx the backend marks as its own, or a 502). A 404 saying
a backend does not serve the version is a deployment gap the router routes around
(``canary.version_missing``), not the version's fault. Anything else (a 4xx the request caused, a
429 or a 504: busy, not broken) is not counted at all, not even its latency: a client
can make its own requests fail, fast or slowly, on whichever version it likes.

Latency is compared only between like-sized requests. Each request falls in a size class:
its body bytes and its input size (tensor elements plus text tokens), each rounded down to
a half-octave, so sizes within a class differ by less than √2. A client that sends large
bodies only to the canary fills classes where the stable version has too few requests to
be compared, and within a class it can move a p99 by less than √2 (below the default
``max_p99_ratio`` of 1.5). The classes are pooled into one test, so more classes are not
more chances of a false alarm: a canary request is slow when its latency exceeds its
class's bound (the stable version's p99 in that class × ``max_p99_ratio``, and by
``min_p99_increase_ms``), and the canary is rolled back when more than 1 % of its
requests in the compared classes are slow, i.e. its p99 against the bounds passes 1.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from spillway.models.canary_spec import RollbackBounds
from spillway.policy.backend import BackendResponse
from spillway.policy.facts import RequestFacts
from spillway.protocol.replies import FAULT_HEADER

WINDOW_CAP = 2000
SIGNIFICANCE_Z = 3.0
"""Standard errors by which a fault-rate excess must stand out before it rolls back: the
guard judges on every canary request, so a looser test would roll healthy canaries back
on a chance cluster of faults."""
P99_MIN_REQUESTS = 100
"""Requests before p99s are compared (below 100 a p99 is just the maximum): the stable
version's in each compared size class, the canary's over the compared classes."""

SizeClass = tuple[int, int]
"""Half-octaves of a request's body bytes and of its input size."""
Outcome = Literal["ok", "fault"]


def size_class(facts: RequestFacts) -> SizeClass:
    """The size class of a request."""
    work = (facts.input_elements or 0) + (facts.input_tokens or 0)
    return _half_octave(facts.payload_bytes), _half_octave(work)


def _half_octave(value: int) -> int:
    return math.floor(2 * math.log2(value)) if value >= 1 else -1


def outcome(response: BackendResponse) -> Outcome | None:
    """What an answer says about the version that served it: ``ok`` (it served),
    ``fault`` (it failed by its own fault), or ``None`` (nothing: not counted)."""
    if 200 <= response.status < 300:
        return "ok"
    if response.status == 502:
        return "fault"
    if response.status >= 500 and response.headers.get(FAULT_HEADER) == "server":
        return "fault"
    return None


@dataclass(frozen=True)
class WindowSummary:
    """A version's counted requests in the window: how many, how many failed by its
    fault, and the latencies of those it served, sorted, by size class."""

    count: int
    faults: int
    latencies: Mapping[SizeClass, Sequence[float]] = field(default_factory=dict)

    @property
    def fault_rate(self) -> float:
        """Faults per request (0 without requests)."""
        return self.faults / self.count if self.count else 0.0


class Window:
    """One version's outcomes ``(at, latency_s, fault, size class)``, oldest first, at
    most ``WINDOW_CAP`` (at a higher rate the window is the last ``WINDOW_CAP``)."""

    def __init__(self) -> None:
        self._events: deque[tuple[float, float, bool, SizeClass]] = deque(maxlen=WINDOW_CAP)

    def add(self, at: float, latency_s: float, fault: bool, size: SizeClass) -> None:
        """Record one counted outcome."""
        self._events.append((at, latency_s, fault, size))

    def summary(self, now: float, span_s: float) -> WindowSummary:
        """The outcomes of the last ``span_s`` seconds (older ones are dropped)."""
        events = self._events
        while events and events[0][0] < now - span_s:
            events.popleft()
        by_class: dict[SizeClass, list[float]] = {}
        for _, latency, fault, size in events:
            if not fault:
                by_class.setdefault(size, []).append(latency)
        for latencies in by_class.values():
            latencies.sort()
        return WindowSummary(len(events), sum(1 for e in events if e[2]), by_class)


def verdict(canary: WindowSummary, stable: WindowSummary, bounds: RollbackBounds) -> str | None:
    """Why the canary must be rolled back, or ``None`` while it is within its bounds."""
    if canary.count < bounds.min_requests:
        return None
    compared = stable.count >= bounds.min_requests
    baseline = stable if compared else WindowSummary(0, 0)
    if _above(canary, baseline, bounds.max_error_rate_increase):
        return (
            f"fault rate {canary.fault_rate:.1%} over {canary.count} requests against "
            f"{baseline.fault_rate:.1%} for the stable version "
            f"(bound +{bounds.max_error_rate_increase:.1%})"
        )
    return _slower(canary, stable, bounds)


def _slower(canary: WindowSummary, stable: WindowSummary, bounds: RollbackBounds) -> str | None:
    """The p99 test over like-sized requests (see the module's docstring)."""
    needed = max(bounds.min_requests, P99_MIN_REQUESTS)
    limits: dict[SizeClass, tuple[float, float]] = {}
    for size, latencies in stable.latencies.items():
        if len(latencies) >= needed and size in canary.latencies:
            p99 = _p99(latencies)
            limits[size] = (
                p99,
                max(p99 * bounds.max_p99_ratio, p99 + bounds.min_p99_increase_ms / 1000),
            )
    ratios = sorted(
        latency / limits[size][1] for size in limits for latency in canary.latencies[size]
    )
    if len(ratios) < needed or _p99(ratios) <= 1:
        return None
    largest = max(limits, key=lambda size: len(canary.latencies[size]))
    return (
        f"p99 {_p99(canary.latencies[largest]) * 1000:.1f} ms against "
        f"{limits[largest][0] * 1000:.1f} ms for the stable version on like-sized requests "
        f"({len(ratios)} canary requests in {len(limits)} size classes compared; "
        f"bound x{bounds.max_p99_ratio:g})"
    )


def _p99(ordered: Sequence[float]) -> float:
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


def _above(canary: WindowSummary, stable: WindowSummary, margin: float) -> bool:
    """Whether the canary's fault rate exceeds the stable one's plus ``margin`` by more
    than chance explains (a one-sided test of the difference at ``SIGNIFICANCE_Z``
    standard errors): one fault in 50 requests is no regression, ten are."""
    excess = canary.fault_rate - stable.fault_rate - margin
    if excess <= 0:
        return False
    variance = sum(s.fault_rate * (1 - s.fault_rate) / s.count for s in (canary, stable) if s.count)
    return variance == 0 or excess / math.sqrt(variance) >= SIGNIFICANCE_Z
