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
    """Batches that may compute at once per length bucket (a long batch never blocks a
    short one)."""
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
        """Runs that may be in flight at once: a shared executor needs this many threads."""
        return self.concurrency * (len(self.length_buckets) + 1)

    def niceness(self, bucket: int) -> int:
        """OS scheduling niceness of a bucket's compute threads: longer buckets yield the CPU
        to shorter ones (with one intra-op thread the run computes on this thread)."""
        return min(19, 5 * bucket)

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
    common: dict[str, Any] = {
        "concurrency": settings.compute_slots(),
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
