"""A circuit breaker per backend, and the retry budget.

Closed: requests pass; ``failures`` consecutive failures open the circuit. Open: requests
skip the backend until ``reset_s`` has passed, then the circuit is half-open and lets
exactly one trial request through. The trial's success closes it (and the wait returns
to ``reset_s``); its failure re-opens it with the wait doubled, up to ``max_reset_s``. A
neutral outcome (the backend answered but was busy) ends the trial without a verdict.
Every caller that was allowed through must report exactly one outcome.

The retry budget allows a retry for every ``1 / ratio`` requests on average (a token
bucket filled by ``ratio`` per request, capped), so a failing backend never sees more
than ``ratio`` extra load from retries.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Literal

State = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """Closed → open after N consecutive failures → half-open after a growing wait."""

    def __init__(
        self,
        name: str,
        *,
        failures: int = 5,
        reset_s: float = 5.0,
        max_reset_s: float = 120.0,
        clock: Callable[[], float],
    ) -> None:
        if failures < 1 or reset_s <= 0 or max_reset_s < reset_s:
            raise ValueError("need failures >= 1 and 0 < reset_s <= max_reset_s")
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
        """Whether a request may go to the backend now (claims the trial when half-open)."""
        with self._lock:
            if self._state == "open" and self._clock() >= self._open_until:
                self._state, self._trial = "half_open", False
            if self._state == "closed":
                return True
            if self._state == "half_open" and not self._trial:
                self._trial = True
                return True
            return False

    def success(self) -> None:
        """The backend served: close the circuit and forget past failures."""
        with self._lock:
            self._state, self._failures, self._trial = "closed", 0, False
            self._reset_s = self._base_reset_s

    def failure(self) -> None:
        """The backend failed: count it; open the circuit at the threshold or on a trial."""
        with self._lock:
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
