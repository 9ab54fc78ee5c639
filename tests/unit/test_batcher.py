"""The dynamic batcher with fake runners: matching, limits, deadlines, priority, faults.

Every test runs on a virtual-time loop with an inline executor: no real time passes and no
thread runs, so each scenario (hypothesis examples included) plays out the same way every
time. "Running" batches are calls the executor holds until the test releases them."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from gpu_service.batcher import DynamicBatcher
from gpu_service.batching_policy import BatchingPolicy
from spillway.models.processing import Prepared, Tensors
from spillway.protocol.errors import (
    DeadlineExceededError,
    InferenceError,
    OverloadedError,
    SpillwayError,
    UnavailableError,
)
from spillway.state.table import scope
from tests.fakes import (
    InlineExecutor,
    SummingRunner,
    advance,
    fake_request,
    idle,
    row_sums,
    run_virtual,
    virtual_loop,
)


@dataclass
class Rig:
    """A started batcher on the virtual loop, with its runner and executor."""

    batcher: DynamicBatcher
    runner: SummingRunner
    executor: InlineExecutor


Scenario = Callable[[Rig], Awaitable[None]]


def run_with(
    policy: BatchingPolicy,
    scenario: Scenario,
    *,
    runner: SummingRunner | None = None,
    executor: InlineExecutor | None = None,
) -> Rig:
    """Run ``scenario`` against a batcher whose clock is the virtual loop's; then drain."""
    runner = runner or SummingRunner()
    executor = executor or InlineExecutor()

    async def main() -> Rig:
        loop = virtual_loop()
        batcher = DynamicBatcher("fake", runner, policy, executor, clock=loop.time)
        batcher.start()
        rig = Rig(batcher, runner, executor)
        try:
            await scenario(rig)
        finally:
            executor.resume()
            await batcher.stop(drain_timeout_s=10)
        return rig

    return run_virtual(main)


def submit(
    batcher: DynamicBatcher,
    prepared: Prepared,
    *,
    priority: int = 0,
    timeout_s: float | None = None,
    scope: str | None = None,
) -> asyncio.Task[Tensors]:
    """A request in flight (of tenant ``scope``), as a task the test can inspect, cancel
    or await."""
    return asyncio.ensure_future(
        batcher.submit(prepared, priority=priority, timeout_s=timeout_s, scope=scope)
    )


ACME, GLOBEX = scope("acme"), scope("globex")
"""Two tenants' scopes, as the data plane hands them down."""


# -- properties ------------------------------------------------------------------------

