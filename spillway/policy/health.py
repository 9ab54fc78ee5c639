"""What the router knows about each backend's health: its circuit, its load, retries.

**Circuit breaker.** Closed: requests pass; ``failures`` consecutive failures open the
circuit. Open: requests skip the backend until ``reset_s`` has passed, then the circuit is
half-open and lets exactly one trial request through. The trial's success closes it (and
the wait returns to ``reset_s``); its failure re-opens it with the wait doubled, up to
``max_reset_s``. A neutral outcome (the backend answered but was busy) ends the trial
without a verdict. Every caller that was allowed through must report exactly one outcome.

A circuit opened by refused connections (a backend still starting, or restarting) is
probed instead of waited out: while it is open, a request that finds it so starts one
readiness probe (``probe``, e.g. ``GET /v2/health/ready`` with a short timeout) at most
once per ``probe_interval_s``, one at a time, off the request's path (``run``). A ready
answer half-opens the circuit at once, so the next request is its trial; the circuit
closes within about a probe interval of the backend being ready, not after a doubled
wait. A circuit opened by timeouts or errors (a backend that is up but failing) waits as
before: its readiness says little.

**Retry budget.** A retry for every ``1 / ratio`` requests on average (a token bucket
filled by ``ratio`` per request, capped), so a failing backend never sees more than
``ratio`` extra load from retries.

**Live load**, kept in the warm container as a moving average. The GPU service reports its
state on every infer response (``x-spillway-busy``: the share of the recent window spent
computing, ``x-spillway-queue-depth``); a 429 counts as fully busy. Readings feed a
time-weighted exponential moving average per backend. For each threshold a policy asks
about, the tracker remembers since when the average has stayed above it, so "above 0.85
for 300 s" is one look-up. A threshold first asked about starts its clock then (the
tracker keeps no history it was not asked to keep), and a reading older than ``stale_s``
says nothing: the backend counts as cool.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

State = Literal["closed", "open", "half_open"]


Probe = Callable[[], bool]
"""Whether the backend says it is ready (an exception counts as not ready)."""
Runner = Callable[[Callable[[], None]], None]
"""Runs a probe off the request's path."""
_PROBE_STALE_S = 10.0  # a probe running longer than this is taken as lost (a frozen thread)


def in_thread(job: Callable[[], None]) -> None:
    """Run ``job`` on a daemon thread (the default ``Runner``)."""
    threading.Thread(target=job, name="breaker-probe", daemon=True).start()


class CircuitBreaker:
    """Closed → open after N consecutive failures → half-open after a growing wait (or
    as soon as a readiness probe says so, when refused connections opened it)."""

    def __init__(
        self,
        name: str,
        *,
        failures: int = 5,
        reset_s: float = 5.0,
        max_reset_s: float = 120.0,
        clock: Callable[[], float],
        probe: Probe | None = None,
        probe_interval_s: float = 1.0,
        run: Runner = in_thread,
    ) -> None:
        if failures < 1 or reset_s <= 0 or max_reset_s < reset_s:
            raise ValueError("need failures >= 1 and 0 < reset_s <= max_reset_s")
        if probe_interval_s <= 0:
            raise ValueError("need probe_interval_s > 0")
        self._probe = probe
        self._probe_interval_s = probe_interval_s
        self._run = run
        self._refused = False  # the failure that opened the circuit was a refusal
        self._next_probe = 0.0
        self._probing_since: float | None = None
        self.probes = 0
        self.name = name
        self._threshold = failures
        self._base_reset_s = reset_s
        self._max_reset_s = max_reset_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state: State = "closed"
        self._failures = 0
        self._reset_s = reset_s
        self._open_until = 0.0
        self._trial = False
        self.opened_count = 0

    @property
    def state(self) -> State:
        """The state now (an open circuit whose wait has passed reads as half-open)."""
        with self._lock:
            if self._state == "open" and self._clock() >= self._open_until:
                return "half_open"
            return self._state

    @property
    def reset_s(self) -> float:
        """The wait the circuit uses the next time it opens (or uses now, while open)."""
        return self._reset_s

    def retry_after_s(self) -> float:
        """Seconds until an open circuit lets a trial through (0 when it would now)."""
        with self._lock:
            if self._state != "open":
                return 0.0
            return max(0.0, self._open_until - self._clock())

    def allow(self) -> bool:
        """Whether a request may go to the backend now (claims the trial when half-open;
        starts a readiness probe when due)."""
        with self._lock:
            now = self._clock()
            if self._state == "open" and now >= self._open_until:
                self._state, self._trial = "half_open", False
            if self._state == "closed":
                return True
            if self._state == "half_open" and not self._trial:
                self._trial = True
                return True
            start = self._claim_probe(now)
        if start:
            self._run(self._probe_once)
        return False

    def _claim_probe(self, now: float) -> bool:
        """Whether this caller starts the next probe (lock held)."""
        if self._probe is None or self._state != "open" or not self._refused:
            return False
        if self._probing_since is not None and now - self._probing_since < _PROBE_STALE_S:
            return False  # single flight
        if now < self._next_probe:
            return False
        self._probing_since, self._next_probe = now, now + self._probe_interval_s
        self.probes += 1
        return True

    def _probe_once(self) -> None:
        probe = self._probe
        try:
            ready = probe is not None and probe()
        except Exception:  # noqa: BLE001 - an unreachable backend is simply not ready
            ready = False
        with self._lock:
            self._probing_since = None
            if ready and self._state == "open":
                self._open_until = self._clock()  # the next request is the trial

    def success(self) -> None:
        """The backend served: close the circuit and forget past failures."""
        with self._lock:
            self._state, self._failures, self._trial = "closed", 0, False
            self._reset_s = self._base_reset_s

    def failure(self, *, refused: bool = False) -> None:
        """The backend failed (``refused``: it refused the connection): count it; open the
        circuit at the threshold or on a trial."""
        with self._lock:
            if self._state != "open":
                self._refused = refused
            if self._state == "half_open":
                self._reset_s = min(self._reset_s * 2, self._max_reset_s)
                self._open()
            elif self._state == "closed":
                self._failures += 1
                if self._failures >= self._threshold:
                    self._open()

    def neutral(self) -> None:
        """The backend answered without a verdict (e.g. busy): end a trial, change nothing."""
        with self._lock:
            self._trial = False

    def _open(self) -> None:
        self._state, self._trial, self._failures = "open", False, 0
        self._open_until = self._clock() + self._reset_s
        self.opened_count += 1


