"""The recorded traffic, as the tuner replays it: who sent what, and when.

The router's metric lines say when a request came, for which model, which rule fired and
which backend answered, at what latency and cost; they do not carry the request's own
facts (mode, priority, tenant, sizes). The tuner gets those back from the recorded policy
itself, as **kinds** of request:

* An *archetype* is a set of facts built from the policy's conditions (the defaults; for
  every rule, facts that meet its conditions; for every range, a value just outside). Two
  archetypes the policy cannot tell apart (every rule's conditions, time windows and load
  aside, hold for both or for neither) are one. An archetype's **kind** is named after the
  first rule whose conditions, time windows and load aside, it meets: the rule that would
  decide it if every time window and load condition held.
* A request whose rule fired is one of the archetypes that rule could have decided: those
  meeting the rule's conditions and failing every earlier rule's, unless that earlier rule
  has a time window or a load condition, which may not have held. An earlier rule that
  fired in the same time bin shows that its window and load held then, which rules its
  archetypes out.
* Where several archetypes remain, the bin's requests are shared among them in the
  proportions seen where only one remained.

The replay is exact for what a metric line carries (time, model) and for every rule
whose conditions the recorded decisions pin down; the proportions stand in for the rest.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from spillway.policy.accounting import route_events
from spillway.policy.decision import mismatch
from spillway.policy.facts import MODES, RequestFacts
from spillway.policy.rules import Match, Policy, Range, Rule, globs_hold

CONTEXT = frozenset({"time_window", "load"})


@dataclass(frozen=True)
class Recorded:
    """One request of the recorded trace."""

    at: float
    rule: str
    backend: str
    model: str | None
    latency_ms: float
    cost_usd: float
    status_error: bool


def read_trace(paths: Iterable[Path]) -> list[Recorded]:
    """Every request in the router's metric logs, oldest first."""
    requests = []
    for path in paths:
        with path.open(encoding="utf-8") as handle:
            for event in route_events(handle):
                model = None if event.model in ("-", "") else event.model
                latency = event.latencies_ms[0] if event.latencies_ms else 0.0
                for _ in range(max(event.requests, 1)):
                    requests.append(
                        Recorded(
                            event.at,
                            event.rule,
                            event.backend,
                            model,
                            latency,
                            event.cost_usd / max(event.requests, 1),
                            event.errors > 0,
                        )
                    )
    requests.sort(key=lambda r: r.at)
    return requests


class _NoLoad:
    """Static conditions never ask about load."""

    def sustained_above(self, backend: str, threshold: float, for_s: float) -> bool:
        return False


def static_part(rule: Rule) -> Rule:
    """The rule without its time window and load condition."""
    return rule.model_copy(update={"match": rule.match.model_copy(update=dict.fromkeys(CONTEXT))})


def has_context(rule: Rule) -> bool:
    """Whether the rule also depends on the time or the load."""
    return any(getattr(rule.match, name) is not None for name in CONTEXT)


def has_static(rule: Rule) -> bool:
    """Whether the rule has conditions besides a time window and load."""
    return not static_part(rule).match.empty()


_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


def meets_static(policy: Policy, rule: Rule, facts: RequestFacts) -> bool:
    """Whether ``facts`` meet ``rule``'s conditions, time window and load aside."""
    return mismatch(policy, static_part(rule), facts, _EPOCH, _NoLoad()) is None


# --- archetypes ----------------------------------------------------------------------


def _inside(bounds: Range) -> float | None:
    """An integer-friendly value within ``bounds``."""
    for value in (bounds.ge, _plus(bounds.gt), bounds.le, _minus(bounds.lt)):
        if value is not None and bounds.holds(value):
            return value
    return None


def _outside(bounds: Range) -> list[float]:
    """Values just past each bound."""
    values = [_minus(bounds.ge), bounds.gt, _plus(bounds.le), bounds.lt]
    return [v for v in values if v is not None and v >= 1 and not bounds.holds(v)]


def _plus(value: float | None) -> float | None:
    return None if value is None else math.floor(value) + 1


def _minus(value: float | None) -> float | None:
    return None if value is None else math.ceil(value) - 1


_RANGES = ("priority", "latency_budget_ms", "payload_bytes", "input_elements", "input_tokens")


def _with(facts: RequestFacts, name: str, value: float) -> RequestFacts:
    """``facts`` with one ranged fact set (a whole number, but for the latency budget)."""
    if name == "latency_budget_ms":
        return replace(facts, latency_budget_ms=value)
    if name == "priority":
        return replace(facts, priority=int(value))
    if name == "payload_bytes":
        return replace(facts, payload_bytes=int(value))
    if name == "input_elements":
        return replace(facts, input_elements=int(value))
    return replace(facts, input_tokens=int(value))


def _meeting(policy: Policy, match: Match, base: RequestFacts) -> RequestFacts | None:
    """``base`` changed to meet every static condition of ``match`` (``None``: cannot)."""
    facts = base
    if match.mode is not None:
        facts = replace(facts, mode=match.mode[0])
    for name in _RANGES:
        bounds = getattr(match, name)
        if bounds is not None:
            value = _inside(bounds)
            if value is None:
                return None
            facts = _with(facts, name, value)
    found, tenant = _tenant_for(policy, match)
    return replace(facts, tenant=tenant) if found else None