Op = tuple[int, int, int, float | None, float | None, int, int, str | None]
op = st.tuples(
    st.integers(1, 4),  # rows
    st.integers(1, 2),  # priority
    st.sampled_from([0, 0, 1, 2]),  # ms before the next arrival
    st.sampled_from([None, None, 0.0005, 0.02]),  # timeout (s)
    st.sampled_from([None, None, None, 0.001]),  # cancel after (s)
    st.integers(0, 9),  # poison when 0
    st.integers(0, 40),  # length (tokens)
    st.sampled_from([ACME, ACME, GLOBEX, None]),  # tenant scope (None: none proven)
)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(op, min_size=1, max_size=40),
    max_batch=st.integers(4, 8),
    queue_size=st.integers(2, 30),
    concurrency=st.integers(1, 2),
    run_s=st.sampled_from([0.0005, 0.01]),
    early=st.booleans(),
    fair=st.booleans(),
)
def test_every_request_gets_exactly_its_own_answer(
    ops: list[Op],
    max_batch: int,
    queue_size: int,
    concurrency: int,
    run_s: float,
    early: bool,
    fair: bool,
) -> None:
    # GIVEN a batcher whose runs take 0.5 or 10 ms, with or without early dispatch and
    # fair share, and any interleaving of arrivals from three tenants, deadlines,
    # cancellations and poisoned requests
    policy = BatchingPolicy(
        fair_share=fair,
        early_dispatch=early,
        max_batch_size=max_batch,
        max_queue_delay_s=0.001,
        max_queue_size=queue_size,
        priority_levels=2,
        default_priority=2,
        aging_s=0.005,
        length_buckets=(8, 16),
        concurrency=concurrency,
    )
    outcomes: dict[int, object] = {}
    requests: dict[int, Prepared] = {}
    depth_seen: list[int] = []

    async def one(rig: Rig, ident: int, spec: Op) -> None:
        rows, priority, _, timeout_s, cancel_after, poison, length, tenant = spec
        prepared = fake_request(ident, rows, poison=poison == 0, length=length)
        requests[ident] = prepared
        task = submit(rig.batcher, prepared, priority=priority, timeout_s=timeout_s, scope=tenant)
        await idle()  # admitted or refused, and whatever that set off has run
        depth_seen.append(rig.batcher.queue_depth)
        if cancel_after is not None:
            await advance(cancel_after)
            task.cancel()
        try:
            outcomes[ident] = await task
        except asyncio.CancelledError:
            outcomes[ident] = "cancelled"
        except SpillwayError as error:
            outcomes[ident] = error

    async def scenario(rig: Rig) -> None:
        # WHEN the requests arrive with their gaps
        tasks = []
        for ident, spec in enumerate(ops):
            tasks.append(asyncio.ensure_future(one(rig, ident, spec)))
            await advance(spec[2] / 1000)
        await asyncio.gather(*tasks)

    rig = run_with(policy, scenario, executor=InlineExecutor(run_s=run_s))
    batches = rig.runner.batches

    # THEN every request has exactly one outcome
    assert sorted(outcomes) == list(range(len(ops)))
    ran = [ident for batch in batches for ident in batch]
    assert len(ran) == len(set(ran)), "a request ran twice"
    batch_of = {ident: batch for batch in batches for ident in batch}
    for ident, outcome in outcomes.items():
        event(f"some request ends {type(outcome).__name__}")
        prepared = requests[ident]
        if isinstance(outcome, dict):
            # its own rows, whatever it was batched with
            np.testing.assert_array_equal(outcome["y"], row_sums(prepared))
        elif isinstance(outcome, DeadlineExceededError):
            assert ident not in batch_of, "an expired request reached the runner"
        elif isinstance(outcome, InferenceError):
            assert any((requests[i].feeds["x"] < 0).any() for i in batch_of[ident])
        elif isinstance(outcome, OverloadedError):
            assert ident not in batch_of
        else:
            assert outcome == "cancelled"
    # AND a tenant's own requests of one level and bucket run in the order they came
    order = {ident: n for n, ident in enumerate(ran)}
    for first, later in itertools.combinations(sorted(order), 2):
        a, b = ops[first], ops[later]
        same = (a[1], a[7], policy.bucket_of(a[6])) == (b[1], b[7], policy.bucket_of(b[6]))
        if same:
            assert order[first] < order[later], "a tenant's requests overtook each other"
    for batch in batches:
        assert sum(requests[i].rows for i in batch) <= max_batch
        # a batch never mixes length buckets
        assert len({policy.bucket_of(requests[i].length) for i in batch}) == 1
        # a healthy request in a batch with no poison never fails
        if not any((requests[i].feeds["x"] < 0).any() for i in batch):
            assert all(isinstance(outcomes[i], dict | str) for i in batch)
    assert max(depth_seen) <= queue_size


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=30))
def test_batched_outputs_equal_unbatched(sizes: list[int]) -> None:
    # GIVEN requests of any sizes sent at once
    policy = BatchingPolicy(max_batch_size=16, max_queue_delay_s=0.002, max_queue_size=64)
    got: dict[int, Tensors] = {}

    async def scenario(rig: Rig) -> None:
        async def one(i: int, n: int) -> None:
            got[i] = await rig.batcher.submit(fake_request(i, n))

        await asyncio.gather(*(one(i, n) for i, n in enumerate(sizes)))

    # WHEN they are batched
    rig = run_with(policy, scenario)
    # THEN each answer equals the one computed alone, and they really were batched
    alone = SummingRunner()
    for i, n in enumerate(sizes):
        np.testing.assert_array_equal(got[i]["y"], alone.run([fake_request(i, n)])[0]["y"])
    assert len(rig.runner.batches) <= len(sizes)
    assert sorted(i for b in rig.runner.batches for i in b) == list(range(len(sizes)))


# -- the rules one by one --------------------------------------------------------------


