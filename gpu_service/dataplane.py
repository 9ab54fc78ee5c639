"""What each endpoint does, apart from HTTP: the service's request handling.

The HTTP module translates requests and responses; this module decodes, validates,
queues and encodes, and counts what happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from gpu_service.registry import ModelRegistry
from gpu_service.settings import GpuSettings
from gpu_service.versions import ServedVersion
from spillway import pipeline
from spillway.engine import config_metadata
from spillway.errors import (
    ControlDisabledError,
    ModelNotReadyError,
    SpillwayError,
    UnavailableError,
)
from spillway.processing import Tensors
from spillway.protocol import server_metadata

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
    """Bytes of request bodies held at once; a request that does not fit is refused with
    503 and ``Retry-After`` before its body is read. Used from the event loop only."""

    def __init__(self, limit: int, retry_after_s: float) -> None:
        self.limit = limit
        self.in_use = 0
        self._retry_after_s = retry_after_s

    @contextlib.contextmanager
    def hold(self, size: int) -> Iterator[None]:
        """Reserve ``size`` bytes for the duration of a request."""
        if self.in_use + size > self.limit:
            raise UnavailableError(
                "too many request bytes in flight; retry shortly",
                retry_after_s=self._retry_after_s,
            )
        self.in_use += size
        try:
            yield
        finally:
            self.in_use -= size


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
        return not self.draining and self.registry.ready

    def model_ready(self, name: str, version: str | None) -> bool:
        try:
            self.registry.get(name, version)
        except ModelNotReadyError:
            return False
        return not self.draining

    def model_metadata(self, name: str, version: str | None) -> dict[str, Any]:
        entry = self.registry.entry(name)
        if version is None and entry.serving() is None and entry.config is not None:
            # Scaled to zero: the signature is known without loading the model.
            return config_metadata(entry.config, sorted(entry.states))
        return self.registry.get(name, version).model.metadata()

    def model_config(self, name: str, version: str | None) -> dict[str, Any]:
        entry = self.registry.entry(name)
        if version is None and entry.config is not None:
            return entry.config.to_json_dict()
        return self.registry.get(name, version).model.config.to_json_dict()

    def model_stats(self, name: str | None, version: str | None) -> dict[str, Any]:
        if name is None:
            served = self.registry.all_versions()
        elif version is None:
            entry = self.registry.entry(name)
            served = [entry.versions[v] for v in sorted(entry.versions)]
        else:
            served = [self.registry.get(name, version)]
        return {
            "model_stats": [s.stats.to_triton(s.model.name, str(s.model.version)) for s in served]
        }

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
        self, name: str, version: str | None, body: bytes, header_length: int | None
    ) -> InferResult:
        """Run one request through the core pipeline, executing on the version's batcher.

        Big bodies are decoded, prepared (tokenised) and encoded on the parse threads. The
        model itself is looked up by the lease (the transport checked it before the body)."""
        self._check_draining()
        arrived = time.perf_counter()
        offload = self._offload if len(body) > self.settings.inline_parse_bytes else None
        decoded = await self._decode(body, header_length)
        timeout_s = decoded.parameters.timeout_s
        async with self.registry.lease(name, version, timeout_s) as (served, cold):
            if timeout_s is not None and cold is not None:
                # The deadline runs from arrival: a cold start spent part of it.
                timeout_s = max(0.0, timeout_s - cold)
            try:
                encoded = await self._infer(served, decoded, timeout_s, arrived, offload)
            except SpillwayError:
                served.stats.fail.add(time.perf_counter() - arrived)
                raise
        return InferResult(
            encoded.body,
            encoded.header_length,
            encoded.version,
            served.batcher.queue_depth,
            served.batcher.busy_fraction(),
            cold,
        )

    async def _infer(
        self,
        served: ServedVersion,
        decoded: pipeline.Decoded,
        timeout_s: float | None,
        arrived: float,
        offload: pipeline.Offload | None,
    ) -> pipeline.Encoded:
        marks: list[float] = []

        async def submit(admitted: pipeline.Admitted) -> Tensors:
            marks.append(time.perf_counter())  # validated and prepared
            priority = admitted.parameters.priority or 0
            result = await served.batcher.submit(
                admitted.prepared, priority=priority, timeout_s=timeout_s
            )
            marks.append(time.perf_counter())  # computed
            return result

        encoded = await pipeline.run_async(served.model, decoded, submit, offload)
        done = time.perf_counter()
        stats = served.stats
        stats.compute_input.add(marks[0] - arrived)
        stats.compute_output.add(done - marks[1])
        stats.success.add(done - arrived)
        return encoded

    async def _decode(self, body: bytes, header_length: int | None) -> pipeline.Decoded:
        """Small bodies inline; big binary ones on a thread (numpy reads the tensor bytes
        without the GIL-bound work); big JSON headers in a parse process."""
        limit, inline = self.settings.max_body_bytes, self.settings.inline_parse_bytes
        if len(body) <= inline:
            return pipeline.decode(body, header_length, limit)
        loop = asyncio.get_running_loop()
        if (header_length if header_length is not None else len(body)) > inline:
            pool: Executor = self._json_pool
        else:
            pool = self._parse_pool
        return await loop.run_in_executor(pool, pipeline.decode, body, header_length, limit)

    async def _offload(self, function: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._parse_pool, function, *args)
