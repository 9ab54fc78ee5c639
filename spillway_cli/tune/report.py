"""What ``spillway tune`` prints and writes: the change, predicted p99 and cost per route
now and with it, the recorded cost report, and the proposed policy as YAML."""

from __future__ import annotations

import math
from collections import Counter
from datetime import UTC, datetime

import yaml

from spillway.policy.rules import Policy
from spillway_cli.tune.search import Proposal, Slo
from spillway_cli.tune.simulate import Outcome


def _ms(value: float) -> str:
    return "–" if math.isinf(value) else f"{value:,.1f}"


def routes_table(proposal: Proposal, slo: Slo) -> str:
    """Per route: its SLO, and the replayed p99 and cost now and with the proposal."""
    now = proposal.recorded.outcome
    then = proposal.best.outcome if proposal.best else None
    head = (
        "| route | SLO p99 ms | requests | now: p99 ms | now: USD | proposed: p99 ms "
        "| proposed: USD |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    rows = []
    for kind in sorted(now.kinds):
        limit = slo.of(kind)
        before = now.kinds[kind]
        after = then.kinds[kind] if then else None

        def mark(p99: float, limit: float | None = limit) -> str:
            return _ms(p99) + (" (over)" if limit is not None and p99 > limit else "")

        rows.append(
            f"| {kind} | {_ms(limit) if limit is not None else '–'} | {before.requests:,} "
            f"| {mark(before.p99_ms)} | {before.cost_usd:.6f} "
            f"| {mark(after.p99_ms) if after else '–'} "
            f"| {f'{after.cost_usd:.6f}' if after else '–'} |"
        )
    total = sum(k.requests for k in now.kinds.values())
    after_cost = f"{then.cost_usd:.6f}" if then else "–"
    rows.append(f"| **total** | | {total:,} | | {now.cost_usd:.6f} | | {after_cost} |")
    return "\n".join([head, *rows])


def routing_table(now: Outcome, then: Outcome | None) -> str:
    """Requests per rule and backend, now and with the proposal."""
    keys = sorted(set(now.routes) | set(then.routes if then else Counter()))
    head = "| rule | backend | now | proposed |\n|---|---|---:|---:|"
    rows = [
        f"| {rule} | {backend} | {now.routes.get((rule, backend), 0):,} "
        f"| {then.routes.get((rule, backend), 0) if then else 0:,} |"
        for rule, backend in keys
    ]
    return "\n".join([head, *rows])


def dump_policy(policy: Policy, note: str) -> str:
    """The policy as YAML, headed by where it came from."""
    body = yaml.safe_dump(
        policy.model_dump(mode="json", exclude_unset=True), sort_keys=False, allow_unicode=True
    )
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"# {note} ({stamp}).\n# Check it: spillway policy check FILE\n{body}"