def test_lone_request_waits_for_the_delay_from_its_arrival() -> None:
    # GIVEN a queue delay of 50 ms and a batcher idle for a second
    policy = BatchingPolicy(max_batch_size=8, max_queue_delay_s=0.05)
    done_at: dict[int, float] = {}

    async def scenario(rig: Rig) -> None:
        loop = virtual_loop()
        await advance(1.0)
        started = loop.time()

        async def one(ident: int) -> None:
            result = await rig.batcher.submit(fake_request(ident))
            np.testing.assert_array_equal(result["y"], row_sums(fake_request(ident)))
            done_at[ident] = loop.time() - started

        # WHEN one request arrives, and a second one 20 ms later
        first = asyncio.ensure_future(one(1))
        await advance(0.02)
        await asyncio.gather(first, one(2))

    rig = run_with(policy, scenario)
    # THEN both leave together, 50 ms after the first one arrived (not after the second)
    assert rig.runner.batches == [[1, 2]]
    assert done_at == {1: pytest.approx(0.05), 2: pytest.approx(0.05)}


def test_without_dynamic_batching_each_request_runs_alone_whatever_its_rows() -> None:
    # GIVEN a policy that does not merge (a model without a dynamic_batching block) and a
    # batch limit of 4 rows
    policy = BatchingPolicy(max_batch_size=4, max_queue_delay_s=0.0, merge=False)

    async def scenario(rig: Rig) -> None:
        # WHEN requests of 1, 2 and 1 rows arrive together (they would fit one run)
        requests = [fake_request(1), fake_request(2, rows=2), fake_request(3)]
        results = await asyncio.gather(*(rig.batcher.submit(r) for r in requests))
        for request, result in zip(requests, results, strict=True):
            np.testing.assert_array_equal(result["y"], row_sums(request))

    rig = run_with(policy, scenario)
    # THEN each ran alone, its rows together, in arrival order
    assert rig.runner.batches == [[1], [2], [3]]


def test_full_batch_goes_at_once_without_waiting_the_delay() -> None:
    # GIVEN a queue delay of 30 s and a batch limit of 4
    policy = BatchingPolicy(max_batch_size=4, max_queue_delay_s=30.0)
    elapsed: list[float] = []

    async def scenario(rig: Rig) -> None:
        loop = virtual_loop()
        # WHEN 4 requests arrive
        await asyncio.gather(*(rig.batcher.submit(fake_request(i)) for i in range(4)))
        elapsed.append(loop.time())

    rig = run_with(policy, scenario)
    # THEN they run as one batch with no time passing
    assert rig.runner.batches == [[0, 1, 2, 3]]
    assert elapsed == [0.0]


def test_preferred_size_dispatches_early() -> None:
    # GIVEN a preferred batch size of 2 and a queue delay of 30 s
    policy = BatchingPolicy(max_batch_size=8, preferred_batch_sizes=(2,), max_queue_delay_s=30.0)
    elapsed: list[float] = []

    async def scenario(rig: Rig) -> None:
        loop = virtual_loop()
        # WHEN 2 requests arrive
        await asyncio.gather(*(rig.batcher.submit(fake_request(i)) for i in range(2)))
        elapsed.append(loop.time())

    rig = run_with(policy, scenario)
    # THEN they go as a batch of 2 at once
    assert rig.runner.batches == [[0, 1]]
    assert elapsed == [0.0]


def test_full_queue_rejects_exactly_the_excess_without_running() -> None:
    # GIVEN a busy model (one batch held) and a queue bound of 3
    policy = BatchingPolicy(
        max_batch_size=1, max_queue_delay_s=0.0, max_queue_size=3, retry_after_s=2.0
    )
    results: list[object] = []

    async def scenario(rig: Rig) -> None:
        rig.executor.hold()
        first = submit(rig.batcher, fake_request(0))
        await idle()
        assert len(rig.executor.held) == 1
        # WHEN 3 + 2 more arrive
        tasks = [submit(rig.batcher, fake_request(i)) for i in range(1, 6)]
        await idle()
        # THEN exactly the last 2 are refused at once with a retry hint, before anything ran
        assert [t.done() for t in tasks] == [False, False, False, True, True]
        for task in tasks[3:]:
            error = task.exception()
            assert isinstance(error, OverloadedError)
            assert error.status == 429
            assert error.retry_after_s == 2.0
        assert rig.runner.batches == []
        assert rig.batcher.queue_depth == 3
        rig.executor.resume()
        results.extend(await asyncio.gather(first, *tasks, return_exceptions=True))

    rig = run_with(policy, scenario)
    # AND the admitted 4 are computed
    assert sum(isinstance(r, dict) for r in results) == 4
    assert rig.runner.batches == [[0], [1], [2], [3]]
    assert rig.batcher.stats.rejected == 2


