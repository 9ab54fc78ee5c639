"""Quotas on what a tenant holds in the state table: how many items, and how many bytes.

One ledger item per tenant and kind (``quota#<kind>#<scope>``) lists what the tenant
holds: entry name → ``[bytes, expires_at]``. A charge reads the ledger, checks the limits
and writes it back only if nobody wrote it since (its revision): the table's conditional
write is the atomic step, so concurrent writers of one tenant, on any router instance,
never pass the quota together. Another tenant has another ledger and never waits on it.

Held items expire by their own TTL and reads renew them without writing the ledger, so an
entry's ``expires_at`` is the earliest its item can be gone, never later. An entry that
looks expired still counts until ``probe`` (a read of the held item) confirms it is gone;
that read happens only when a charge would not fit otherwise, oldest entries first and at
most ``PROBES`` per charge. A charge made before its item is written, and a release that
could not be written, leave an entry for an item that is not there: it counts until its
expiry and is then probed away. The ledger errs on counting too much, for at most a TTL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spillway.protocol.errors import OverloadedError, QuotaExceededError, StateUnavailableError
from spillway.state.table import StateStore, StoredItem, ttl_value

log = logging.getLogger("spillway.quota")

PROBES = 64
"""Items read, at most, to learn whether entries that look expired are gone."""
_ATTEMPTS = 8
_ENTRIES = "entries"

Probe = Callable[[str, float], float | None]
"""The live expiry (epoch seconds) of the item an entry names, ``None`` if it is gone."""


@dataclass(frozen=True)
class QuotaLimits:
    """What one tenant may hold of one kind."""

    count: int
    bytes: int


class QuotaLedger:
    """The ledgers of one kind of held item (``noun``: how a refusal names them)."""

    def __init__(self, store: StateStore, kind: str, limits: QuotaLimits, noun: str) -> None:
        self.store = store
        self.kind = kind
        self.limits = limits
        self.noun = noun

    def key(self, scope: str) -> str:
        """The ledger item of the tenant whose key segment is ``scope``."""
        return f"quota#{self.kind}#{scope}"

    def charge(
        self, scope: str, name: str, size: int, now: float, expires_at: float, probe: Probe
    ) -> None:
        """Record that the tenant holds ``name`` (``size`` bytes, until ``expires_at``),
        replacing what ``name`` held before; ``QuotaExceededError`` when it does not fit."""
        key = self.key(scope)
        for _ in range(_ATTEMPTS):
            item = self.store.get(key, now)
            entries = _entries(item)
            held = entries.pop(name, None)
            if held is not None and held[0] == size:
                return  # held already at this size; its expiry is a lower bound anyway
            probed = self._make_room(entries, size, now, probe)
            refusal = self._refusal(entries, size)
            if refusal is not None:
                if held is not None:
                    entries[name] = held
                if probed:
                    self._write(key, item, entries, now)  # keep what the probes learnt
                raise QuotaExceededError(refusal, retry_after_s=_room_in(entries, now))
            entries[name] = (size, float(ttl_value(expires_at)))
            if self._write(key, item, entries, now):
                return
        raise OverloadedError(
            f"too many concurrent {self.noun} writes for this tenant; retry", retry_after_s=1.0
        )

    def release(self, scope: str, name: str, now: float) -> None:
        """Forget ``name`` (its item was deleted). Best effort: an entry left behind is
        probed away once it looks expired, so a failure here is logged, not raised."""
        key = self.key(scope)
        try:
            for _ in range(_ATTEMPTS):
                item = self.store.get(key, now)
                entries = _entries(item)
                if entries.pop(name, None) is None or self._write(key, item, entries, now):
                    return
        except StateUnavailableError as exc:
            log.warning("quota release not recorded: %s", exc.message, extra={"kind": self.kind})
            return
        log.warning("quota release lost to concurrent writers", extra={"kind": self.kind})

    def _fits(self, entries: dict[str, tuple[int, float]], size: int) -> bool:
        total = sum(held for held, _ in entries.values())
        return len(entries) < self.limits.count and total + size <= self.limits.bytes

    def _make_room(
        self, entries: dict[str, tuple[int, float]], size: int, now: float, probe: Probe
    ) -> bool:
        """Probe entries that look expired, oldest first, until the charge fits; whether
        any entry changed."""
        if self._fits(entries, size):
            return False
        stale = sorted((e[1], n) for n, e in entries.items() if e[1] <= now)[:PROBES]
        for _, name in stale:
            live = probe(name, now)
            if live is None:
                del entries[name]
            else:
                entries[name] = (entries[name][0], live)
            if self._fits(entries, size):
                break
        return bool(stale)

    def _refusal(self, entries: dict[str, tuple[int, float]], size: int) -> str | None:
        if len(entries) >= self.limits.count:
            return (
                f"this tenant holds {len(entries)} {self.noun}, its quota; delete one or let "
                "one expire"
            )
        total = sum(held for held, _ in entries.values()) + size
        if total > self.limits.bytes:
            return (
                f"this tenant's {self.noun} would hold {total} bytes, past its quota of "
                f"{self.limits.bytes} bytes"
            )
        return None

    def _write(
        self,
        key: str,
        item: StoredItem | None,
        entries: dict[str, tuple[int, float]],
        now: float,
    ) -> bool:
        doc: dict[str, Any] = {_ENTRIES: {n: [b, e] for n, (b, e) in entries.items()}}
        if item is None:
            return self.store.create(key, doc, now, None)
        return self.store.replace(key, doc, item.revision, None)


def _entries(item: StoredItem | None) -> dict[str, tuple[int, float]]:
    if item is None:
        return {}
    raw: dict[str, list[float]] = item.doc.get(_ENTRIES, {})
    return {name: (int(held), float(expires)) for name, (held, expires) in raw.items()}


def _room_in(entries: dict[str, tuple[int, float]], now: float) -> float:
    """Seconds until the first entry may expire and free room (at least one)."""
    first = min((expires for _, expires in entries.values()), default=now)
    return max(1.0, first - now)
