"""The router's core, free of any transport: decide, walk the chain, account.

For one request: read its facts, let the policy pick a chain of backends, and try them in
order within the request's deadline. A backend is skipped while its circuit is open. An
attempt that finds a backend unreachable, overloaded (429), unavailable (502/503), late
(504) or silent moves on to the next backend; anything else the backend says (a result,
or a 4xx caused by the request) is the answer. Only connect errors are retried, once, on
the same backend, within the retry budget. An attempt with backends after it leaves
``fallback_reserve`` of the remaining time to them; its timeout travels down as the
Open Inference Protocol ``timeout`` parameter, so a backend drops work nobody waits for.

What counts against a backend's circuit: no connection, no answer in time, a broken
connection, a 5xx other than 504. A 429 or a 504 says "busy", not "broken": it moves the
request on without a verdict, and a 429 counts as a fully busy load reading.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from functions.router.backends import (
    Backend,
    BackendError,
    BackendRequest,
    BackendResponse,
    CannotServe,
    ConnectFailed,
)
from functions.router.breaker import CircuitBreaker, RetryBudget
from functions.router.decide import Decision, SpillState, decide
from functions.router.facts import RequestFacts
from functions.router.load import LoadTracker, parse_load_headers
from functions.router.policy import Policy
from spillway.errors import DeadlineExceededError, SpillwayError, UnavailableError

log = logging.getLogger("spillway.router")

FAILOVER_STATUS = {429: "overloaded", 502: "bad_gateway", 503: "unavailable", 504: "deadline"}
_MIN_ATTEMPT_S = 0.005
# The backend is told 90% of the attempt's time so that its own 504 arrives before ours.
BACKEND_TIMEOUT_SHARE = 0.9


@dataclass(frozen=True)
class RouterConfig:
    """The router's tuning (from ``RouterSettings``)."""

    default_deadline_s: float = 5.0
    deadline_margin_s: float = 0.15
    fallback_reserve: float = 0.3
    breaker_failures: int = 5
    breaker_reset_s: float = 5.0
    breaker_max_reset_s: float = 120.0
    retry_budget: float = 0.1
    load_halflife_s: float = 10.0
    load_stale_s: float = 30.0


@dataclass
class Attempt:
    """One try on one backend: how it ended, and what it billed."""

    backend: str
    outcome: str
    billed_s: float = 0.0
    served: bool = False


@dataclass
class Outcome:
    """The walk down a chain: the answer (if any backend gave one) and every attempt."""

    decision: Decision
    response: BackendResponse | None = None
    backend: str | None = None
    attempts: list[Attempt] = field(default_factory=list)
    error: SpillwayError | None = None

    @property
    def fallback(self) -> str | None:
        """``<first backend>:<why it did not serve>`` when another backend served."""
        if self.backend is None or self.backend == self.decision.chain[0]:
            return None
        first = next((a for a in self.attempts if a.backend == self.decision.chain[0]), None)
        return f"{self.decision.chain[0]}:{first.outcome if first else 'not_configured'}"


RequestBuilder = Callable[[str, float], BackendRequest]


