"""A loaded model version, its leases, and how it is loaded and warmed."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from gpu_service.batcher import DynamicBatcher
from gpu_service.batching_policy import BatchingPolicy
from gpu_service.compute_budget import ComputeBudget
from gpu_service.memory import Probe
from gpu_service.preparing import PrepareQueue
from gpu_service.settings import GpuSettings
from gpu_service.stats import ModelStats, RequestTimer
from spillway import tracing
from spillway.models.config import ModelConfig
from spillway.models.engine import CUDA, OnnxModel
from spillway.models.loader import open_version
from spillway.models.processing import Prepared, Tensors
from spillway.protocol.errors import SpillwayError


class State(StrEnum):
    """Triton's model states, as the repository index reports them."""

    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass
class ServedVersion:
    """One loaded model version: its engine, batcher, preparation queue, statistics and
    leases.

    A request holds a lease from the moment it picks this version until its response is
    encoded, so a version that is being replaced is freed only once nobody uses it.
    """

    model: OnnxModel
    batcher: DynamicBatcher
    stats: ModelStats
    load_seconds: float
    footprint: int
    footprint_method: str
    leases: int = 0
    last_used: float = field(default_factory=time.monotonic)
    retiring: bool = False
    released: asyncio.Event = field(default_factory=asyncio.Event)
    preparer: PrepareQueue = field(init=False)

    def __post_init__(self) -> None:
        self.preparer = PrepareQueue(self.model, limit=max(self.batcher.policy.max_batch_size, 16))

    @property
    def ready(self) -> bool:
        """Takes new requests."""
        return not self.retiring and self.batcher.healthy

    @property
    def idle(self) -> bool:
        """Nobody holds it and nothing is queued or running."""
        return self.leases == 0 and self.batcher.idle

    def acquire(self) -> None:
        self.leases += 1
        self.released.clear()

    def release(self) -> None:
        self.leases -= 1
        self.last_used = time.monotonic()
        if self.leases == 0:
            self.released.set()

    async def compute(
        self,
        prepared: Prepared,
        priority: int,
        timeout_s: float | None,
        timer: RequestTimer,
        *,
        scope: str | None = None,
    ) -> Tensors:
        """Queue one request's prepared inputs on the batcher, as tenant ``scope``'s (the
        batcher shares compute fairly by it), and await its outputs; the wait and the run
        are timed in ``timer`` (the caller records its statistics)."""
        timer.enqueued()
        queued_ns = time.time_ns() if tracing.enabled() else 0
        try:
            computed = await self.batcher.submit_timed(
                prepared, priority=priority, timeout_s=timeout_s, scope=scope
            )
        except SpillwayError as exc:
            if queued_ns:
                tracing.record("spillway.queue", queued_ns, time.time_ns(), error=exc.code)
            raise
        timer.computed(computed.queue_s, computed.infer_s)
        if queued_ns:
            # The wait as the batcher timed it: from admission to its batch's start.
            waited_ns = queued_ns + int(computed.queue_s * 1e9)
            attributes = {"spillway.rows": prepared.rows, "spillway.priority": priority}
            tracing.record("spillway.queue", queued_ns, waited_ns, attributes=attributes)
        return computed.tensors

    def triton_stats(self) -> dict[str, Any]:
        """The version's ``model_stats`` entry of Triton's statistics extension."""
        return self.stats.to_triton(self.model.name, str(self.model.version))

    async def drain(self, timeout_s: float) -> None:
        """Wait until no request holds it, then stop its batcher."""
        if self.leases:
            await asyncio.wait({asyncio.ensure_future(self.released.wait())}, timeout=timeout_s)
        await self.batcher.stop(timeout_s)


def load_version(
    config: ModelConfig, version: int, path: Path, settings: GpuSettings
) -> tuple[OnnxModel, int, str]:
    """Open and warm the session (the core loader), measuring the memory it took;
    blocking (run it on a thread)."""
    probe = Probe(on_device=CUDA in settings.providers)
    options = settings.engine_options(config.spillway.compute.slots)
    model = open_version(config, version, path, options)
    files = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    # The allocator may reuse memory freed by an earlier unload, so never count less than
    # the version's files.
    return model, max(probe.grown(), files), probe.method


def start_version(
    model: OnnxModel,
    policy: BatchingPolicy,
    footprint: int,
    method: str,
    started: float,
    budget: ComputeBudget,
) -> ServedVersion:
    """A batcher for a loaded model, computing within the device's ``budget``, started on
    the running loop."""
    stats = ModelStats()
    name = f"{model.name}/{model.version}"
    batcher = DynamicBatcher(name, model, policy, stats=stats, budget=budget)
    batcher.start()
    return ServedVersion(model, batcher, stats, time.monotonic() - started, footprint, method)
