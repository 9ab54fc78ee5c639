"""The replay: recorded traffic through a policy, with the router's own engine.

Time moves in bins of ``bin_s``. In each bin every group of requests is decided by
``spillway.policy.decision`` (the router's rule evaluation, spill draws from its
``SpillState``) against a ``LoadTracker`` (the router's moving average of the GPU's busy
fraction, built from the deployment's ``RouterSettings`` as the router builds it, on the
replay's clock). The GPU tier is ``gpu_tasks`` tasks; a request of a model takes
``1 / rows_per_s`` task-seconds (its measured peak); requests past a bin's capacity are
refused (429) and go down the rule's fallback chain, as the router sends them. At the end
of a bin the tier's busy fraction is what the router reads.

Latency, per request, is a log-normal fitted to a measured p50 and p99: the GPU task's
at the rate the tier ran at in that bin (interpolated between the measured loads), the
CPU function's warm figures, and a Batch job's start for batch. A route's p99 is the
99th percentile of the mixture of its requests' distributions. Cost is the router's own
accounting (``Pricing``: the router's share, the Lambda bill at the mean duration, the
GPU's or Batch's per-row share), so predicted and recorded cost per route compare.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from itertools import groupby

from spillway.policy.accounting import Pricing
from spillway.policy.decision import Decision, SpillState, decide
from spillway.policy.health import LoadTracker
from spillway.policy.rules import Policy, Rule
from spillway.router.settings import RouterSettings
from spillway_cli.plan.inputs import Measured
from spillway_cli.tune.trace import Group

Z99 = 2.3263478740408408  # the standard normal's 99th percentile
Component = tuple[float, float]
"""A log-normal latency: (mu, sigma) of ln(milliseconds); sigma 0 is a fixed latency."""
REFUSED: Component = (math.inf, 0.0)
Binned = list[tuple[float, list[Group]]]
"""The trace's groups per time bin."""


def lognormal(p50_ms: float, p99_ms: float) -> Component:
    """The log-normal with this median and 99th percentile (rounded, so that equal
    latencies share one mixture component)."""
    mu = math.log(max(p50_ms, 1e-3))
    sigma = max(0.0, math.log(max(p99_ms, p50_ms)) - mu) / Z99
    return round(mu, 4), round(sigma, 4)


def mean_ms(component: Component) -> float:
    mu, sigma = component
    return math.exp(mu + sigma * sigma / 2) if math.isfinite(mu) else 0.0


def quantile_ms(components: Counter[Component], q: float = 0.99) -> float:
    """The ``q`` quantile of a mixture of log-normals (weights: request counts)."""
    total = sum(components.values())
    if not total:
        return 0.0
    refused = components.get(REFUSED, 0)
    if refused / total > 1 - q:
        return math.inf
    parts = [(mu, s, n) for (mu, s), n in components.items() if math.isfinite(mu)]

    def cdf(log_x: float) -> float:
        below = 0.0
        for mu, sigma, n in parts:
            if sigma == 0:
                below += n if mu <= log_x else 0
            else:
                below += n * 0.5 * math.erfc(-(log_x - mu) / (sigma * math.sqrt(2)))
        return below / total

    low = min(mu - 6 * s for mu, s, _ in parts) - 1
    high = max(mu + 6 * s for mu, s, _ in parts) + 1
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < q else (low, middle)
    return math.exp(high)


