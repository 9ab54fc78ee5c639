"""How long the router waits for a request, and whose budget that is.

A request's deadline is, first found: the latency budget the request states (its
``latency_budget_ms`` parameter or ``x-spillway-latency-budget-ms`` header, 100 ms to
1 h), the latency budget its model declares (``spillway.latency_budget_ms`` in the
model's ``config.json``, the same bounds), else the router's default
(``ROUTER_DEFAULT_DEADLINE_MS``); on Lambda it is capped by what is left of the
invocation less ``ROUTER_DEADLINE_MARGIN_MS``. A 504 names the budget that passed and
how to give another (``Deadline.passed``).

The router learns a model's budget from the model's configuration as a backend serves it
(``GET /v2/models/{m}/config``: the GPU service, else the CPU fallback; both answer from
the configuration they hold, without loading the model), at most once per
``ROUTER_LATENCY_BUDGET_TTL_S`` per model and router instance (``ModelBudgets``), and not
at all for a request that states its own budget. That keeps the router as it was: no
repository access or AWS permission of its own, no model schema imported (the budget is
one number read from the JSON), and a budget a model changes reaches every router within
the TTL. Concurrent requests for a model whose budget is being asked share that one
look-up. A name no backend knows is remembered as such like a model's budget, in a
cache of ``CACHED_MODELS`` names (least recently used out first), so an invented name
costs one look-up per TTL, the size of the forward its request costs anyway; when no
backend answers, what was known is kept and asked again after ``RETRY_S``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from spillway.policy.backend import Backend, Unanswered, served_config
from spillway.policy.facts import Request, RequestFacts
from spillway.protocol.errors import DeadlineExceededError, InvalidInputError
from spillway.protocol.wire import latency_budget_ms
from spillway.router.settings import RouterSettings

CACHED_MODELS = 1024
"""Models (and names no backend knows) whose budget one router remembers."""
RETRY_S = 5.0
"""A look-up no backend answered is tried again after this long (at most the TTL)."""
BUDGET_HEADER = "x-spillway-latency-budget-ms"

Source = Literal["request", "model", "default"]


@dataclass(frozen=True, slots=True)
class Deadline:
    """When the router stops waiting for a request (``at``, on its clock): ``limit_ms``
    after the request arrived, from the budget of ``source`` (``budget_ms``, before the
    invocation's time left capped it)."""

    at: float
    limit_ms: float
    source: Source
    budget_ms: float
    model: str | None = None

    def passed(self, attempts: str) -> DeadlineExceededError:
        """The 504 of a request no backend answered in time: which budget passed, how to
        give another, and what each attempt ended with."""
        return DeadlineExceededError(
            f"the {self.limit_ms:.0f} ms deadline ({self._why()}) passed before a backend "
            f"answered ({attempts})"
        )

    def _why(self) -> str:
        if self.limit_ms < self.budget_ms:
            return (
                f"the time left of the router's invocation, short of {self._budget()}; "
                "send Prefer: respond-async for longer work"
            )
        if self.source == "request":
            return f"the request's own latency budget, {BUDGET_HEADER}"
        if self.source == "model":
            return f"the latency budget of model {self.model!r}; send {BUDGET_HEADER} for another"
        return (
            f"the router's default; send {BUDGET_HEADER} or set the model's "
            "spillway.latency_budget_ms"
        )

    def _budget(self) -> str:
        if self.source == "request":
            return f"the request's own {self.budget_ms:.0f} ms latency budget"
        if self.source == "model":
            return f"the {self.budget_ms:.0f} ms latency budget of model {self.model!r}"
        return f"the router's {self.budget_ms:.0f} ms default"


def deadline_for(
    request: Request,
    started: float,
    settings: RouterSettings,
    budgets: ModelBudgets | None,
) -> Deadline:
    """The deadline of a request that arrived at ``started``: its own budget, else its
    model's (an infer request's, looked up in ``budgets``), else the default; capped by
    the Lambda invocation's time left less the margin."""
    model = request.target.model if request.target.operation == "infer" else None
    source: Source = "request"
    budget = request.facts.latency_budget_ms
    if budget is None and model is not None and budgets is not None:
        source, budget = "model", budgets.budget_ms(model)
    if budget is None:
        source, budget = "default", settings.default_deadline_ms
    limit = budget
    remaining = request.call.remaining_ms
    if remaining is not None:
        limit = min(limit, remaining - settings.deadline_margin_ms)
    limit = max(limit, 0.0)
    return Deadline(started + limit / 1000, limit, source, budget, model)


def decided_on(facts: RequestFacts, deadline: Deadline) -> RequestFacts:
    """The facts the policy decides on: a request that names no latency budget is
    matched by its model's declared one (a rule on ``latency_budget_ms`` sees it), never
    by the router's default."""
    if facts.latency_budget_ms is None and deadline.source == "model":
        return replace(facts, latency_budget_ms=deadline.budget_ms)
    return facts


NoAnswer = Unanswered
"""No backend said what a model's configuration is (unreachable, busy, loading)."""


Lookup = Callable[[str], float | None]
"""A model's declared budget in ms (``None``: it declares none, or no backend knows the
name); raises ``NoAnswer`` when it cannot tell."""


@dataclass(frozen=True, slots=True)
class _Known:
    budget_ms: float | None
    until: float


class ModelBudgets:
    """Each model's declared latency budget, asked through ``lookup`` at most once per
    ``ttl_s`` per model (``retry_s`` after a look-up nobody answered); concurrent requests
    for one model share its look-up."""

    def __init__(
        self,
        lookup: Lookup,
        *,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        retry_s: float = RETRY_S,
    ) -> None:
        self._lookup = lookup
        self.ttl_s = ttl_s
        self.retry_s = min(retry_s, ttl_s)
        self.clock = clock
        self._known: OrderedDict[str, _Known] = OrderedDict()
        self._flights: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def budget_ms(self, model: str) -> float | None:
        """The latency budget ``model`` declares (``None``: none, or no backend knows it)."""
        now = self.clock()
        with self._lock:
            known = self._known.get(model)
            if known is not None and now < known.until:
                self._known.move_to_end(model)
                return known.budget_ms
            flight = self._flights.get(model)
            if flight is None:
                self._flights[model] = threading.Event()
        if flight is not None:  # another request is asking: its answer is this one's
            flight.wait()
            with self._lock:
                known = self._known.get(model)
            return None if known is None else known.budget_ms
        try:
            return self._ask(model, known)
        finally:
            with self._lock:
                done = self._flights.pop(model)
            done.set()

    def _ask(self, model: str, known: _Known | None) -> float | None:
        try:
            budget, keep_s = self._lookup(model), self.ttl_s
        except NoAnswer:
            budget, keep_s = (known.budget_ms if known is not None else None), self.retry_s
        with self._lock:
            self._known[model] = _Known(budget, self.clock() + keep_s)
            self._known.move_to_end(model)
            while len(self._known) > CACHED_MODELS:
                self._known.popitem(last=False)
        return budget


def backend_lookup(backends: Mapping[str, Backend], timeout_s: float) -> Lookup:
    """A model's budget from its configuration as the GPU service serves it, else the CPU
    fallback (each asked within ``timeout_s``); a 404 says no backend knows the name."""

    def lookup(model: str) -> float | None:
        config = served_config(backends, model, timeout_s)  # NoAnswer when none answers
        return None if config is None else declared_budget(config)

    return lookup


def declared_budget(config: bytes) -> float | None:
    """``spillway.latency_budget_ms`` of a served ``config.json``; ``None`` when it names
    none, or a value the router would not take from a request either."""
    try:
        block = json.loads(config).get("spillway") or {}
        return latency_budget_ms(block.get("latency_budget_ms"))
    except (ValueError, AttributeError, InvalidInputError):
        return None
