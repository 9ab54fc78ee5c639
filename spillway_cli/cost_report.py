"""``spillway cost report``: a metrics log (EMF JSON lines) summarised by route.

Lines that are not EMF documents of the ``Spillway`` namespace (plain log lines, other
services' metrics) are skipped, so a whole CloudWatch Logs export or a local router's
stdout can be fed as-is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from spillway.policy.accounting import RouteTotals, combined, route_events


@dataclass(kw_only=True)
class RouteSummary(RouteTotals):
    """Totals of one route (rule, backend)."""

    rule: str
    backend: str


def summarise(lines: Iterable[str]) -> list[RouteSummary]:
    """Routes found in the lines, most expensive first."""
    routes: dict[tuple[str, str], RouteSummary] = {}
    for event in route_events(lines):
        key = (event.rule, event.backend)
        if key not in routes:
            routes[key] = RouteSummary(rule=event.rule, backend=event.backend)
        routes[key].add(event)
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
    t = combined(routes)
    total = f"| **total** | | {t.requests} | {t.errors} | {t.fallbacks} | {t.spills} "
    total += f"| {t.cost_usd:.6f} | {t.usd_per_1k:.6f} | | |"
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
