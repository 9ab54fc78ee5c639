"""Evaluating a policy for one request: which rule fires, the chain of backends, and why.

Spilling uses a dithered accumulator per rule: each matching request adds ``share`` to a
credit, spills with probability equal to the credit (so a credit of 1 always spills) and
pays 1 when it does. The spilled count therefore stays within two requests of
``share × matching requests`` over any run, while which request spills stays random
(seedable for tests) rather than every tenth.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Protocol

from spillway.policy.facts import RequestFacts
from spillway.policy.rules import Backend, Match, Policy, Range, Rule, globs_hold


class LoadView(Protocol):
    """Live load of the backends, as the policy's ``load`` condition needs it."""

    def sustained_above(self, backend: str, threshold: float, for_s: float) -> bool:
        """Whether the backend's busy fraction has stayed above ``threshold`` for ``for_s``."""
        ...


@dataclass(frozen=True)
class Decision:
    """The fired rule, the backends to try in order, and whether it spilled."""

    rule: str
    chain: tuple[Backend, ...]
    spilled: bool = False


@dataclass(frozen=True)
class RuleTrace:
    """One rule's verdict for ``explain``: matched, or the first condition that failed."""

    rule: str
    matched: bool
    reason: str


class SpillState:
    """The spill credit of each rule; reset when a new policy is installed."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._credit: dict[str, float] = {}
        self._lock = threading.Lock()

    def draw(self, rule: str, share: float) -> bool:
        """Whether this matching request spills."""
        with self._lock:
            credit = self._credit.get(rule, self._rng.random() * share) + share
            spill = self._rng.random() < credit
            self._credit[rule] = credit - 1.0 if spill else credit
            return spill

    def reset(self) -> None:
        """Forget the credits (a new policy's rules start fresh)."""
        with self._lock:
            self._credit.clear()


def mismatch(
    policy: Policy, rule: Rule, facts: RequestFacts, now: datetime, load: LoadView
) -> str | None:
    """``None`` when ``rule`` matches, else the first condition that does not hold."""
    return (
        _who_mismatch(policy, rule.match, facts)
        or _size_mismatch(rule.match, facts)
        or _context_mismatch(rule.match, now, load)
    )


def _who_mismatch(policy: Policy, match: Match, facts: RequestFacts) -> str | None:
    mode = facts.mode or policy.defaults.mode
    priority = facts.priority if facts.priority is not None else policy.defaults.priority
    tier = policy.tier_of(facts.tenant)
    if match.path is not None and not globs_hold(match.path, facts.path):
        return f"path {facts.path} is not one of {match.path}"
    if match.mode is not None and mode not in match.mode:
        return f"mode {mode} is not one of {match.mode}"
    if match.model is not None and not globs_hold(match.model, facts.model):
        return f"model {facts.model} is not one of {match.model}"
    if match.priority is not None and not match.priority.holds(priority):
        return f"priority {priority} is out of range"
    if match.tenant is not None and not globs_hold(match.tenant, facts.tenant):
        return f"tenant {facts.tenant} is not one of {match.tenant}"
    if match.tenant_tier is not None and not globs_hold(match.tenant_tier, tier):
        return f"tenant tier {tier} is not one of {match.tenant_tier}"
    return None


def _size_mismatch(match: Match, facts: RequestFacts) -> str | None:
    bounded: list[tuple[str, Range | None, float | None]] = [
        ("latency_budget_ms", match.latency_budget_ms, facts.latency_budget_ms),
        ("payload_bytes", match.payload_bytes, facts.payload_bytes),
        ("input_elements", match.input_elements, facts.input_elements),
        ("input_tokens", match.input_tokens, facts.input_tokens),
    ]
    for name, bounds, value in bounded:
        if bounds is not None and not bounds.holds(value):
            return f"{name} {value} is out of range"
    return None


def _context_mismatch(match: Match, now: datetime, load: LoadView) -> str | None:
    if match.time_window is not None and not match.time_window.holds(now):
        window = match.time_window
        return f"{now.isoformat()} is outside {window.start}-{window.end} {window.tz}"
    if match.load is not None and not load.sustained_above(
        match.load.backend, match.load.busy_above, match.load.for_s
    ):
        cond = match.load
        return f"{cond.backend} has not been above {cond.busy_above} busy for {cond.for_s} s"
    return None


def with_allowed_priority(policy: Policy, facts: RequestFacts) -> RequestFacts:
    """The facts with the priority the caller may use: its tenant's tier decides, not the
    request alone (``tier_priorities``)."""
    allowed = policy.allowed_priority(facts.tenant, facts.priority)
    return facts if allowed == facts.priority else replace(facts, priority=allowed)


def decide(
    policy: Policy, facts: RequestFacts, now: datetime, load: LoadView, spills: SpillState
) -> Decision:
    """The first matching rule's decision (the last rule always matches)."""
    for rule in policy.rules:
        if mismatch(policy, rule, facts, now, load) is None:
            return _act(policy, rule, facts, spills)
    raise AssertionError("a validated policy ends with a rule that matches everything")


def _act(policy: Policy, rule: Rule, facts: RequestFacts, spills: SpillState) -> Decision:
    spilled = rule.spill is not None and spills.draw(rule.name, rule.spill.share)
    primary = rule.spill.to if spilled and rule.spill is not None else rule.route
    decision = Decision(rule.name, policy.chain(rule, primary), spilled)
    return decision if facts.operation == "infer" else without_batch(policy, decision)


_GPU_RULE = Rule(name="gpu", route="gpu")


def without_batch(policy: Policy, decision: Decision) -> Decision:
    """``decision`` for a request that must be answered with a result, never a job id
    (metadata, readiness; a door that answers at once): its chain without ``batch``, or
    the policy's chain for the GPU service when nothing else is left."""
    chain = tuple(b for b in decision.chain if b != "batch")
    if chain == decision.chain:
        return decision
    return replace(decision, chain=chain or policy.chain(_GPU_RULE, "gpu"))


def explain(policy: Policy, facts: RequestFacts, now: datetime, load: LoadView) -> list[RuleTrace]:
    """Every rule up to the one that fires, each with its verdict."""
    traces: list[RuleTrace] = []
    for rule in policy.rules:
        reason = mismatch(policy, rule, facts, now, load)
        traces.append(RuleTrace(rule.name, reason is None, reason or "all conditions hold"))
        if reason is None:
            break
    return traces
