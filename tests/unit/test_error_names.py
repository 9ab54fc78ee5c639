"""Refusals that help: an unknown model names the models served (at most twenty, then how
many more), on the GPU service's registry and the CPU fallback's index alike; a path no
route has is a 404 whatever the method, and a 405 only says the path is there."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gpu_service.registry import ModelRegistry
from gpu_service.settings import GpuSettings
from spillway.models.engine import EngineOptions
from spillway.models.loader import OnDemandVersions
from spillway.protocol.errors import (
    MethodNotAllowedError,
    ModelNotFoundError,
    RouteNotFoundError,
    name_list,
)
from spillway.protocol.wire import allow_get
from tests.fakes import FakeLoader, FakeRepository

NAMES = [f"m{i:02d}" for i in range(25)]
FIRST_TWENTY = ", ".join(f"'m{i:02d}'" for i in range(20))
UNKNOWN = f"unknown model 'nope'; models served here: {FIRST_TWENTY} and 5 more"


def _repository(tmp_path: Path) -> FakeRepository:
    repo = FakeRepository(tmp_path)
    for name in reversed(NAMES):  # added out of order: the message sorts them
        repo.add(name, 1)
    return repo


def test_a_name_list_is_sorted_quoted_and_bounded() -> None:
    assert name_list(["b", "a", "b"]) == "'a', 'b'"
    assert name_list([]) == "none"
    assert name_list(NAMES) == f"{FIRST_TWENTY} and 5 more"
    assert name_list(NAMES[:20]) == FIRST_TWENTY


def test_the_gpu_registry_names_the_models_it_serves(tmp_path: Path) -> None:
    # GIVEN a registry over 25 models
    repo = _repository(tmp_path)

    async def main() -> None:
        registry = ModelRegistry(repo, GpuSettings(), loader=FakeLoader())
        await registry.start()
        try:
            # WHEN a request names a model it does not have
            with pytest.raises(ModelNotFoundError) as caught:
                registry.entry("nope")
        finally:
            await registry.stop(5)
        # THEN the 404 keeps its code and names the first twenty, then how many more
        assert (caught.value.status, caught.value.code) == (404, "model_not_found")
        assert caught.value.message == UNKNOWN

    asyncio.run(main())


def test_the_cpu_fallback_names_the_models_it_serves(tmp_path: Path) -> None:
    # GIVEN the fallback's index over the same 25 models (nothing loaded)
    versions = OnDemandVersions(
        _repository(tmp_path), None, cache_dir=tmp_path / "cache", options=EngineOptions()
    )
    # WHEN a request names a model it does not have
    with pytest.raises(ModelNotFoundError) as caught:
        versions.get("nope", None)
    # THEN it answers in the GPU service's words
    assert caught.value.message == UNKNOWN


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_a_path_no_route_has_is_404_whatever_the_method(method: str) -> None:
    with pytest.raises(RouteNotFoundError) as caught:
        allow_get(method, "/v2/model/digits/infer", {"/v2", "/v2/health/live"})
    assert (caught.value.status, caught.value.code) == (404, "not_found")


def test_a_fixed_path_takes_get_alone() -> None:
    allow_get("GET", "/v2", {"/v2"})
    with pytest.raises(MethodNotAllowedError) as caught:
        allow_get("POST", "/v2", {"/v2"})
    assert (caught.value.status, caught.value.allow) == (405, "GET")
