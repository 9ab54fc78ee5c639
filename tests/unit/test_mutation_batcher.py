"""What the mutation run of gpu_service/batcher.py and gpu_service/batch_compute.py found
untested (docs/mutation.md): each refusal's words, the log line of a dead batcher, the
owner task's name, a stop that cannot drain, and the threads batches compute on (the
device's, however many models and buckets)."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from gpu_service.batcher import DynamicBatcher
from gpu_service.batching_policy import BatchingPolicy
from gpu_service.compute_budget import ComputeBudget
from spillway.models.processing import Prepared, Tensors
from spillway.protocol.errors import InvalidInputError, OverloadedError, UnavailableError
from tests.fakes import InlineExecutor, SummingRunner, fake_request, idle, sum_rows
from tests.unit.test_batcher import Rig, run_with, submit

ONE_AT_A_TIME = BatchingPolicy(max_batch_size=1, max_queue_delay_s=0.0, max_queue_size=1)


# -- refusals, word for word -------------------------------------------------------------


def test_a_batcher_that_was_not_started_refuses_with_its_name() -> None:
    batcher = DynamicBatcher("idle-model", SummingRunner(), ONE_AT_A_TIME, InlineExecutor())

    async def main() -> None:
        await batcher.submit(fake_request(0))

    with pytest.raises(UnavailableError) as refused:
        asyncio.run(main())
    assert refused.value.message == "model idle-model is not serving"
    assert batcher.failure is None  # not started is not dead


def test_refusals_name_the_limit_that_was_passed() -> None:
    policy = BatchingPolicy(
        max_batch_size=2, max_queue_delay_s=0.0, max_queue_size=1, priority_levels=2
    )
    refusals: list[tuple[type, str]] = []

    async def scenario(rig: Rig) -> None:
        rig.executor.hold()
        running = submit(rig.batcher, fake_request(0))
        await idle()
        queued = submit(rig.batcher, fake_request(1))
        await idle()
        for rows, priority in ((3, 0), (1, 3), (1, 0)):
            try:
                await rig.batcher.submit(fake_request(9, rows), priority=priority)
            except (InvalidInputError, OverloadedError) as error:
                refusals.append((type(error), error.message))
        rig.executor.resume()
        await asyncio.gather(running, queued)

    run_with(policy, scenario)
    assert refusals == [
        (InvalidInputError, "batch of 3 exceeds 2"),
        (InvalidInputError, "priority must be between 1 and 2, or 0"),
        (OverloadedError, "model fake queue is full (1)"),
    ]


def test_a_timeout_of_zero_is_allowed_and_a_negative_one_refused() -> None:
    batcher = DynamicBatcher("x", SummingRunner(), ONE_AT_A_TIME, InlineExecutor())
    assert batcher.policy.timeout_of(0.0) == 0.0
    with pytest.raises(InvalidInputError) as refused:
        batcher.policy.timeout_of(-0.001)
    assert refused.value.message == "timeout must not be negative"


# -- the owner task ------------------------------------------------------------------------


def test_the_owner_task_is_named_after_its_model() -> None:
    names: list[str] = []

    async def scenario(rig: Rig) -> None:
        names.extend(t.get_name() for t in asyncio.all_tasks())

    run_with(ONE_AT_A_TIME, scenario)
    assert "batcher-fake" in names


def test_a_dead_batcher_logs_its_failure_and_fails_what_was_queued(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = BatchingPolicy(max_batch_size=1, max_queue_delay_s=0.0, max_queue_size=4)
    crash = RuntimeError("bug in the batcher")
    errors: list[str] = []

    async def scenario(rig: Rig) -> None:
        # GIVEN a request running (held) and one queued behind it
        rig.executor.hold()
        running = submit(rig.batcher, fake_request(0))
        await idle()
        queued = submit(rig.batcher, fake_request(1))
        await idle()

        # WHEN the owner task crashes the next time it forms a batch
        def broken(*_: object) -> None:
            raise crash

        rig.batcher._form = broken  # type: ignore[method-assign,assignment]
        rig.executor.resume()
        await running
        # THEN the queued request fails with the batcher's failure
        with pytest.raises(UnavailableError) as failed:
            await queued
        errors.append(failed.value.message)

    with caplog.at_level(logging.ERROR, logger="spillway.batcher"):
        run_with(policy, scenario)
    assert errors == ["the batcher of model fake failed"]
    died = [r for r in caplog.records if "died" in r.getMessage()]
    assert [r.getMessage() for r in died] == ["batcher of fake died; failing its queued requests"]
    assert died[0].exc_info is not None
    assert died[0].exc_info[1] is crash


def test_a_stop_that_cannot_drain_fails_the_queued_requests() -> None:
    errors: list[str] = []
    policy = BatchingPolicy(max_batch_size=1, max_queue_delay_s=0.0, max_queue_size=4)

    async def scenario(rig: Rig) -> None:
        # GIVEN a batch that does not finish and a request queued behind it
        rig.executor.hold()
        running = submit(rig.batcher, fake_request(0))
        await idle()
        queued = submit(rig.batcher, fake_request(1))
        await idle()
        # WHEN the batcher stops with 50 ms to drain
        await rig.batcher.stop(drain_timeout_s=0.05)
        # THEN the queued request is failed, not left waiting
        with pytest.raises(UnavailableError) as failed:
            await queued
        errors.append(failed.value.message)
        rig.executor.resume()
        running.cancel()

    run_with(policy, scenario)
    assert errors == ["model fake is shutting down"]


def test_a_stop_waits_30_seconds_by_default_for_running_work() -> None:
    waited: list[float] = []

    async def scenario(rig: Rig) -> None:
        # GIVEN a batch that does not finish
        rig.executor.hold()
        running = submit(rig.batcher, fake_request(0))
        await idle()
        # WHEN the batcher stops with its default drain time
        loop = asyncio.get_running_loop()
        started = loop.time()
        await rig.batcher.stop()
        # THEN it gave the batch 30 s (virtual) before ending
        waited.append(loop.time() - started)
        rig.executor.resume()
        running.cancel()

    run_with(ONE_AT_A_TIME, scenario)
    assert waited == [pytest.approx(30.0)]


def test_a_request_without_a_priority_gets_the_default_level() -> None:
    # GIVEN two levels, the default being the lower one
    policy = BatchingPolicy(
        max_batch_size=1, max_queue_delay_s=0.0, priority_levels=2, default_priority=2, aging_s=60.0
    )

    async def scenario(rig: Rig) -> None:
        rig.executor.hold()
        first = submit(rig.batcher, fake_request(0))
        await idle()
        # WHEN a request that names no priority queues before one of priority 1
        plain = asyncio.ensure_future(rig.batcher.submit(fake_request(1)))
        await idle()
        urgent = submit(rig.batcher, fake_request(2), priority=1)
        await idle()
        rig.executor.resume()
        await asyncio.gather(first, plain, urgent)

    rig = run_with(policy, scenario)
    # THEN the priority-1 request overtakes it
    assert rig.runner.batches == [[0], [2], [1]]


# -- compute threads -------------------------------------------------------------------------


class _ThreadRecorder:
    """A summing runner that records the thread each batch computes on, and the most
    batches that computed at once. Its first two runs meet before either ends (a
    barrier, not a sleep): they overlap for certain when two may compute at once, and
    the barrier breaks (failing the run) when the budget lets only one."""

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.now = 0
        self.peak = 0
        self.started = 0
        self._lock = threading.Lock()
        self._meet = threading.Barrier(2, timeout=10)

    def run(self, batch: list[Prepared]) -> list[Tensors]:
        with self._lock:
            self.threads.add(threading.current_thread().name)
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.started += 1
            meets = self.started <= 2
        try:
            if meets:
                self._meet.wait()
        finally:
            with self._lock:
                self.now -= 1
        return sum_rows(batch)


def test_every_bucket_of_every_model_computes_on_the_devices_threads() -> None:
    # GIVEN one budget of 2 slots (no overdraft) and three models of three length
    # buckets each, none given an executor (per-bucket or per-model pools would start
    # nine threads here)
    budget = ComputeBudget(2, overdraft=0)
    policy = BatchingPolicy(max_batch_size=2, max_queue_delay_s=0.0, length_buckets=(10, 20))
    runner = _ThreadRecorder()

    async def main() -> None:
        batchers = [DynamicBatcher(f"m{i}", runner, policy, budget=budget) for i in range(3)]
        for batcher in batchers:
            batcher.start()
        try:
            # WHEN 90 requests of every length go to all of them at once
            await asyncio.gather(
                *(
                    b.submit(fake_request(i, length=length))
                    for b in batchers
                    for i in range(10)
                    for length in (5, 15, 25)
                )
            )
        finally:
            for batcher in batchers:
                await batcher.stop(drain_timeout_s=5)
            budget.close()

    asyncio.run(main())
    # THEN every run computed on the budget's threads, two at most at once
    assert runner.threads
    assert all(t.startswith(("compute_", "compute-long_")) for t in runner.threads)
    assert len(runner.threads) <= 2 * budget.slots + budget.overdraft
    assert runner.peak == budget.peak == 2
