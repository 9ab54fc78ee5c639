"""The search: candidate policies around the recorded one, the cheapest that keeps every
route's SLO, and what changed.

The knobs are those of the rules that spill: the share spilled and, for a rule with a
load condition, its busy threshold and how long it must hold. For each such rule in
turn (the others as found so far) every share of ``SHARES`` is tried at every threshold
of ``THRESHOLDS`` (and the recorded values), the best pair is refined by ``STEP`` around
it, then every duration of ``HOLDS`` is tried at that pair; a share of 0 means no spill.
Each candidate is replayed on the same trace with the same seed. The proposal is the
cheapest candidate whose replay keeps every SLO; among equally cheap ones, the one that
changes fewest settings, then the one whose threshold moved least. A candidate that
breaks an SLO is never proposed, however cheap.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from spillway.policy.rules import Backend, Policy, Rule, Spill
from spillway_cli.tune.simulate import Outcome

SHARES = tuple(round(0.1 * i, 1) for i in range(11))
THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9)
STEP = 0.05
"""After the grid, the best pair is refined by this step in each direction."""
HOLDS = (0.0, 30.0, 60.0, 300.0)


class Slo(BaseModel):
    """p99 objectives per route: a route is a kind of request, named after the rule of
    the recorded policy that decides it when every window and load condition holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default_p99_ms: float | None = Field(default=None, gt=0)
    """The objective of a route the file does not name (none: no objective)."""
    routes: dict[str, float] = Field(default_factory=dict)

    def of(self, kind: str) -> float | None:
        return self.routes.get(kind, self.default_p99_ms)

    def unmatched(self, kinds: Iterable[str]) -> list[str]:
        """The routes the file names that are not among ``kinds`` (those seen)."""
        return sorted(self.routes.keys() - set(kinds))

    def holds_any(self, kinds: Iterable[str]) -> bool:
        """Whether any of ``kinds`` has an objective to hold."""
        return any(self.of(kind) is not None for kind in kinds)

    def breaches(self, outcome: Outcome) -> list[str]:
        """The routes whose p99 is over their objective."""
        return [
            kind
            for kind, result in sorted(outcome.kinds.items())
            if (limit := self.of(kind)) is not None and result.p99_ms > limit
        ]


@dataclass(frozen=True)
class Setting:
    """A spill rule's knobs."""

    share: float
    busy_above: float | None
    for_s: float | None


def setting_of(rule: Rule) -> Setting:
    load = rule.match.load
    share = rule.spill.share if rule.spill is not None else 0.0
    return Setting(share, load.busy_above if load else None, load.for_s if load else None)


def with_setting(policy: Policy, name: str, setting: Setting, spill_to: Backend) -> Policy:
    """The policy with one rule's knobs set (a share of 0 drops its spill)."""
    rules = []
    for rule in policy.rules:
        if rule.name == name:
            spill = Spill(share=setting.share, to=spill_to) if setting.share else None
            match = rule.match
            if match.load is not None and setting.busy_above is not None:
                load = match.load.model_copy(
                    update={"busy_above": setting.busy_above, "for_s": setting.for_s}
                )
                match = match.model_copy(update={"load": load})
            rule = rule.model_copy(update={"spill": spill, "match": match})
        rules.append(rule)
    return policy.model_copy(update={"rules": rules})


def changes(recorded: Policy, proposed: Policy) -> list[str]:
    """Each knob that differs, as ``rule: field old -> new``."""
    lines = []
    for before, after in zip(recorded.rules, proposed.rules, strict=True):
        old, new = setting_of(before), setting_of(after)
        for label, a, b in (
            ("spill.share", old.share, new.share),
            ("match.load.busy_above", old.busy_above, new.busy_above),
            ("match.load.for_s", old.for_s, new.for_s),
        ):
            if a != b:
                lines.append(f"{before.name}: {label} {_show(a)} -> {_show(b)}")
    return lines


def _show(value: float | None) -> str:
    if value is None:
        return "none"
    return "0 (no spill)" if value == 0 else f"{value:g}"


@dataclass(frozen=True)
class Tried:
    """A candidate and its replay."""

    policy: Policy
    outcome: Outcome
    breaches: tuple[str, ...]
    changed: int
    moved: float


@dataclass(frozen=True)
class Proposal:
    """The recorded policy's replay, the best candidate, and how many were tried."""

    recorded: Tried
    best: Tried | None
    tried: int

    @property
    def changes(self) -> list[str]:
        return changes(self.recorded.policy, self.best.policy) if self.best else []


def _rank(tried: Tried) -> tuple[float, int, float]:
    return (round(tried.outcome.cost_usd, 12), tried.changed, tried.moved)


def propose(policy: Policy, replay: Callable[[Policy], Outcome], slo: Slo) -> Proposal:
    """Search the knobs of every spill rule for the cheapest policy within the SLOs."""
    seen: dict[str, Tried] = {}

    def attempt(candidate: Policy) -> Tried:
        key = candidate.model_dump_json()
        if key not in seen:
            outcome = replay(candidate)
            moved = sum(
                abs((setting_of(a).busy_above or 0) - (setting_of(b).busy_above or 0))
                for a, b in zip(policy.rules, candidate.rules, strict=True)
            )
            seen[key] = Tried(
                candidate,
                outcome,
                tuple(slo.breaches(outcome)),
                len(changes(policy, candidate)),
                moved,
            )
        return seen[key]

    recorded = attempt(policy)
    best = recorded if not recorded.breaches else None

    def keep(tried: Tried) -> None:
        nonlocal best
        if not tried.breaches and (best is None or _rank(tried) < _rank(best)):
            best = tried

    for rule in [r for r in policy.rules if r.spill is not None]:
        spill_to = rule.spill.to if rule.spill else "cpu"
        current = setting_of(rule)
        base = best.policy if best else policy

        def trial(share: float, busy: float | None, hold: float | None) -> None:
            if 0 <= share <= 1 and (busy is None or 0 <= busy < 1):
                setting = Setting(round(share, 2), None if busy is None else round(busy, 2), hold)
                keep(attempt(with_setting(base, rule.name, setting, spill_to)))  # noqa: B023

        busies = [None] if current.busy_above is None else sorted({*THRESHOLDS, current.busy_above})
        for busy in busies:
            for share in sorted({*SHARES, current.share}):
                trial(share, busy, current.for_s)
        if best is None:
            continue
        found = setting_of(next(r for r in best.policy.rules if r.name == rule.name))
        steps = (-STEP, 0.0, STEP)
        for d_share in steps:
            for d_busy in steps if found.busy_above is not None else (0.0,):
                busy = None if found.busy_above is None else found.busy_above + d_busy
                trial(found.share + d_share, busy, current.for_s)
        found = setting_of(next(r for r in best.policy.rules if r.name == rule.name))
        if found.for_s is not None:
            for hold in sorted({*HOLDS, found.for_s}):
                trial(found.share, found.busy_above, hold)
    return Proposal(recorded, best, len(seen))


def finite(value: float) -> str:
    return "–" if math.isinf(value) else f"{value:,.1f}"
