"""The batcher's queue: requests waiting by length bucket, priority level and tenant.

A ``Bucket`` holds one length bucket's queued requests, counts their rows and its batches
being computed; each of its ``Level``s (index 0 is priority 1, the highest) keeps one FIFO
queue per tenant scope, so a tenant's own requests keep their order while the batcher
chooses between tenants (``gpu_service.fair_share``). A request that leaves before it
runs (expired, cancelled, failed) is only marked ``LEFT``: ``heads()`` drops it when it
reaches the front of its queue, so leaving costs no search. What goes next, and when, is
the batcher's decision (``gpu_service.batcher``); this module only holds the requests.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from gpu_service.batch_compute import Computed
from gpu_service.compute_budget import Turn
from gpu_service.fair_share import Scope
from spillway import tracing
from spillway.models.processing import Prepared
from spillway.protocol.errors import SpillwayError

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext


class State(Enum):
    """Where a request stands: waiting, in a batch, or gone without running."""

    QUEUED = 1
    RUNNING = 2
    LEFT = 3  # expired, cancelled or failed before it ran


@dataclass(eq=False)
class Pending:
    """One admitted request: its rows to compute and the future its caller awaits."""

    prepared: Prepared
    level: int
    arrival: float
    bucket: int
    future: asyncio.Future[Computed]
    scope: Scope = None
    seq: int = 0
    """Admission order (FIFO among equal arrival times)."""
    deadline: float | None = None
    timer: asyncio.TimerHandle | None = None
    state: State = State.QUEUED
    link: SpanContext | None = field(default_factory=tracing.current_link)
    """The request's span where it was admitted (``None``: not traced): its batch's
    ``spillway.batch`` span links to it."""

    def settle(self, *, result: Computed | None = None, error: SpillwayError | None = None) -> None:
        """Answer the caller once: the first answer wins, later ones are dropped."""
        if self.timer is not None:
            self.timer.cancel()
        if self.future.done():
            return
        if error is not None:
            self.future.set_exception(error)
        elif result is not None:
            self.future.set_result(result)


@dataclass
class Level:
    """One priority level of a bucket: a FIFO queue per tenant scope."""

    queues: dict[Scope, deque[Pending]] = field(default_factory=dict)

    def append(self, pending: Pending) -> None:
        self.queues.setdefault(pending.scope, deque()).append(pending)

    def heads(self) -> list[Pending]:
        """Each tenant's first queued request; ones that left are dropped here."""
        heads = []
        for scope in list(self.queues):
            queue = self.queues[scope]
            while queue and queue[0].state is not State.QUEUED:
                queue.popleft()
            if queue:
                heads.append(queue[0])
            else:
                del self.queues[scope]
        return heads

    def pop(self, head: Pending) -> None:
        """Take ``head``, its tenant's first queued request."""
        queue = self.queues[head.scope]
        queue.popleft()
        if not queue:
            del self.queues[head.scope]

    def drain(self) -> list[Pending]:
        """Every request still held, emptied out."""
        held = [p for queue in self.queues.values() for p in queue]
        self.queues.clear()
        return held


@dataclass
class Bucket:
    """One length bucket: its priority levels, queued rows and batches computing now."""

    index: int
    levels: list[Level]
    rows: int = 0
    running: int = 0
    row_s: float = 0.0
    """Measured seconds of compute per row of this bucket's runs (a moving average; 0
    before the first run): the device's budget estimates waits and short runs by it."""

    def measured(self, rows: int, seconds: float) -> None:
        """A run of ``rows`` took ``seconds``."""
        per_row = seconds / max(rows, 1)
        self.row_s = per_row if not self.row_s else self.row_s + _WEIGHT * (per_row - self.row_s)

    def heads(self) -> list[Pending]:
        """The first queued request of each tenant at each level."""
        return [head for level in self.levels for head in level.heads()]

    def turn(self, level: int, horizon_s: float) -> Turn:
        """Its most urgent head's turn in the device's order, for a model at priority
        ``level`` whose requests without a deadline count one ``horizon_s`` after their
        arrival (the bucket must have a head)."""
        return min(turn_of(head, level, horizon_s) for head in self.heads())

    def work_before(self, turn: Turn, level: int, horizon_s: float) -> float:
        """Seconds of compute its queued requests whose turn comes before ``turn`` need,
        at the measured seconds per row."""
        if not self.row_s:
            return 0.0
        rows = sum(
            pending.prepared.rows
            for lane in self.levels
            for queue in lane.queues.values()
            for pending in queue
            if pending.state is State.QUEUED and turn_of(pending, level, horizon_s) < turn
        )
        return rows * self.row_s


def turn_of(pending: Pending, level: int, horizon_s: float) -> Turn:
    """A queued request's turn: by its deadline, else by its arrival plus ``horizon_s``."""
    deadline = pending.arrival + horizon_s if pending.deadline is None else pending.deadline
    return Turn(level, deadline, pending.arrival)


_WEIGHT = 0.2
"""How much the latest run moves a bucket's seconds per row: about the last ten count."""
