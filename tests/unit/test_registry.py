"""The model registry with an in-memory repository and a fake loader: hot swap, broken
versions, memory budget and LRU eviction, single-flight cold starts, idle TTL."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpu_service.registry import ModelRegistry
from gpu_service.settings import GpuSettings
from gpu_service.versions import State
from spillway.errors import (
    InsufficientMemoryError,
    ModelLoadError,
    ModelNotFoundError,
    ModelNotReadyError,
)
from spillway.modelconfig import ModelConfig
from spillway.processing import Prepared, Tensors

MB = 1_000_000


def config(name: str, **block: Any) -> ModelConfig:
    spec = {"data_type": "TYPE_FP32", "dims": [1]}
    return ModelConfig(
        name=name,
        max_batch_size=4,
        input=[{"name": "x", **spec}],
        output=[{"name": "y", **spec}],
        dynamic_batching={"max_queue_delay_microseconds": 0},
        spillway={"kind": "tensor", **block},
    )


@dataclass
class FakeRepository:
    """Models in memory; a fetched version is a folder with a file of the given size."""

    root: Path
    configs: dict[str, ModelConfig] = field(default_factory=dict)
    versions: dict[str, list[int]] = field(default_factory=dict)
    location: str = "memory"

    def add(self, name: str, *versions: int, **block: Any) -> None:
        self.configs[name] = config(name, **block)
        self.versions.setdefault(name, []).extend(versions)

    def list_models(self) -> list[str]:
        return sorted(self.configs)

    def list_versions(self, model: str) -> list[int]:
        return sorted(self.versions[model])

    def read_config(self, model: str) -> ModelConfig:
        if model not in self.configs:
            raise ModelNotFoundError(model)
        return self.configs[model]

    def fetch_version(self, model: str, version: int, cache_dir: Path) -> Path:
        path = self.root / model / str(version)
        path.mkdir(parents=True, exist_ok=True)
        (path / "model.onnx").write_bytes(b"x")
        return path

    def publish_version(self, model: str, files: Any, config: Any = None) -> int:
        raise NotImplementedError


@dataclass
class FakeModel:
    """Adds the version number to each row, so a response names who computed it."""

    name: str
    version: int
    config: ModelConfig
    provider: str = "fake"
    provider_fallback: bool = False
    gate: threading.Event | None = None

    def run(self, batch: list[Prepared]) -> list[Tensors]:
        if self.gate is not None:
            assert self.gate.wait(10)
        return [{"y": p.feeds["x"] + self.version} for p in batch]

    def prepare(self, inputs: Tensors) -> Prepared:
        return Prepared(inputs, 1)


@dataclass
class FakeLoader:
    footprint: int = 40 * MB
    broken: set[tuple[str, int]] = field(default_factory=set)
    calls: list[tuple[str, int]] = field(default_factory=list)
    gate: threading.Event | None = None

    def __call__(
        self, cfg: ModelConfig, version: int, path: Path, settings: GpuSettings
    ) -> tuple[Any, int, str]:
        self.calls.append((cfg.name, version))
        if (cfg.name, version) in self.broken:
            raise ModelLoadError(f"{cfg.name} v{version} failed warm-up")
        return FakeModel(cfg.name, version, cfg, gate=self.gate), self.footprint, "fake"


def run(
    repo: FakeRepository,
    loader: FakeLoader,
    scenario: Callable[[ModelRegistry], Awaitable[None]],
    **settings: Any,
) -> None:
    async def main() -> None:
        registry = ModelRegistry(repo, GpuSettings(**settings), loader=loader)
        await registry.start()
        try:
            await scenario(registry)
        finally:
            await registry.stop(5)

    asyncio.run(main())


async def infer(registry: ModelRegistry, name: str, value: float = 0.0) -> int:
    """The version that computed one request."""
    async with registry.lease(name, None, None) as (served, _):
        prepared = Prepared({"x": np.array([[value]], np.float32)}, 1)
        out = await served.batcher.submit(prepared)
        return int(out["y"][0, 0] - value)


def test_hot_swap_keeps_old_version_until_its_requests_finish(tmp_path: Path) -> None:
    repo = FakeRepository(tmp_path)
    repo.add("m", 1)
    loader = FakeLoader()

    async def scenario(registry: ModelRegistry) -> None:
        # GIVEN a request holding version 1
        async with registry.lease("m", None, None) as (old, _):
            # WHEN version 2 is published and synced
            repo.versions["m"].append(2)
            sync = asyncio.ensure_future(registry.sync("m"))
            await asyncio.sleep(0.05)
            # THEN new requests already get version 2, while version 1 still exists
            assert await infer(registry, "m") == 2
            assert old.retiring
            assert not sync.done()
            out = await old.batcher.submit(Prepared({"x": np.zeros((1, 1), np.float32)}, 1))
            assert out["y"][0, 0] == 1  # the held request is still served by version 1
        assert await sync == []
        assert sorted(registry.entry("m").versions) == [2]
        assert registry.entry("m").states[1][0] == State.UNAVAILABLE

    run(repo, loader, scenario)


def test_broken_version_never_replaces_the_serving_one(tmp_path: Path) -> None:
    repo = FakeRepository(tmp_path)
    repo.add("m", 1)
    loader = FakeLoader(broken={("m", 2)})

    async def scenario(registry: ModelRegistry) -> None:
        repo.versions["m"].append(2)
        failures = await registry.sync("m")
        assert [f.code for f in failures] == ["model_load_failed"]
        assert await infer(registry, "m") == 1
        index = {(r["name"], r["version"]): r for r in await registry.index()}
        assert index["m", "1"]["state"] == "READY"
        assert index["m", "2"]["state"] == "UNAVAILABLE"
        assert "warm-up" in index["m", "2"]["reason"]
        assert registry.entry("m").load_failures == 1

    run(repo, loader, scenario)


def test_budget_evicts_least_recently_used_idle_version(tmp_path: Path) -> None:
    repo = FakeRepository(tmp_path)
    for name in ("a", "b", "c"):
        repo.add(name, 1)
    loader = FakeLoader(footprint=40 * MB)

    async def scenario(registry: ModelRegistry) -> None:
        await registry.sync("a")
        await registry.sync("b")
        await infer(registry, "a")  # b is now the least recently used
        assert await registry.sync("c") == []
        loaded = {n for n, e in registry.models.items() if e.versions}
        assert loaded == {"a", "c"}
        assert registry.entry("b").evictions == 1
        assert registry.memory_in_use() <= 100 * MB

    run(repo, loader, scenario, memory_budget_mb=100, startup_models=())


def test_busy_version_is_never_evicted_and_impossible_load_fails(tmp_path: Path) -> None:
    repo = FakeRepository(tmp_path)
    for name in ("a", "b", "c"):
        repo.add(name, 1)
    loader = FakeLoader(footprint=40 * MB)

    async def scenario(registry: ModelRegistry) -> None:
        await registry.sync("a")
        await registry.sync("b")
        async with registry.lease("a", None, None), registry.lease("b", None, None):
            # GIVEN both resident versions busy WHEN c must load THEN nothing is evicted
            failures = await registry.sync("c")
            assert [type(f) for f in failures] == [InsufficientMemoryError]
            assert {n for n, e in registry.models.items() if e.versions} == {"a", "b"}
            # AND requests for c get 503 model_not_ready with a retry hint
            with pytest.raises(ModelNotReadyError) as caught:
                registry.get("c")
            assert caught.value.code == "model_not_ready"
            assert caught.value.retry_after_s is not None

    run(repo, loader, scenario, memory_budget_mb=100, startup_models=())


def test_pinned_model_is_never_evicted(tmp_path: Path) -> None:
    repo = FakeRepository(tmp_path)
    repo.add("pinned", 1, pinned=True)
    repo.add("b", 1)
    loader = FakeLoader(footprint=60 * MB)

    async def scenario(registry: ModelRegistry) -> None:
        await registry.sync("pinned")
        failures = await registry.sync("b")
        assert [f.code for f in failures] == ["insufficient_memory"]
        assert registry.entry("pinned").versions

    run(repo, loader, scenario, memory_budget_mb=100, startup_models=())


def test_concurrent_first_requests_share_one_load(tmp_path: Path) -> None:
    repo = FakeRepository(tmp_path)
    repo.add("cold", 1)
    loader = FakeLoader()

    async def scenario(registry: ModelRegistry) -> None:
        versions = await asyncio.gather(*(infer(registry, "cold", i) for i in range(50)))
        assert versions == [1] * 50
        assert loader.calls == [("cold", 1)]
        assert registry.entry("cold").cold_starts == 1

    run(repo, loader, scenario, startup_models=())


def test_idle_ttl_unloads_and_next_request_cold_starts(tmp_path: Path) -> None:
    repo = FakeRepository(tmp_path)
    repo.add("m", 1, idle_ttl_seconds=0.05)
    loader = FakeLoader()

    async def scenario(registry: ModelRegistry) -> None:
        assert await infer(registry, "m") == 1
        for _ in range(100):
            if not registry.entry("m").versions:
                break
            await asyncio.sleep(0.05)
        assert not registry.entry("m").versions
        assert registry.entry("m").states[1][0] == State.UNAVAILABLE
        async with registry.lease("m", None, None) as (_, cold):
            assert cold is not None
        assert loader.calls == [("m", 1), ("m", 1)]

    run(repo, loader, scenario)


def test_version_policy_latest_two_and_pinned_version_requests(tmp_path: Path) -> None:
    repo = FakeRepository(tmp_path)
    repo.configs["m"] = ModelConfig.model_validate(
        {**config("m").model_dump(), "version_policy": {"latest": {"num_versions": 2}}}
    )
    repo.versions["m"] = [1, 2, 3]

    async def scenario(registry: ModelRegistry) -> None:
        assert sorted(registry.entry("m").versions) == [2, 3]
        assert registry.get("m", "2").model.version == 2
        with pytest.raises(ModelNotFoundError):
            registry.get("m", "1")

    run(repo, FakeLoader(), scenario)


def test_loading_an_unknown_model_leaves_no_trace(tmp_path: Path) -> None:
    repo = FakeRepository(tmp_path)
    repo.add("m", 1)

    async def scenario(registry: ModelRegistry) -> None:
        failures = await registry.sync("ghost")
        assert [f.code for f in failures] == ["model_not_found"]
        with pytest.raises(ModelNotFoundError):
            registry.get("ghost")
        assert "ghost" not in {r["name"] for r in await registry.index()}

    run(repo, FakeLoader(), scenario)