def _tenant_for(policy: Policy, match: Match) -> tuple[bool, str | None]:
    """A tenant meeting the tenant conditions (``None``: no tenant, the default tier);
    ``(False, None)`` when the policy names no tenant that does."""
    candidates: list[str | None] = [None, *policy.tenants]
    candidates += [p.replace("*", "x").replace("?", "x") for p in match.tenant or []]
    for tenant in candidates:
        if globs_hold(match.tenant_tier, policy.tier_of(tenant)) and globs_hold(
            match.tenant, tenant
        ):
            return True, tenant
    return False, None


def archetypes(policy: Policy, model: str | None) -> list[RequestFacts]:
    """Distinct kinds of request the policy can tell apart, for one model."""
    path = f"/v2/models/{model}/infer" if model else "/v2"
    base = RequestFacts(method="POST", path=path, operation="infer", model=model)
    found: list[RequestFacts] = [base]
    for rule in policy.rules:
        met = _meeting(policy, rule.match, base)
        if met is not None:
            found.append(met)
        for name in _RANGES:
            bounds = getattr(rule.match, name)
            for value in _outside(bounds) if bounds is not None else []:
                found.append(_with(base, name, value))
        for mode in MODES:
            if rule.match.mode is not None and mode not in rule.match.mode:
                found.append(replace(base, mode=mode))
    distinct: dict[tuple[bool, ...], RequestFacts] = {}
    for facts in found:
        signature = tuple(meets_static(policy, r, facts) for r in policy.rules)
        distinct.setdefault(signature, facts)
    return list(distinct.values())


def kind_of(policy: Policy, facts: RequestFacts) -> str:
    """The first rule whose conditions (time window and load aside) ``facts`` meet."""
    return next(r.name for r in policy.rules if meets_static(policy, r, facts))


# --- requests to kinds ---------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """Requests of one kind and model that arrived in one time bin."""

    start: float
    kind: str
    facts: RequestFacts
    count: int


def _could_fire(policy: Policy, rule_index: int, facts: RequestFacts, fired: set[str]) -> bool:
    """Whether the recorded policy could have decided ``facts`` with rule ``rule_index``
    in a bin where the rules ``fired`` fired (their windows and load held)."""
    rule = policy.rules[rule_index]
    if not meets_static(policy, rule, facts):
        return False
    for earlier in policy.rules[:rule_index]:
        if meets_static(policy, earlier, facts) and (
            not has_context(earlier) or earlier.name in fired
        ):
            return False
    return True


def group_requests(policy: Policy, trace: list[Recorded], bin_s: float) -> list[Group]:
    """The trace as groups of kinds per time bin, shared as the module docstring says."""
    index = {rule.name: i for i, rule in enumerate(policy.rules)}
    bins: dict[float, list[Recorded]] = defaultdict(list)
    for request in trace:
        if request.rule in index:
            bins[math.floor(request.at / bin_s) * bin_s].append(request)
    kinds_of: dict[str | None, list[RequestFacts]] = {}
    pending: list[tuple[float, list[RequestFacts], int]] = []
    priors: Counter[tuple[str | None, tuple[object, ...]]] = Counter()
    for start in sorted(bins):
        fired = {r.rule for r in bins[start]}
        counts = Counter((r.rule, r.model) for r in bins[start])
        for (rule, model), count in counts.items():
            if model not in kinds_of:
                kinds_of[model] = archetypes(policy, model)
            options = [f for f in kinds_of[model] if _could_fire(policy, index[rule], f, fired)]
            if not options:  # the policy changed during the trace: take the rule at its word
                options = [
                    f for f in kinds_of[model] if meets_static(policy, policy.rules[index[rule]], f)
                ]
            pending.append((start, options or kinds_of[model][:1], count))
            if len(options) == 1:
                priors[(model, _key(options[0]))] += count
    return list(_share(policy, pending, priors))


def _key(facts: RequestFacts) -> tuple[object, ...]:
    return (facts.mode, facts.priority, facts.tenant, facts.latency_budget_ms, facts.payload_bytes)


def _share(
    policy: Policy,
    pending: list[tuple[float, list[RequestFacts], int]],
    priors: Counter[tuple[str | None, tuple[object, ...]]],
) -> Iterator[Group]:
    """Split each bin's ambiguous requests by the unambiguous proportions (largest
    remainder, so counts stay whole and add up)."""
    for start, options, count in pending:
        weights = [priors[(f.model, _key(f))] for f in options]
        if not any(weights):
            weights = [1] * len(options)
        total = sum(weights)
        exact = [count * w / total for w in weights]
        shares = [math.floor(x) for x in exact]
        order = sorted(range(len(options)), key=lambda i: exact[i] - shares[i], reverse=True)
        for i in order[: count - sum(shares)]:
            shares[i] += 1
        for facts, share in zip(options, shares, strict=True):
            if share:
                yield Group(start, kind_of(policy, facts), facts, share)
