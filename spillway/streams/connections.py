"""A WebSocket connection's state, and the store the gateway keeps it in.

What a connection is (``Connection``): its tenant, when it connected, the next ``seq`` to
deliver, the delivery lease, its counters (``in_flight``, ``frames_in``,
``frames_answered``, ``frames_failed``, ``frames_refused``, ``bytes_in``, ``bytes_out``,
``cost_usd`` and one count per backend), and ``pending``: a map from each ``seq`` in flight
to its frame's token (or ``held`` once its answer waits for its turn). Why a frame may not
be admitted (the bound on frames in flight, the ``seq`` window, a ``seq`` already in
flight or delivered), and ``ConnectionStore``: what the gateway asks of the store, each
operation one atomic step. ``spillway.streams.dynamo_connections`` keeps it all in the
router's state table.

API Gateway chooses connection ids (never a tenant), so they are keys as they are, once
checked to be plain.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from spillway.protocol.errors import InvalidInputError

CONNECTION_PREFIX = "wsconn#"
HELD_PREFIX = "wsheld#"
COUNTERS = (
    "in_flight",
    "frames_in",
    "frames_answered",
    "frames_failed",
    "frames_refused",
    "bytes_in",
    "bytes_out",
    "cost_usd",
)
_CONNECTION_ID = re.compile(r"^[A-Za-z0-9._:=+/-]{1,128}$")
HELD = "held"
"""A ``pending`` entry whose answer is held for its turn (else: its frame's token)."""
SLOW_DOWN, DUPLICATE, OUT_OF_WINDOW = "slow_down", "duplicate_seq", "seq_out_of_window"


@dataclass(frozen=True)
class Connection:
    """A live connection as its item says."""

    id: str
    tenant: str | None
    connected_at: float
    next_seq: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    backends: dict[str, int] = field(default_factory=dict)
    pending: dict[int, str] = field(default_factory=dict)
    lease_owner: str | None = None
    lease_until: float = 0.0

    @property
    def in_flight(self) -> int:
        """Frames received and not yet answered."""
        return int(self.counters.get("in_flight", 0))

    def stats(self) -> dict[str, Any]:
        """The accounting a client may read about its own connection, and the tenant
        ``$connect`` took it for (its own: which key maps to which tenant)."""
        counts = {name: _number(self.counters.get(name, 0)) for name in COUNTERS}
        return {
            "connected_at": self.connected_at,
            "tenant": self.tenant,
            **counts,
            "backends": dict(self.backends),
        }

    def next_is_held(self) -> bool:
        """Whether the answer to ``next_seq`` is held, waiting to be pushed."""
        return self.pending.get(self.next_seq) == HELD

    def serving(self) -> bool:
        """Whether a frame with ``seq`` is still being served (pending, its answer not
        held): its invocation pushes what is held when it holds or pushes its own."""
        return any(state != HELD for state in self.pending.values())

    def leased(self, owner: str, now: float) -> bool:
        """Whether another owner's lease is running (that owner looks again when done)."""
        return self.lease_owner not in (None, owner) and self.lease_until > now

    def refusal(self, seq: int | None, limit: int) -> str | None:
        """Why a frame of this ``seq`` may not be admitted now; ``None``: it may. The frame
        every held answer waits for (``seq == next_seq``) is never told to slow down: its
        answer is what frees the others (refused, a client that waits for an answer before
        sending it again would wait for good), so ``in_flight`` is at most ``limit`` + 1."""
        if self.in_flight >= limit and (seq is None or seq != self.next_seq):
            return SLOW_DOWN
        if seq is None:
            return None
        if seq >= self.next_seq + limit:
            return OUT_OF_WINDOW
        if seq < self.next_seq or seq in self.pending:
            return DUPLICATE
        return None


@dataclass(frozen=True)
class Admission:
    """A frame admitted (``connection``: its item just after) or refused (``refusal``:
    ``slow_down``, ``duplicate_seq`` or ``seq_out_of_window``)."""

    connection: Connection
    refusal: str | None = None

    @property
    def admitted(self) -> bool:
        """Whether the frame may be served."""
        return self.refusal is None

    @property
    def in_flight(self) -> int:
        """Frames in flight (the admitted frame's own included)."""
        return self.connection.in_flight


class ConnectionStore(Protocol):
    """Connection items, held answers and the delivery lease; ``now`` is epoch seconds."""

    def open(self, connection_id: str, tenant: str | None, now: float, ttl_s: float) -> None:
        """Write a fresh item (zero counters) for a new connection."""
        ...

    def get(self, connection_id: str, now: float) -> Connection | None:
        """The live connection, read consistently; ``None`` when absent or expired."""
        ...

    def admit(
        self,
        connection_id: str,
        size: int,
        limit: int,
        now: float,
        seq: int | None = None,
        token: str = "",
    ) -> Admission | None:
        """Count a received frame of ``size`` bytes and admit it (``in_flight`` + 1, its
        ``seq`` pending under ``token``) while fewer than ``limit`` are in flight and its
        ``seq`` is within ``[next_seq, next_seq + limit)``, neither delivered nor in
        flight; else count it refused. ``None``: no live connection."""
        ...

    def count(
        self, connection_id: str, deltas: Mapping[str, float], backend: str | None = None
    ) -> None:
        """Add ``deltas`` to counters (and one to ``backend``'s count); nothing when the
        connection is gone."""
        ...

    def claim(self, connection_id: str, seq: int, owner: str, now: float, until: float) -> bool:
        """Take the delivery lease until ``until`` to push ``seq``: only while ``seq`` is
        ``next_seq`` and no other owner holds a lease that is still running (``owner``
        may take its own again, so a retried write is not refused)."""
        ...

    def finish(
        self,
        connection_id: str,
        seq: int,
        owner: str,
        now: float,
        deltas: Mapping[str, float],
        backend: str | None = None,
        *,
        held: bool = True,
    ) -> Connection | None:
        """After ``seq``'s answer was pushed, in one write: ``next_seq`` becomes ``seq +
        1`` (only from ``seq``, only while ``owner`` holds the lease), the lease is given
        back, ``seq`` leaves ``pending``, ``in_flight`` - 1 and ``deltas`` (and one to
        ``backend``) are added; ``seq``'s answer, when it was ``held``, is deleted. The
        connection just after; ``None`` when ``seq`` was not ``owner``'s to finish."""
        ...

    def hold(
        self,
        connection_id: str,
        seq: int,
        answer: bytes,
        now: float,
        ttl_s: float,
        deltas: Mapping[str, float],
        backend: str | None = None,
    ) -> Connection | None:
        """Store ``seq``'s answer, mark it held in ``pending`` and add ``deltas`` (and one
        to ``backend``); the connection just after (``None``: it is gone)."""
        ...

    def held(self, connection_id: str, seq: int, now: float) -> bytes | None:
        """``seq``'s held answer; ``None`` when absent."""
        ...

    def release(self, connection_id: str, owner: str) -> None:
        """Give the delivery lease back (only ``owner``'s)."""
        ...

    def withdraw(self, connection_id: str, seq: int | None) -> None:
        """Take an admitted frame back, refused after all (its tenant's budget): ``in_flight``
        - 1, ``frames_refused`` + 1 and its ``seq`` out of ``pending``, open again."""
        ...

    def close(self, connection_id: str, now: float, window: int) -> Connection | None:
        """Delete the connection's item and every answer held in its window; the
        connection as it was last (``None`` if there was none)."""
        ...


def connection_key(connection_id: str) -> str:
    """The key of a connection's item; an id that is not plain is refused."""
    if not _CONNECTION_ID.fullmatch(connection_id):
        raise InvalidInputError("not a WebSocket connection id")
    return f"{CONNECTION_PREFIX}{connection_id}"


def held_key(connection_id: str, seq: int) -> str:
    """The key of an answer held for ``seq``."""
    connection_key(connection_id)
    return f"{HELD_PREFIX}{connection_id}#{seq}"


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else float(value)
