"""``spillway cost report``: a metrics log (EMF JSON lines) summarised by route.

Lines that are not EMF documents of the ``Spillway`` namespace (plain log lines, other
services' metrics) are skipped, so a whole CloudWatch Logs export or a local router's
stdout can be fed as-is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from spillway.routing.accounting import NAMESPACE


@dataclass
class RouteSummary:
    """Totals of one route (rule, backend)."""

    rule: str
    backend: str
    requests: int = 0
    errors: int = 0
    fallbacks: int = 0
    spills: int = 0
    cost_usd: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)

    @property
    def usd_per_1k(self) -> float:
        """Average cost of a thousand requests on this route."""
        return self.cost_usd / self.requests * 1000 if self.requests else 0.0

    def latency_ms(self, quantile: float) -> float:
        """A latency quantile (nearest rank), 0 when there are none."""
        return nearest_rank(self.latencies_ms, quantile)


def nearest_rank(values: Iterable[float], quantile: float) -> float:
    """The nearest-rank ``quantile`` of ``values`` (0 when there are none): the figure the
    cost report and the dashboard both print, so the two agree to the digit."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(quantile * len(ordered)) - 1))]


def _values(value: object) -> list[float]:
    items = value if isinstance(value, list) else [value]
    return [float(v) for v in items if isinstance(v, int | float) and not isinstance(v, bool)]


def _is_route_document(document: object) -> bool:
    if not isinstance(document, dict):
        return False
    directives = document.get("_aws", {}).get("CloudWatchMetrics", [])
    return (
        any(isinstance(d, dict) and d.get("Namespace") == NAMESPACE for d in directives)
        and isinstance(document.get("rule"), str)
        and isinstance(document.get("backend"), str)
    )


def route_document(line: str) -> dict[str, Any] | None:
    """The router's EMF document of one request on ``line``, or ``None`` for any other
    line (plain logs, other namespaces, broken JSON)."""
    text = line.strip()
    if not text.startswith("{"):
        return None
    try:
        document = json.loads(text)
    except ValueError:
        return None
    return document if _is_route_document(document) else None


@dataclass(frozen=True)
class RouteEvent:
    """One request as the router's metric line records it."""

    at: float
    """Seconds since the epoch (the EMF timestamp)."""
    rule: str
    backend: str
    model: str
    requests: int
    errors: int
    fallbacks: int
    spills: int
    cost_usd: float
    latencies_ms: tuple[float, ...]

    @classmethod
    def of(cls, document: dict[str, Any]) -> RouteEvent:
        """The event of a document ``route_document`` accepted."""
        stamp = document.get("_aws", {}).get("Timestamp", 0)
        return cls(
            at=float(stamp) / 1000 if isinstance(stamp, int | float) else 0.0,
            rule=document["rule"],
            backend=document["backend"],
            model=str(document.get("model", "-")),
            requests=int(sum(_values(document.get("Requests", 0)))),
            errors=int(sum(_values(document.get("Errors", 0)))),
            fallbacks=int(sum(_values(document.get("Fallbacks", 0)))),
            spills=int(sum(_values(document.get("Spills", 0)))),
            cost_usd=sum(_values(document.get("CostUSD", 0))),
            latencies_ms=tuple(_values(document.get("LatencyMs", []))),
        )


def route_events(lines: Iterable[str]) -> Iterator[RouteEvent]:
    """The request events among ``lines``, in order."""
    for line in lines:
        document = route_document(line)
        if document is not None:
            yield RouteEvent.of(document)


def summarise(lines: Iterable[str]) -> list[RouteSummary]:
    """Routes found in the lines, most expensive first."""
    routes: dict[tuple[str, str], RouteSummary] = {}
    for event in route_events(lines):
        key = (event.rule, event.backend)
        summary = routes.setdefault(key, RouteSummary(*key))
        summary.requests += event.requests
        summary.errors += event.errors
        summary.fallbacks += event.fallbacks
        summary.spills += event.spills
        summary.cost_usd += event.cost_usd
        summary.latencies_ms += event.latencies_ms
    return sorted(routes.values(), key=lambda r: (-r.cost_usd, r.rule, r.backend))


def markdown(routes: list[RouteSummary]) -> str:
    """The summary as a markdown table with a total row."""
    head = (
        "| rule | backend | requests | errors | fallbacks | spills | cost USD | USD / 1k "
        "| p50 ms | p99 ms |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [
        f"| {r.rule} | {r.backend} | {r.requests} | {r.errors} | {r.fallbacks} | {r.spills} "
        f"| {r.cost_usd:.6f} | {r.usd_per_1k:.6f} | {r.latency_ms(0.5):.1f} "
        f"| {r.latency_ms(0.99):.1f} |"
        for r in routes
    ]
    requests = sum(r.requests for r in routes)
    cost = sum(r.cost_usd for r in routes)
    per_1k = cost / requests * 1000 if requests else 0.0
    total = f"| **total** | | {requests} | {sum(r.errors for r in routes)} | "
    total += f"{sum(r.fallbacks for r in routes)} | {sum(r.spills for r in routes)} "
    total += f"| {cost:.6f} | {per_1k:.6f} | | |"
    return "\n".join([head, *rows, total])


def as_json(routes: list[RouteSummary]) -> list[dict[str, object]]:
    """The summary as plain data."""
    return [
        {
            "rule": r.rule,
            "backend": r.backend,
            "requests": r.requests,
            "errors": r.errors,
            "fallbacks": r.fallbacks,
            "spills": r.spills,
            "cost_usd": r.cost_usd,
            "usd_per_1k": r.usd_per_1k,
            "p50_ms": r.latency_ms(0.5),
            "p99_ms": r.latency_ms(0.99),
        }
        for r in routes
    ]
