"""How a request's walk down a chain ended, and the reply and span that say so.

``Attempt`` is one try on one backend, ``Outcome`` the whole walk; ``reply_of`` turns an
outcome into the client's reply with the ``x-spillway-*`` headers that explain it, and
``describe`` writes the same facts onto the request's ``spillway.route`` span.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spillway import tracing
from spillway.policy.backend import BackendResponse
from spillway.policy.decision import Decision
from spillway.policy.facts import Request
from spillway.protocol.errors import SpillwayError, UnavailableError
from spillway.protocol.framing import JSON_CONTENT_TYPE
from spillway.protocol.replies import Reply, error_reply
from spillway.protocol.wire import Target
from spillway.router.backends import RESPONSE_HEADERS


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


@dataclass
class Seen:
    """How far a request got, for its span and its watcher."""

    request: Request | None = None
    outcome: Outcome | None = None


def why_not(outcome: Outcome) -> str:
    """``<backend>:<outcome>`` of the last attempt (what the next one falls back from)."""
    last = outcome.attempts[-1]
    return f"{last.backend}:{last.outcome}"


def describe(span: tracing.Span_, seen: Seen, reply: Reply) -> None:
    """The route span's attributes: what was asked, by whom, and what answered."""
    if span is tracing.NO_SPAN:
        return
    request, outcome = seen.request, seen.outcome
    span.set("http.response.status_code", reply.status)
    span.set("spillway.backend", reply.header("x-spillway-backend"))
    span.set("spillway.rule", reply.header("x-spillway-rule"))
    span.set("spillway.fallback", reply.header("x-spillway-fallback"))
    if request is not None:
        span.set("spillway.request_id", request.call.request_id)
        span.set("spillway.model", request.target.model)
        span.set("spillway.version", request.target.version)
        span.set("spillway.operation", request.target.operation)
        span.set("spillway.tenant", request.facts.tenant)
        span.set("spillway.mode", request.facts.mode)
    if outcome is not None:
        span.set("spillway.attempts", [f"{a.backend}:{a.outcome}" for a in outcome.attempts])
    if reply.status >= 500:
        span.fail(f"status {reply.status}")


def status_of(outcome: Outcome) -> int:
    if outcome.response is not None:
        return outcome.response.status
    return outcome.error.status if outcome.error is not None else 500


def reply_of(outcome: Outcome, target: Target, cost: float) -> Reply:
    """The backend's answer (or the routing error) with the headers that explain it."""
    decision = outcome.decision
    extra = [
        ("x-spillway-rule", decision.rule),
        ("x-spillway-backend", outcome.backend or "none"),
        ("x-spillway-cost-usd", f"{cost:.9f}"),
    ]
    if outcome.fallback is not None:
        extra.append(("x-spillway-fallback", outcome.fallback))
    if decision.spilled:
        extra.append(("x-spillway-spilled", "true"))
    response = outcome.response
    if response is None:
        error = error_reply(outcome.error or UnavailableError("no backend answered"))
        return Reply(error.status, [*error.headers, *extra], error.body)
    headers = [(k, v) for k, v in response.headers.items() if k in RESPONSE_HEADERS]
    body = response.body
    if target.operation == "ready" and response.status == 200:
        # Triton answers readiness with an empty body; the router's answer is JSON.
        headers, body = [(k, v) for k, v in headers if k != "content-type"], b'{"ready":true}'
    if not any(k == "content-type" for k, _ in headers):
        headers.append(("content-type", JSON_CONTENT_TYPE))
    return Reply(response.status, headers + extra, body)
