"""The capture buffer: records waiting to be written, bounded in bytes, grouped per object.

Records are grouped by what one S3 object holds: one tenant's records of one model in one
hour (``Group``), so an object never mixes tenants. ``offer`` takes a record when it fits
under ``max_bytes`` and otherwise drops it and counts the drop: it never waits. A group
is due once it holds ``flush_bytes`` or its oldest record has waited ``flush_s``;
``take_due`` hands the due groups over as batches, whose bytes still count against the
bound until the writer says they were written (``done``) or gives them back (``retry``):
what the buffer counts is all that capture holds in memory, the batches being written
included.

All times come from the injected monotonic ``clock``; one lock guards everything, held
only for list and counter updates.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from spillway.capture.records import Captured


@dataclass(frozen=True)
class Group:
    """What one object holds: a tenant's (its scope) records of one model in one hour."""

    scope: str
    model: str
    hour: str
    """``YYYY/MM/DD/HH`` (UTC) of the records' time."""


@dataclass
class Batch:
    """A group's records on their way to one object."""

    group: Group
    items: list[Captured]
    size: int
    attempts: int = 0


@dataclass
class _Pending:
    items: list[Captured] = field(default_factory=list)
    size: int = 0
    since: float = 0.0
    attempts: int = 0
    held_until: float = 0.0
    """A batch given back waits until then, however full its group."""


class CaptureBuffer:
    """Records waiting to be written, at most ``max_bytes`` of them (batches in flight
    included)."""

    def __init__(
        self,
        *,
        max_bytes: int,
        flush_bytes: int,
        flush_s: float,
        clock: Callable[[], float],
        max_attempts: int = 3,
    ) -> None:
        self.max_bytes = max_bytes
        self.flush_bytes = flush_bytes
        self.flush_s = flush_s
        self.max_attempts = max_attempts
        self._clock = clock
        self._lock = threading.Lock()
        self._groups: dict[Group, _Pending] = {}
        self._bytes = 0
        self._full_group = False
        self.accepted = 0
        """Records taken, ever."""
        self.dropped = 0
        """Records dropped, ever: no room, or a batch that failed ``max_attempts`` times."""
        self._unreported = 0

    @property
    def bytes(self) -> int:
        """Bytes held now: records waiting and batches being written."""
        return self._bytes

    def offer(self, group: Group, item: Captured) -> bool:
        """Take ``item`` when it fits, else drop it (counted); never waits for room."""
        size = item.size
        with self._lock:
            if self._bytes + size > self.max_bytes:
                self._drop(1)
                return False
            pending = self._groups.get(group)
            if pending is None:
                pending = self._groups[group] = _Pending(since=self._clock())
            pending.items.append(item)
            pending.size += size
            self._bytes += size
            self.accepted += 1
            if pending.size >= self.flush_bytes:
                self._full_group = True
            return True

    def due(self) -> bool:
        """Whether some group is due now (full, or its oldest record waited ``flush_s``)."""
        with self._lock:
            if self._full_group:
                return True
            now = self._clock()
            return any(
                now - p.since >= self.flush_s and now >= p.held_until for p in self._groups.values()
            )

    def next_due_in(self) -> float | None:
        """Seconds until the oldest group is due by age (``None``: nothing waits)."""
        with self._lock:
            if not self._groups:
                return None
            now = self._clock()
            return max(
                0.0,
                min(
                    max(p.held_until, p.since + (0 if p.size >= self.flush_bytes else self.flush_s))
                    for p in self._groups.values()
                )
                - now,
            )

    def take_due(self, *, everything: bool = False) -> list[Batch]:
        """The due groups (every group with ``everything``) as batches, oldest first; their
        bytes stay counted until ``done`` or ``retry``."""
        with self._lock:
            now = self._clock()
            due = [
                (group, pending)
                for group, pending in self._groups.items()
                if everything
                or (
                    now >= pending.held_until
                    and (pending.size >= self.flush_bytes or now - pending.since >= self.flush_s)
                )
            ]
            for group, _ in due:
                del self._groups[group]
            self._full_group = any(p.size >= self.flush_bytes for p in self._groups.values())
        due.sort(key=lambda entry: entry[1].since)
        return [Batch(group, p.items, p.size, p.attempts) for group, p in due]

    def done(self, batch: Batch) -> None:
        """``batch`` was written: its bytes are free."""
        with self._lock:
            self._bytes -= batch.size

    def retry(self, batch: Batch) -> bool:
        """``batch`` could not be written: back in the buffer to be tried again after
        ``flush_s``, or dropped (counted) once it has failed ``max_attempts`` times.
        Whether it was kept."""
        attempts = batch.attempts + 1
        with self._lock:
            if attempts >= self.max_attempts:
                self._bytes -= batch.size
                self._drop(len(batch.items))
                return False
            now = self._clock()
            pending = self._groups.get(batch.group)
            if pending is None:
                pending = self._groups[batch.group] = _Pending(since=now)
            pending.items[:0] = batch.items
            pending.size += batch.size
            pending.attempts = max(pending.attempts, attempts)
            pending.held_until = now + self.flush_s
            return True

    def take_dropped(self) -> int:
        """Drops since the last call (to report them once)."""
        with self._lock:
            count, self._unreported = self._unreported, 0
            return count

    def _drop(self, count: int) -> None:
        self.dropped += count
        self._unreported += count
