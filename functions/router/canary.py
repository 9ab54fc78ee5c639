"""Canary versions in the router: the version of a request that pins none, session
affinity, and the automatic rollback.

For a model with a canary record (``spillway.canary``), an infer request that names no
version goes to ``/v2/models/M/versions/V/infer``: V is the canary for ``percent`` % of
draws, else the stable version, and the response names V (``x-spillway-model-version``).
A request carrying ``x-spillway-session: <id>`` keeps the version its session first got
(an affinity item in the state table, scoped to the caller's tenant, renewed on use)
whatever the percentage does later; a session bound to a canary that was rolled back, or
to a version a promotion retired, moves to the stable version. Records are cached for
``canary_ttl_s``; once per ``canary_config_check_s`` the model's ``config.json`` (asked
from a backend) may start the canary it names (``spillway.canary.seed``).

The guard: this router keeps, per version, the outcomes of the last ``window_s`` seconds
(at most ``WINDOW_CAP`` requests): whether the version failed by its own fault (a 5xx the
backend marks as its own, a 502, or a 404 for the version the router chose) and the
latency. A 4xx the request caused, a 429 or a 504 (busy, not broken) says nothing about
a version and is not counted. Once the canary has ``min_requests`` in the window, it is
rolled back when its fault rate exceeds the stable version's by more than
``max_error_rate_increase`` (beyond chance: ``SIGNIFICANCE_Z``), or, from
``P99_MIN_REQUESTS`` requests each, its p99 exceeds the stable version's times
``max_p99_ratio`` (and by ``min_p99_increase_ms``); with fewer than ``min_requests``
stable requests in the window (a canary at 100 %) its fault rate is compared with zero
and p99 is not compared. Windows are local to a router instance (each judges the traffic
it sees); the decision is written to the shared record with an optimistic write, so
every router follows it within ``canary_ttl_s`` and it is logged and counted
(``CanaryRollback``) once.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from functions.router.accounting import EmfSink, event_metric
from functions.router.backends import Backend, BackendError, BackendRequest, BackendResponse
from functions.router.facts import Request
from functions.router.sessions import check_session_id
from spillway.canary import CanarySpec, CanaryState, CanaryStore, RollbackBounds
from spillway.state_table import StateStore, StateUnavailableError, scope
from spillway.wire import FAULT_HEADER, Reply, Target

log = logging.getLogger("spillway.router.canary")

SESSION_HEADER = "x-spillway-session"
VERSION_HEADER = "x-spillway-model-version"
WINDOW_CAP = 2000
SIGNIFICANCE_Z = 3.0
"""Standard errors by which a fault-rate excess must stand out before it rolls back: the
guard judges on every canary request, so a looser test would roll healthy canaries back
on a chance cluster of faults."""
P99_MIN_REQUESTS = 100
"""Requests per version before p99s are compared (below 100 a p99 is just the maximum)."""
_NEUTRAL = frozenset({429, 504})
_MODELS_CACHED = 1024
_SESSIONS_CACHED = 10_000

ConfigSource = Callable[[str], CanarySpec | None]


@dataclass(frozen=True)
class Pick:
    """The version the router chose for a request, and the record it chose it from."""

    state: CanaryState
    version: int

    def pinned(self, request: Request) -> Request:
        """The request, sent to the chosen version."""
        target = request.target
        return replace(request, target=Target(target.operation, target.model, str(self.version)))


# --- the sliding window -----------------------------------------------------------------


@dataclass(frozen=True)
class WindowSummary:
    """A version's requests in the window: how many, how many failed by its fault, p99."""

    count: int
    faults: int
    p99_s: float | None

    @property
    def fault_rate(self) -> float:
        """Faults per request (0 without requests)."""
        return self.faults / self.count if self.count else 0.0