@dataclass(frozen=True, eq=False)
class Backends:
    """What the replay knows of the backends: measured figures, prices and capacity."""

    measured: Measured
    pricing: Pricing
    gpu_tasks: int = 1
    batch_latency_ms: float = 300_000.0
    router: RouterSettings = field(default_factory=RouterSettings)
    """The deployment's router settings: the replay's load tracker is the router's."""

    @cache  # noqa: B019 - a few models; the instance lives as long as the search
    def gpu_rate(self, model: str | None) -> float:
        """Rows per second one task takes of ``model``."""
        return self.measured.model(model or "").dedicated.max_rows_per_s

    @cache  # noqa: B019
    def gpu_latency(self, model: str | None, busy: float) -> Component:
        """A task's latency for ``model`` while the tier is ``busy`` (0 to 1, rounded to
        a thousandth by the caller)."""
        curve = self.measured.model(model or "").dedicated
        rate = min(busy, 1.0) * curve.max_rows_per_s
        return lognormal(curve.latency_at(rate, "p50_ms"), curve.latency_at(rate))

    @cache  # noqa: B019
    def cpu_latency(self, model: str | None) -> Component:
        s = self.measured.model(model or "").serverless
        return lognormal(s.p50_ms, s.p99_ms)

    @cache  # noqa: B019
    def cost(self, backend: str, latency: Component) -> float:
        """The router's estimate for one request of one row (as ``x-spillway-cost-usd``)."""
        seconds = mean_ms(latency) / 1000
        return self.pricing.router.cost(seconds) + self.pricing.attempt(
            backend, rows=1, billed_s=seconds, served=True
        )


@dataclass
class KindOutcome:
    """One kind of request under one policy."""

    requests: int = 0
    cost_usd: float = 0.0
    latencies: Counter[Component] = field(default_factory=Counter)
    backends: Counter[str] = field(default_factory=Counter)

    @property
    def p99_ms(self) -> float:
        return quantile_ms(self.latencies)


Placement = tuple[str, str, str, Component]
"""(kind, rule, backend, latency) of requests placed alike."""


@dataclass
class Outcome:
    """A whole replay: per kind of request and per route (rule, backend)."""

    kinds: dict[str, KindOutcome] = field(default_factory=lambda: defaultdict(KindOutcome))
    routes: Counter[tuple[str, str]] = field(default_factory=Counter)
    route_cost: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    refused: int = 0

    @property
    def cost_usd(self) -> float:
        return sum(k.cost_usd for k in self.kinds.values())

    @classmethod
    def of(cls, placed: Counter[Placement], backends: Backends) -> Outcome:
        """Totals of every placement, each priced once."""
        outcome = cls()
        for (kind, rule, backend, latency), count in placed.items():
            usd = backends.cost(backend, latency) * count if backend != "none" else 0.0
            result = outcome.kinds[kind]
            result.requests += count
            result.cost_usd += usd
            result.latencies[latency] += count
            result.backends[backend] += count
            outcome.routes[(rule, backend)] += count
            outcome.route_cost[(rule, backend)] += usd
            outcome.refused += count if backend == "none" else 0
        return outcome


class _Asking:
    """The tracker as ``decide`` sees it, remembering what it was asked."""

    def __init__(self, tracker: LoadTracker) -> None:
        self.tracker = tracker
        self.asked: list[tuple[str, float, float, bool]] = []

    def sustained_above(self, backend: str, threshold: float, for_s: float) -> bool:
        answer = self.tracker.sustained_above(backend, threshold, for_s)
        self.asked.append((backend, threshold, for_s, answer))
        return answer


Placed = Callable[[float, Group, Rule, str, int, Component, float], None]
"""Told of every placement: bin start, group, rule, backend, count, latency, unit cost."""


