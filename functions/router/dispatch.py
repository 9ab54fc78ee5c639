"""One proxied request from facts to reply: policy, deadline, the walk, cost, metrics.

Every reply says what happened: ``x-spillway-rule`` (the rule that fired),
``x-spillway-backend`` (who answered), ``x-spillway-cost-usd`` (the estimate),
``x-spillway-fallback`` (``<first backend>:<why>`` when another one served) and
``x-spillway-spilled`` (when the rule's spill share moved it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from functions.router.backends import RESPONSE_HEADERS, BackendRequest
from functions.router.cost import Pricing
from functions.router.facts import (
    HEADER_LENGTH,
    RequestFacts,
    header_length_from,
    input_size,
    read_hints,
    read_json_header,
    with_timeout,
)
from functions.router.metrics import EmfSink, RouteRecord
from functions.router.policy_store import PolicyStore
from functions.router.router import BACKEND_TIMEOUT_SHARE, Outcome, Router
from spillway.errors import SpillwayError

log = logging.getLogger("spillway.router")

JSON = "application/json"
BINARY = "application/octet-stream"


@dataclass(frozen=True)
class Call:
    """One client request, transport-free; header names are lower-case."""

    method: str
    headers: Mapping[str, str]
    body: bytes
    request_id: str
    remaining_ms: float | None = None
    trusted_tenant: str | None = None


@dataclass(frozen=True)
class Target:
    """What a request asks for: an operation, maybe on a model (and version)."""

    operation: str
    model: str | None = None
    version: str | None = None

    @property
    def path(self) -> str:
        """The canonical backend path (never the client's raw path)."""
        if self.model is None:
            return "/v2/models/stats" if self.operation == "stats" else "/v2"
        path = f"/v2/models/{self.model}"
        if self.version is not None:
            path += f"/versions/{self.version}"
        return path if self.operation == "metadata" else f"{path}/{self.operation}"


@dataclass(frozen=True)
class Reply:
    """Status, headers and body of a response."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


@dataclass(frozen=True)
class Parsed:
    """A request as the router understands it."""

    facts: RequestFacts
    header: dict[str, Any] | None
    header_length: int | None


def parse_request(call: Call, target: Target, *, trust_tenant_hints: bool = True) -> Parsed:
    """The facts the policy sees, the parsed JSON header (infer only) and its length.

    The tenant is the authorizer's; the one the request claims counts only when
    ``trust_tenant_hints`` (no authorizer in front to set it)."""
    header: dict[str, Any] | None = None
    length = header_length_from(call.headers.get(HEADER_LENGTH))
    if target.operation == "infer":
        header = read_json_header(call.body, length)
    hints = read_hints(header.get("parameters") if header else None, call.headers)
    elements, tokens, rows = input_size(header) if header else (None, None, 1)
    facts = RequestFacts(
        method=call.method,
        path=target.path,
        operation=target.operation,
        model=target.model,
        version=target.version,
        mode=hints.mode,
        latency_budget_ms=hints.latency_budget_ms,
        priority=hints.priority,
        tenant=call.trusted_tenant or (hints.tenant if trust_tenant_hints else None),
        payload_bytes=len(call.body),
        input_elements=elements,
        input_tokens=tokens,
        rows=rows,
    )
    return Parsed(facts, header, length)


class Dispatcher:
    """Forwards Open Inference Protocol requests as the policy says."""

    def __init__(
        self,
        router: Router,
        policies: PolicyStore,
        pricing: Pricing,
        sink: EmfSink,
        wall: Callable[[], datetime],
        *,
        trust_tenant_hints: bool = True,
    ) -> None:
        self.trust_tenant_hints = trust_tenant_hints
        self.router = router
        self.policies = policies
        self.pricing = pricing
        self.sink = sink
        self.wall = wall

    def forward(self, call: Call, target: Target) -> Reply:
        """Decide, walk the chain within the deadline, and account the request."""
        started = self.router.clock()
        parsed = parse_request(call, target, trust_tenant_hints=self.trust_tenant_hints)
        decision = self.router.decide(self.policies.policy, parsed.facts, self.wall())
        deadline = self.router.deadline(started, parsed.facts.latency_budget_ms, call.remaining_ms)

        def build(backend: str, timeout_s: float) -> BackendRequest:
            return self._request(call, target, parsed, backend, timeout_s)

        outcome = self.router.walk(decision, build, deadline)
        cost = self._account(outcome, target, parsed.facts.rows, started, call.request_id)
        return self._reply(outcome, target, cost)

    def _account(
        self, outcome: Outcome, target: Target, rows: int, started: float, request_id: str
    ) -> float:
        """The request's cost; one EMF line and one log line say what happened."""
        decision = outcome.decision
        elapsed = self.router.clock() - started
        cost = self._cost(outcome, rows, elapsed)
        status = self._status(outcome)
        record = RouteRecord(
            rule=decision.rule,
            backend=outcome.backend or "none",
            model=target.model,
            status=status,
            latency_ms=elapsed * 1000,
            cost_usd=cost,
            fallback=outcome.fallback is not None,
            spilled=decision.spilled,
            attempts=len(outcome.attempts),
        )
        self.sink.emit(record)
        attempts = [f"{a.backend}:{a.outcome}" for a in outcome.attempts]
        log.info(
            "routed",
            extra={
                "rule": decision.rule,
                "chain": list(decision.chain),
                "attempts": attempts,
                "status": status,
                "cost_usd": cost,
                "request_id": request_id,
            },
        )
        return cost

    def ready(self) -> bool:
        """Whether some synchronous backend is configured and its circuit is not open."""
        return any(
            name in self.router.backends and self.router.breakers[name].state != "open"
            for name in ("gpu", "cpu")
        )

    def _request(
        self, call: Call, target: Target, parsed: Parsed, backend: str, timeout_s: float
    ) -> BackendRequest:
        body, length = call.body, parsed.header_length
        if parsed.header is None:
            body, length = b"", None
        if parsed.header is not None and backend != "batch":
            timeout_us = max(1, int(timeout_s * BACKEND_TIMEOUT_SHARE * 1e6))
            body, length = with_timeout(call.body, parsed.header, length, timeout_us)
        headers: dict[str, str] = {}
        if target.operation == "infer":
            headers["content-type"] = JSON if length is None else BINARY
        if length is not None:
            headers[HEADER_LENGTH] = str(length)
        return BackendRequest(
            method=call.method,
            path=target.path,
            operation=target.operation,
            model=target.model,
            version=target.version,
            headers=headers,
            body=body,
            request_id=call.request_id,
            tenant=parsed.facts.tenant,
        )

    def _cost(self, outcome: Outcome, rows: int, elapsed_s: float) -> float:
        total = self.pricing.router.cost(elapsed_s)
        for attempt in outcome.attempts:
            total += self.pricing.attempt(
                attempt.backend, rows=rows, billed_s=attempt.billed_s, served=attempt.served
            )
        return total

    @staticmethod
    def _status(outcome: Outcome) -> int:
        if outcome.response is not None:
            return outcome.response.status
        return outcome.error.status if outcome.error is not None else 500

    def _reply(self, outcome: Outcome, target: Target, cost: float) -> Reply:
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
            error = outcome.error or SpillwayError("no backend answered")
            raise RoutedError(error, extra)
        headers = [(k, v) for k, v in response.headers.items() if k in RESPONSE_HEADERS]
        body = response.body
        if target.operation == "ready" and response.status == 200:
            # Triton answers readiness with an empty body; the router's answer is JSON.
            headers, body = [(k, v) for k, v in headers if k != "content-type"], b'{"ready":true}'
        if not any(k == "content-type" for k, _ in headers):
            headers.append(("content-type", JSON))
        return Reply(response.status, headers + extra, body)


class RoutedError(Exception):
    """An error reply that still carries the routing headers."""

    def __init__(self, error: SpillwayError, headers: list[tuple[str, str]]) -> None:
        super().__init__(error.message)
        self.error = error
        self.headers = headers
