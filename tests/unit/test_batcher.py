"""The dynamic batcher with fake runners: matching, limits, deadlines, priority, faults."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_service.batching_policy import BatchingPolicy
from gpu_service.batcher import DynamicBatcher
from spillway.errors import (
    DeadlineExceededError,
    InferenceError,
    OverloadedError,
    SpillwayError,
    UnavailableError,
)
from spillway.processing import Prepared, Tensors


@dataclass
class FakeRunner:
    """Sums each row; records batches by request id; fails batches holding a poison row;
    can be held (gate) to make the model look busy."""

    delay_s: float = 0.0
    gate: threading.Event | None = None
    batches: list[list[int]] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)

    def run(self, batch: list[Prepared]) -> list[Tensors]:
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.delay_s:
            time.sleep(self.delay_s)
        self.batches.append([int(p.feeds["id"][0, 0]) for p in batch])
        x = np.concatenate([p.feeds["x"] for p in batch])
        if (x < 0).any():
            raise InferenceError("poison row")
        out = x.sum(axis=1, keepdims=True)
        results, start = [], 0
        for p in batch:
            results.append({"y": out[start : start + p.rows]})
            start += p.rows
        return results


def request(ident: int, rows: int = 1, *, poison: bool = False, length: int = 0) -> Prepared:
    x = np.arange(rows * 3, dtype=np.float64).reshape(rows, 3) + ident * 100
    if poison:
        x[0, 0] = -1
    return Prepared({"x": x, "id": np.full((rows, 1), ident)}, rows, length)


def expected(prepared: Prepared) -> np.ndarray:
    return np.asarray(prepared.feeds["x"].sum(axis=1, keepdims=True))


Scenario = Callable[[DynamicBatcher, FakeRunner], Awaitable[None]]


def run_with(policy: BatchingPolicy, runner: FakeRunner, scenario: Scenario) -> None:
    async def main() -> None:
        with ThreadPoolExecutor(max_workers=policy.max_parallel_runs) as pool:
            batcher = DynamicBatcher("fake", runner, policy, pool)
            batcher.start()
            try:
                await scenario(batcher, runner)
            finally:
                if runner.gate is not None:
                    runner.gate.set()
                await batcher.stop(drain_timeout_s=10)

    asyncio.run(main())


# -- properties ------------------------------------------------------------------------

op = st.tuples(
    st.integers(1, 4),  # rows
    st.integers(1, 2),  # priority
    st.integers(0, 2),  # ms before the next arrival
    st.sampled_from([None, None, 0.0005, 0.02]),  # timeout (s)
    st.sampled_from([None, None, None, 0.001]),  # cancel after (s)
    st.integers(0, 9),  # poison when 0
    st.integers(0, 40),  # length (tokens)
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=1, max_size=40),
    max_batch=st.integers(4, 8),
    queue_size=st.integers(4, 30),
    concurrency=st.integers(1, 2),
)
def test_every_request_gets_exactly_its_own_answer(
    ops: list[tuple[int, int, int, float | None, float | None, int, int]],
    max_batch: int,
    queue_size: int,
    concurrency: int,
) -> None:
    policy = BatchingPolicy(
        max_batch_size=max_batch,
        max_queue_delay_s=0.001,
        max_queue_size=queue_size,
        priority_levels=2,
        default_priority=2,
        aging_s=0.005,
        length_buckets=(8, 16),
        concurrency=concurrency,
    )
    runner = FakeRunner(delay_s=0.0005)
    outcomes: dict[int, object] = {}
    requests: dict[int, Prepared] = {}
    depth_seen: list[int] = []

    async def one(
        batcher: DynamicBatcher,
        ident: int,
        rows: int,
        priority: int,
        timeout_s: float | None,
        cancel: float | None,
        poison: bool,
        length: int,
    ) -> None:
        prepared = request(ident, rows, poison=poison, length=length)
        requests[ident] = prepared
        task = asyncio.ensure_future(
            batcher.submit(prepared, priority=priority, timeout_s=timeout_s)
        )
        await asyncio.sleep(0)
        depth_seen.append(batcher.queue_depth)
        if cancel is not None:
            await asyncio.sleep(cancel)
            task.cancel()
        try:
            outcomes[ident] = await task
        except asyncio.CancelledError:
            outcomes[ident] = "cancelled"
        except SpillwayError as error:
            outcomes[ident] = error

    async def scenario(batcher: DynamicBatcher, _: FakeRunner) -> None:
        tasks = []
        for ident, (rows, prio, gap, timeout, cancel, poison, length) in enumerate(ops):
            tasks.append(
                asyncio.ensure_future(
                    one(batcher, ident, rows, prio, timeout, cancel, poison == 0, length)
                )
            )
            await asyncio.sleep(gap / 1000)
        await asyncio.gather(*tasks)

    run_with(policy, runner, scenario)

    # THEN every request has exactly one outcome
    assert sorted(outcomes) == list(range(len(ops)))
    ran = [ident for batch in runner.batches for ident in batch]
    assert len(ran) == len(set(ran)), "a request ran twice"
    batch_of = {ident: batch for batch in runner.batches for ident in batch}
    for ident, outcome in outcomes.items():
        prepared = requests[ident]
        if isinstance(outcome, dict):
            # its own rows, whatever it was batched with
            np.testing.assert_array_equal(outcome["y"], expected(prepared))
        elif isinstance(outcome, DeadlineExceededError):
            assert ident not in batch_of, "an expired request reached the runner"
        elif isinstance(outcome, InferenceError):
            assert any((requests[i].feeds["x"] < 0).any() for i in batch_of[ident])
        elif isinstance(outcome, OverloadedError):
            assert ident not in batch_of
        else:
            assert outcome == "cancelled"
    for batch in runner.batches:
        assert sum(requests[i].rows for i in batch) <= max_batch
        # a batch never mixes length buckets
        assert len({policy.bucket_of(requests[i].length) for i in batch}) == 1
        # a healthy request in a batch with no poison never fails
        if not any((requests[i].feeds["x"] < 0).any() for i in batch):
            assert all(isinstance(outcomes[i], dict | str) for i in batch)
    assert max(depth_seen) <= queue_size


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=30))
def test_batched_outputs_equal_unbatched(sizes: list[int]) -> None:
    policy = BatchingPolicy(max_batch_size=16, max_queue_delay_s=0.002, max_queue_size=64)
    runner = FakeRunner()
    got: dict[int, Tensors] = {}

    async def scenario(batcher: DynamicBatcher, _: FakeRunner) -> None:
        async def one(i: int, n: int) -> None:
            got[i] = await batcher.submit(request(i, n))

        await asyncio.gather(*(one(i, n) for i, n in enumerate(sizes)))

    run_with(policy, runner, scenario)
    alone = FakeRunner()
    for i, n in enumerate(sizes):
        np.testing.assert_array_equal(got[i]["y"], alone.run([request(i, n)])[0]["y"])


# -- the rules one by one --------------------------------------------------------------


def test_lone_request_waits_for_the_delay_from_its_arrival() -> None:
    policy = BatchingPolicy(max_batch_size=8, max_queue_delay_s=0.05)
    runner = FakeRunner()
    elapsed: list[float] = []

    async def scenario(batcher: DynamicBatcher, _: FakeRunner) -> None:
        started = time.monotonic()
        result = await batcher.submit(request(1))
        elapsed.append(time.monotonic() - started)
        np.testing.assert_array_equal(result["y"], expected(request(1)))

    run_with(policy, runner, scenario)
    assert runner.batches == [[1]]
    assert 0.05 <= elapsed[0] < 2.0


def test_full_batch_goes_at_once_without_waiting_the_delay() -> None:
    policy = BatchingPolicy(max_batch_size=4, max_queue_delay_s=30.0)
    runner = FakeRunner()

    async def scenario(batcher: DynamicBatcher, _: FakeRunner) -> None:
        await asyncio.wait_for(
            asyncio.gather(*(batcher.submit(request(i)) for i in range(4))), timeout=10
        )

    run_with(policy, runner, scenario)
    assert runner.batches == [[0, 1, 2, 3]]


def test_preferred_size_dispatches_early() -> None:
    policy = BatchingPolicy(max_batch_size=8, preferred_batch_sizes=(2,), max_queue_delay_s=30.0)
    runner = FakeRunner()

    async def scenario(batcher: DynamicBatcher, _: FakeRunner) -> None:
        await asyncio.wait_for(
            asyncio.gather(*(batcher.submit(request(i)) for i in range(2))), timeout=10
        )

    run_with(policy, runner, scenario)
    assert runner.batches == [[0, 1]]


def test_full_queue_rejects_exactly_the_excess_without_running() -> None:
    # GIVEN a busy model (one batch held) and a queue bound of 3
    policy = BatchingPolicy(
        max_batch_size=1, max_queue_delay_s=0.0, max_queue_size=3, retry_after_s=2.0
    )
    runner = FakeRunner(gate=threading.Event())
    results: list[object] = []

    async def scenario(batcher: DynamicBatcher, runner: FakeRunner) -> None:
        first = asyncio.ensure_future(batcher.submit(request(0)))
        assert await asyncio.to_thread(runner.started.wait, 5)
        # WHEN 3 + 2 more arrive
        tasks = [asyncio.ensure_future(batcher.submit(request(i))) for i in range(1, 6)]
        await asyncio.sleep(0.01)
        rejected = [t for t in tasks if t.done()]
        # THEN exactly 2 are refused at once with a retry hint, before anything more ran
        assert len(rejected) == 2
        for task in rejected:
            error = task.exception()
            assert isinstance(error, OverloadedError)
            assert error.status == 429
            assert error.retry_after_s == 2.0
        assert runner.batches == []
        assert runner.gate is not None
        runner.gate.set()
        results.extend(await asyncio.gather(first, *tasks, return_exceptions=True))

    run_with(policy, runner, scenario)
    assert sum(isinstance(r, dict) for r in results) == 4
    assert sorted(i for b in runner.batches for i in b) == [0, 1, 2, 3]


def test_deadline_in_queue_is_answered_promptly_and_never_computed() -> None:
    policy = BatchingPolicy(max_batch_size=1, max_queue_delay_s=0.0)
    runner = FakeRunner(gate=threading.Event())

    async def scenario(batcher: DynamicBatcher, runner: FakeRunner) -> None:
        first = asyncio.ensure_future(batcher.submit(request(0)))
        assert await asyncio.to_thread(runner.started.wait, 5)
        # WHEN a request with a 20 ms deadline waits behind the held batch
        with pytest.raises(DeadlineExceededError) as caught:
            await asyncio.wait_for(batcher.submit(request(1), timeout_s=0.02), timeout=5)
        # THEN it is answered 504 while the batch is still running
        assert caught.value.status == 504
        assert batcher.running == 1
        assert runner.gate is not None
        runner.gate.set()
        await first

    run_with(policy, runner, scenario)
    assert runner.batches == [[0]]


def test_timeout_may_only_lower_the_default() -> None:
    policy = BatchingPolicy(max_batch_size=1, default_timeout_s=0.01)
    batcher = DynamicBatcher("x", FakeRunner(), policy, ThreadPoolExecutor(1))
    assert batcher._timeout(None) == 0.01
    assert batcher._timeout(5.0) == 0.01
    assert batcher._timeout(0.001) == 0.001


def test_higher_priority_is_dequeued_first() -> None:
    policy = BatchingPolicy(
        max_batch_size=1, max_queue_delay_s=0.0, priority_levels=2, default_priority=2, aging_s=60.0
    )
    runner = FakeRunner(gate=threading.Event())

    async def scenario(batcher: DynamicBatcher, runner: FakeRunner) -> None:
        first = asyncio.ensure_future(batcher.submit(request(0)))
        assert await asyncio.to_thread(runner.started.wait, 5)
        low = [asyncio.ensure_future(batcher.submit(request(i), priority=2)) for i in (1, 2)]
        await asyncio.sleep(0)
        high = asyncio.ensure_future(batcher.submit(request(3), priority=1))
        await asyncio.sleep(0.01)
        assert runner.gate is not None
        runner.gate.set()
        await asyncio.gather(first, high, *low)

    run_with(policy, runner, scenario)
    assert runner.batches == [[0], [3], [1], [2]]


def test_aged_low_priority_is_not_starved() -> None:
    policy = BatchingPolicy(
        max_batch_size=1, max_queue_delay_s=0.0, priority_levels=2, default_priority=2, aging_s=0.02
    )
    runner = FakeRunner(gate=threading.Event())

    async def scenario(batcher: DynamicBatcher, runner: FakeRunner) -> None:
        first = asyncio.ensure_future(batcher.submit(request(0)))
        assert await asyncio.to_thread(runner.started.wait, 5)
        low = asyncio.ensure_future(batcher.submit(request(1), priority=2))
        await asyncio.sleep(0.05)  # older than aging_s
        high = asyncio.ensure_future(batcher.submit(request(2), priority=1))
        await asyncio.sleep(0)
        assert runner.gate is not None
        runner.gate.set()
        await asyncio.gather(first, low, high)

    run_with(policy, runner, scenario)
    assert runner.batches == [[0], [1], [2]]


def test_short_requests_do_not_wait_for_long_ones() -> None:
    policy = BatchingPolicy(max_batch_size=4, max_queue_delay_s=30.0, length_buckets=(8,))
    runner = FakeRunner()

    async def scenario(batcher: DynamicBatcher, _: FakeRunner) -> None:
        long = asyncio.ensure_future(batcher.submit(request(9, length=100)))
        short = [batcher.submit(request(i, length=5)) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*short), timeout=10)
        assert not long.done()
        long.cancel()

    run_with(policy, runner, scenario)
    assert runner.batches == [[0, 1, 2, 3]]


def test_failed_run_fails_its_batch_only() -> None:
    policy = BatchingPolicy(max_batch_size=2, max_queue_delay_s=30.0)
    runner = FakeRunner()
    outcomes: list[object] = []

    async def scenario(batcher: DynamicBatcher, _: FakeRunner) -> None:
        first = [batcher.submit(request(0, poison=True)), batcher.submit(request(1))]
        outcomes.extend(await asyncio.gather(*first, return_exceptions=True))
        second = [batcher.submit(request(2)), batcher.submit(request(3))]
        outcomes.extend(await asyncio.gather(*second, return_exceptions=True))

    run_with(policy, runner, scenario)
    assert [type(o).__name__ for o in outcomes] == [
        "InferenceError",
        "InferenceError",
        "dict",
        "dict",
    ]


def test_dead_batcher_fails_pending_and_turns_unhealthy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = BatchingPolicy(max_batch_size=4, max_queue_delay_s=0.01)

    async def scenario(batcher: DynamicBatcher, _: FakeRunner) -> None:
        def broken(*_: object) -> None:
            raise RuntimeError("bug in the batcher")

        batcher._form = broken  # type: ignore[method-assign,assignment]
        with pytest.raises(UnavailableError):
            await asyncio.wait_for(batcher.submit(request(0)), timeout=5)
        assert not batcher.healthy
        with pytest.raises(UnavailableError):
            await batcher.submit(request(1))

    with caplog.at_level(logging.ERROR, logger="spillway.batcher"):
        run_with(policy, FakeRunner(), scenario)
    assert any("died" in r.message for r in caplog.records)


def test_stop_drains_queued_work_and_refuses_new() -> None:
    policy = BatchingPolicy(max_batch_size=2, max_queue_delay_s=30.0)
    runner = FakeRunner(delay_s=0.01)

    async def main() -> None:
        with ThreadPoolExecutor(1) as pool:
            batcher = DynamicBatcher("d", runner, policy, pool)
            batcher.start()
            tasks = [asyncio.ensure_future(batcher.submit(request(i))) for i in range(3)]
            await asyncio.sleep(0)
            await batcher.stop(drain_timeout_s=10)
            results = await asyncio.gather(*tasks)
            assert [r["y"][0, 0] for r in results] == [expected(request(i))[0, 0] for i in range(3)]
            with pytest.raises(UnavailableError):
                await batcher.submit(request(9))

    asyncio.run(main())
    assert sorted(i for b in runner.batches for i in b) == [0, 1, 2]


def test_adaptive_target_follows_arrival_rate() -> None:
    policy = BatchingPolicy(max_batch_size=64, max_queue_delay_s=0.01, adaptive=True)
    batcher = DynamicBatcher("a", FakeRunner(), policy, ThreadPoolExecutor(1))
    assert batcher._target() == 2  # no traffic seen: the floor
    for i in range(50):
        batcher._rate.arrive(i * 0.0005)  # 2,000 requests/s × 10 ms ≈ 20
    assert batcher._target() == 20
    for i in range(50):
        batcher._rate.arrive(1 + i * 0.00001)  # a burst caps at max_batch_size
    assert batcher._target() == 64


def test_a_running_long_batch_does_not_block_short_ones() -> None:
    # GIVEN a long-text batch held in compute (one slot per bucket)
    policy = BatchingPolicy(max_batch_size=4, max_queue_delay_s=0.0, length_buckets=(8,))
    release_long = threading.Event()

    class LengthGated(FakeRunner):
        def run(self, batch: list[Prepared]) -> list[Tensors]:
            if batch[0].length > 8:
                assert release_long.wait(10)
            return super().run(batch)

    runner = LengthGated()

    async def scenario(batcher: DynamicBatcher, _: FakeRunner) -> None:
        long = asyncio.ensure_future(batcher.submit(request(9, length=100)))
        # WHEN short requests arrive THEN they complete while the long one still runs
        await asyncio.wait_for(batcher.submit(request(1, length=5)), timeout=10)
        await asyncio.wait_for(batcher.submit(request(2, length=5)), timeout=10)
        assert not long.done()
        release_long.set()
        await long

    run_with(policy, runner, scenario)
    assert runner.batches == [[1], [2], [9]]