class RetryBudget:
    """Retries as a share of requests: ``ratio`` tokens per request, one per retry."""

    def __init__(self, ratio: float, *, cap: float = 10.0, initial: float = 1.0) -> None:
        self._ratio = ratio
        self._cap = cap
        self._tokens = min(initial, cap)
        self._lock = threading.Lock()
        self.requests = 0
        self.retries = 0

    def deposit(self) -> None:
        """Count one request."""
        with self._lock:
            self.requests += 1
            self._tokens = min(self._cap, self._tokens + self._ratio)

    def try_spend(self) -> bool:
        """Whether one retry may happen now (and take its token)."""
        with self._lock:
            if self._tokens < 1.0 - 1e-9:  # ten deposits of 0.1 make one token
                return False
            self._tokens = max(0.0, self._tokens - 1.0)
            self.retries += 1
            return True


# --- live load ----------------------------------------------------------------------


@dataclass
class _Reading:
    busy: float
    queue_depth: float
    updated: float
    above_since: dict[float, float | None] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadSnapshot:
    """One backend's averaged load and the age of its last reading."""

    busy: float
    queue_depth: float
    age_s: float


class LoadSettings(Protocol):
    """Where a tracker's half-life and staleness come from: the router's settings (their
    defaults are defined there, once), read by the router and by ``spillway tune``'s replay."""

    @property
    def load_halflife_s(self) -> float: ...

    @property
    def load_stale_s(self) -> float: ...


class LoadTracker:
    """Moving averages of busy fraction and queue depth per backend."""

    def __init__(self, halflife_s: float, stale_s: float, clock: Callable[[], float]) -> None:
        self._halflife_s = halflife_s
        self._stale_s = stale_s
        self._clock = clock
        self._readings: dict[str, _Reading] = {}
        self._lock = threading.Lock()

    @classmethod
    def configured(cls, settings: LoadSettings, clock: Callable[[], float]) -> LoadTracker:
        """The tracker the settings describe, on ``clock``."""
        return cls(settings.load_halflife_s, settings.load_stale_s, clock)

    def observe(self, backend: str, busy: float, queue_depth: float | None = None) -> None:
        """Fold one reading (busy in [0, 1]) into the backend's averages."""
        busy = min(1.0, max(0.0, busy))
        now = self._clock()
        with self._lock:
            reading = self._readings.get(backend)
            if reading is None:
                depth = queue_depth or 0.0
                self._readings[backend] = reading = _Reading(busy, depth, now)
            else:
                weight = 1.0 - math.exp2(-max(0.0, now - reading.updated) / self._halflife_s)
                reading.busy += weight * (busy - reading.busy)
                if queue_depth is not None:
                    reading.queue_depth += weight * (queue_depth - reading.queue_depth)
                reading.updated = now
            for threshold, since in reading.above_since.items():
                if reading.busy <= threshold:
                    reading.above_since[threshold] = None
                elif since is None:
                    reading.above_since[threshold] = now

    def snapshot(self, backend: str) -> LoadSnapshot | None:
        """The backend's averages, or ``None`` before its first reading."""
        with self._lock:
            reading = self._readings.get(backend)
            if reading is None:
                return None
            return LoadSnapshot(reading.busy, reading.queue_depth, self._clock() - reading.updated)

    def sustained_above(self, backend: str, threshold: float, for_s: float) -> bool:
        """Whether the average has stayed above ``threshold`` for at least ``for_s`` seconds."""
        now = self._clock()
        with self._lock:
            reading = self._readings.get(backend)
            if reading is None or now - reading.updated > self._stale_s:
                return False
            if threshold not in reading.above_since:
                reading.above_since[threshold] = now if reading.busy > threshold else None
            since = reading.above_since[threshold]
            return since is not None and now - since >= for_s


def parse_load_headers(headers: dict[str, str]) -> tuple[float, float | None] | None:
    """(busy, queue depth) from a GPU service response's headers, if it sent them."""
    busy = _number(headers.get("x-spillway-busy"))
    if busy is None:
        return None
    return busy, _number(headers.get("x-spillway-queue-depth"))


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None
