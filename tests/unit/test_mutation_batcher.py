"""What the mutation run of gpu_service/batcher.py and gpu_service/batch_compute.py found
untested (docs/mutation.md): each refusal's words, the log line of a dead batcher, the
owner task's name, a stop that cannot drain, and the compute threads a batcher owns
(their name, their number and their niceness)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import pytest

from gpu_service.batch_compute import compute_pool
from gpu_service.batcher import DynamicBatcher
from gpu_service.batching_policy import BatchingPolicy
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
    assert batcher._timeout(0.0) == 0.0
    with pytest.raises(InvalidInputError) as refused:
        batcher._timeout(-0.001)
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


def _niceness_now() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _reached(niceness: int) -> int:
    """The niceness a thread set to ``niceness`` ends with: lowering it below the
    process's needs privilege (the compute threads then keep what they inherited)."""
    base = _niceness_now()
    return niceness if niceness >= base or os.geteuid() == 0 else base


def _on_thread() -> tuple[str, int]:
    return threading.current_thread().name, os.getpriority(
        os.PRIO_PROCESS, threading.get_native_id()
    )


class _ThreadRecorder:
    """A summing runner that records the thread each batch computes on."""

    def __init__(self) -> None:
        self.threads: list[tuple[str, int]] = []

    def run(self, batch: list[Prepared]) -> list[Tensors]:
        self.threads.append(_on_thread())
        return sum_rows(batch)


def test_a_batcher_owns_named_reniced_threads_per_length_bucket() -> None:
    # GIVEN a batcher with two length buckets and no executor of its own
    policy = BatchingPolicy(max_batch_size=1, max_queue_delay_s=0.0, length_buckets=(10,))
    runner = _ThreadRecorder()

    async def main() -> None:
        batcher = DynamicBatcher("m", runner, policy)
        batcher.start()
        try:
            # WHEN a short and a long request run
            await batcher.submit(fake_request(0, length=5))
            await batcher.submit(fake_request(1, length=50))
        finally:
            await batcher.stop(drain_timeout_s=5)

    asyncio.run(main())
    # THEN each ran on its bucket's thread, the long one's yielding the CPU (niceness 5)
    (short_name, _), (long_name, long_nice) = runner.threads
    assert short_name.startswith("ort-m-0_")
    assert long_name.startswith("ort-m-1_")
    assert long_nice == _reached(5)


def test_a_compute_pool_has_its_size_name_and_niceness() -> None:
    niceness = min(19, _niceness_now() + 3)
    pool = compute_pool(2, niceness, "digits")
    try:
        name, nice = pool.submit(_on_thread).result(timeout=10)
        assert pool._max_workers == 2  # the pool's size, as ThreadPoolExecutor keeps it
    finally:
        pool.shutdown(wait=True)
    assert name.startswith("ort-digits_")
    assert nice == niceness


def test_a_niceness_of_zero_leaves_the_thread_as_it_was_made() -> None:
    # GIVEN a thread 4 steps nicer than the test that starts a pool of niceness 0 (its
    # threads inherit the starter's niceness)
    made = min(19, _niceness_now() + 4)
    seen: list[int] = []

    def make_and_use() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), made)
        pool = compute_pool(1, 0, "plain")
        try:
            seen.append(pool.submit(_on_thread).result(timeout=10)[1])
        finally:
            pool.shutdown(wait=True)

    starter = threading.Thread(target=make_and_use)
    starter.start()
    starter.join(timeout=10)
    # THEN the compute thread keeps the niceness it was made with
    assert seen == [made]