class Window:
    """One version's outcomes ``(at, latency_s, fault)``, oldest first, at most
    ``WINDOW_CAP`` (at a higher rate the window is the last ``WINDOW_CAP`` requests)."""

    def __init__(self) -> None:
        self._events: deque[tuple[float, float, bool]] = deque(maxlen=WINDOW_CAP)

    def add(self, at: float, latency_s: float, fault: bool) -> None:
        """Record one outcome."""
        self._events.append((at, latency_s, fault))

    def summary(self, now: float, span_s: float) -> WindowSummary:
        """The outcomes of the last ``span_s`` seconds (older ones are dropped)."""
        events = self._events
        while events and events[0][0] < now - span_s:
            events.popleft()
        if not events:
            return WindowSummary(0, 0, None)
        latencies = sorted(latency for _, latency, _ in events)
        p99 = latencies[math.ceil(0.99 * len(latencies)) - 1]
        return WindowSummary(len(events), sum(1 for e in events if e[2]), p99)


def verdict(canary: WindowSummary, stable: WindowSummary, bounds: RollbackBounds) -> str | None:
    """Why the canary must be rolled back, or ``None`` while it is within its bounds."""
    if canary.count < bounds.min_requests:
        return None
    compared = stable.count >= bounds.min_requests
    baseline = stable if compared else WindowSummary(0, 0, None)
    if _above(canary, baseline, bounds.max_error_rate_increase):
        return (
            f"fault rate {canary.fault_rate:.1%} over {canary.count} requests against "
            f"{baseline.fault_rate:.1%} for the stable version "
            f"(bound +{bounds.max_error_rate_increase:.1%})"
        )
    enough = min(canary.count, stable.count) >= max(bounds.min_requests, P99_MIN_REQUESTS)
    if enough and canary.p99_s is not None and stable.p99_s is not None:
        limit = max(
            stable.p99_s * bounds.max_p99_ratio, stable.p99_s + bounds.min_p99_increase_ms / 1000
        )
        if canary.p99_s > limit:
            return (
                f"p99 {canary.p99_s * 1000:.1f} ms over {canary.count} requests against "
                f"{stable.p99_s * 1000:.1f} ms for the stable version "
                f"(bound x{bounds.max_p99_ratio:g})"
            )
    return None


def _above(canary: WindowSummary, stable: WindowSummary, margin: float) -> bool:
    """Whether the canary's fault rate exceeds the stable one's plus ``margin`` by more
    than chance explains (a one-sided test of the difference at ``SIGNIFICANCE_Z``
    standard errors): one fault in 50 requests is no regression, ten are."""
    excess = canary.fault_rate - stable.fault_rate - margin
    if excess <= 0:
        return False
    variance = sum(s.fault_rate * (1 - s.fault_rate) / s.count for s in (canary, stable) if s.count)
    return variance == 0 or excess / math.sqrt(variance) >= SIGNIFICANCE_Z


def version_fault(response: BackendResponse) -> bool:
    """Whether an answer is a failure of the version that served it: a server fault, or
    (the router chose the version) a 404 saying the version is not there."""
    if response.status == 404:
        try:
            return bool(json.loads(response.body).get("code") == "model_not_found")
        except (ValueError, AttributeError):
            return False
    if response.status == 502:
        return True
    return response.status >= 500 and response.headers.get(FAULT_HEADER) == "server"


# --- session affinity -------------------------------------------------------------------