@dataclass
class Replay:
    """One policy's replay of the grouped trace."""

    policy: Policy
    backends: Backends
    bin_s: float = 10.0
    seed: int = 7
    now: float = 0.0
    tally: Counter[Placement] = field(default_factory=Counter)
    placed: Placed | None = None

    def run(self, binned: Binned) -> Outcome:
        """Replay every bin, in time order."""
        self.tracker = LoadTracker.configured(self.backends.router, lambda: self.now)
        self.spills = SpillState(random.Random(self.seed))  # noqa: S311 - a replay, not a secret
        self.rules = {rule.name: rule for rule in self.policy.rules}
        self.chains = {
            rule.name: (
                self.policy.chain(rule, rule.route),
                self.policy.chain(rule, rule.spill.to) if rule.spill else (),
            )
            for rule in self.policy.rules
        }
        self._known: dict[tuple[int, int], tuple[list[tuple[str, float, float, bool]], str]] = {}
        # Time windows are whole minutes: a decision holds for its minute at most; without
        # windows, for as long as the load answers it depended on stay the same.
        self._minute = 60 if any(r.match.time_window for r in self.policy.rules) else 0
        for start, in_bin in binned:
            self.now = start
            self._bin(in_bin)
        return Outcome.of(self.tally, self.backends)

    def _decide(self, group: Group) -> tuple[Rule, int]:
        """The rule for the group, and how many of its requests spill. A decision is
        reused (within its minute when the policy has time windows) while the load answers
        it depended on are unchanged; otherwise the engine decides afresh."""
        key = (id(group.facts), int(self.now // self._minute) if self._minute else 0)
        known = self._known.get(key)
        tracker = self.tracker
        if known is not None and all(
            tracker.sustained_above(b, t, f) == answer for b, t, f, answer in known[0]
        ):
            rule, drawn, first = self.rules[known[1]], 0, False
        else:
            asking = _Asking(self.tracker)
            wall = datetime.fromtimestamp(self.now, UTC)
            decision: Decision = decide(self.policy, group.facts, wall, asking, self.spills)
            self._known[key] = (asking.asked, decision.rule)
            rule, drawn, first = self.rules[decision.rule], int(decision.spilled), True
        if rule.spill is None:
            return rule, 0
        rest = group.count - 1 if first else group.count
        drawn += sum(self.spills.draw(rule.name, rule.spill.share) for _ in range(rest))
        return rule, drawn

    def _bin(self, groups: list[Group]) -> None:
        capacity = self.bin_s * self.backends.gpu_tasks
        used = 0.0
        placed: list[tuple[Group, Rule, str, int]] = []
        for group in groups:
            rule, spilled = self._decide(group)
            routed, spilling = self.chains[rule.name]
            ways = [(routed, group.count - spilled)]
            if spilled:
                ways.append((spilling, spilled))
            for chain, count in ways:
                for backend, n in self._place(group, chain, count, capacity - used):
                    if backend == "gpu":
                        used += n / self.backends.gpu_rate(group.facts.model)
                    placed.append((group, rule, backend, n))
        busy = used / capacity
        for group, rule, backend, n in placed:
            latency = self._latency(backend, group.facts.model, round(busy, 3))
            self.tally[(group.kind, rule.name, backend, latency)] += n
            if self.placed is not None:
                usd = self.backends.cost(backend, latency) if backend != "none" else 0.0
                self.placed(self.now, group, rule, backend, n, latency, usd)
        if used:
            self.now += self.bin_s
            self.tracker.observe("gpu", min(busy, 1.0))

    def _place(
        self, group: Group, chain: tuple[str, ...], count: int, room_s: float
    ) -> Iterator[tuple[str, int]]:
        """Requests down the chain: the GPU takes what fits in its remaining time this bin,
        the next backend the rest (none left: refused)."""
        left = count
        for backend in chain:
            if not left:
                return
            if backend != "gpu":
                yield backend, left
                return
            fits = min(
                left, max(0, math.floor(room_s * self.backends.gpu_rate(group.facts.model) + 1e-9))
            )
            if fits:
                yield "gpu", fits
            left -= fits
        if left:
            yield "none", left

    def _latency(self, backend: str, model: str | None, busy: float) -> Component:
        if backend == "gpu":
            return self.backends.gpu_latency(model, busy)
        if backend == "cpu":
            return self.backends.cpu_latency(model)
        if backend == "batch":
            return (round(math.log(self.backends.batch_latency_ms), 4), 0.0)
        return REFUSED


def binned(groups: Iterable[Group], default_priority: int) -> Binned:
    """Groups per bin, in time order; within a bin by priority, as the GPU service
    dequeues them (1 first)."""
    return [
        (start, sorted(in_bin, key=lambda g: g.facts.priority or default_priority))
        for start, in_bin in groupby(groups, key=lambda g: g.start)
    ]


def replay(
    policy: Policy, bins: Binned, backends: Backends, bin_s: float, seed: int = 7
) -> Outcome:
    """The outcome of ``policy`` on the binned trace."""
    return Replay(policy, backends, bin_s, seed).run(bins)
