"""The batcher's bookkeeping: queue slots, rows, results and times, exactly.

A request that leaves the queue without running (its deadline passed, or its caller went
away) must give back its queue slot and its rows, or a full queue that emptied keeps
answering 429 and a bucket dispatches early on rows nobody waits for. A runner that
returns the wrong number of results must fail every caller of that batch, not leave one
waiting. Virtual time and an inline executor, as in ``test_batcher``."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gpu_service.batch_compute import Computed
from gpu_service.batcher import DynamicBatcher
from gpu_service.batching_policy import BatchingPolicy
from spillway.models.processing import Prepared, Tensors
from spillway.protocol.errors import DeadlineExceededError, InferenceError, OverloadedError
from tests.fakes import (
    InlineExecutor,
    SummingRunner,
    advance,
    fake_request,
    idle,
    row_sums,
    run_virtual,
    sum_rows,
    virtual_loop,
)
from tests.unit.test_batcher import Rig, run_with, submit

QUEUE = 3


def _busy_model_policy() -> BatchingPolicy:
    """One request per batch, no delay, a queue of ``QUEUE``: a held batch fills it."""
    return BatchingPolicy(
        max_batch_size=1, max_queue_delay_s=0.0, max_queue_size=QUEUE, retry_after_s=1.0
    )


def _refused(tasks: list[asyncio.Task[Tensors]]) -> int:
    return sum(t.done() and isinstance(t.exception(), OverloadedError) for t in tasks)


# -- queue slots come back --------------------------------------------------------------------


def test_expired_requests_give_their_queue_slots_back() -> None:
    outcomes: list[object] = []

    async def scenario(rig: Rig) -> None:
        # GIVEN a busy model (one batch held) whose queue of 3 is full of 20 ms requests
        rig.executor.hold()
        first = submit(rig.batcher, fake_request(0))
        await idle()
        doomed = [submit(rig.batcher, fake_request(i), timeout_s=0.02) for i in (1, 2, 3)]
        await idle()
        assert rig.batcher.queue_depth == QUEUE
        # WHEN all of them expire
        await advance(0.03)
        assert all(isinstance(t.exception(), DeadlineExceededError) for t in doomed)
        # THEN the queue is empty, and takes 3 new requests again (the 4th is the excess)
        assert rig.batcher.queue_depth == 0
        fresh = [submit(rig.batcher, fake_request(i)) for i in (4, 5, 6, 7)]
        await idle()
        assert [t.done() for t in fresh] == [False, False, False, True]
        assert _refused(fresh) == 1
        assert rig.batcher.queue_depth == QUEUE
        rig.executor.resume()
        outcomes.extend(await asyncio.gather(first, *fresh[:3]))

    rig = run_with(_busy_model_policy(), scenario)
    assert rig.runner.batches == [[0], [4], [5], [6]]
    assert (rig.batcher.stats.expired, rig.batcher.stats.rejected) == (3, 1)
    assert rig.batcher.queue_depth == 0


def test_cancelled_requests_give_their_queue_slots_back() -> None:
    async def scenario(rig: Rig) -> None:
        # GIVEN a busy model whose queue of 3 is full
        rig.executor.hold()
        first = submit(rig.batcher, fake_request(0))
        await idle()
        gone = [submit(rig.batcher, fake_request(i)) for i in (1, 2, 3)]
        excess = submit(rig.batcher, fake_request(9))
        await idle()
        assert _refused([excess]) == 1
        assert rig.batcher.queue_depth == QUEUE
        # WHEN every queued caller goes away
        for task in gone:
            task.cancel()
        await idle()
        # THEN the slots are free again: 3 new requests are taken, none refused
        assert rig.batcher.queue_depth == 0
        fresh = [submit(rig.batcher, fake_request(i)) for i in (4, 5, 6)]
        await idle()
        assert _refused(fresh) == 0
        assert rig.batcher.queue_depth == QUEUE
        rig.executor.resume()
        await asyncio.gather(first, *fresh)

    rig = run_with(_busy_model_policy(), scenario)
    # AND the cancelled requests were never computed
    assert rig.runner.batches == [[0], [4], [5], [6]]
    assert rig.batcher.stats.rejected == 1
    assert rig.batcher.stats.expired == 0


@pytest.mark.parametrize("leave", ["expire", "cancel"])
def test_requests_that_left_give_their_rows_back(leave: str) -> None:
    # GIVEN a batch target of 8 rows and a 1 s delay (no early dispatch)
    policy = BatchingPolicy(
        max_batch_size=8, max_queue_delay_s=1.0, early_dispatch=False, max_queue_size=8
    )
    sent_at: list[float] = []

    class TimedRunner(SummingRunner):
        def run(self, batch: list[Prepared]) -> list[Tensors]:
            sent_at.append(virtual_loop().time())
            return super().run(batch)

    async def scenario(rig: Rig) -> None:
        # WHEN requests of 1, 2 and 4 rows queue and leave before their batch goes
        timeout = 0.1 if leave == "expire" else None
        left = [submit(rig.batcher, fake_request(i, rows=i), timeout_s=timeout) for i in (1, 2, 4)]
        await idle()
        if leave == "cancel":
            await advance(0.1)
            for task in left:
                task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        # AND one of 4 rows arrives at t=0.2
        await advance(0.1)
        assert virtual_loop().time() == pytest.approx(0.2)
        answer = await rig.batcher.submit(fake_request(5, rows=4))
        np_equal(answer["y"], row_sums(fake_request(5, rows=4)))

    rig = run_with(policy, scenario, runner=TimedRunner())
    # THEN it waits its own full delay: 4 rows are short of 8 (rows left behind by the
    # requests that went would make up a full batch and send it at once)
    assert rig.runner.batches == [[5]]
    assert sent_at == [pytest.approx(1.2)]


def np_equal(a: object, b: object) -> None:
    import numpy as np

    np.testing.assert_array_equal(a, b)


# -- a runner returning the wrong number of results ------------------------------------------


class MiscountingRunner:
    """Returns ``extra`` more (or fewer) results than requests, once; then the right
    number."""

    def __init__(self, extra: int) -> None:
        self.extra = extra
        self.calls = 0

    def run(self, batch: list[Prepared]) -> list[Tensors]:
        self.calls += 1
        results = sum_rows(batch)
        if self.calls == 1:
            if self.extra < 0:
                return results[: self.extra]
            return results + results[: self.extra]
        return results


@pytest.mark.parametrize("extra", [-1, -3, 1])
def test_a_wrong_number_of_results_fails_every_caller_of_the_batch(extra: int) -> None:
    policy = BatchingPolicy(max_batch_size=3, max_queue_delay_s=30.0)
    runner = MiscountingRunner(extra)
    outcomes: list[object] = []
    later: list[Tensors] = []

    async def main() -> None:
        loop = virtual_loop()
        batcher = DynamicBatcher("fake", runner, policy, InlineExecutor(), clock=loop.time)
        batcher.start()
        # GIVEN a full batch of 3 whose run returns 3 + extra results
        batch = [batcher.submit(fake_request(i)) for i in range(3)]
        # WHEN it is answered THEN every caller gets an error (none waits for ever)
        outcomes.extend(await asyncio.wait_for(asyncio.gather(*batch, return_exceptions=True), 60))
        # AND the batcher still serves the next batch
        again = [batcher.submit(fake_request(i)) for i in range(3, 6)]
        later.extend(await asyncio.gather(*again))
        assert batcher.healthy
        stats = batcher.stats
        assert (stats.execution_count, stats.inference_count) == (2, 3)
        await batcher.stop(drain_timeout_s=1)

    run_virtual(main)
    assert len(outcomes) == 3
    assert all(isinstance(o, InferenceError) for o in outcomes)
    assert {str(o) for o in outcomes} == {f"{3 + extra} results for 3 requests"}
    assert all(o.status == 500 for o in outcomes)  # type: ignore[attr-defined]
    assert [float(r["y"][0, 0]) for r in later] == [
        float(row_sums(fake_request(i))[0, 0]) for i in range(3, 6)
    ]


# -- the times a request carries, and the busy fraction ---------------------------------------


def test_each_request_carries_its_own_queue_time_and_the_runs_compute_time() -> None:
    # GIVEN a 0.1 s delay and runs of 0.25 s; requests arrive at t=0 and t=0.04
    policy = BatchingPolicy(max_batch_size=4, max_queue_delay_s=0.1, early_dispatch=False)
    timed: list[Computed] = []

    async def scenario(rig: Rig) -> None:
        first = asyncio.ensure_future(rig.batcher.submit_timed(fake_request(0)))
        await advance(0.04)
        second = asyncio.ensure_future(rig.batcher.submit_timed(fake_request(1, rows=2)))
        timed.extend(await asyncio.gather(first, second))
        # THEN at t=0.35 the window starts at the first sample (the run's start, t=0.1):
        # busy all of it; 0.25 s later, busy half of it
        assert virtual_loop().time() == pytest.approx(0.35)
        assert rig.batcher.busy_fraction() == pytest.approx(1.0)
        await advance(0.25)
        assert rig.batcher.busy_fraction() == pytest.approx(0.5)

    rig = run_with(policy, scenario, executor=InlineExecutor(run_s=0.25))
    # THEN one batch ran at t=0.1 (the oldest request's delay) for 0.25 s
    assert rig.runner.batches == [[0, 1]]
    assert [c.queue_s for c in timed] == [pytest.approx(0.1), pytest.approx(0.06)]
    assert [c.infer_s for c in timed] == [pytest.approx(0.25), pytest.approx(0.25)]
    assert [c.tensors["y"].shape for c in timed] == [(1, 1), (2, 1)]
    stats = rig.batcher.stats
    assert (stats.execution_count, stats.inference_count) == (1, 3)
    assert stats.batch_sizes[3].count == 1
    assert stats.batch_sizes[3].ns == pytest.approx(250_000_000, abs=1)


def test_queue_depth_and_running_count_what_waits_and_what_computes() -> None:
    policy = BatchingPolicy(max_batch_size=2, max_queue_delay_s=0.0, max_queue_size=10)

    async def scenario(rig: Rig) -> None:
        rig.executor.hold()
        tasks = [submit(rig.batcher, fake_request(i)) for i in range(5)]
        await idle()
        # one batch of 2 computing, 3 waiting (concurrency 1)
        assert (rig.batcher.running, rig.batcher.queue_depth) == (1, 3)
        assert not rig.batcher.idle
        rig.executor.release()
        await idle()
        assert (rig.batcher.running, rig.batcher.queue_depth) == (1, 1)
        rig.executor.resume()
        await asyncio.gather(*tasks)
        await idle()
        assert (rig.batcher.running, rig.batcher.queue_depth) == (0, 0)
        assert rig.batcher.idle

    rig = run_with(policy, scenario)
    assert rig.runner.batches == [[0, 1], [2, 3], [4]]


def test_a_deadline_answer_says_how_long_the_request_waited() -> None:
    async def scenario(rig: Rig) -> None:
        rig.executor.hold()
        first = submit(rig.batcher, fake_request(0))
        await idle()
        with pytest.raises(DeadlineExceededError) as caught:
            await rig.batcher.submit(fake_request(1), timeout_s=0.5)
        assert str(caught.value) == "deadline passed after 500.0 ms in the queue of fake"
        rig.executor.resume()
        await first

    run_with(_busy_model_policy(), scenario)


def test_a_timed_request_without_a_priority_gets_the_models_default_level() -> None:
    # GIVEN two levels, the default the lower one, and a busy model
    policy = BatchingPolicy(
        max_batch_size=1, max_queue_delay_s=0.0, priority_levels=2, default_priority=2
    )

    async def scenario(rig: Rig) -> None:
        rig.executor.hold()
        first = submit(rig.batcher, fake_request(0))
        await idle()
        # WHEN a timed request with no priority queues, then one of priority 1
        low = asyncio.ensure_future(rig.batcher.submit_timed(fake_request(1)))
        high = submit(rig.batcher, fake_request(2), priority=1)
        await idle()
        rig.executor.resume()
        await asyncio.gather(first, low, high)

    rig = run_with(policy, scenario)
    # THEN the priority-1 request goes first
    assert rig.runner.batches == [[0], [2], [1]]


def test_a_runner_that_raises_fails_its_batch_and_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Raising:
        def run(self, batch: list[Prepared]) -> list[Tensors]:
            raise RuntimeError("out of memory")

    policy = BatchingPolicy(max_batch_size=2, max_queue_delay_s=30.0)
    outcomes: list[object] = []

    async def main() -> None:
        loop = virtual_loop()
        batcher = DynamicBatcher("fake", Raising(), policy, InlineExecutor(), clock=loop.time)
        batcher.start()
        batch = [batcher.submit(fake_request(i)) for i in range(2)]
        outcomes.extend(await asyncio.gather(*batch, return_exceptions=True))
        await batcher.stop(drain_timeout_s=1)

    with caplog.at_level(logging.ERROR, logger="spillway.batcher"):
        run_virtual(main)
    assert [str(o) for o in outcomes] == ["inference failed on model fake: out of memory"] * 2
    assert [r.getMessage() for r in caplog.records] == ["a batch of 2 requests for fake failed"]


def test_a_batch_whose_settling_fails_says_so_to_its_callers_and_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = BatchingPolicy(max_batch_size=2, max_queue_delay_s=30.0)
    outcomes: list[object] = []

    async def scenario(rig: Rig) -> None:
        # GIVEN accounting that fails after the model ran
        def broken(*args: object, **kwargs: object) -> None:
            raise TypeError("bug in the accounting")

        rig.batcher.stats.record_batch = broken  # type: ignore[method-assign]
        batch = [rig.batcher.submit(fake_request(0)), rig.batcher.submit(fake_request(1))]
        outcomes.extend(await asyncio.gather(*batch, return_exceptions=True))

    with caplog.at_level(logging.ERROR, logger="spillway.batcher"):
        run_with(policy, scenario)
    assert [str(o) for o in outcomes] == [
        "inference failed on model fake: bug in the accounting"
    ] * 2
    assert [r.getMessage() for r in caplog.records] == [
        "settling a batch of 2 requests for fake failed"
    ]