class Affinity:
    """Session → version in the state table, scoped to the caller; a local cache spares
    the table read for sessions this router saw recently (the item is renewed in the
    table whenever less than half of its life is left)."""

    def __init__(self, store: StateStore, ttl_s: float) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._cache: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(tenant: str | None, model: str, session: str) -> str:
        """The affinity item's key."""
        return f"affinity#{scope(tenant)}#{model}#{session}"

    def get(self, key: str, now: float) -> int | None:
        """The version the session is bound to, its life renewed; ``None`` if unbound."""
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None and cached[1] - now > self.ttl_s / 2:
            return cached[0]
        item = self.store.get(key, now)
        if item is not None and (item.expires_at or now) - now <= self.ttl_s / 2:
            item = self.store.touch(key, now, now + self.ttl_s)
        if item is None:
            return None
        version = int(item.doc["version"])
        self._remember(key, version, item.expires_at or now + self.ttl_s)
        return version

    def bind(self, key: str, version: int, now: float, *, rebind: bool) -> int:
        """Bind the session to ``version`` (``rebind``: over a version given up); when a
        concurrent first request of the session bound it first, that binding wins."""
        expires = now + self.ttl_s
        document = {"version": version}
        if rebind:
            self.store.put(key, document, expires)
        elif not self.store.create(key, document, now, expires):
            won = self.store.get(key, now)
            if won is not None:
                version, expires = int(won.doc["version"]), won.expires_at or expires
        self._remember(key, version, expires)
        return version

    def _remember(self, key: str, version: int, expires_at: float) -> None:
        with self._lock:
            self._cache[key] = (version, expires_at)
            self._cache.move_to_end(key)
            while len(self._cache) > _SESSIONS_CACHED:
                self._cache.popitem(last=False)


# --- the router's side ------------------------------------------------------------------


@dataclass
class _Cached:
    state: CanaryState | None
    loaded_at: float
    config_at: float


