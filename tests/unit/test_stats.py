"""Statistics: the busy fraction the router reads from every response, and statistics
that are one snapshot (what Triton's perf_analyzer checks).

perf_analyzer aborts with "Server side statistics compute counts must be the same" when,
between two snapshots, the ``compute_input``, ``compute_infer`` and ``compute_output``
counts of a model (or of a pipeline's composing model) grew differently. The invariant
held here: in every snapshot, per model version, the counts of ``success``, ``queue``
and the three compute counters are equal; a failed request adds to ``fail`` only.
The service reads statistics on its event loop, so "every snapshot" means "between any
two steps of the loop": the tests look at every loop turn while requests are in flight.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpu_service.batch_compute import Computed
from gpu_service.batcher import DynamicBatcher
from gpu_service.batching_policy import BatchingPolicy
from gpu_service.dataplane import DataPlane
from gpu_service.pipelines import _BatcherSteps
from gpu_service.registry import ModelRegistry
from gpu_service.settings import GpuSettings
from gpu_service.stats import BusyTracker, ModelStats, RequestTimer
from spillway.models.config import ModelConfig
from spillway.models.processing import Prepared, Tensors
from spillway.pipelines.definition import Step
from spillway.pipelines.runner import Compute, Resolve
from spillway.protocol.errors import InferenceError
from tests.fakes import (
    MB,
    FakeModel,
    FakeRepository,
    InlineExecutor,
    SummingRunner,
    advance,
    fake_request,
    idle,
    run_virtual,
    virtual_loop,
)

PER_REQUEST = ("success", "queue", "compute_input", "compute_infer", "compute_output")
NS = 1_000_000_000


def test_busy_fraction_over_the_window() -> None:
    busy = BusyTracker(window_s=10.0)
    busy.start(0.0)
    busy.stop(5.0)
    assert busy.fraction(10.0) == 0.5
    busy.start(10.0)
    # measured from the oldest sample inside the window (t=5): busy 2 of the last 7 s
    assert busy.fraction(12.0) == 2.0 / 7.0
    busy.stop(12.0)
    # long idle: nothing of the window was busy, and old samples were dropped
    assert busy.fraction(100.0) == 0.0
    assert len(busy._samples) == 0


def test_samples_stay_bounded_under_many_batches() -> None:
    busy = BusyTracker(window_s=1.0)
    for i in range(10_000):
        busy.start(i * 0.01)
        busy.stop(i * 0.01 + 0.005)
        busy.fraction(i * 0.01 + 0.005)
    assert len(busy._samples) <= 202
    assert abs(busy.fraction(100.0) - 0.5) < 0.01


# -- the batcher hands each request its times; the answerer counts the request ----------


def test_a_batch_hands_each_request_its_queue_and_run_time_and_counts_only_the_run() -> None:
    # GIVEN a batcher on virtual time whose runs take 0.25 s and whose queue delay is 0.1 s
    policy = BatchingPolicy(max_batch_size=8, max_queue_delay_s=0.1, early_dispatch=False)
    stats = ModelStats()

    async def main() -> list[Computed]:
        loop = virtual_loop()
        executor = InlineExecutor(run_s=0.25)
        batcher = DynamicBatcher(
            "fake", SummingRunner(), policy, executor, stats=stats, clock=loop.time
        )
        batcher.start()
        # WHEN one request arrives at t=0 and another (of 2 rows) at t=0.04
        first = asyncio.ensure_future(batcher.submit_timed(fake_request(1)))
        await advance(0.04)
        second = asyncio.ensure_future(batcher.submit_timed(fake_request(2, rows=2)))
        await idle()
        # THEN while they compute together (dispatched at t=0.1), no request is counted
        assert stats.execution_count == 0
        done = await asyncio.gather(first, second)
        await batcher.stop(drain_timeout_s=1)
        return list(done)

    first, second = run_virtual(main)
    # AND each got its rows, its own wait and the whole run of its batch
    np.testing.assert_array_equal(first.tensors["y"], [[3.0 + 300.0]])
    assert first.queue_s == pytest.approx(0.1)
    assert second.queue_s == pytest.approx(0.06)
    assert first.infer_s == second.infer_s == pytest.approx(0.25)
    # AND the batcher counted one execution of 3 rows, and no request: the answerer does
    assert (stats.execution_count, stats.inference_count) == (1, 3)
    assert stats.batch_sizes[3].count == 1
    assert {kind: getattr(stats, kind).count for kind in PER_REQUEST} == dict.fromkeys(
        PER_REQUEST, 0
    )


def test_record_success_adds_every_counter_of_a_request_at_once() -> None:
    # GIVEN a request that arrived at t=10, was queued at t=10.5 and answered at t=12.25
    # after 0.75 s in the queue and a 1 s run, and is done at t=13
    now = iter([10.5, 12.25, 13.0])
    timer = RequestTimer(10.0, clock=lambda: next(now))
    timer.enqueued()
    timer.computed(queue_s=0.75, infer_s=1.0)
    stats = ModelStats()
    # WHEN it is recorded
    stats.record_success(timer)
    stats.record_failure(0.5)
    entry = stats.to_triton("m", "1")["inference_stats"]
    # THEN each per-request counter has one request with its share of the time
    assert {kind: entry[kind] for kind in PER_REQUEST} == {
        "success": {"count": 1, "ns": 3 * NS},
        "queue": {"count": 1, "ns": int(0.75 * NS)},
        "compute_input": {"count": 1, "ns": NS // 2},
        "compute_infer": {"count": 1, "ns": NS},
        "compute_output": {"count": 1, "ns": int(0.75 * NS)},
    }
    # AND the failure is in fail alone; the response-cache fields perf_analyzer reads exist
    assert entry["fail"] == {"count": 1, "ns": NS // 2}
    assert entry["cache_hit"] == entry["cache_miss"] == {"count": 0, "ns": 0}


# -- the data plane and the pipeline steps, looked at on every loop turn ---------------


@dataclass
class PlusModel(FakeModel):
    """``y = x + version``; a batch holding a negative value fails whole."""

    batched_prepare: bool = False

    @property
    def output_names(self) -> list[str]:
        return ["y"]

    def run(self, batch: list[Prepared]) -> list[Tensors]:
        if any((p.feeds["x"] < 0).any() for p in batch):
            raise InferenceError("negative input")
        return super().run(batch)


def plus_loader(
    cfg: ModelConfig, version: int, path: Path, settings: GpuSettings
) -> tuple[Any, int, str]:
    return PlusModel(cfg.name, version, cfg), 40 * MB, "fake"


def body(value: float) -> bytes:
    tensor = {"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [value]}
    return json.dumps({"inputs": [tensor]}).encode()


async def inline(function: Callable[..., Any], *args: Any) -> Any:
    """The offload of a pipeline run, on the loop (the fake model prepares at once)."""
    return function(*args)


class Watcher:
    """Reads ``stats`` at every turn of the event loop until stopped; keeps the counts
    of each reading whose per-request counts disagree."""

    def __init__(self, stats: Callable[[], ModelStats]) -> None:
        self.stats = stats
        self.turns = 0
        self.disagreeing: list[dict[str, int]] = []
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            counts = counts_of(self.stats())
            if len(set(counts.values())) != 1:
                self.disagreeing.append(counts)
            self.turns += 1
            await asyncio.sleep(0)  # one turn of the loop

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def counts_of(stats: ModelStats) -> dict[str, int]:
    return {kind: getattr(stats, kind).count for kind in PER_REQUEST}


@pytest.fixture
def repository(tmp_path: Path) -> FakeRepository:
    repo = FakeRepository(tmp_path)
    repo.add("m", 1)
    # a queue delay, so requests arriving together share batches
    config = repo.configs["m"].to_json_dict()
    config["dynamic_batching"] = {"max_queue_delay_microseconds": 2000}
    repo.configs["m"] = ModelConfig.model_validate(config)
    return repo


def run_service(
    repository: FakeRepository,
    scenario: Callable[[DataPlane], Awaitable[None]],
) -> None:
    async def main() -> None:
        registry = ModelRegistry(repository, GpuSettings(), loader=plus_loader)
        await registry.start()
        plane = DataPlane(registry, registry.settings)
        try:
            await scenario(plane)
        finally:
            await registry.stop(5)
            plane.close()

    asyncio.run(main())


def test_every_loop_turn_sees_equal_counts_while_requests_finish(
    repository: FakeRepository,
) -> None:
    served: list[int] = []
    watched: list[Watcher] = []
    final: list[ModelStats] = []
    requests = 24

    async def scenario(plane: DataPlane) -> None:
        def stats() -> ModelStats:
            return plane.registry.get("m").stats

        watcher = Watcher(stats)
        watched.append(watcher)
        # GIVEN 24 requests sent at once, and one whose batch fails at run time
        answers = await asyncio.gather(
            *(plane.infer("m", None, body(float(i)), None) for i in range(requests)),
            plane.infer("m", None, body(-1.0), None),
            return_exceptions=True,
        )
        await watcher.stop()
        served.extend(a.version for a in answers if not isinstance(a, BaseException))
        final.append(stats())

    # WHEN they are served while the statistics are read at every loop turn
    run_service(repository, scenario)
    # THEN no reading ever had the counters of some request and not its others, over
    # more turns than there were runs (each run's answers arrive in a turn of their own;
    # how many more depends on the machine: a run finishing sooner leaves fewer turns)
    watcher, stats = watched[0], final[0]
    assert watcher.turns > stats.execution_count
    assert watcher.disagreeing == []
    # AND each success counts once in each counter; the failed batch's requests in fail
    assert set(served) == {1}
    assert stats.fail.count == requests + 1 - len(served) >= 1
    assert counts_of(stats) == dict.fromkeys(PER_REQUEST, len(served))
    assert stats.execution_count < requests  # they were batched


def test_pipeline_steps_count_in_their_step_model_as_requests_of_its_own(
    repository: FakeRepository,
) -> None:
    step = Step(
        index=0,
        model="m",
        version=None,
        input_map={"x": "x"},
        output_map={"y": "y"},
        condition=None,
        cache=False,
        cache_shared=False,
        config_digest="",
        batching=True,
    )
    watched: list[Watcher] = []
    answers: list[float] = []

    async def scenario(plane: DataPlane) -> None:
        registry = plane.registry
        deadline = time.perf_counter() + 60
        steps = _BatcherSteps(
            registry,
            priority=0,
            arrived=time.perf_counter(),
            deadline=deadline,
            offload=inline,
            scope=None,
        )
        # GIVEN a pipeline run that resolved its step model
        assert await steps(Resolve(step)) == 1
        served = steps.leases[0]
        watcher = Watcher(lambda: served.stats)
        watched.append(watcher)
        # WHEN the step computes 12 requests' inputs (batched by the step model)
        inputs = [{"x": np.array([[float(i)]], np.float32)} for i in range(12)]
        outputs = await steps(Compute(step, inputs))
        steps.release()
        await watcher.stop()
        answers.extend(float(o["y"][0, 0]) for o in outputs)

    run_service(repository, scenario)
    # THEN no loop turn saw a step request counted in part
    watcher = watched[0]
    assert watcher.disagreeing == []
    # AND each input got its own answer, and the step model counted 12 whole requests
    assert answers == [i + 1.0 for i in range(12)]
    assert counts_of(watcher.stats()) == dict.fromkeys(PER_REQUEST, 12)
    assert watcher.stats().fail.count == 0
