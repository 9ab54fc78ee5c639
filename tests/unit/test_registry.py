"""The model registry with an in-memory repository and a fake loader: hot swap, broken
versions, memory budget and LRU eviction, single-flight cold starts, idle TTL.

Nothing here waits a fixed time: tests wait on the registry's version states
(``ModelEntry.wait_state``), gate the fake loader, or run the idle reaper at a chosen
instant (``reap_idle``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpu_service.registry import ModelRegistry
from gpu_service.settings import GpuSettings
from gpu_service.versions import State
from spillway.models.config import ModelConfig
from spillway.models.processing import Prepared
from spillway.protocol.errors import InsufficientMemoryError, ModelNotFoundError, ModelNotReadyError
from tests.fakes import MB, FakeLoader, FakeRepository, StepClock, tensor_config

# Generous bound on a wait for something that should happen at once; a hang fails here.
WAIT_S = 10.0


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
        entry = registry.entry("m")
        # GIVEN a request holding version 1
        async with registry.lease("m", None, None) as (old, _):
            # WHEN version 2 is published and synced, up to where version 1 drains
            repo.versions["m"].append(2)
            sync = asyncio.ensure_future(registry.sync("m"))
            await asyncio.wait_for(entry.wait_state(1, State.UNLOADING), WAIT_S)
            # THEN new requests already get version 2, while version 1 still exists
            assert entry.states[2] == (State.READY, "")
            assert await infer(registry, "m") == 2
            assert old.retiring
            assert not sync.done()
            out = await old.batcher.submit(Prepared({"x": np.zeros((1, 1), np.float32)}, 1))
            assert out["y"][0, 0] == 1  # the held request is still served by version 1
            assert sorted(entry.versions) == [1, 2]
        # AND once it is released, version 1 is freed and the sync ends without failures
        assert await asyncio.wait_for(sync, WAIT_S) == []
        assert sorted(entry.versions) == [2]
        assert entry.states[1] == (State.UNAVAILABLE, "unloaded: replaced by a newer version")

    run(repo, loader, scenario)


def test_broken_version_never_replaces_the_serving_one(tmp_path: Path) -> None:
    # GIVEN version 1 serving and a version 2 that fails its warm-up
    repo = FakeRepository(tmp_path)
    repo.add("m", 1)
    loader = FakeLoader(broken={("m", 2)})

    async def scenario(registry: ModelRegistry) -> None:
        # WHEN version 2 is published and synced
        repo.versions["m"].append(2)
        failures = await registry.sync("m")
        # THEN the sync reports it, version 1 keeps serving, and the index says why
        assert [f.code for f in failures] == ["model_load_failed"]
        assert await infer(registry, "m") == 1
        index = {(r["name"], r["version"]): r for r in await registry.index()}
        assert index["m", "1"]["state"] == "READY"
        assert index["m", "2"]["state"] == "UNAVAILABLE"
        assert "warm-up" in index["m", "2"]["reason"]
        assert registry.entry("m").load_failures == 1

    run(repo, loader, scenario)


def test_budget_evicts_least_recently_used_idle_version(tmp_path: Path) -> None:
    # GIVEN a 100 MB budget holding a and b (40 MB each), b the least recently used
    repo = FakeRepository(tmp_path)
    for name in ("a", "b", "c"):
        repo.add(name, 1)
    loader = FakeLoader(footprint=40 * MB)

    async def scenario(registry: ModelRegistry) -> None:
        await registry.sync("a")
        await registry.sync("b")
        await infer(registry, "a")
        # WHEN c loads THEN b makes room
        assert await registry.sync("c") == []
        loaded = {n for n, e in registry.models.items() if e.versions}
        assert loaded == {"a", "c"}
        assert registry.entry("b").evictions == 1
        assert registry.memory_in_use() == 80 * MB

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
    # GIVEN a pinned model taking 60 of 100 MB
    repo = FakeRepository(tmp_path)
    repo.add("pinned", 1, pinned=True)
    repo.add("b", 1)
    loader = FakeLoader(footprint=60 * MB)

    async def scenario(registry: ModelRegistry) -> None:
        await registry.sync("pinned")
        # WHEN another 60 MB model loads THEN it fails and the pinned one stays
        failures = await registry.sync("b")
        assert [f.code for f in failures] == ["insufficient_memory"]
        assert sorted(registry.entry("pinned").versions) == [1]
        assert registry.entry("pinned").evictions == 0

    run(repo, loader, scenario, memory_budget_mb=100, startup_models=())


def test_concurrent_first_requests_share_one_load(tmp_path: Path) -> None:
    # GIVEN a model scaled to zero whose load is held open
    repo = FakeRepository(tmp_path)
    repo.add("cold", 1)
    loader = FakeLoader(gate=threading.Event())

    async def scenario(registry: ModelRegistry) -> None:
        assert loader.gate is not None
        # WHEN 50 first requests arrive while it loads
        requests = asyncio.gather(*(infer(registry, "cold", i) for i in range(50)))
        try:
            await asyncio.wait_for(registry.entry("cold").wait_state(1, State.LOADING), WAIT_S)
            assert not requests.done()
        finally:
            loader.gate.set()
        # THEN they all get version 1 from one load, counted as one cold start
        assert await asyncio.wait_for(requests, WAIT_S) == [1] * 50
        assert loader.calls == [("cold", 1)]
        assert registry.entry("cold").cold_starts == 1

    run(repo, loader, scenario, startup_models=())


def test_idle_ttl_unloads_and_next_request_cold_starts(tmp_path: Path) -> None:
    # GIVEN a model with a 60 s idle TTL, used once
    repo = FakeRepository(tmp_path)
    repo.add("m", 1, idle_ttl_seconds=60)
    loader = FakeLoader()

    async def scenario(registry: ModelRegistry) -> None:
        entry = registry.entry("m")
        assert await infer(registry, "m") == 1
        used = entry.versions[1].last_used
        # WHEN the reaper looks just before the TTL THEN the version stays
        await registry.reap_idle(used + 59)
        assert sorted(entry.versions) == [1]
        # WHEN it looks after the TTL THEN the version is unloaded
        await registry.reap_idle(used + 61)
        assert entry.versions == {}
        assert entry.states[1] == (State.UNAVAILABLE, "unloaded: idle for more than 60 s")
        # AND the next request loads it again, as a cold start
        async with registry.lease("m", None, None) as (served, cold):
            assert cold is not None
            assert served.model.version == 1
        assert loader.calls == [("m", 1), ("m", 1)]
        assert entry.cold_starts == 1

    run(repo, loader, scenario)


def test_busy_or_pinned_versions_outlive_their_ttl(tmp_path: Path) -> None:
    # GIVEN a leased model and a pinned model, both with a 60 s idle TTL
    repo = FakeRepository(tmp_path)
    repo.add("busy", 1, idle_ttl_seconds=60)
    repo.add("pinned", 1, idle_ttl_seconds=60, pinned=True)

    async def scenario(registry: ModelRegistry) -> None:
        async with registry.lease("busy", None, None):
            # WHEN the reaper looks an hour later
            await registry.reap_idle(time.monotonic() + 3600)
            # THEN neither is unloaded
            assert sorted(registry.entry("busy").versions) == [1]
            assert sorted(registry.entry("pinned").versions) == [1]

    run(repo, FakeLoader(), scenario)


def test_version_policy_latest_two_and_pinned_version_requests(tmp_path: Path) -> None:
    # GIVEN versions 1 to 3 and a policy serving the latest two
    repo = FakeRepository(tmp_path)
    repo.configs["m"] = ModelConfig.model_validate(
        {**tensor_config("m").model_dump(), "version_policy": {"latest": {"num_versions": 2}}}
    )
    repo.versions["m"] = [1, 2, 3]

    async def scenario(registry: ModelRegistry) -> None:
        # THEN versions 2 and 3 load, 2 can be asked for by number, 1 cannot
        assert sorted(registry.entry("m").versions) == [2, 3]
        assert registry.get("m", "2").model.version == 2
        assert registry.get("m").model.version == 3
        with pytest.raises(ModelNotFoundError):
            registry.get("m", "1")

    run(repo, FakeLoader(), scenario)


def test_loading_an_unknown_model_leaves_no_trace(tmp_path: Path) -> None:
    repo = FakeRepository(tmp_path)
    repo.add("m", 1)

    async def scenario(registry: ModelRegistry) -> None:
        # WHEN a model the repository does not have is synced
        failures = await registry.sync("ghost")
        # THEN it fails 404 and the registry does not list it
        assert [f.code for f in failures] == ["model_not_found"]
        with pytest.raises(ModelNotFoundError):
            registry.get("ghost")
        assert "ghost" not in {r["name"] for r in await registry.index()}

    run(repo, FakeLoader(), scenario)


class ListingRepository(FakeRepository):
    """Counts its listings."""

    listings = 0

    def list_models(self) -> list[str]:
        self.listings += 1
        return super().list_models()


def test_a_model_published_after_start_is_found_after_a_miss(tmp_path: Path) -> None:
    repo = ListingRepository(tmp_path)
    repo.add("m", 1)
    clock = StepClock()

    async def main() -> None:
        registry = ModelRegistry(
            repo, GpuSettings(), loader=FakeLoader(), clock=clock, sleep=clock.sleep
        )
        await registry.start()
        try:
            # GIVEN a registry started while the repository held m alone; a second later
            # a model is published, nobody asking the service to load it
            clock.now += 1
            repo.add("new", 1)
            listings = repo.listings
            # WHEN a look-up that answers at once (not an infer request's) names it
            with pytest.raises(ModelNotFoundError):
                registry.entry("new")
            # THEN it is 404, and the listing it started registers the model, which the
            # next request loads and is served by
            assert registry.listing is not None
            await asyncio.wait_for(registry.listing, WAIT_S)
            assert await infer(registry, "new") == 1
            # AND 50 look-ups of names that do not exist, within the second, list nothing
            for i in range(50):
                with pytest.raises(ModelNotFoundError):
                    registry.entry(f"invented-{i}")
            assert repo.listings == listings + 1
            # AND a second later 50 more start one listing between them
            clock.now += 1
            for i in range(50, 100):
                with pytest.raises(ModelNotFoundError):
                    registry.entry(f"invented-{i}")
            await asyncio.wait_for(registry.listing, WAIT_S)
            assert repo.listings == listings + 2
            assert not any(name.startswith("invented") for name in registry.models)
        finally:
            await registry.stop(5)

    asyncio.run(main())
