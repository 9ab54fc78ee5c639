"""One routing step, request in and reply out: decide, walk the fallback chain, account.

``Router.route`` reads the request (``facts``), lets the policy pick a chain of backends
(``decide``) and tries them in order within the request's deadline (its own latency
budget, else its model's, else the router's default: ``deadlines``). A backend is skipped
while its circuit is open. An attempt that finds a backend unreachable, overloaded (429),
unavailable (502/503), late (504), failing by its own account (a 5xx it marks
``x-spillway-fault: server``: a failed run) or silent moves on to the next backend;
anything else the backend says (a result, or a 4xx caused by the request) is the answer.
Only connect errors are retried, once, on the same backend, within the retry budget. An
attempt with backends after it leaves ``fallback_reserve`` of the remaining time to them;
its timeout travels down as the Open Inference Protocol ``timeout`` parameter, so a
backend drops work nobody waits for.

Which version of a model a request is sent to is one stage, ``versions``
(``spillway.canary.stage``): ``pick`` gives the request its arm before anything else
happens to it, in every mode (an async request is queued, and a batch-mode one
submitted, with the version chosen there, never left to a worker's default); the walk
passes over the backends the arm ``skips`` and takes an answer the arm calls
``unserved`` (a 404 ``model_not_found`` for a version the router chose) for no answer,
moving on to the next backend with the same version (``x-spillway-fallback`` then names
``<backend>:version_not_served``); when no backend served it the arm may hand the walk
another arm (``walk_again``: the stable version) for a second walk; and the arm
``settle``s the answer. A router without canaries has the stand-in stage, whose arms send
every request as it came. A client sees a 404 only for a version it asked for.

What counts against a backend's circuit: no connection, no answer in time, a broken
connection, a 502, a 503 the backend marks as its own fault (``x-spillway-fault:
server``), and another marked 5xx (a failed run) once another backend served the same
request; when none did, the request is what the failures had in common, and they are
neutral. An unmarked 5xx is neutral: it may have been caused by the request. A 429
or a 504 says "busy", not "broken": it moves the request on without a verdict, and a
429 counts as a fully busy load reading. A 4xx is the request's own fault and the
backend's good answer.

Every reply says what happened: ``x-spillway-rule`` (the rule that fired),
``x-spillway-backend`` (who answered), ``x-spillway-cost-usd`` (the estimate),
``x-spillway-fallback`` (``<first backend>:<why>`` when another one served) and
``x-spillway-spilled`` (when the rule's spill share moved it); one EMF line and one log
line record it. A request too malformed to route raises its ``SpillwayError`` before any
of that, for the transport to answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime

from spillway import tracing
from spillway.canary.stage import NO_CANARY, VERSION_NOT_SERVED, Arm, VersionStage
from spillway.policy.accounting import EmfSink, Pricing, RouteRecord, event_metric
from spillway.policy.backend import (
    Backend,
    BackendError,
    BackendResponse,
    CannotServe,
    ConnectFailed,
)
from spillway.policy.decision import (
    Decision,
    SpillState,
    decide,
    with_allowed_priority,
    without_batch,
)
from spillway.policy.facts import Call, Request, read_request
from spillway.policy.health import CircuitBreaker, LoadTracker, RetryBudget, parse_load_headers
from spillway.policy.rules import Policy
from spillway.policy.store import PolicyStore
from spillway.protocol.errors import ModeUnavailableError, SpillwayError, UnavailableError
from spillway.protocol.replies import FAULT_HEADER, Reply, error_reply
from spillway.protocol.wire import Target
from spillway.router.async_mode import AsyncFront
from spillway.router.deadlines import Deadline, ModelBudgets, deadline_for, decided_on
from spillway.router.outbound import backend_request, readiness_probe
from spillway.router.outcome import (
    Attempt,
    Outcome,
    Seen,
    describe,
    reply_of,
    status_of,
    why_not,
)
from spillway.router.routed import Routed, Watcher
from spillway.router.settings import RouterSettings

log = logging.getLogger("spillway.router")

FAILOVER_STATUS = {429: "overloaded", 502: "bad_gateway", 503: "unavailable", 504: "deadline"}
SERVER_FAULT = "server_fault"
"""A 5xx the backend marks as its own (a failed run): the walk moves on, and it counts
against the backend only when another backend served the same request."""
_MIN_ATTEMPT_S = 0.005


class Router:
    """Policy decisions, fallback chains, circuit breakers, live load and accounting.

    ``config`` is the deployment's ``RouterSettings`` as they are, read where they are
    used: a new knob is one field there, never a copy here."""

    def __init__(
        self,
        backends: Mapping[str, Backend],
        policies: PolicyStore,
        *,
        config: RouterSettings,
        pricing: Pricing,
        sink: EmfSink,
        spills: SpillState,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
        versions: VersionStage = NO_CANARY,
        async_front: AsyncFront | None = None,
        budgets: ModelBudgets | None = None,
        watch: Watcher | None = None,
    ) -> None:
        self.backends = dict(backends)
        self.watch = watch
        """Told of every request routed (data capture); ``None``: nobody watches."""
        self.budgets = budgets
        """The models' declared latency budgets (``None``: the default serves them all)."""
        self.async_front = async_front
        self.versions = versions
        self.policies = policies
        self.config = config
        self.pricing = pricing
        self.sink = sink
        self.spills = spills
        self.clock = clock
        self.wall = wall
        self.breakers = {
            name: CircuitBreaker(
                name,
                failures=config.breaker_failures,
                reset_s=config.breaker_reset_s,
                max_reset_s=config.breaker_max_reset_s,
                clock=clock,
                probe=readiness_probe(self.backends[name], config.breaker_probe_timeout_s)
                if name in self.backends
                else None,
                probe_interval_s=config.breaker_probe_interval_s,
            )
            for name in ("gpu", "cpu", "batch")
        }
        self.load = LoadTracker.configured(config, clock)
        self.budget = RetryBudget(config.retry_budget)

    def route(self, call: Call, target: Target, *, at_once: bool = False) -> Reply:
        """Decide, walk the chain within the deadline (through the version stage's arm),
        account, and answer. ``at_once``: a door that answers only with results (the
        OpenAI-compatible one) refuses the async and batch modes a caller asks for, and
        a rule routing to batch walks its chain without it, as a metadata request does.

        The request's trace is the client's ``traceparent`` (else one starts here): its
        ``spillway.route`` span holds ``spillway.decide`` and one ``spillway.attempt`` per
        backend tried. ``watch`` is told how it ended, refusals included."""
        started = self.clock()
        seen = Seen()
        with tracing.carry(call.headers), tracing.span("spillway.route", kind="server") as span:
            try:
                reply = self._route(call, target, at_once, started, seen)
            except SpillwayError as exc:
                span.fail(exc.code)
                self._watched(call, target, seen, error_reply(exc), started)
                raise
            describe(span, seen, reply)
            self._watched(call, target, seen, reply, started)
            return reply

    def _route(
        self, call: Call, target: Target, at_once: bool, started: float, seen: Seen
    ) -> Reply:
        policy, request = self._read(call, target)
        seen.request = request
        if at_once and request.facts.mode in ("async", "batch"):
            raise ModeUnavailableError(
                f"this endpoint answers at once: mode {request.facts.mode} is not offered here"
            )
        arm = self.versions.pick(request)
        seen.request = arm.request
        if request.facts.mode == "async":
            return self._queue(arm.request)
        deadline = self._deadline(started, request)
        facts = decided_on(request.facts, deadline)
        with tracing.span("spillway.decide") as span:
            decision = decide(policy, facts, self.wall(), self.load, self.spills)
            if at_once:
                decision = without_batch(policy, decision)
            if span is not tracing.NO_SPAN:
                span.set("spillway.rule", decision.rule)
                span.set("spillway.chain", list(decision.chain))
                span.set("spillway.spilled", decision.spilled)
        outcome, arm = self._walk(decision, arm, deadline)
        seen.request, seen.outcome = arm.request, outcome
        cost = self._account(outcome, arm.request, started)
        reply = reply_of(outcome, target, cost)
        return arm.settle(outcome.response, self.clock() - started, reply)

    def _watched(
        self, call: Call, target: Target, seen: Seen, reply: Reply, started: float
    ) -> None:
        """Tell ``watch`` how the request ended (never its error: capture must not fail
        a request)."""
        if self.watch is None:
            return
        request, outcome = seen.request, seen.outcome
        asked = request.target if request is not None else target
        try:
            self.watch(
                Routed(
                    call=call,
                    target=target,
                    tenant=request.facts.tenant if request is not None else call.trusted_tenant,
                    reply=reply,
                    backend=outcome.backend if outcome is not None else None,
                    version=asked.version,
                    latency_s=self.clock() - started,
                    trace_id=tracing.trace_id(),
                    request=request,
                )
            )
        except Exception:
            log.exception("the router's watcher failed")

    def _read(self, call: Call, target: Target) -> tuple[Policy, Request]:
        """The policy in force, and the request as it reads under it (with the priority
        its caller may use)."""
        request = read_request(call, target, trust_tenant_hints=self.config.trust_tenant_hints)
        policy = self.policies.policy
        facts = with_allowed_priority(policy, request.facts)
        if facts is not request.facts:
            request = replace(request, facts=facts)
        return policy, request

    def _queue(self, request: Request) -> Reply:
        """Async mode: the request queued, answered 202 at once."""
        if self.async_front is None:
            raise ModeUnavailableError(
                "async mode is not offered by this deployment (ASYNC_TABLE, "
                "ASYNC_QUEUE_URL and ASYNC_LOCATION are unset)"
            )
        reply = self.async_front.submit(request)
        self.sink.write(event_metric("AsyncAccepted"))
        return reply

    def ready(self) -> bool:
        """Whether some synchronous backend is configured and its circuit is not open."""
        return any(
            name in self.backends and self.breakers[name].state != "open" for name in ("gpu", "cpu")
        )

    def _deadline(self, started: float, request: Request) -> Deadline:
        """The request's deadline: its own latency budget, else its model's, else the
        default, capped by what is left of the Lambda invocation minus the margin."""
        return deadline_for(request, started, self.config, self.budgets)

    # --- the walk ----------------------------------------------------------------------

    def _walk(self, decision: Decision, arm: Arm, deadline: Deadline) -> tuple[Outcome, Arm]:
        """Walk the chain with the request's arm; when nothing served and the arm hands
        over another (the stable version for a chosen one no backend serves), walk it
        again with that one. The outcome lists the attempts of both walks."""
        outcome = self._chain(decision, arm, deadline)
        again = arm.walk_again(outcome.attempts)
        if again is None:
            return outcome, arm
        tried = outcome.attempts
        outcome = self._chain(decision, again, deadline)
        outcome.attempts[:0] = tried
        return outcome, again

    def _chain(self, decision: Decision, arm: Arm, deadline: Deadline) -> Outcome:
        """Try the chain's backends in order until one answers for good; a backend the
        arm ``skips`` is not sent the request, and one whose answer the arm calls
        ``unserved`` did not answer for good."""
        self.budget.deposit()
        at = deadline.at
        outcome = Outcome(decision)
        chain = [name for name in decision.chain if name in self.backends]
        last_failover: tuple[str, BackendResponse] | None = None
        for index, name in enumerate(chain):
            if arm.skips(name):
                outcome.attempts.append(Attempt(name, VERSION_NOT_SERVED))
                continue
            blocked = self._blocked(name, at)
            if blocked is not None:
                outcome.attempts.append(Attempt(name, blocked))
                if blocked == "deadline":
                    break
                continue
            remaining = at - self.clock()
            later = any(self.breakers[n].state != "open" for n in chain[index + 1 :])
            timeout = remaining * (1 - self.config.fallback_reserve) if later else remaining
            with self._attempt_span(name, timeout, outcome) as span:
                try:
                    attempt, response = self._attempt(name, arm.request, timeout, at)
                except SpillwayError as exc:  # e.g. batch mode without a jobs API
                    outcome.attempts.append(Attempt(name, exc.code))
                    outcome.error = exc
                    span.fail(exc.code)
                    continue
                if response is not None and arm.unserved(name, response):
                    # The backend does not serve the version the router chose: not an
                    # answer for the client, who asked for no version (the next backend,
                    # or the stable version, serves it).
                    attempt = replace(attempt, outcome=VERSION_NOT_SERVED, served=False)
                span.set("spillway.outcome", attempt.outcome)
                if not attempt.served:
                    span.fail(attempt.outcome)
            outcome.attempts.append(attempt)
            if response is not None and attempt.served:
                outcome.response, outcome.backend = response, name
                self._settle_faults(outcome, served=True)
                return outcome
            if response is not None:
                last_failover = (name, response)
        self._settle_faults(outcome, served=False)
        return self._unserved(outcome, last_failover, deadline)

    def _attempt_span(self, name: str, timeout: float, outcome: Outcome) -> tracing.Span_:
        """The ``spillway.attempt`` span of a try on ``name`` (its attributes read only
        when the request is recorded)."""
        if not tracing.recording():
            return tracing.NO_SPAN
        attributes = {
            "spillway.backend": name,
            "spillway.breaker": self.breakers[name].state,
            "spillway.timeout_ms": round(timeout * 1000, 1),
            "spillway.fallback_from": why_not(outcome) if outcome.attempts else None,
        }
        return tracing.span("spillway.attempt", kind="client", attributes=attributes)

    def _blocked(self, name: str, deadline: float) -> str | None:
        """The one rule for whether another attempt may go to ``name`` now, the chain's
        next backend or a retry alike: ``None`` when it may, else why not (``circuit_open``,
        or ``deadline``: too little time is left). A pass the circuit gave without the time
        to use it is handed back (a neutral outcome)."""
        breaker = self.breakers[name]
        if not breaker.allow():
            return "circuit_open"
        if deadline - self.clock() < _MIN_ATTEMPT_S:
            breaker.neutral()
            return "deadline"
        return None

    def _attempt(
        self, name: str, request: Request, timeout: float, deadline: float
    ) -> tuple[Attempt, BackendResponse | None]:
        backend, breaker = self.backends[name], self.breakers[name]
        started = self.clock()
        while True:
            try:
                response = backend.send(backend_request(request, name, timeout), timeout)
            except CannotServe:
                breaker.neutral()
                return Attempt(name, "cannot_serve"), None
            except ConnectFailed:
                breaker.failure(refused=True)
                if self._blocked(name, deadline) is None:
                    if self.budget.try_spend():
                        timeout = min(timeout, deadline - self.clock())
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
        marked = response.headers.get(FAULT_HEADER) == "server"
        if status == 429:
            self.load.observe(name, 1.0)
            breaker.neutral()
        elif status == 504:
            # The backend answered in time that the deadline had passed in its queue: it is
            # busy, not broken (a backend that does not answer at all times out instead).
            breaker.neutral()
        elif status >= 500 and marked and status not in FAILOVER_STATUS:
            # A run that failed: the backend's fault, or its request's (a row that fails
            # any batch it is in). The walk gives the verdict (``_settle_faults``).
            return Attempt(name, SERVER_FAULT, billed)
        elif status >= 500 and (marked or status == 502):
            # Only a failure the backend calls its own (or a gateway that could not reach it)
            # counts: an unmarked 5xx may have been caused by the request.
            breaker.failure()
        elif status >= 500:
            breaker.neutral()
        else:
            breaker.success()
        if status in FAILOVER_STATUS:
            return Attempt(name, FAILOVER_STATUS[status], billed)
        return Attempt(name, f"status_{status}", billed, served=True)

    def _settle_faults(self, outcome: Outcome, served: bool) -> None:
        """The verdict on the walk's failed runs (``SERVER_FAULT``): a failure of each
        backend that had one when another backend served the same request; neutral when
        none did, as the request is then what they had in common (a poisoned input must
        not open every circuit)."""
        for attempt in outcome.attempts:
            if attempt.outcome == SERVER_FAULT:
                breaker = self.breakers[attempt.backend]
                if served:
                    breaker.failure()
                else:
                    breaker.neutral()

    def _unserved(
        self,
        outcome: Outcome,
        last_failover: tuple[str, BackendResponse] | None,
        deadline: Deadline,
    ) -> Outcome:
        if last_failover is not None:
            outcome.backend, outcome.response = last_failover
            outcome.error = None
            return outcome
        if outcome.error is not None:
            return outcome
        kinds = ", ".join(f"{a.backend}: {a.outcome}" for a in outcome.attempts) or "none"
        if any(a.outcome in ("timeout", "deadline") for a in outcome.attempts):
            outcome.error = deadline.passed(kinds)
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

    # --- accounting --------------------------------------------------------------------

    def _account(self, outcome: Outcome, request: Request, started: float) -> float:
        """The request's cost; one EMF line and one log line say what happened."""
        decision = outcome.decision
        elapsed = self.clock() - started
        cost = self.pricing.router.cost(elapsed) + sum(
            self.pricing.attempt(
                a.backend, rows=request.facts.rows, billed_s=a.billed_s, served=a.served
            )
            for a in outcome.attempts
        )
        status = status_of(outcome)
        record = RouteRecord(
            rule=decision.rule,
            backend=outcome.backend or "none",
            # A metric dimension only for models a backend knows: a client inventing names
            # must not create a CloudWatch metric per name.
            model=request.target.model if outcome.response is not None and status != 404 else None,
            status=status,
            latency_ms=elapsed * 1000,
            cost_usd=cost,
            fallback=outcome.fallback is not None,
            spilled=decision.spilled,
            attempts=len(outcome.attempts),
        )
        self.sink.emit(record)
        log.info(
            "routed",
            extra={
                "rule": decision.rule,
                "chain": list(decision.chain),
                "attempts": [f"{a.backend}:{a.outcome}" for a in outcome.attempts],
                "status": status,
                "cost_usd": cost,
                "request_id": request.call.request_id,
            },
        )
        return cost
