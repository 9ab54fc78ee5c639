"""How a model version's requests are batched dynamically (not AWS Batch jobs): the
policy built from ``config.json`` and the settings, and the tracker of recent arrivals
that the adaptive target and early dispatch read. Invalid combinations fail when the
model loads, never per request."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from gpu_service.settings import GpuSettings
from spillway.models.config import ModelConfig
from spillway.protocol.errors import InvalidInputError


@dataclass(frozen=True)
class BatchingPolicy:
    """How a model version's requests are batched (from ``config.json`` and settings)."""

    max_batch_size: int
    max_queue_delay_s: float = 0.002
    preferred_batch_sizes: tuple[int, ...] = ()
    min_batch_size: int | None = None
    adaptive: bool = False
    max_queue_size: int = 256
    priority_levels: int = 1
    default_priority: int = 1
    default_timeout_s: float | None = None
    allow_timeout_override: bool = True
    aging_s: float = 0.1
    length_buckets: tuple[int, ...] = ()
    """Edges of ``Prepared.length`` that requests queue apart by: token lengths for text,
    padded widths for a variable-width image (``SpillwayBlock.batch_buckets``)."""
    concurrency: int = 1
    """Batches of one length bucket that may compute at once (the device's compute budget
    bounds them all together)."""
    compute_level: int = 2
    """The model's priority level in the device's compute budget (1 first;
    ``spillway.compute.priority``)."""
    slots_per_run: int = 1
    """Slots of the device's compute budget one run holds (``spillway.compute.slots``)."""
    horizon_s: float = 5.0
    """For a request without a deadline, the budget orders it as if it had this one: the
    model's ``spillway.latency_budget_ms``, else the router's default deadline."""
    retry_after_s: float = 1.0
    merge: bool = True
    """Whether a run may hold several requests (dynamic batching). Off (a model without a
    ``dynamic_batching`` block): one request per run, however many rows it has."""
    early_dispatch: bool = False
    """Dispatch before the target or the delay when waiting cannot gain a row (see
    ``DynamicBatcher``). Off, a batch waits for its target or its oldest request's delay,
    as Triton's dynamic batcher does."""
    fair_share: bool = True
    """Order waiting requests by tenant: the tenant served least lately goes first
    (``gpu_service.fair_share``), so one tenant's many requests never hold the model
    while another's wait. Off: first come, first served (Triton's order)."""
    fair_share_half_life_s: float = 1.0
    """How quickly a tenant's past usage stops counting against it (it halves this often)."""

    @property
    def max_parallel_runs(self) -> int:
        """Runs of this model that may be in flight at once (``concurrency`` per bucket)."""
        return self.concurrency * (len(self.length_buckets) + 1)

    def level_of(self, priority: int) -> int:
        """The queue level of a request's ``priority`` (0: the model's default level)."""
        levels = self.priority_levels
        priority = priority or self.default_priority
        if not 1 <= priority <= levels:
            raise InvalidInputError(f"priority must be between 1 and {levels}, or 0")
        return priority - 1

    def timeout_of(self, requested: float | None) -> float | None:
        """A request's timeout: its own, within the model's default (when it may override
        it), else that default."""
        default = self.default_timeout_s
        if requested is not None and requested < 0:
            raise InvalidInputError("timeout must not be negative")
        if requested is None or not self.allow_timeout_override:
            return default
        return requested if default is None else min(requested, default)

    def bucket_of(self, length: int) -> int:
        """The index of the first bucket edge that holds ``length`` (the last if none)."""
        for index, edge in enumerate(self.length_buckets):
            if length <= edge:
                return index
        return len(self.length_buckets)


RECENT_S = 1.0
"""How long an arrival counts as recent traffic when predicting company for a batch."""


@dataclass
class RateTracker:
    """Recent arrivals: their inter-arrival gaps (the p50 rate) and how many requests each
    found in the batcher's hands, itself included (the crowd that traffic brings)."""

    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    last: float | None = None
    crowds: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))

    def arrive(self, now: float, crowd: int = 1) -> None:
        if self.last is not None:
            self.gaps.append(max(now - self.last, 1e-6))
        self.last = now
        self.crowds.append((now, crowd))

    def p50_rate(self) -> float:
        if not self.gaps:
            return 0.0
        return 1.0 / sorted(self.gaps)[len(self.gaps) // 2]

    def crowd(self, now: float) -> int:
        """The most requests in hand at once among the last ``RECENT_S`` of arrivals; a
        closed population of clients never brings more than that (0: no recent traffic)."""
        since = now - RECENT_S
        return max((n for at, n in self.crowds if at >= since), default=0)


def batching_policy(config: ModelConfig, settings: GpuSettings) -> BatchingPolicy:
    """A batcher policy from the model's Triton-style config and the service settings."""
    dyn = config.dynamic_batching
    budget_ms = config.spillway.latency_budget_ms
    common: dict[str, Any] = {
        "concurrency": settings.compute_slots_per_bucket(),
        "compute_level": config.spillway.compute.priority,
        "slots_per_run": config.spillway.compute.slots,
        "horizon_s": (budget_ms or settings.default_horizon_ms) / 1e3,
        "retry_after_s": settings.retry_after_s,
        "fair_share": settings.fair_share,
        "fair_share_half_life_s": settings.fair_share_half_life_s,
    }
    if config.max_batch_size == 0 or dyn is None:
        # No dynamic batching: one request per run, still queued and bounded.
        return BatchingPolicy(
            max_batch_size=max(config.max_batch_size, 1),
            max_queue_delay_s=0.0,
            merge=False,
            length_buckets=config.spillway.batch_buckets,
            **common,
        )
    queue = dyn.default_queue_policy
    timeout_us = queue.default_timeout_microseconds
    default_ms = settings.default_timeout_ms
    default_timeout = timeout_us / 1e6 if timeout_us else (default_ms / 1e3 if default_ms else None)
    return BatchingPolicy(
        max_batch_size=config.max_batch_size,
        max_queue_delay_s=dyn.max_queue_delay_microseconds / 1e6,
        preferred_batch_sizes=tuple(
            s for s in dyn.preferred_batch_size if s <= config.max_batch_size
        ),
        min_batch_size=settings.min_batch_size,
        adaptive=settings.adaptive_batching,
        max_queue_size=queue.max_queue_size,
        priority_levels=dyn.priority_levels,
        default_priority=dyn.default_priority_level or dyn.priority_levels,
        default_timeout_s=default_timeout,
        allow_timeout_override=queue.allow_timeout_override,
        aging_s=settings.priority_aging_ms / 1e3,
        length_buckets=config.spillway.batch_buckets,
        early_dispatch=settings.early_dispatch,
        **common,
    )
