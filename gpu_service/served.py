"""What the registry serves a name with: one interface for a model and for a pipeline.

Every name of the repository has a ``ModelEntry`` (its configuration, the states the
index reports, its load counters). ``ModelRegistry.find`` answers a name with the entry
behind ``Served``: ``ModelVersions`` for a model (its loaded versions, each with its own
batcher) or ``gpu_service.pipelines.PipelineEntry`` for a pipeline (its steps run on
their models' versions). The data plane asks that interface and never which kind it has.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpu_service.stats import RequestTimer
from gpu_service.versions import ServedVersion, State
from spillway import inference
from spillway.models.config import ModelConfig
from spillway.models.engine import config_metadata
from spillway.models.processing import Tensors
from spillway.models.repository import ModelRepository
from spillway.pipelines.serving import Described
from spillway.protocol.errors import ModelNotReadyError, SpillwayError


@dataclass
class ModelEntry:
    """A model (or pipeline) of the repository: its loaded versions and what happened to
    the others."""

    name: str
    config: ModelConfig | None = None
    versions: dict[int, ServedVersion] = field(default_factory=dict)
    states: dict[int, tuple[State, str]] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    loading: asyncio.Task[list[SpillwayError]] | None = None
    loads: int = 0
    load_failures: int = 0
    cold_starts: int = 0
    evictions: int = 0
    last_error: str | None = None
    footprint: int | None = None  # last measured, the estimate for the next load
    _changed: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    @property
    def is_pipeline(self) -> bool:
        """Its configuration describes a pipeline (``platform: ensemble``)."""
        return self.config is not None and self.config.is_pipeline

    def set_state(self, number: int, state: State, reason: str = "") -> None:
        """Record a version's state and wake whoever waits for a change."""
        self.states[number] = (state, reason)
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_state(self, number: int, state: State) -> None:
        """Return once version ``number`` is in ``state``."""
        while (current := self.states.get(number)) is None or current[0] is not state:
            await self._changed.wait()

    def serving(self) -> ServedVersion | None:
        """The version a request that pins none gets: the newest ready one, or the
        canary's stable version while the configuration names a canary."""
        ready = {n: v for n, v in self.versions.items() if v.ready}
        number = self.config.default_version(ready) if self.config else max(ready, default=None)
        return ready[number] if number is not None else None

    def ttl(self, default: float | None) -> float | None:
        if self.config is None or self.config.spillway.pinned:
            return None
        return self.config.spillway.idle_ttl_seconds or default


@dataclass(frozen=True)
class InferResult:
    """An encoded infer response and the load signals of the version(s) that served it."""

    body: bytes
    header_length: int | None
    version: int
    queue_depth: int
    busy: float
    cold_start_s: float | None = None

    @classmethod
    def of(
        cls, encoded: inference.Encoded, queue_depth: int, busy: float, cold: float | None = None
    ) -> InferResult:
        return cls(encoded.body, encoded.header_length, encoded.version, queue_depth, busy, cold)


@dataclass(frozen=True)
class InferCall:
    """One decoded infer request and how to run it: ``arrived`` is its
    ``time.perf_counter()`` arrival, ``offload`` runs blocking work on the parse threads
    (always for tokenising; for the rest of a request only when it is ``big``), and
    ``scope`` is its tenant's (a pipeline's step cache entries are that tenant's;
    ``None``: no tenant's, the router proved none)."""

    decoded: inference.Decoded
    arrived: float
    offload: inference.Offload
    big: bool
    scope: str | None


class Served(Described, Protocol):
    """A name the registry serves, whatever its kind: the Open Inference Protocol's
    per-model operations (its documents: ``Described``). ``version`` is the one a request
    names, or ``None`` for the one that serves now."""

    def ready(self, version: str | None) -> bool:
        """Whether ``version`` takes requests (an unknown version: 404)."""
        ...

    def stats(self, version: str | None) -> list[dict[str, Any]]:
        """Triton's ``model_stats`` entries (every loaded version when none is named)."""
        ...

    async def infer(self, version: str | None, call: InferCall) -> InferResult:
        """Validate, run and encode one request."""
        ...


