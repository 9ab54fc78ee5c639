"""What each endpoint does, apart from HTTP: the service's request handling.

The HTTP module translates requests and responses; this module decodes, validates,
queues and encodes, and counts what happened.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

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


class DataPlane:
    """The Open Inference Protocol operations over a model registry."""

    def __init__(self, registry: ModelRegistry, settings: GpuSettings) -> None:
        self.registry = registry
        self.settings = settings
        self.draining = False

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
        """Run one request through the core pipeline, executing on the version's batcher."""
        if self.draining:
            raise UnavailableError(
                "the service is shutting down", retry_after_s=self.settings.retry_after_s
            )
        arrived = time.perf_counter()
        decoded = pipeline.decode(body, header_length, max_body_bytes=self.settings.max_body_bytes)
        timeout_s = decoded.parameters.timeout_s
        async with self.registry.lease(name, version, timeout_s) as (served, cold):
            if timeout_s is not None and cold is not None:
                # The deadline runs from arrival: a cold start spent part of it.
                timeout_s = max(0.0, timeout_s - cold)
            try:
                encoded = await self._infer(served, decoded, timeout_s, arrived)
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

        encoded = await pipeline.run_async(served.model, decoded, submit)
        done = time.perf_counter()
        stats = served.stats
        stats.compute_input.add(marks[0] - arrived)
        stats.compute_output.add(done - marks[1])
        stats.success.add(done - arrived)
        return encoded
