"""Live backend load, kept in the warm container as a moving average.

The GPU service reports its state on every infer response (``x-spillway-busy``: the share
of the recent window spent computing, ``x-spillway-queue-depth``); a 429 counts as fully
busy. Readings feed a time-weighted exponential moving average per backend. For each
threshold a policy asks about, the tracker remembers since when the average has stayed
above it, so "above 0.85 for 300 s" is one look-up. A threshold first asked about starts
its clock then (the tracker keeps no history it was not asked to keep), and a reading
older than ``stale_s`` says nothing: the backend counts as cool.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


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


class LoadTracker:
    """Moving averages of busy fraction and queue depth per backend."""

    def __init__(self, halflife_s: float, stale_s: float, clock: Callable[[], float]) -> None:
        self._halflife_s = halflife_s
        self._stale_s = stale_s
        self._clock = clock
        self._readings: dict[str, _Reading] = {}
        self._lock = threading.Lock()

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