class CanaryRouter:
    """Chooses versions, keeps session affinity, judges canaries and rolls them back."""

    def __init__(
        self,
        canaries: CanaryStore,
        affinity: Affinity,
        *,
        rng: random.Random,
        clock: Callable[[], float],
        ttl_s: float,
        config_check_s: float,
        config_source: ConfigSource | None,
        sink: EmfSink,
    ) -> None:
        self.canaries = canaries
        self.affinity = affinity
        self.rng = rng
        self.clock = clock
        self.wall = canaries.wall
        self.ttl_s = ttl_s
        self.config_check_s = config_check_s
        self.config_source = config_source
        self.sink = sink
        self._states: OrderedDict[str, _Cached] = OrderedDict()
        self._windows: dict[tuple[str, int], Window] = {}
        self._lock = threading.Lock()

    def pick(self, request: Request) -> Pick | None:
        """The version of an infer request that pins none, for a model with a canary
        record; ``None`` leaves the request as it is."""
        session = request.call.headers.get(SESSION_HEADER)
        if session is not None:
            check_session_id(session)
        target = request.target
        if target.operation != "infer" or target.model is None or target.version is not None:
            return None
        state = self.state(target.model)
        if state is None:
            return None
        if session is None:
            return Pick(state, state.choose(self.rng.random()))
        return Pick(state, self._session_version(state, request.facts.tenant, session))

    def settle(
        self, pick: Pick, response: BackendResponse | None, latency_s: float, reply: Reply
    ) -> Reply:
        """Count the outcome for the guard and name the chosen version on the reply."""
        if response is not None and response.status not in _NEUTRAL:
            self._observe(pick, latency_s, version_fault(response))
        if reply.header(VERSION_HEADER) is None:
            reply = Reply(
                reply.status, [*reply.headers, (VERSION_HEADER, str(pick.version))], reply.body
            )
        return reply

    # -- records -------------------------------------------------------------------------

    def state(self, model: str) -> CanaryState | None:
        """The model's record, cached for ``ttl_s``; the last one read while the table
        cannot be reached (or none: then the backends' default version serves)."""
        now = self.clock()
        with self._lock:
            cached = self._states.get(model)
        if cached is not None and now - cached.loaded_at < self.ttl_s:
            return cached.state
        config_at = cached.config_at if cached is not None else -math.inf
        try:
            state = self.canaries.load(model)
            source = self.config_source
            if source is not None and now - config_at >= self.config_check_s:
                config_at = now
                state = self._seed(model, source) or state
        except StateUnavailableError as exc:
            log.warning("canary record unreadable: %s", exc.message, extra={"model": model})
            state = cached.state if cached is not None else None
        self._remember(model, _Cached(state, now, config_at))
        return state

    def _remember(self, model: str, entry: _Cached) -> None:
        with self._lock:
            self._states[model] = entry
            self._states.move_to_end(model)
            while len(self._states) > _MODELS_CACHED:
                self._states.popitem(last=False)

    def _seed(self, model: str, source: ConfigSource) -> CanaryState | None:
        spec = source(model)
        if spec is None:
            return None
        seeded = self.canaries.seed(model, spec)
        if seeded is not None:
            log.info(
                "canary started from config.json",
                extra={"model": model, "version": spec.version, "percent": spec.percent},
            )
        return seeded

    def _session_version(self, state: CanaryState, tenant: str | None, session: str) -> int:
        key = Affinity.key(tenant, state.model, session)
        now = self.wall()
        try:
            bound = self.affinity.get(key, now)
            if bound is not None and state.serves(bound):
                return bound
            chosen = state.choose(self.rng.random()) if bound is None else state.stable
            kept = self.affinity.bind(key, chosen, now, rebind=bound is not None)
        except StateUnavailableError as exc:
            log.warning("session affinity unavailable: %s", exc.message)
            return state.choose(self.rng.random())
        return kept if state.serves(kept) else state.stable

    # -- the guard -----------------------------------------------------------------------

    def _observe(self, pick: Pick, latency_s: float, fault: bool) -> None:
        model, now = pick.state.model, self.clock()
        with self._lock:
            self._window(model, pick.version).add(now, latency_s, fault)
            cached = self._states.get(model)
            current = cached.state if cached is not None and cached.state else pick.state
            if not current.running or current.canary != pick.version:
                return
            bounds = current.bounds
            canary = self._window(model, pick.version).summary(now, bounds.window_s)
            stable = self._window(model, current.stable).summary(now, bounds.window_s)
        reason = verdict(canary, stable, bounds)
        if reason is not None:
            self._roll_back(current, pick.version, reason)

    def _window(self, model: str, version: int) -> Window:
        return self._windows.setdefault((model, version), Window())

    def _roll_back(self, state: CanaryState, version: int, reason: str) -> None:
        model = state.model
        try:
            rolled = self.canaries.rollback(model, version, reason)
            current = rolled or self.canaries.load(model)
        except StateUnavailableError as exc:
            log.error("canary rollback not recorded: %s", exc.message, extra={"model": model})
            return
        if rolled is not None:
            log.warning(
                "canary rolled back",
                extra={"model": model, "version": version, "reason": reason},
            )
            document = event_metric("CanaryRollback")
            document.update(model=model, version=version, reason=reason)
            self.sink.write(document)
        with self._lock:
            cached = self._states.get(model)
            config_at = cached.config_at if cached is not None else self.clock()
        self._remember(model, _Cached(current, self.clock(), config_at))


def backend_config(backends: Mapping[str, Backend], timeout_s: float) -> ConfigSource:
    """Reads a model's ``spillway.canary`` from its configuration as a backend serves it
    (the GPU service, else the CPU fallback); ``None`` when it names none or no backend
    answers."""

    def fetch(model: str) -> CanarySpec | None:
        target = Target("config", model)
        request = BackendRequest("GET", target.path, "config", model=model)
        for name in ("gpu", "cpu"):
            backend = backends.get(name)
            if backend is None:
                continue
            try:
                response = backend.send(request, timeout_s)
            except BackendError:
                continue
            if response.status == 200:
                return _canary_block(response.body)
            if response.status == 404:
                return None
        return None

    return fetch


def _canary_block(body: bytes) -> CanarySpec | None:
    try:
        config: Any = json.loads(body)
        block = (config.get("spillway") or {}).get("canary")
        return CanarySpec.model_validate(block) if block else None
    except (ValueError, AttributeError, ValidationError):
        return None
