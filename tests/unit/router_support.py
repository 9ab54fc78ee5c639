"""What every unit-test router replaces, written once: in-memory backends, a clock that
moves only when told to, a fixed wall time, seeded spill draws and metrics in a string.
The router, canary and session tests build their routers with it."""

from __future__ import annotations

import io
import random
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from spillway.policy.accounting import EmfSink
from spillway.policy.backend import Backend
from spillway.router.wiring import Overrides
from spillway.state.table import StateStore

NOON = datetime(2026, 1, 15, 12, tzinfo=UTC)
"""The router's wall clock in unit tests (a Thursday, for the policies' time windows)."""


def fake_overrides(
    backends: Mapping[str, Backend],
    clock: Callable[[], float],
    metrics: io.StringIO,
    *,
    state: StateStore | None = None,
) -> Overrides:
    """The router's time from ``clock``, its wall at ``NOON``, spill draws seeded, metric
    lines written to ``metrics``; with a state table, ``clock`` is its epoch clock too."""
    return Overrides(
        clock=clock,
        wall=lambda: NOON,
        rng=random.Random(7),
        backends=backends,
        sink=EmfSink(stream=metrics),
        state=state,
        epoch=clock if state is not None else None,
    )