def test_deadline_in_queue_is_answered_promptly_and_never_computed() -> None:
    policy = BatchingPolicy(max_batch_size=1, max_queue_delay_s=0.0)

    async def scenario(rig: Rig) -> None:
        loop = virtual_loop()
        rig.executor.hold()
        first = submit(rig.batcher, fake_request(0))
        await idle()
        # WHEN a request with a 20 ms deadline waits behind the held batch
        started = loop.time()
        with pytest.raises(DeadlineExceededError) as caught:
            await rig.batcher.submit(fake_request(1), timeout_s=0.02)
        # THEN it is answered 504 at its deadline, while the batch is still running
        assert caught.value.status == 504
        assert loop.time() - started == pytest.approx(0.02)
        assert rig.batcher.running == 1
        assert rig.batcher.stats.expired == 1
        rig.executor.resume()
        await first

    rig = run_with(policy, scenario)
    # AND it never reached the runner
    assert rig.runner.batches == [[0]]


def test_deadline_is_kept_by_the_clock_when_the_timer_fires_early() -> None:
    # GIVEN a loop whose time lags the batcher's clock by 1 ms when a request is admitted
    # and not later (uvloop caches its time per iteration, so its timers fire early)
    policy = BatchingPolicy(max_batch_size=1, max_queue_delay_s=0.0)
    executor = InlineExecutor()
    lag = [0.001]
    expired: list[tuple[float, DeadlineExceededError]] = []

    async def main() -> None:
        loop = virtual_loop()
        batcher = DynamicBatcher(
            "late", SummingRunner(), policy, executor, clock=lambda: loop.time() + lag[0]
        )
        batcher.start()
        executor.hold()
        first = submit(batcher, fake_request(0))
        late = submit(batcher, fake_request(1), timeout_s=0.02)
        await idle()
        lag[0] = 0.0
        # WHEN the loop's 20 ms timer fires
        with pytest.raises(DeadlineExceededError) as caught:
            await late
        expired.append((loop.time(), caught.value))
        executor.resume()
        await first
        await batcher.stop(drain_timeout_s=1)

    run_virtual(main)
    # THEN the request expires when the batcher's clock says 20 ms passed, 1 ms later
    [(at, error)] = expired
    assert at == pytest.approx(0.021)
    assert "after 20.0 ms" in error.message


def test_timeout_may_only_lower_the_default() -> None:
    policy = BatchingPolicy(max_batch_size=1, default_timeout_s=0.01)
    batcher = DynamicBatcher("x", SummingRunner(), policy, InlineExecutor())
    assert batcher.policy.timeout_of(None) == 0.01
    assert batcher.policy.timeout_of(5.0) == 0.01
    assert batcher.policy.timeout_of(0.001) == 0.001


def test_higher_priority_is_dequeued_first() -> None:
    policy = BatchingPolicy(
        max_batch_size=1, max_queue_delay_s=0.0, priority_levels=2, default_priority=2, aging_s=60.0
    )

    async def scenario(rig: Rig) -> None:
        # GIVEN a held batch, then two low-priority requests, then a high-priority one
        rig.executor.hold()
        first = submit(rig.batcher, fake_request(0))
        await idle()
        low = [submit(rig.batcher, fake_request(i), priority=2) for i in (1, 2)]
        await idle()
        high = submit(rig.batcher, fake_request(3), priority=1)
        await idle()
        # WHEN the model frees up
        rig.executor.resume()
        await asyncio.gather(first, high, *low)

    rig = run_with(policy, scenario)
    # THEN the high-priority request runs next, then the low ones in arrival order
    assert rig.runner.batches == [[0], [3], [1], [2]]


@pytest.mark.parametrize(
    ("waited_s", "order"),
    [(0.05, [[0], [1], [2]]), (0.01, [[0], [2], [1]])],
    ids=["aged-low-goes-first", "fresh-low-waits-for-high"],
)
def test_aging_bounds_how_long_low_priority_waits(waited_s: float, order: list[list[int]]) -> None:
    policy = BatchingPolicy(
        max_batch_size=1, max_queue_delay_s=0.0, priority_levels=2, default_priority=2, aging_s=0.02
    )

    async def scenario(rig: Rig) -> None:
        # GIVEN a held batch and a low-priority request that then waits longer (or shorter)
        # than aging_s
        rig.executor.hold()
        first = submit(rig.batcher, fake_request(0))
        await idle()
        low = submit(rig.batcher, fake_request(1), priority=2)
        await advance(waited_s)
        # WHEN a fresh high-priority request arrives and the model frees up
        high = submit(rig.batcher, fake_request(2), priority=1)
        await idle()
        rig.executor.resume()
        await asyncio.gather(first, low, high)

    rig = run_with(policy, scenario)
    # THEN an aged low-priority request goes first; a fresh one waits behind the high one
    assert rig.runner.batches == order


