"""``spillway cost report``: a metrics log (EMF JSON lines) summarised by route.

Lines that are not EMF documents of the ``Spillway`` namespace (plain log lines, other
services' metrics) are skipped, so a whole CloudWatch Logs export or a local router's
stdout can be fed as-is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from functions.router.accounting import NAMESPACE


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
        if not self.latencies_ms:
            return 0.0
        ordered = sorted(self.latencies_ms)
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


def summarise(lines: Iterable[str]) -> list[RouteSummary]:
    """Routes found in the lines, most expensive first."""
    routes: dict[tuple[str, str], RouteSummary] = {}
    for line in lines:
        text = line.strip()
        if not text.startswith("{"):
            continue
        try:
            document = json.loads(text)
        except ValueError:
            continue
        if not _is_route_document(document):
            continue
        key = (document["rule"], document["backend"])
        summary = routes.setdefault(key, RouteSummary(*key))
        summary.requests += int(sum(_values(document.get("Requests", 0))))
        summary.errors += int(sum(_values(document.get("Errors", 0))))
        summary.fallbacks += int(sum(_values(document.get("Fallbacks", 0))))
        summary.spills += int(sum(_values(document.get("Spills", 0))))
        summary.cost_usd += sum(_values(document.get("CostUSD", 0)))
        summary.latencies_ms += _values(document.get("LatencyMs", []))
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
