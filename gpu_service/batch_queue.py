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

from gpu_service.batch_compute import Computed
from gpu_service.fair_share import Scope
from spillway.models.processing import Prepared
from spillway.protocol.errors import SpillwayError


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

    def heads(self) -> list[Pending]:
        """The first queued request of each tenant at each level."""
        return [head for level in self.levels for head in level.heads()]