def test_short_requests_do_not_wait_for_long_ones() -> None:
    policy = BatchingPolicy(max_batch_size=4, max_queue_delay_s=30.0, length_buckets=(8,))

    async def scenario(rig: Rig) -> None:
        # GIVEN a long request waiting for company
        long = submit(rig.batcher, fake_request(9, length=100))
        await idle()
        # WHEN 4 short ones arrive THEN they go at once as a full batch of their own
        await asyncio.gather(*(rig.batcher.submit(fake_request(i, length=5)) for i in range(4)))
        assert virtual_loop().time() == 0.0
        assert not long.done()
        long.cancel()

    rig = run_with(policy, scenario)
    assert rig.runner.batches == [[0, 1, 2, 3]]


def test_failed_run_fails_its_batch_only() -> None:
    policy = BatchingPolicy(max_batch_size=2, max_queue_delay_s=30.0)
    outcomes: list[object] = []

    async def scenario(rig: Rig) -> None:
        # GIVEN a batch holding a poison row, then a healthy batch
        b = rig.batcher
        first = [b.submit(fake_request(0, poison=True)), b.submit(fake_request(1))]
        outcomes.extend(await asyncio.gather(*first, return_exceptions=True))
        second = [b.submit(fake_request(2)), b.submit(fake_request(3))]
        outcomes.extend(await asyncio.gather(*second, return_exceptions=True))

    rig = run_with(policy, scenario)
    # THEN both requests of the first batch fail, both of the second succeed
    assert [type(o).__name__ for o in outcomes] == [
        "InferenceError",
        "InferenceError",
        "dict",
        "dict",
    ]
    assert rig.runner.batches == [[0, 1], [2, 3]]


