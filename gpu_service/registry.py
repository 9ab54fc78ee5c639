"""The model registry: which versions are loaded, and their batchers.

At start every model of the repository is loaded (the versions its version policy names),
warmed up, and given a batcher. A request names a model and optionally a version; without
a version the newest ready one serves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from gpu_service.batcher import BatchPolicy, DynamicBatcher
from gpu_service.settings import GpuSettings
from gpu_service.stats import ModelStats
from spillway.engine import OnnxModel
from spillway.errors import ModelNotFoundError, ModelNotReadyError, SpillwayError
from spillway.modelconfig import ModelConfig, VersionPolicy
from spillway.repository import ModelRepository, validate_model_name, validate_version

log = logging.getLogger("spillway.registry")


def batch_policy(config: ModelConfig, settings: GpuSettings) -> BatchPolicy:
    """A batcher policy from the model's Triton-style config and the service settings."""
    dyn = config.dynamic_batching
    if config.max_batch_size == 0 or dyn is None:
        # No dynamic batching: one request per run, still queued and bounded.
        return BatchPolicy(
            max_batch_size=max(config.max_batch_size, 1),
            max_queue_delay_s=0.0,
            concurrency=settings.instance_count,
            retry_after_s=settings.retry_after_s,
        )
    queue = dyn.default_queue_policy
    timeout_us = queue.default_timeout_microseconds
    default_timeout = (
        timeout_us / 1e6
        if timeout_us
        else (settings.default_timeout_ms / 1e3 if settings.default_timeout_ms else None)
    )
    return BatchPolicy(
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
        length_buckets=config.spillway.length_buckets,
        concurrency=settings.instance_count,
        retry_after_s=settings.retry_after_s,
    )


def chosen_versions(policy: VersionPolicy, available: list[int]) -> list[int]:
    """The versions a Triton version policy selects from those available."""
    if policy.specific is not None:
        return [v for v in policy.specific["versions"] if v in available]
    if policy.all is not None:
        return list(available)
    count = policy.latest["num_versions"] if policy.latest else 1
    return available[-count:]


@dataclass
class ServedVersion:
    """One loaded model version with its batcher and statistics."""

    model: OnnxModel
    batcher: DynamicBatcher
    stats: ModelStats
    load_seconds: float = 0.0

    @property
    def ready(self) -> bool:
        return self.batcher.healthy


@dataclass
class ModelEntry:
    """A model of the repository and its loaded versions (newest last)."""

    name: str
    config: ModelConfig | None
    versions: dict[int, ServedVersion] = field(default_factory=dict)
    error: str | None = None


class ModelRegistry:
    """Loads models at start; finds the version that serves a request."""

    def __init__(self, repository: ModelRepository, settings: GpuSettings) -> None:
        self.repository = repository
        self.settings = settings
        self.models: dict[str, ModelEntry] = {}

    async def start(self) -> None:
        """Load every model of the repository; a model that fails is reported, not fatal."""
        names = await asyncio.to_thread(self.repository.list_models)
        for name in names:
            try:
                await self._load_model(name)
            except SpillwayError as error:
                log.error("model %s failed to load: %s", name, error.message)
                self.models.setdefault(name, ModelEntry(name, None)).error = error.message

    async def _load_model(self, name: str) -> None:
        config = await asyncio.to_thread(self.repository.read_config, name)
        entry = self.models.setdefault(name, ModelEntry(name, config))
        available = await asyncio.to_thread(self.repository.list_versions, name)
        for version in chosen_versions(config.version_policy, available):
            entry.versions[version] = await self._load_version(config, version)

    async def _load_version(self, config: ModelConfig, version: int) -> ServedVersion:
        started = time.monotonic()
        path = await asyncio.to_thread(
            self.repository.fetch_version, config.name, version, self.settings.cache_dir
        )
        options = self.settings.engine_options()
        model = await asyncio.to_thread(OnnxModel, config.name, version, config, path, options)
        await asyncio.to_thread(model.infer, model.sample_inputs(1))  # warm-up
        policy = batch_policy(config, self.settings)
        stats = ModelStats()
        batcher = DynamicBatcher(f"{config.name}/{version}", model, policy, stats=stats)
        batcher.start()
        elapsed = time.monotonic() - started
        log.info("loaded %s v%d on %s in %.2f s", config.name, version, model.provider, elapsed)
        return ServedVersion(model, batcher, stats, elapsed)

    async def stop(self, drain_timeout_s: float) -> None:
        """Drain every batcher (each frees its compute threads)."""
        served = [v for e in self.models.values() for v in e.versions.values()]
        await asyncio.gather(*(v.batcher.stop(drain_timeout_s) for v in served))

    def entry(self, name: str) -> ModelEntry:
        """A model known to the registry (404 otherwise)."""
        entry = self.models.get(validate_model_name(name))
        if entry is None:
            raise ModelNotFoundError(f"unknown model {name!r}")
        return entry

    def get(self, name: str, version: str | None = None) -> ServedVersion:
        """The version that serves a request: the pinned one, or the newest ready one."""
        entry = self.entry(name)
        if version is not None:
            number = validate_version(version)
            served = entry.versions.get(number)
            if served is None:
                raise ModelNotFoundError(f"model {name!r} has no version {number} loaded")
            if not served.ready:
                raise ModelNotReadyError(
                    f"model {name!r} version {number} is not ready",
                    retry_after_s=self.settings.retry_after_s,
                )
            return served
        for number in sorted(entry.versions, reverse=True):
            if entry.versions[number].ready:
                return entry.versions[number]
        reason = f": {entry.error}" if entry.error else ""
        raise ModelNotReadyError(
            f"model {name!r} has no ready version{reason}",
            retry_after_s=self.settings.retry_after_s,
        )

    def all_versions(self) -> list[ServedVersion]:
        """Every loaded version, by model name then version."""
        return [e.versions[v] for _, e in sorted(self.models.items()) for v in sorted(e.versions)]

    @property
    def ready(self) -> bool:
        """Every model has a ready version."""
        return bool(self.models) and all(
            any(v.ready for v in e.versions.values()) for e in self.models.values()
        )
