"""Fair share of compute between tenants: while others wait, no tenant holds more than
its share.

Every request a batcher queues carries its tenant's scope, as the data plane hands it
down (``gpu_service.served.InferCall.scope``; ``None``, a request no tenant's scope was
proven for, is one tenant of its own). When a batch is formed, among the requests that
may go next (the same priority level, aging aside) the first taken is the one whose
tenant has been served least lately: its **usage** (rows dispatched, halving every
``half_life_s``) plus the rows it already has in the batch being formed; ties go to the
request that came first. So a tenant with 900 queued crops takes turns with one that
has 5, whose rows join the next batch instead of waiting behind the 900; two busy
tenants alternate; a tenant alone gets every batch (nothing is held back for a tenant
that sends nothing).

The rule lives here once, on an injected clock, apart from the batcher's mechanics:
one ``FairShare`` may serve every batcher of a device (the per-device compute budget
builds on it), and its unit is whatever the caller charges (the batchers: rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

Scope = str | None
"""A tenant scope (``None``: requests no tenant's scope was proven for, as one)."""

MAX_TENANTS = 1024
"""Tenants whose usage is remembered; past it the least-used half is forgotten (a
forgotten tenant counts as unserved, which only ever favours it)."""


@dataclass
class FairShare:
    """Recent usage per tenant, decaying by half every ``half_life_s`` seconds of the
    caller's clock, and the order it gives waiting tenants."""

    half_life_s: float = 1.0
    max_tenants: int = MAX_TENANTS
    _usage: dict[Scope, tuple[float, float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.half_life_s <= 0:
            raise ValueError("half_life_s must be positive")
        if self.max_tenants < 2:
            raise ValueError("max_tenants must be at least 2")

    def usage(self, scope: Scope, now: float) -> float:
        """What ``scope`` was charged lately, decayed to ``now``."""
        entry = self._usage.get(scope)
        if entry is None:
            return 0.0
        amount, at = entry
        decay: float = 0.5 ** (max(0.0, now - at) / self.half_life_s)
        return amount * decay

    def charge(self, scope: Scope, amount: float, now: float) -> None:
        """``scope`` was given ``amount`` of compute (rows) at ``now``."""
        self._usage[scope] = (self.usage(scope, now) + amount, now)
        if len(self._usage) > self.max_tenants:
            ranked = sorted(self._usage, key=lambda s: self.usage(s, now), reverse=True)
            for forgotten in ranked[self.max_tenants // 2 :]:
                del self._usage[forgotten]

    def rank(self, scope: Scope, now: float, taken: Mapping[Scope, float]) -> float:
        """Lower goes first: ``scope``'s usage plus what ``taken`` (the batch being
        formed) already gives it."""
        return self.usage(scope, now) + taken.get(scope, 0.0)