def test_a_batch_whose_settling_fails_answers_every_caller(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = BatchingPolicy(max_batch_size=2, max_queue_delay_s=30.0)
    outcomes: list[object] = []

    async def scenario(rig: Rig) -> None:
        # GIVEN a batcher whose accounting fails once, after its model ran
        record = rig.batcher.stats.record_batch
        calls = itertools.count()

        def broken(*args: object, **kwargs: object) -> None:
            if next(calls) == 0:
                raise TypeError("bug in the accounting")
            record(*args, **kwargs)  # type: ignore[arg-type]

        rig.batcher.stats.record_batch = broken  # type: ignore[method-assign]
        # WHEN a full batch runs, then another
        first = [rig.batcher.submit(fake_request(0)), rig.batcher.submit(fake_request(1))]
        outcomes.extend(await asyncio.gather(*first, return_exceptions=True))
        second = [rig.batcher.submit(fake_request(2)), rig.batcher.submit(fake_request(3))]
        outcomes.extend(await asyncio.gather(*second, return_exceptions=True))

    with caplog.at_level(logging.ERROR, logger="spillway.batcher"):
        rig = run_with(policy, scenario)
    # THEN the first batch's callers get an error instead of waiting for ever, the next
    # batch is served, and the failure is logged
    assert [type(o).__name__ for o in outcomes] == [
        "InferenceError",
        "InferenceError",
        "dict",
        "dict",
    ]
    assert rig.runner.batches == [[0, 1], [2, 3]]
    assert any("settling a batch" in r.message for r in caplog.records)


def test_dead_batcher_fails_pending_and_turns_unhealthy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = BatchingPolicy(max_batch_size=4, max_queue_delay_s=0.01)

    async def scenario(rig: Rig) -> None:
        # GIVEN a batcher whose owner task crashes when it forms a batch
        def broken(*_: object) -> None:
            raise RuntimeError("bug in the batcher")

        rig.batcher._form = broken  # type: ignore[method-assign,assignment]
        # WHEN a request waits THEN it fails 503, and so does every later one
        with pytest.raises(UnavailableError):
            await rig.batcher.submit(fake_request(0))
        assert not rig.batcher.healthy
        assert isinstance(rig.batcher.failure, RuntimeError)
        with pytest.raises(UnavailableError):
            await rig.batcher.submit(fake_request(1))

    with caplog.at_level(logging.ERROR, logger="spillway.batcher"):
        rig = run_with(policy, scenario)
    assert rig.runner.batches == []
    assert any("died" in r.message for r in caplog.records)


def test_stop_drains_queued_work_and_refuses_new() -> None:
    # GIVEN 3 requests queued behind a 30 s delay, with runs that take 10 ms
    policy = BatchingPolicy(max_batch_size=2, max_queue_delay_s=30.0)
    runner, executor = SummingRunner(), InlineExecutor(run_s=0.01)
    stopped_at: list[float] = []

    async def main() -> None:
        loop = virtual_loop()
        batcher = DynamicBatcher("d", runner, policy, executor, clock=loop.time)
        batcher.start()
        tasks = [submit(batcher, fake_request(i)) for i in range(3)]
        await idle()
        # WHEN the batcher stops
        await batcher.stop(drain_timeout_s=10)
        stopped_at.append(loop.time())
        # THEN everything queued was computed without waiting for the delay
        results = await asyncio.gather(*tasks)
        for i, result in enumerate(results):
            np.testing.assert_array_equal(result["y"], row_sums(fake_request(i)))
        # AND new requests are refused
        with pytest.raises(UnavailableError):
            await batcher.submit(fake_request(9))

    run_virtual(main)
    assert runner.batches == [[0, 1], [2]]
    assert stopped_at == [pytest.approx(0.02)]  # two runs of 10 ms, one after the other


def test_adaptive_target_follows_arrival_rate() -> None:
    policy = BatchingPolicy(max_batch_size=64, max_queue_delay_s=0.01, adaptive=True)
    batcher = DynamicBatcher("a", SummingRunner(), policy, InlineExecutor())
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

    async def scenario(rig: Rig) -> None:
        rig.executor.hold()
        long = submit(rig.batcher, fake_request(9, length=100))
        await idle()
        assert len(rig.executor.held) == 1
        rig.executor.holding = False
        # WHEN short requests arrive THEN they complete while the long one still runs
        await rig.batcher.submit(fake_request(1, length=5))
        await rig.batcher.submit(fake_request(2, length=5))
        assert not long.done()
        assert rig.batcher.running == 1
        rig.executor.release()
        await long

    rig = run_with(policy, scenario)
    assert rig.runner.batches == [[1], [2], [9]]


# -- early dispatch --------------------------------------------------------------------


def _early(**fields: object) -> BatchingPolicy:
    """A policy with early dispatch on: 5 ms delay, batches of up to 32 by default."""
    values: dict[str, object] = {
        "max_batch_size": 32,
        "max_queue_delay_s": 0.005,
        "early_dispatch": True,
    }
    values.update(fields)
    return BatchingPolicy(**values)  # type: ignore[arg-type]


def test_early_dispatch_sends_a_lone_client_at_once_every_time() -> None:
    # GIVEN early dispatch, a 5 ms delay and runs of 0.5 ms
    latencies: list[float] = []

    async def scenario(rig: Rig) -> None:
        loop = virtual_loop()
        # WHEN one client sends 20 requests, each 1 ms after the previous answer
        for ident in range(20):
            started = loop.time()
            result = await rig.batcher.submit(fake_request(ident))
            np.testing.assert_array_equal(result["y"], row_sums(fake_request(ident)))
            latencies.append(loop.time() - started)
            await advance(0.001)

    rig = run_with(_early(), scenario, executor=InlineExecutor(run_s=0.0005))
    # THEN each one runs alone and at once: its latency is its compute, never the delay
    assert rig.runner.batches == [[i] for i in range(20)]
    assert latencies == [pytest.approx(0.0005)] * 20


def test_early_dispatch_still_forms_full_batches_for_64_clients() -> None:
    # GIVEN early dispatch, batches of up to 32, two compute slots and runs of 1 ms
    rounds, clients = 12, 64
    finished: list[float] = []

    async def client(rig: Rig, index: int) -> None:
        for turn in range(rounds):
            ident = turn * clients + index
            result = await rig.batcher.submit(fake_request(ident))
            np.testing.assert_array_equal(result["y"], row_sums(fake_request(ident)))
            # the answer travels back and the next request comes, 0.1 to 0.45 ms later
            await advance(0.0001 + 0.00005 * (index % 8))
        finished.append(virtual_loop().time())

    async def scenario(rig: Rig) -> None:
        # WHEN 64 closed-loop clients send 12 requests each
        await asyncio.gather(*(client(rig, i) for i in range(clients)))

    rig = run_with(_early(concurrency=2), scenario, executor=InlineExecutor(run_s=0.001))
    # THEN every batch is full
    assert [len(batch) for batch in rig.runner.batches] == [32] * (rounds * 2)
    # AND no round waited out the 5 ms delay: a round is one run plus the way back
    assert max(finished) < rounds * 0.0015


def test_a_request_on_its_way_keeps_the_batch_open() -> None:
    # GIVEN early dispatch and a request announced as on its way (being tokenised, say)
    done_at: dict[int, float] = {}

    async def scenario(rig: Rig) -> None:
        loop = virtual_loop()

        async def one(ident: int, prepared_for: float = 0.0) -> None:
            if prepared_for:
                with rig.batcher.incoming():
                    await advance(prepared_for)
            await rig.batcher.submit(fake_request(ident))
            done_at[ident] = loop.time()

        later = asyncio.ensure_future(one(2, prepared_for=0.002))
        await idle()
        # WHEN another request arrives meanwhile, and the announced one joins 2 ms later
        await asyncio.gather(one(1), later)

    rig = run_with(_early(), scenario)
    # THEN the first waited for it and both ran together, before the 5 ms delay ended
    assert rig.runner.batches == [[1, 2]]
    assert done_at == {1: pytest.approx(0.002), 2: pytest.approx(0.002)}


def test_a_request_called_off_on_its_way_releases_the_batch() -> None:
    # GIVEN early dispatch and a request announced as on its way
    done_at: list[float] = []

    async def scenario(rig: Rig) -> None:
        async def called_off() -> None:
            with rig.batcher.incoming():
                await advance(0.001)
            # its tokenising failed: it never reaches the batcher

        abandoned = asyncio.ensure_future(called_off())
        await idle()
        # WHEN another request arrives meanwhile
        await rig.batcher.submit(fake_request(1))
        done_at.append(virtual_loop().time())
        await abandoned

    rig = run_with(_early(), scenario)
    # THEN it goes as soon as its companion is called off, not at the end of the delay
    assert rig.runner.batches == [[1]]
    assert done_at == [pytest.approx(0.001)]


@pytest.mark.parametrize(
    ("third_comes", "batches", "dispatched_at"),
    [(True, [[0], [1, 2, 3]], 0.003), (False, [[0], [1, 2]], 0.010)],
    ids=["whole-crowd-in-hand", "rate-stops-expecting"],
)
def test_early_dispatch_waits_only_while_company_is_expected(
    third_comes: bool, batches: list[list[int]], dispatched_at: float
) -> None:
    # GIVEN early dispatch, a 10 ms delay and one compute slot held by request 0, while
    # requests 1 and 2 arrive 1 ms apart (so 3 requests were in hand at once, 1,000/s)
    when: list[float] = []

    async def scenario(rig: Rig) -> None:
        loop = virtual_loop()
        rig.executor.hold()
        tasks = [submit(rig.batcher, fake_request(0))]
        for ident in (1, 2):
            await advance(0.001)
            tasks.append(submit(rig.batcher, fake_request(ident)))
        await advance(0.0005)
        # WHEN the slot frees at 2.5 ms (and a third client comes back at 3 ms, or not)
        rig.executor.resume()
        await idle()
        assert rig.runner.batches == [[0]], "the two queued requests waited for company"
        if third_comes:
            await advance(0.0005)
            tasks.append(submit(rig.batcher, fake_request(3)))
        await asyncio.gather(*tasks)
        when.append(loop.time())

    rig = run_with(_early(max_batch_size=8, max_queue_delay_s=0.010), scenario)
    # THEN the batch goes once the whole crowd is in hand, or else once the rate no longer
    # expects anyone before the delay ends: 1 ms (one gap) before request 1's 11 ms
    assert rig.runner.batches == batches
    assert when == [pytest.approx(dispatched_at)]


@pytest.mark.parametrize("early", [False, True], ids=["wait", "early-dispatch"])
def test_a_request_due_before_its_timer_fires_is_never_computed(early: bool) -> None:
    # GIVEN a batcher on a clock that moves 1 ms on every reading (a very slow machine),
    # so a 0.5 ms deadline has passed by the time the batcher looks, before its timer ran
    policy = BatchingPolicy(max_batch_size=4, max_queue_delay_s=0.0, early_dispatch=early)
    runner = SummingRunner()
    outcome: list[object] = []

    async def main() -> None:
        loop = virtual_loop()
        readings = itertools.count()
        batcher = DynamicBatcher(
            "slow",
            runner,
            policy,
            InlineExecutor(),
            clock=lambda: loop.time() + next(readings) * 1e-3,
        )
        batcher.start()
        # WHEN a request with a 0.5 ms timeout arrives at an idle batcher
        try:
            outcome.append(await batcher.submit(fake_request(1), timeout_s=0.0005))
        except DeadlineExceededError as error:
            outcome.append(error)
        await batcher.stop(drain_timeout_s=1)

    run_virtual(main)
    # THEN it is answered 504 and never reaches the runner
    [error] = outcome
    assert isinstance(error, DeadlineExceededError)
    assert runner.batches == []


# -- fair share between tenants ---------------------------------------------------------


def _flood(fair: bool) -> list[list[int]]:
    """The batches run when acme queues 100 requests, then globex 2, behind a held batch."""
    policy = BatchingPolicy(
        max_batch_size=8, max_queue_delay_s=0.0, max_queue_size=200, fair_share=fair
    )

    async def scenario(rig: Rig) -> None:
        # GIVEN a batch computing, acme's 100 requests queued behind it, then globex's 2
        rig.executor.hold()
        first = submit(rig.batcher, fake_request(0), scope=ACME)
        await idle()
        acme = [submit(rig.batcher, fake_request(i), scope=ACME) for i in range(1, 101)]
        globex = [submit(rig.batcher, fake_request(i), scope=GLOBEX) for i in (101, 102)]
        await idle()
        # WHEN the model frees up
        rig.executor.resume()
        await asyncio.gather(first, *acme, *globex)

    return run_with(policy, scenario).runner.batches


def test_a_light_tenant_joins_the_next_batch_not_the_back_of_the_queue() -> None:
    batches = _flood(fair=True)
    # THEN globex's 2 are in the first batch formed after the held one, between acme's
    assert batches[1] == [101, 1, 102, 2, 3, 4, 5, 6]
    # AND acme's own requests keep their order, and every request ran once
    acme = [i for batch in batches for i in batch if i <= 100]
    assert acme == list(range(101))
    assert all(len(batch) <= 8 for batch in batches)


def test_without_fair_share_the_light_tenant_waits_behind_the_flood() -> None:
    # The same flood first come, first served: what the rule changes
    batches = _flood(fair=False)
    assert batches[1] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert batches[-1][-2:] == [101, 102]


def test_two_busy_tenants_take_turns() -> None:
    policy = BatchingPolicy(max_batch_size=2, max_queue_delay_s=0.0, max_queue_size=64)

    async def scenario(rig: Rig) -> None:
        # GIVEN acme's 6 requests queued, then globex's 6, behind a held batch of a third
        rig.executor.hold()
        first = submit(rig.batcher, fake_request(0))
        await idle()
        tasks = [submit(rig.batcher, fake_request(i), scope=ACME) for i in range(1, 7)]
        tasks += [submit(rig.batcher, fake_request(i), scope=GLOBEX) for i in range(7, 13)]
        await idle()
        rig.executor.resume()
        await asyncio.gather(first, *tasks)

    batches = run_with(policy, scenario).runner.batches
    # THEN every batch after the held one holds one request of each, in each one's order
    assert batches[1:] == [[1, 7], [2, 8], [3, 9], [4, 10], [5, 11], [6, 12]]


def test_a_tenant_served_lately_waits_for_one_that_was_not() -> None:
    policy = BatchingPolicy(max_batch_size=4, max_queue_delay_s=0.0, max_queue_size=64)

    async def scenario(rig: Rig) -> None:
        # GIVEN acme served 8 rows just now, and a held batch
        await asyncio.gather(*(submit(rig.batcher, fake_request(i, 4), scope=ACME) for i in (0, 1)))
        rig.executor.hold()
        held = submit(rig.batcher, fake_request(2), scope=None)
        await idle()
        # WHEN acme's request queues first and globex's after it
        tasks = [submit(rig.batcher, fake_request(3, 4), scope=ACME)]
        tasks.append(submit(rig.batcher, fake_request(4, 4), scope=GLOBEX))
        await idle()
        rig.executor.resume()
        await asyncio.gather(held, *tasks)

    batches = run_with(policy, scenario).runner.batches
    # THEN globex's goes first: acme has had its share lately
    assert batches[-2:] == [[4], [3]]
