"""What each endpoint does, apart from HTTP: the service's request handling.

The HTTP module translates requests and responses; this module decodes, validates,
queues and encodes, and counts what happened.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from gpu_service.registry import ModelRegistry
from gpu_service.settings import GpuSettings
from gpu_service.stats import RequestTimer
from gpu_service.versions import ServedVersion
from spillway import inference
from spillway.models.engine import config_metadata
from spillway.models.processing import Tensors
from spillway.protocol.errors import (
    ControlDisabledError,
    ModelNotReadyError,
    SpillwayError,
    UnavailableError,
)
from spillway.protocol.v2 import server_metadata
from spillway.protocol.wire import read_tenant_scope

log = logging.getLogger("spillway.server")
T = TypeVar("T")
EXTENSIONS = ["binary_tensor_data", "statistics", "model_configuration", "schedule_policy"]


@dataclass(frozen=True)
class InferResult:
    """An encoded infer response and the load signals of the version that served it."""

    body: bytes
    header_length: int | None
    version: int
    queue_depth: int
    busy: float
    cold_start_s: float | None = None


class BodyBudget:
    """Bytes of request bodies held at once, charged as they are received (an announced
    size reserves nothing). A request whose declared size does not fit what is held now
    is refused with 503 and ``Retry-After`` before its body is read; a piece of body that
    would pass the limit ends its request with the same 503. Event loop only."""

    READY_ROOM = 64 * 1024
    """Readiness turns false while less than this (or a quarter of the limit, if less) is
    free: a small request would not fit."""

    def __init__(self, limit: int, retry_after_s: float) -> None:
        self.limit = limit
        self.in_use = 0
        self._retry_after_s = retry_after_s

    def admit(self, size: int) -> None:
        """Refuse a request announcing ``size`` bytes that cannot fit beside what is held
        now; reserves nothing."""
        if self.in_use + size > self.limit:
            raise self._full()

    def charge(self, size: int) -> None:
        """Hold ``size`` more bytes just received; the caller releases them when done
        (a pair of calls, not a context manager: this is on every request's path)."""
        if self.in_use + size > self.limit:
            raise self._full()
        self.in_use += size

    def release(self, size: int) -> None:
        self.in_use -= size

    @property
    def saturated(self) -> bool:
        """Too little is free for another small request."""
        return self.limit - self.in_use < min(self.READY_ROOM, self.limit // 4)

    def _full(self) -> UnavailableError:
        return UnavailableError(
            "too many request bytes in flight; retry shortly", retry_after_s=self._retry_after_s
        )


class DataPlane:
    """The Open Inference Protocol operations over a model registry."""

    def __init__(self, registry: ModelRegistry, settings: GpuSettings) -> None:
        self.registry = registry
        self.settings = settings
        self.draining = False
        self.bodies = BodyBudget(settings.max_body_bytes_in_flight, settings.retry_after_s)
        self._parse_pool = ThreadPoolExecutor(settings.parse_threads, thread_name_prefix="parse")
        # Started on the first big JSON body; spawned, never forked (CUDA is not fork-safe).
        self._json_pool = ProcessPoolExecutor(
            settings.parse_processes, mp_context=multiprocessing.get_context("spawn")
        )

    def close(self) -> None:
        """Stop the parse threads and processes (after the registry has drained)."""
        self._parse_pool.shutdown(wait=False, cancel_futures=True)
        self._json_pool.shutdown(wait=False, cancel_futures=True)

    def start_draining(self, reason: str) -> None:
        """Turn readiness false and refuse new infer requests (logged once)."""
        if not self.draining:
            log.info(
                "%s: readiness false, draining for up to %.0f s",
                reason,
                self.settings.drain_timeout_s,
            )
        self.draining = True

    def check_infer(self, name: str) -> None:
        """Refuse an infer request before its body is read: draining, or an unknown model."""
        self._check_draining()
        self.registry.entry(name)

    def _check_draining(self) -> None:
        if self.draining:
            raise UnavailableError(
                "the service is shutting down", retry_after_s=self.settings.retry_after_s
            )

    def server_metadata(self) -> dict[str, Any]:
        extensions = EXTENSIONS + ["model_repository"] * self.control_enabled
        return server_metadata("spillway-gpu", extensions)

    @property
    def control_enabled(self) -> bool:
        return self.settings.model_control_mode == "explicit"

    def ready(self) -> bool:
        """Whether the service can admit work: not draining, its start-up models loaded,
        and room in the body budget (a load balancer then sends work elsewhere)."""
        return not self.draining and self.registry.ready and not self.bodies.saturated

    def model_ready(self, name: str, version: str | None) -> bool:
        if self.registry.pipelines.serves(name):
            return self.registry.pipelines.ready(name, version) and not self.draining
        try:
            self.registry.get(name, version)
        except ModelNotReadyError:
            return False
        return not self.draining

    def model_metadata(self, name: str, version: str | None) -> dict[str, Any]:
        if self.registry.pipelines.serves(name):
            return self.registry.pipelines.metadata(name, version)
        entry = self.registry.entry(name)
        if version is None and entry.serving() is None and entry.config is not None:
            # Scaled to zero: the signature is known without loading the model.
            return config_metadata(entry.config, sorted(entry.states))
        return self.registry.get(name, version).model.metadata()

    def model_config(self, name: str, version: str | None) -> dict[str, Any]:
        entry = self.registry.entry(name)
        if version is None and entry.config is not None:
            return entry.config.to_json_dict()
        if self.registry.pipelines.serves(name):
            return self.registry.pipelines.served(name, version).config.to_json_dict()
        return self.registry.get(name, version).model.config.to_json_dict()

    def model_stats(self, name: str | None, version: str | None) -> dict[str, Any]:
        pipelines = self.registry.pipelines
        if name is not None and pipelines.serves(name):
            return {"model_stats": pipelines.stats(name, version)}
        if name is None:
            served = self.registry.all_versions()
        elif version is None:
            entry = self.registry.entry(name)
            served = [entry.versions[v] for v in sorted(entry.versions)]
        else:
            served = [self.registry.get(name, version)]
        stats = [s.stats.to_triton(s.model.name, str(s.model.version)) for s in served]
        return {"model_stats": stats + (pipelines.stats(None) if name is None else [])}

    async def repository_index(self) -> list[dict[str, str]]:
        return await self.registry.index()

    async def load(self, name: str) -> None:
        """Load (or re-read) a model: new versions are swapped in without failing requests."""
        self._check_control()
        failures = await self.registry.sync(name)
        if failures:
            raise failures[0]

    async def unload(self, name: str) -> None:
        self._check_control()
        await self.registry.unload(name)

    def _check_control(self) -> None:
        if not self.control_enabled:
            raise ControlDisabledError(
                f"model control is disabled (--model-control-mode "
                f"{self.settings.model_control_mode}); use explicit"
            )

    async def infer(
        self,
        name: str,
        version: str | None,
        body: bytes,
        header_length: int | None,
        *,
        tenant_scope: str | None = None,
    ) -> InferResult:
        """Run one request through the core pipeline, executing on the version's batcher.

        Big bodies are decoded, prepared and encoded on the parse threads; text requests
        are tokenised there together with the others that arrived meanwhile. The model is
        looked up once, by the lease (the transport checked it before the body).
        ``tenant_scope`` is the caller's tenant scope as the router sent it
        (``x-spillway-tenant-scope``; anonymous without one): a pipeline's step cache
        entries are that tenant's."""
        self._check_draining()
        scope = read_tenant_scope(tenant_scope)
        arrived = time.perf_counter()
        big = len(body) > self.settings.inline_parse_bytes
        if big:
            decoded = await self._decode(body, header_length)
        else:
            decoded = inference.decode(body, header_length, self.settings.max_body_bytes)
        if self.registry.pipelines.serves(name):
            answer = await self.registry.pipelines.infer(
                name, version, decoded, arrived, self._offload, scope=scope
            )
            done = answer.encoded
            return InferResult(
                done.body, done.header_length, done.version, answer.queue_depth, answer.busy
            )
        timeout_s = decoded.parameters.timeout_s
        served, cold = await self.registry.acquire(name, version, timeout_s)
        try:
            if timeout_s is not None and cold is not None:
                # The deadline runs from arrival: a cold start spent part of it.
                timeout_s = max(0.0, timeout_s - cold)
            encoded = await self._infer(served, decoded, timeout_s, arrived, big)
        except SpillwayError:
            served.stats.record_failure(time.perf_counter() - arrived)
            raise
        finally:
            served.release()
        batcher = served.batcher
        return InferResult(
            encoded.body,
            encoded.header_length,
            encoded.version,
            batcher.queue_depth,
            batcher.busy_fraction(),
            cold,
        )

    async def _infer(
        self,
        served: ServedVersion,
        decoded: inference.Decoded,
        timeout_s: float | None,
        arrived: float,
        big: bool,
    ) -> inference.Encoded:
        batcher = served.batcher
        timer = RequestTimer(arrived)

        async def submit(admitted: inference.Admitted) -> Tensors:
            timer.enqueued()
            priority = admitted.parameters.priority or 0
            computed = await batcher.submit_timed(
                admitted.prepared, priority=priority, timeout_s=timeout_s
            )
            timer.computed(computed.queue_s, computed.infer_s)
            return computed.tensors

        async def prepare(decoded: inference.Decoded) -> inference.Admitted:
            # Announced to the batcher, so early dispatch keeps a batch open for it.
            with batcher.incoming():
                return await served.preparer.admit(decoded, self._offload)

        encoded = await inference.run_async(
            served.model,
            decoded,
            submit,
            self._offload if big else None,
            prepare if served.model.batched_prepare else None,
        )
        # Every counter of the request at once, with no await in between: a statistics
        # snapshot sees all of them or none (perf_analyzer checks they agree).
        served.stats.record_success(timer)
        return encoded

    async def _decode(self, body: bytes, header_length: int | None) -> inference.Decoded:
        """A big body: binary on a thread (numpy reads the tensor bytes without the
        GIL-bound work); a big JSON header in a parse process."""
        limit, inline = self.settings.max_body_bytes, self.settings.inline_parse_bytes
        loop = asyncio.get_running_loop()
        if (header_length if header_length is not None else len(body)) > inline:
            pool: Executor = self._json_pool
        else:
            pool = self._parse_pool
        return await loop.run_in_executor(pool, inference.decode, body, header_length, limit)

    async def _offload(self, function: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._parse_pool, function, *args)