class Router:
    """Policy decisions, fallback chains, circuit breakers and live load."""

    def __init__(
        self,
        backends: Mapping[str, Backend],
        config: RouterConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        spills: SpillState,
    ) -> None:
        self.backends = dict(backends)
        self.config = config
        self.clock = clock
        self.spills = spills
        self.breakers = {
            name: CircuitBreaker(
                name,
                failures=config.breaker_failures,
                reset_s=config.breaker_reset_s,
                max_reset_s=config.breaker_max_reset_s,
                clock=clock,
            )
            for name in ("gpu", "cpu", "batch")
        }
        self.load = LoadTracker(config.load_halflife_s, config.load_stale_s, clock)
        self.budget = RetryBudget(config.retry_budget)

    def deadline(
        self, started: float, budget_ms: float | None, remaining_ms: float | None
    ) -> float:
        """The request's deadline: its latency budget (else the default), capped by what
        is left of the Lambda invocation minus the margin."""
        limit_s = budget_ms / 1000 if budget_ms is not None else self.config.default_deadline_s
        if remaining_ms is not None:
            limit_s = min(limit_s, remaining_ms / 1000 - self.config.deadline_margin_s)
        return started + max(limit_s, 0.0)

    def decide(self, policy: Policy, facts: RequestFacts, now: datetime) -> Decision:
        """The policy's decision for these facts, with live load and spill state."""
        return decide(policy, facts, now, self.load, self.spills)

    def walk(self, decision: Decision, build: RequestBuilder, deadline: float) -> Outcome:
        """Try the chain's backends in order until one answers for good."""
        self.budget.deposit()
        outcome = Outcome(decision)
        chain = [name for name in decision.chain if name in self.backends]
        last_failover: tuple[str, BackendResponse] | None = None
        for index, name in enumerate(chain):
            if not self.breakers[name].allow():
                outcome.attempts.append(Attempt(name, "circuit_open"))
                continue
            remaining = deadline - self.clock()
            if remaining < _MIN_ATTEMPT_S:
                self.breakers[name].neutral()
                outcome.attempts.append(Attempt(name, "deadline"))
                break
            later = any(self.breakers[n].state != "open" for n in chain[index + 1 :])
            timeout = remaining * (1 - self.config.fallback_reserve) if later else remaining
            try:
                attempt, response = self._attempt(name, build, timeout, deadline)
            except SpillwayError as exc:  # e.g. batch mode without a jobs API
                outcome.attempts.append(Attempt(name, exc.code))
                outcome.error = exc
                continue
            outcome.attempts.append(attempt)
            if response is not None and attempt.served:
                outcome.response, outcome.backend = response, name
                return outcome
            if response is not None:
                last_failover = (name, response)
        return self._unserved(outcome, last_failover)

    def _attempt(
        self, name: str, build: RequestBuilder, timeout: float, deadline: float
    ) -> tuple[Attempt, BackendResponse | None]:
        backend, breaker = self.backends[name], self.breakers[name]
        started = self.clock()
        while True:
            try:
                response = backend.send(build(name, timeout), timeout)
            except CannotServe:
                breaker.neutral()
                return Attempt(name, "cannot_serve"), None
            except ConnectFailed:
                breaker.failure()
                left = deadline - self.clock()
                if left >= _MIN_ATTEMPT_S and breaker.allow():
                    if self.budget.try_spend():
                        timeout = min(timeout, left)
                        continue
                    breaker.neutral()
                return Attempt(name, "connect_error", self.clock() - started), None
            except BackendError as exc:
                breaker.failure()
                return Attempt(name, exc.kind, self.clock() - started), None
            except SpillwayError:
                breaker.neutral()
                raise
            return self._judge(name, response), response

    def _judge(self, name: str, response: BackendResponse) -> Attempt:
        breaker = self.breakers[name]
        reading = parse_load_headers(response.headers)
        if reading is not None:
            self.load.observe(name, *reading)
        status = response.status
        billed = response.billed_s if response.billed_s is not None else response.elapsed_s
        if status == 429:
            self.load.observe(name, 1.0)
            breaker.neutral()
        elif status == 504:
            # The backend answered in time that the deadline had passed in its queue: it is
            # busy, not broken (a backend that does not answer at all times out instead).
            breaker.neutral()
        elif status >= 500:
            breaker.failure()
        else:
            breaker.success()
        if status in FAILOVER_STATUS:
            return Attempt(name, FAILOVER_STATUS[status], billed)
        return Attempt(name, f"status_{status}", billed, served=True)

    def _unserved(
        self, outcome: Outcome, last_failover: tuple[str, BackendResponse] | None
    ) -> Outcome:
        if last_failover is not None:
            outcome.backend, outcome.response = last_failover
            outcome.error = None
            return outcome
        if outcome.error is not None:
            return outcome
        kinds = ", ".join(f"{a.backend}: {a.outcome}" for a in outcome.attempts) or "none"
        if any(a.outcome in ("timeout", "deadline") for a in outcome.attempts):
            outcome.error = DeadlineExceededError(
                f"the deadline passed before a backend answered ({kinds})"
            )
        else:
            waits = [
                self.breakers[a.backend].retry_after_s()
                for a in outcome.attempts
                if a.outcome == "circuit_open"
            ]
            outcome.error = UnavailableError(
                f"no backend could serve the request ({kinds})",
                retry_after_s=min(waits) if waits else None,
            )
        return outcome