class Versions(Protocol):
    """What a served name asks of the registry (``gpu_service.registry.ModelRegistry``)."""

    repository: ModelRepository
    models: dict[str, ModelEntry]

    def get(self, name: str, version: str | None = None) -> ServedVersion:
        """The version that serves now (503 while none is ready, 404 for no such one)."""
        ...

    async def acquire(
        self, name: str, version: str | None, timeout_s: float | None
    ) -> tuple[ServedVersion, float | None]:
        """The version, held (loaded first if it was scaled to zero), and the seconds
        its cold start took (or None)."""
        ...

    async def sync(self, name: str) -> list[SpillwayError]:
        """Bring ``name`` in line with its repository; the failures."""
        ...


@dataclass(frozen=True, slots=True)
class ModelVersions:
    """A model of the registry behind ``Served``: each request runs on one of its
    versions' batcher."""

    registry: Versions
    entry: ModelEntry

    def ready(self, version: str | None) -> bool:
        try:
            self.registry.get(self.entry.name, version)
        except ModelNotReadyError:
            return False
        return True

    def metadata(self, version: str | None) -> dict[str, Any]:
        entry = self.entry
        if version is None and entry.serving() is None and entry.config is not None:
            # Scaled to zero: the signature is known without loading the model.
            return config_metadata(entry.config, sorted(entry.states))
        return self.registry.get(entry.name, version).model.metadata()

    def config(self, version: str | None) -> dict[str, Any]:
        if version is None and self.entry.config is not None:
            return self.entry.config.to_json_dict()
        return self.registry.get(self.entry.name, version).model.config.to_json_dict()

    def stats(self, version: str | None) -> list[dict[str, Any]]:
        if version is None:
            versions = self.entry.versions
            return [versions[v].triton_stats() for v in sorted(versions)]
        return [self.registry.get(self.entry.name, version).triton_stats()]

    async def infer(self, version: str | None, call: InferCall) -> InferResult:
        """Run one request on the version's batcher; the lease picks the version (and
        loads it first if it was scaled to zero)."""
        timeout_s = call.decoded.parameters.timeout_s
        served, cold = await self.registry.acquire(self.entry.name, version, timeout_s)
        try:
            if timeout_s is not None and cold is not None:
                # The deadline runs from arrival: a cold start spent part of it.
                timeout_s = max(0.0, timeout_s - cold)
            encoded = await _run(served, call, timeout_s)
        except SpillwayError:
            served.stats.record_failure(time.perf_counter() - call.arrived)
            raise
        finally:
            served.release()
        batcher = served.batcher
        return InferResult.of(encoded, batcher.queue_depth, batcher.busy_fraction(), cold)


async def _run(
    served: ServedVersion, call: InferCall, timeout_s: float | None
) -> inference.Encoded:
    """The request path (``spillway.inference``) with the version's batcher as its
    execute step."""
    batcher = served.batcher
    timer = RequestTimer(call.arrived)

    async def submit(admitted: inference.Admitted) -> Tensors:
        priority = admitted.parameters.priority or 0
        return await served.compute(admitted.prepared, priority, timeout_s, timer, scope=call.scope)

    async def prepare(decoded: inference.Decoded) -> inference.Admitted:
        # Announced to the batcher, so early dispatch keeps a batch open for it.
        with batcher.incoming():
            steps = batcher.seat.offload_steps(call.offload, call.arrived, timeout_s)
            return await served.preparer.admit(decoded, steps)

    encoded = await inference.run_async(
        served.model,
        call.decoded,
        submit,
        call.offload if call.big else None,
        prepare if served.model.batched_prepare else None,
    )
    # Every counter of the request at once, with no await in between: a statistics
    # snapshot sees all of them or none (perf_analyzer checks they agree).
    served.stats.record_success(timer)
    return encoded
