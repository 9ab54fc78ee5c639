"""The canary record's rules, the guard's verdict, the configuration's ``spillway.canary``
and the version each deployable serves to a request that pins none."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from batch_job.plan import resolve_version
from gpu_service.registry import ModelRegistry
from gpu_service.settings import GpuSettings
from spillway.canary import records as canary
from spillway.canary.guard import WindowSummary, verdict
from spillway.canary.records import CanaryState, CanaryStore
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.canary_spec import CanarySpec, RollbackBounds
from spillway.models.config import ModelConfig
from spillway.protocol.errors import InvalidInputError
from tests.fakes import FakeLoader, FakeModel, FakeRepository, tensor_config
from tests.memory_store import MemoryStateStore

BOUNDS = RollbackBounds(min_requests=50)


def window(count: int, faults: int, latency_s: float) -> WindowSummary:
    """A window of like-sized requests, each served in ``latency_s`` unless it faulted."""
    return WindowSummary(count, faults, {(8, 9): [latency_s] * (count - faults)})


def test_a_first_canary_names_its_stable_version() -> None:
    with pytest.raises(InvalidInputError, match="name the stable version"):
        canary.start(None, "digits", 2, 10, at=0)
    state = canary.start(None, "digits", 2, 10, at=0, stable=1)
    assert (state.stable, state.canary, state.percent, state.status) == (1, 2, 10, "running")
    with pytest.raises(InvalidInputError, match="already the stable version"):
        canary.start(state, "digits", 1, 10, at=1)
    with pytest.raises(InvalidInputError, match="promote a canary"):
        canary.start(state, "digits", 2, 10, at=1, stable=3)


def test_percent_changes_promotion_and_rollback_are_recorded() -> None:
    state = canary.start(None, "digits", 2, 10, at=0, stable=1)
    state = canary.start(state, "digits", 2, 50, at=1)
    assert [e.event for e in state.history] == ["started", "percent"]
    assert canary.rollback(state, 3, "not the canary", at=2) is None
    rolled = canary.rollback(state, 2, "faults", at=2)
    assert rolled is not None
    assert (rolled.percent, rolled.status) == (0, "rolled_back")
    assert canary.rollback(rolled, 2, "again", at=3) is None
    assert rolled.serves(1)
    assert not rolled.serves(2)
    assert rolled.choose(0.0) == 1
    with pytest.raises(InvalidInputError, match="no running canary"):
        canary.promote(rolled, at=4)
    promoted = canary.promote(state, at=5)
    assert (promoted.stable, promoted.canary, promoted.status) == (2, None, "promoted")
    assert promoted.knows(1)
    assert promoted.knows(2)
    assert not promoted.knows(3)


def test_the_history_keeps_the_last_twenty_events() -> None:
    state = canary.start(None, "digits", 2, 0, at=0, stable=1)
    for step in range(1, 30):
        state = canary.start(state, "digits", 2, step, at=step)
    assert len(state.history) == canary.HISTORY_LENGTH
    assert state.history[-1].percent == 29


def test_concurrent_writers_record_one_rollback() -> None:
    # GIVEN two stores over one table, both reading the running canary
    table = MemoryStateStore()
    first, second = CanaryStore(table, lambda: 1.0), CanaryStore(table, lambda: 2.0)
    first.start("digits", 2, 10, stable=1)
    # WHEN both roll it back
    results = [first.rollback("digits", 2, "a"), second.rollback("digits", 2, "b")]
    # THEN one wrote it and the other found nothing to do
    assert [r is not None for r in results] == [True, False]
    state = second.load("digits")
    assert state is not None
    assert [e.event for e in state.history] == ["started", "rolled_back"]


def test_a_writer_that_lost_the_race_retries_on_the_new_record() -> None:
    table = MemoryStateStore()
    store = CanaryStore(table, lambda: 1.0)
    store.start("digits", 2, 10, stable=1)
    interfering = {"done": False}

    def change(state: CanaryState | None) -> CanaryState | None:
        if not interfering["done"]:  # another writer gets in between the read and the write
            interfering["done"] = True
            CanaryStore(table, lambda: 1.5).start("digits", 2, 40)
        return canary.start(state, "digits", 2, (state.percent if state else 0) + 1, at=2)

    result = store.apply("digits", change)
    assert result is not None
    assert result.percent == 41


@pytest.mark.parametrize(
    ("canary_window", "stable_window", "expected"),
    [
        (window(49, 49, 0.01), window(500, 0, 0.01), None),  # too few requests
        (window(50, 1, 0.01), window(50, 0, 0.01), None),  # chance, not a trend
        (window(50, 10, 0.01), window(450, 0, 0.01), "fault rate 20.0%"),
        (window(200, 4, 0.01), window(200, 2, 0.01), None),  # +1 point at most
        (window(60, 12, 0.01), window(10, 0, 0.01), "fault rate 20.0%"),
        (window(100, 0, 0.030), window(100, 0, 0.010), "p99 30.0 ms"),
        (window(100, 0, 0.014), window(100, 0, 0.010), None),  # within x1.5
        (window(100, 0, 0.003), window(100, 0, 0.001), None),  # < +10 ms
        (window(99, 0, 0.030), window(99, 0, 0.010), None),  # p99 needs 100
    ],
)
def test_the_verdict(
    canary_window: WindowSummary, stable_window: WindowSummary, expected: str | None
) -> None:
    reason = verdict(canary_window, stable_window, BOUNDS)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None
        assert reason.startswith(expected)


def _config(**changes: Any) -> dict[str, Any]:
    base = tensor_config("m").model_dump()
    return {**base, **changes}


def test_a_configured_canary_needs_both_versions_served() -> None:
    block = {"kind": "tensor", "canary": {"version": 2, "stable": 1, "percent": 10}}
    with pytest.raises(ValidationError, match="num_versions >= 2"):
        ModelConfig.model_validate(_config(spillway=block))
    with pytest.raises(ValidationError, match=r"must list the canary's versions \[1\]"):
        ModelConfig.model_validate(
            _config(spillway=block, version_policy={"specific": {"versions": [2, 3]}})
        )
    with pytest.raises(ValidationError, match="must differ"):
        CanarySpec(version=1, stable=1, percent=5)
    config = ModelConfig.model_validate(
        _config(spillway=block, version_policy={"latest": {"num_versions": 2}})
    )
    assert config.default_version([1, 2]) == 1
    assert config.default_version([2, 3]) == 3
    assert tensor_config("m").default_version([1, 2]) == 2


def test_every_deployable_serves_the_stable_version_by_default(
    tmp_path: Path,
) -> None:
    # GIVEN a model whose config names canary v2 over stable v1, both served
    config = ModelConfig.model_validate(
        _config(
            spillway={"kind": "tensor", "canary": {"version": 2, "stable": 1, "percent": 10}},
            version_policy={"specific": {"versions": [1, 2]}},
        )
    )
    repo = FakeRepository(tmp_path)
    repo.configs["m"], repo.versions["m"] = config, [1, 2]

    async def gpu() -> tuple[int, int]:
        registry = ModelRegistry(repo, GpuSettings(), loader=FakeLoader())
        await registry.start()
        try:
            return registry.get("m").model.version, registry.get("m", "2").model.version
        finally:
            await registry.stop(5)

    # THEN an unpinned request gets v1 on the GPU service, the CPU fallback and a batch
    # job, and v2 when it asks for it
    assert asyncio.run(gpu()) == (1, 2)
    assert (resolve_version(repo, "m", None), resolve_version(repo, "m", 2)) == (1, 2)
    cpu = CpuService({"m": {v: FakeModel("m", v, config) for v in (1, 2)}}, CpuSettings())  # type: ignore[misc]
    assert (cpu.get("m", None).version, cpu.get("m", "2").version) == (1, 2)
