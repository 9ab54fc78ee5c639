"""The life of an asynchronous request's record: which transitions are allowed, and what
each one decides. Plain functions of a record and a time, so the rules are tested in the
process with any clock; ``spillway.async_inference.store`` makes each transition one
conditional DynamoDB write whose condition states the same guard, so whatever SQS
redelivers and whichever consumer crashes, the table decides who won.

::

    queued ──claim──▶ running ──settle──▶ succeeded | failed
      ▲                │  └─ lease ended: a redelivery's claim takes it over
      └───release──────┘     (a server fault with deliveries left)

    pending, no live lease, deliveries used up or message lost ──▶ failed (delivery_lost)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spillway.async_inference.records import DONE, AsyncRecord, State
from spillway.async_inference.settings import AsyncSettings

ORPHAN_AFTER_S = 300.0
"""How long a pending record must have been untouched, with the queue empty, before the
drain check takes its message as lost (SQS's counts lag by about a minute)."""
MAX_VISIBILITY_S = 43_200
"""The longest SQS lets a delivery stay hidden (12 hours)."""

Outcome = Literal["succeeded", "failed", "dead_letter", "retry"]
"""What a settled run leads to: final success, final failure (the client's error), final
failure of the last delivery of a server fault (its message to the dead-letter queue),
or another delivery."""


def is_server_fault(status: int) -> bool:
    """Whether a failed run is the server's (retried), not the client's (final)."""
    return status >= 500 or status == 429


def final_state(status: int) -> State:
    """The state a final outcome with this status records."""
    return "succeeded" if status < 300 else "failed"


@dataclass(frozen=True)
class Lifecycle:
    """The transition rules under one set of limits (``of(settings)``)."""

    lease_s: int
    """How long a claim holds a request (the queue's visibility timeout)."""
    max_attempts: int
    """Deliveries before a request that keeps failing is given up."""

    @classmethod
    def of(cls, settings: AsyncSettings) -> Lifecycle:
        """The rules the settings describe."""
        return cls(lease_s=settings.lease_s, max_attempts=settings.max_attempts)

    @property
    def orphan_after_s(self) -> float:
        """How long an untouched pending record waits before its message counts as lost
        (never less than a lease: a live claim's record is not touched while it runs)."""
        return max(float(self.lease_s), ORPHAN_AFTER_S)

    # --- claims and leases --------------------------------------------------------

    def is_held(self, record: AsyncRecord, now: float) -> bool:
        """Whether a consumer holds the request under a live lease."""
        return record.state == "running" and record.lease_until >= now

    def is_claimable(self, record: AsyncRecord | None, now: float) -> bool:
        """Whether a delivery may take the request: it is queued, or running under a
        lease that has ended (its consumer crashed or ran past it: a redelivery takes
        over). The store's claim writes with this guard as its condition."""
        if record is None:
            return False
        return record.state == "queued" or (record.state == "running" and record.lease_until < now)

    def is_settled(self, record: AsyncRecord | None) -> bool:
        """Whether a delivery has nothing left to run: the request is unknown (expired)
        or finished; its message is deleted."""
        return record is None or record.state in DONE

    def lease_until(self, now: float) -> float:
        """When a claim made at ``now`` ends."""
        return now + self.lease_s

    def claimed(self, record: AsyncRecord, owner: str, now: float) -> AsyncRecord:
        """The record after ``owner`` claims it at ``now`` (one more attempt)."""
        return record.model_copy(
            update={
                "state": "running",
                "lease_until": self.lease_until(now),
                "owner": owner,
                "updated_at": now,
                "attempts": record.attempts + 1,
            }
        )

    def redelivery_in(self, record: AsyncRecord, now: float) -> int | None:
        """After a claim lost to a live lease: the seconds until its delivery should come
        back (when the lease ends, not sooner, so a long run costs one extra delivery per
        lease, no more); None to leave the delivery as it is."""
        left = int(record.lease_until - now) + 1
        if record.state == "running" and left > 0:
            return min(left, MAX_VISIBILITY_S)
        return None

    # --- settles --------------------------------------------------------------------

    def may_settle(self, record: AsyncRecord, owner: str | None) -> bool:
        """Whether the attempt ``owner`` may still record its outcome: the request is
        running under its claim (a later claim or a settle by another attempt wins).
        The store's settle and release write with this guard as their condition."""
        return record.state == "running" and record.owner == owner

    def outcome(self, status: int, receive_count: int) -> Outcome:
        """What a run that answered ``status`` on its ``receive_count``-th delivery leads
        to: a client's error fails at once, a server's is retried until the last delivery."""
        if status < 300:
            return "succeeded"
        if not is_server_fault(status):
            return "failed"
        if receive_count >= self.max_attempts:
            return "dead_letter"
        return "retry"

    def retry_in(self, receive_count: int) -> int:
        """The backoff before a released delivery shows again: doubling, at most a lease."""
        return int(min(2**receive_count, self.lease_s))

    # --- lost messages ----------------------------------------------------------------

    def is_lost(self, record: AsyncRecord, now: float, *, queue_empty: bool) -> bool:
        """Whether a pending request's message is gone: no live lease holds it, and its
        deliveries are used up (the queue's redrive took the message after a consumer
        crashed on the last one) or the queue is empty and it has been untouched longer
        than ``orphan_after_s`` (a send that failed after the record was written, a
        purge). The store fails it only if its attempts are still those read."""
        if record.state in DONE or self.is_held(record, now):
            return False
        exhausted = record.attempts >= self.max_attempts
        orphaned = queue_empty and now - record.updated_at > self.orphan_after_s
        return exhausted or orphaned
