"""Canary versions in the router: the version of a request that pins none, session
affinity, and the automatic rollback. The router reaches all of it through the
version-choice stage (``spillway.canary.stage``), whose canary arms call in here.

For a model with a canary record (``spillway.canary.records``), an infer request that
names no version goes to ``/v2/models/M/versions/V/infer`` (``choose``): V is the canary
for ``percent`` % of draws, else the stable version, and the response names V
(``x-spillway-model-version``). A request carrying ``x-spillway-session: <id>`` keeps the
version its session first got (an affinity item in the state table, scoped to the
caller's tenant, renewed on use) whatever the percentage does later; a session bound to a
canary that was rolled back, or to a version a promotion retired, moves to the stable
version. A request that pins a rolled-back version is refused (409
``version_rolled_back``, ``admit``) unless the operator set ``allow_pinned`` on the
record. Records are cached for ``canary_ttl_s``; once per ``canary_config_check_s`` the
model's ``config.json`` (asked from a backend) may start the canary it names
(``spillway.canary.records.seed``). The record is followed in every mode: an unpinned
async request is queued, and a batch-mode one submitted, with the version chosen here, so
no worker falls back on a backend's own default (which may be a rolled-back newest
version).

Versions are a contract with the backends: a backend that answers the version the router
chose with 404 ``model_not_found`` does not serve it (``version_missing``); the router
remembers that for ``canary_ttl_s`` (it sends that backend the version again only after,
``skips``), tries the next backend of the chain with the same version, and when none
serves it, sends the request to the stable version instead (``to_stable``: logged and
counted as ``CanaryVersionUnserved``). A client never sees a 404 for a version it did not
ask for, and the guard does not count it against the canary (a deployment gap, not a
fault of the version).

The guard (``canary_guard``): this router keeps, per version, the outcomes of the last
``window_s`` seconds (at most ``WINDOW_CAP`` requests): whether the version served or
failed by its own fault (a 5xx the backend marks as its own, or a 502), the latency and
the request's size class. A 4xx the request caused, a 429 or a 504 (busy, not broken)
says nothing about a version and is not counted.
Once the canary has ``min_requests`` in the window, it is rolled back when its fault rate
exceeds the stable version's by more than ``max_error_rate_increase`` (beyond chance:
``SIGNIFICANCE_Z``), or when its p99 exceeds the stable version's times ``max_p99_ratio``
(and by ``min_p99_increase_ms``) on like-sized requests, never on sizes a client chose
for one version only; with fewer than ``min_requests`` stable requests in the window (a
canary at 100 %) its fault rate is compared with zero and p99 is not compared. Windows
are local to a router instance (each judges the traffic it sees); the decision is written
to the shared record with an optimistic write, so every router follows it within
``canary_ttl_s`` and it is logged and counted (``CanaryRollback``) once.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from spillway.canary.guard import SizeClass, Window, outcome, size_class, verdict
from spillway.canary.records import CanaryState, CanaryStore
from spillway.models.canary_spec import CanarySpec
from spillway.policy.accounting import EmfSink, event_metric
from spillway.policy.backend import (
    Backend,
    BackendError,
    BackendRequest,
    BackendResponse,
    Unanswered,
    served_config,
)
from spillway.policy.facts import Request, check_session_id
from spillway.protocol.errors import StateUnavailableError, VersionRolledBackError
from spillway.protocol.replies import Reply
from spillway.protocol.wire import Target
from spillway.state.table import StateStore, scope

log = logging.getLogger("spillway.router.canary")

SESSION_HEADER = "x-spillway-session"
VERSION_HEADER = "x-spillway-model-version"
_MODELS_CACHED = 1024
_SESSIONS_CACHED = 10_000

ConfigSource = Callable[[str], CanarySpec | None]


@dataclass(frozen=True)
class Pick:
    """The version the router chose for a request, the record it chose it from, and the
    request's size class (its latency is compared only with like-sized requests')."""

    state: CanaryState
    version: int
    size: SizeClass

    def pinned(self, request: Request) -> Request:
        """The request, sent to the chosen version."""
        target = request.target
        return replace(request, target=Target(target.operation, target.model, str(self.version)))

    @property
    def model(self) -> str:
        """The model the version was chosen for."""
        return self.state.model


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
        self._misses: OrderedDict[tuple[str, str, int], float] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, request: Request) -> None:
        """Refuse an infer request that pins a rolled-back version the operator has not
        allowed pinned requests to reach: in every mode, before a backend or queue sees it."""
        target = request.target
        if target.operation != "infer" or target.model is None or target.version is None:
            return
        state = self.state(target.model)
        if state is not None and state.refuses(int(target.version)):
            raise VersionRolledBackError(
                f"version {target.version} of {target.model} was rolled back; pin another "
                "version or none"
            )

    def choose(self, request: Request) -> Pick | None:
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
        size = size_class(request.facts)
        if session is None:
            return Pick(state, state.choose(self.rng.random()), size)
        return Pick(state, self._session_version(state, request.facts.tenant, session), size)

    def settle(
        self, pick: Pick, response: BackendResponse | None, latency_s: float, reply: Reply
    ) -> Reply:
        """Count the outcome for the guard and name the chosen version on the reply."""
        counted = outcome(response) if response is not None else None
        if counted is not None:
            self._observe(pick, latency_s, counted == "fault")
        if reply.header(VERSION_HEADER) is None:
            reply = Reply(
                reply.status, [*reply.headers, (VERSION_HEADER, str(pick.version))], reply.body
            )
        return reply

    # -- the version contract ------------------------------------------------------------

    def skips(self, backend: str, pick: Pick) -> bool:
        """Whether ``backend`` said, less than ``ttl_s`` ago, that it does not serve the
        chosen version (then it is not sent it)."""
        return self._noted((backend, pick.model, pick.version), renew=False)

    def missed(self, backend: str, pick: Pick) -> None:
        """Remember for ``ttl_s`` that ``backend`` does not serve the chosen version."""
        if not self._noted((backend, pick.model, pick.version), renew=True):
            log.warning(
                "backend does not serve the chosen version",
                extra={"backend": backend, "model": pick.model, "version": pick.version},
            )

    def to_stable(self, pick: Pick, tried: list[str]) -> Pick | None:
        """The stable version for a request whose chosen version no backend of its chain
        served (``tried``: what each said); ``None`` when the stable one was the choice.
        Every such request is counted; the log says it once per ``ttl_s``."""
        stable = pick.state.stable
        if pick.version == stable:
            return None
        if not self._noted(("", pick.model, pick.version), renew=True):
            log.warning(
                "no backend serves the chosen version; the stable version serves its requests",
                extra={
                    "model": pick.model,
                    "version": pick.version,
                    "stable": stable,
                    "tried": tried,
                },
            )
        document = event_metric("CanaryVersionUnserved")
        document.update(model=pick.model, version=pick.version)
        self.sink.write(document)
        return replace(pick, version=stable)

    def _noted(self, key: tuple[str, str, int], *, renew: bool) -> bool:
        """Whether ``key`` was noted less than ``ttl_s`` ago; ``renew`` notes it now."""
        now = self.clock()
        with self._lock:
            until = self._misses.get(key)
            live = until is not None and until > now
            if renew:
                self._misses[key] = now + self.ttl_s
                self._misses.move_to_end(key)
                while len(self._misses) > _MODELS_CACHED:
                    self._misses.popitem(last=False)
            elif until is not None and not live:
                del self._misses[key]
        return live

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
            self._window(model, pick.version).add(now, latency_s, fault, pick.size)
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
        try:
            config = served_config(backends, model, timeout_s)
        except Unanswered:
            return None
        return None if config is None else _canary_block(config)

    return fetch


def _canary_block(body: bytes) -> CanarySpec | None:
    try:
        config: Any = json.loads(body)
        block = (config.get("spillway") or {}).get("canary")
        return CanarySpec.model_validate(block) if block else None
    except (ValueError, AttributeError, ValidationError):
        return None


def version_missing(response: BackendResponse) -> bool:
    """Whether a backend's answer says it does not serve the version asked for (404
    ``model_not_found``): for a version the router chose, a reason to go elsewhere."""
    if response.status != 404:
        return False
    try:
        return bool(json.loads(response.body).get("code") == "model_not_found")
    except (ValueError, AttributeError):
        return False


def version_served(backend: Backend, model: str, version: int, timeout_s: float) -> bool | None:
    """Whether ``backend`` serves ``version`` of ``model``, by its readiness endpoint: 200
    yes (the CPU fallback counts a version it loads on demand), 404 ``model_not_found``
    no; ``None`` when it cannot tell (unreachable, busy, still loading)."""
    target = Target("ready", model, str(version))
    request = BackendRequest("GET", target.path, "ready", model=model, version=str(version))
    try:
        response = backend.send(request, timeout_s)
    except BackendError:
        return None
    if response.status == 200:
        return True
    return False if version_missing(response) else None
