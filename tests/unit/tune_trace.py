"""The tuning example's recorded day (docs/tuning.md), written as the router's metric
lines: ranking traffic that is quiet at night, steady by day and three times the GPU's
capacity at noon, run through docs/examples/tune-policy.yaml by the replay engine with
the requests' true priorities.

    .venv/bin/python -m tests.unit.tune_trace out/tune/trace.jsonl
"""

from __future__ import annotations

import json
import math
import random
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spillway.policy.accounting import Pricing, RouteRecord, route_metrics
from spillway.policy.facts import RequestFacts
from spillway.policy.rules import Policy, Rule, parse_policy
from spillway_cli.plan.inputs import load_measured
from spillway_cli.tune.simulate import Backends, Component, Replay, binned
from spillway_cli.tune.trace import Group, kind_of

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
DAY = datetime(2026, 11, 30, tzinfo=UTC).timestamp()
SEGMENTS = ((0, 7, 0.02), (7, 11, 0.5), (11, 12, 3.2), (12, 19, 0.5), (19, 24, 0.1))
"""(from hour, to hour, requests per second), arrivals evenly spaced."""
INTERACTIVE_EVERY = 5
"""One request in five is interactive (priority 1), the others low priority (2)."""
BIN_S = 10.0
MODEL = "ranker"


def example_policy() -> Policy:
    return parse_policy((EXAMPLES / "tune-policy.yaml").read_text())


def example_backends() -> Backends:
    return Backends(load_measured(EXAMPLES / "tune-measured.yaml"), Pricing())


def true_groups(
    policy: Policy, segments: tuple[tuple[float, float, float], ...] = SEGMENTS
) -> list[Group]:
    """The day's requests per bin, with their real priorities."""
    path = f"/v2/models/{MODEL}/infer"
    facts = {
        level: RequestFacts("POST", path, "infer", model=MODEL, priority=level) for level in (1, 2)
    }
    groups, sent = [], 0
    for first, last, rate in segments:
        for start in range(int(first * 3600), int(last * 3600), int(BIN_S)):
            arrived = math.floor((start + BIN_S - first * 3600) * rate) - math.floor(
                (start - first * 3600) * rate
            )
            interactive = sum(1 for i in range(sent, sent + arrived) if i % INTERACTIVE_EVERY == 0)
            sent += arrived
            for level, count in ((1, interactive), (2, arrived - interactive)):
                if count:
                    groups.append(
                        Group(DAY + start, kind_of(policy, facts[level]), facts[level], count)
                    )
    return groups


def write_trace(
    path: Path, seed: int = 11, segments: tuple[tuple[float, float, float], ...] = SEGMENTS
) -> int:
    """Write the metric lines of the day (or of ``segments``); how many."""
    policy, backends = example_policy(), example_backends()
    rng = random.Random(seed)
    lines: list[str] = []
    templates: dict[tuple[str, str], dict[str, Any]] = {}

    def placed(
        start: float, group: Group, rule: Rule, backend: str, n: int, latency: Component, usd: float
    ) -> None:
        # One document per route from the router's own serializer; each line changes
        # only its time, latency and cost.
        if (rule.name, backend) not in templates:
            spilled = rule.spill is not None and backend == rule.spill.to
            record = RouteRecord(
                rule=rule.name,
                backend=backend,
                model=MODEL,
                status=200 if backend != "none" else 503,
                latency_ms=0.0,
                cost_usd=0.0,
                spilled=spilled,
                fallback=not spilled and backend not in (rule.route, "none"),
            )
            templates[(rule.name, backend)] = route_metrics(record)
        document = templates[(rule.name, backend)]
        mu, sigma = latency
        for i in range(n):
            document["_aws"]["Timestamp"] = int((start + (i + 0.5) * BIN_S / n) * 1000)
            document["LatencyMs"] = [math.exp(rng.gauss(mu, sigma)) if math.isfinite(mu) else 5e3]
            document["CostUSD"] = [usd]
            lines.append(json.dumps(document, separators=(",", ":")))

    bins = binned(true_groups(policy, segments), policy.defaults.priority)
    Replay(policy, backends, BIN_S, seed, placed=placed).run(bins)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "out/tune/trace.jsonl")
    print(f"wrote {write_trace(target)} lines to {target}")
