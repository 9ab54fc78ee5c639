"""The device's compute budget with batchers of fake models on a virtual-time loop: runs
over every model never outnumber the slots, a better priority level and then the earliest
deadline go first, a short run overdraws rather than wait behind a long one, the expected
wait is what the wait turns out to be, and a request whose deadline it already passes is
refused at admission. Runs take the virtual seconds their model's executor says; no real
time passes and no thread runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from gpu_service.batcher import DynamicBatcher
from gpu_service.batching_policy import BatchingPolicy
from gpu_service.compute_budget import ComputeBudget, Turn
from spillway.models.processing import Prepared, Tensors
from spillway.protocol.errors import DeadlineUnmeetableError
from tests.fakes import InlineExecutor, fake_request, idle, run_virtual, sum_rows, virtual_loop


@dataclass
class Log:
    """The order runs started in, over every model: (model, request ids)."""

    runs: list[tuple[str, list[int]]] = field(default_factory=list)


@dataclass
class Recording:
    name: str
    log: Log

    def run(self, batch: list[Prepared]) -> list[Tensors]:
        self.log.runs.append((self.name, [int(p.feeds["id"][0, 0]) for p in batch]))
        return sum_rows(batch)


def one_at_a_time(**policy: object) -> BatchingPolicy:
    """A model whose runs take one request each, dispatched as soon as a slot is free."""
    return BatchingPolicy(max_batch_size=1, max_queue_delay_s=0.0, **policy)  # type: ignore[arg-type]


Models = dict[str, DynamicBatcher]


def on_budget(
    budget: Callable[[Callable[[], float]], ComputeBudget],
    models: dict[str, tuple[BatchingPolicy, float]],
    scenario: Callable[[Models, ComputeBudget, Log], Awaitable[None]],
) -> Log:
    """Run ``scenario`` with one batcher per model (its policy and the virtual seconds
    each of its runs takes) sharing one budget on the virtual loop's clock."""
    log = Log()

    async def main() -> Log:
        loop = virtual_loop()
        shared = budget(loop.time)
        batchers = {
            name: DynamicBatcher(
                name,
                Recording(name, log),
                policy,
                InlineExecutor(run_s),
                clock=loop.time,
                budget=shared,
            )
            for name, (policy, run_s) in models.items()
        }
        for batcher in batchers.values():
            batcher.start()
        try:
            await scenario(batchers, shared, log)
        finally:
            for batcher in batchers.values():
                await batcher.stop(drain_timeout_s=60)
        return log

    return run_virtual(main)


def send(
    batcher: DynamicBatcher, ident: int, timeout_s: float | None = None
) -> asyncio.Task[Tensors]:
    return asyncio.ensure_future(batcher.submit(fake_request(ident), timeout_s=timeout_s))


# -- the slots ---------------------------------------------------------------------------


def test_runs_of_every_model_and_bucket_share_the_slots() -> None:
    # GIVEN two slots and three models whose runs take 0.1 s, one of two length buckets
    bucketed = BatchingPolicy(max_batch_size=1, max_queue_delay_s=0.0, length_buckets=(10,))
    models = dict.fromkeys(("a", "b", "c"), (bucketed, 0.1))

    async def scenario(batchers: Models, budget: ComputeBudget, log: Log) -> None:
        # WHEN 30 requests arrive at once, 10 a model, long and short alike
        start = virtual_loop().time()
        await asyncio.gather(
            *(
                b.submit(fake_request(i, length=5 if i % 2 else 50))
                for b in batchers.values()
                for i in range(10)
            )
        )
        # THEN they took 15 rounds of 0.1 s: two runs at a time, never more
        assert virtual_loop().time() - start == pytest.approx(1.5)
        assert budget.peak == 2

    log = on_budget(lambda clock: ComputeBudget(2, overdraft=0, clock=clock), models, scenario)
    assert len(log.runs) == 30


# -- the order ---------------------------------------------------------------------------


def test_a_better_level_goes_before_any_earlier_request_of_a_worse_one() -> None:
    # GIVEN one slot, a heavy model at level 3 and a light one at level 1
    models = {
        "heavy": (one_at_a_time(compute_level=3), 0.2),
        "light": (one_at_a_time(compute_level=1), 0.01),
    }

    async def scenario(batchers: Models, budget: ComputeBudget, log: Log) -> None:
        # WHEN five heavy requests queue, then a light one arrives during the first run
        heavy = [send(batchers["heavy"], i) for i in range(5)]
        await idle()
        light = send(batchers["light"], 100)
        await asyncio.gather(*heavy, light)

    log = on_budget(lambda clock: ComputeBudget(1, overdraft=0, clock=clock), models, scenario)
    # THEN the light request ran as soon as the slot freed, before the four heavy ones
    assert log.runs == [
        ("heavy", [0]),
        ("light", [100]),
        ("heavy", [1]),
        ("heavy", [2]),
        ("heavy", [3]),
        ("heavy", [4]),
    ]


def test_within_a_level_the_earliest_deadline_goes_first() -> None:
    # GIVEN one slot and three models of one level: pages counted against 28 s, digits
    # and forms against the default 5 s
    models = {
        "pages": (one_at_a_time(horizon_s=28.0), 0.2),
        "digits": (one_at_a_time(horizon_s=5.0), 0.01),
        "forms": (one_at_a_time(horizon_s=5.0), 0.01),
    }

    async def scenario(batchers: Models, budget: ComputeBudget, log: Log) -> None:
        # WHEN three pages queue, then a digits request comes, then a form that must be
        # done within 1 s
        pages = [send(batchers["pages"], i) for i in range(3)]
        await idle()
        digits = send(batchers["digits"], 100)
        await idle()
        urgent = send(batchers["forms"], 9, timeout_s=1.0)
        await asyncio.gather(*pages, digits, urgent)

    log = on_budget(lambda clock: ComputeBudget(1, overdraft=0, clock=clock), models, scenario)
    # THEN after the running page: the form (deadline 1 s), digits (5 s), then the
    # pages counted against 28 s, oldest first (a model's own queue keeps its order)
    assert log.runs == [
        ("pages", [0]),
        ("forms", [9]),
        ("digits", [100]),
        ("pages", [1]),
        ("pages", [2]),
    ]


# -- the overdraft -----------------------------------------------------------------------


def overdraft_of_one(clock: Callable[[], float]) -> ComputeBudget:
    return ComputeBudget(1, overdraft=1, short_run_s=0.005, clock=clock)


def test_a_short_run_overdraws_rather_than_wait_behind_a_long_one() -> None:
    # GIVEN one slot and one overdraft; pages (counted against 28 s) take 0.5 s a run,
    # digits (against 5 s) 1 ms
    models = {
        "pages": (one_at_a_time(horizon_s=28.0), 0.5),
        "digits": (one_at_a_time(), 0.001),
    }

    async def scenario(batchers: Models, budget: ComputeBudget, log: Log) -> None:
        loop = virtual_loop()
        await send(batchers["digits"], 0)  # measured: 1 ms a row
        await send(batchers["pages"], 1)  # measured: 0.5 s a row
        # WHEN two pages go and a digits request arrives 0.1 s into the first
        pages = [send(batchers["pages"], 2), send(batchers["pages"], 3)]
        await asyncio.sleep(0.1)
        sent = loop.time()
        await send(batchers["digits"], 4)
        # THEN the digits request was answered within its own run, not after the page
        assert loop.time() - sent == pytest.approx(0.001)
        assert budget.overdrawn == 0  # its overdraft is back
        # AND the second page did not overdraw: it ran after the first
        await asyncio.gather(*pages)
        assert loop.time() - sent == pytest.approx(0.9)

    on_budget(overdraft_of_one, models, scenario)


def test_the_overdraft_is_bounded() -> None:
    # GIVEN one slot and one overdraft; a page's 0.5 s run holds the slot
    models = {
        "pages": (one_at_a_time(horizon_s=28.0), 0.5),
        "digits": (one_at_a_time(), 0.001),
    }

    async def scenario(batchers: Models, budget: ComputeBudget, log: Log) -> None:
        loop = virtual_loop()
        await send(batchers["digits"], 0)  # measured: 1 ms, a short run
        page = send(batchers["pages"], 1)
        await idle()
        sent = loop.time()
        # WHEN three digits requests arrive at once during it
        await asyncio.gather(*(send(batchers["digits"], i) for i in (2, 3, 4)))
        # THEN they ran one after another on the one overdraft slot, beside the page
        assert loop.time() - sent == pytest.approx(0.003)
        assert budget.peak == 2
        await page

    log = on_budget(overdraft_of_one, models, scenario)
    assert [ids for name, ids in log.runs if name == "digits"] == [[0], [2], [3], [4]]


# -- the expected wait and the shed rule -------------------------------------------------


@pytest.mark.parametrize(
    ("slots", "concurrency", "queued", "batch"),
    [(1, 1, 8, 1), (2, 1, 11, 1), (2, 2, 11, 1), (2, 2, 24, 4), (3, 2, 7, 2)],
)
def test_the_expected_wait_is_the_wait(
    slots: int, concurrency: int, queued: int, batch: int
) -> None:
    # GIVEN a model whose runs take 0.1 s, measured, on `slots` slots, `concurrency`
    # batches at once, `queued` requests waiting beyond those running, batches of up to
    # `batch`
    policy = BatchingPolicy(max_batch_size=batch, max_queue_delay_s=0.0, concurrency=concurrency)
    models = {"m": (policy, 0.1)}

    async def scenario(batchers: Models, budget: ComputeBudget, log: Log) -> None:
        loop = virtual_loop()
        model = batchers["m"]
        await asyncio.gather(*(send(model, i) for i in range(batch)))  # measured
        waiting = [send(model, i) for i in range(slots * batch + queued)]
        await asyncio.sleep(0.04)  # 40 ms into the running batches
        # WHEN one more request arrives
        now = loop.time()
        expected = model.seat.expected_wait(0, now, 60.0)
        computed = await model.submit_timed(fake_request(99), timeout_s=60)
        await asyncio.gather(*waiting)
        # THEN it waited as long as expected, within 10 %
        assert computed.queue_s == pytest.approx(expected, rel=0.1)
        assert computed.queue_s > 0.1

    on_budget(lambda clock: ComputeBudget(slots, overdraft=0, clock=clock), models, scenario)


def test_a_request_the_queue_would_make_late_is_refused_at_admission() -> None:
    # GIVEN one slot, a model of 0.1 s runs with eight requests ahead (0.9 s of work)
    # and a light model at a better level
    models = {
        "m": (one_at_a_time(), 0.1),
        "light": (one_at_a_time(compute_level=1), 0.001),
    }

    async def scenario(batchers: Models, budget: ComputeBudget, log: Log) -> None:
        model = batchers["m"]
        await send(model, 0)
        await send(batchers["light"], 0)
        queued = [send(model, i) for i in range(1, 10)]
        await idle()
        # WHEN requests come that must be answered within 0.5 s and within 2 s
        with pytest.raises(DeadlineUnmeetableError) as refused:
            await model.submit(fake_request(50), timeout_s=0.5)
        kept = send(model, 51, timeout_s=2.0)
        # AND a light request within 0.2 s: only the running batch is ahead of it
        light = await batchers["light"].submit_timed(fake_request(52), timeout_s=0.2)
        await asyncio.gather(*queued, kept)
        # THEN the first is refused at once, with the wait as the time to retry, and
        # counted as rejected; the others are answered
        assert refused.value.status == 429
        assert refused.value.code == "deadline_unmeetable"
        assert refused.value.retry_after_s == 1.0
        assert "expected to take 900 ms" in refused.value.message
        assert model.stats.rejected == 1
        assert light.queue_s <= 0.1

    on_budget(lambda clock: ComputeBudget(1, overdraft=0, clock=clock), models, scenario)


def test_requests_without_a_deadline_are_never_shed() -> None:
    models = {"m": (one_at_a_time(), 0.1)}

    async def scenario(batchers: Models, budget: ComputeBudget, log: Log) -> None:
        model = batchers["m"]
        await send(model, 0)
        await asyncio.gather(*(send(model, i) for i in range(1, 40)))
        assert model.stats.rejected == 0

    log = on_budget(lambda clock: ComputeBudget(1, overdraft=0, clock=clock), models, scenario)
    assert len(log.runs) == 40


# -- CPU steps ---------------------------------------------------------------------------


def test_a_cpu_step_takes_a_slot_in_its_turn() -> None:
    # GIVEN one slot, held by a page's 0.2 s run, with two more pages queued
    models = {"pages": (one_at_a_time(horizon_s=28.0), 0.2)}

    async def scenario(batchers: Models, budget: ComputeBudget, log: Log) -> None:
        loop = virtual_loop()
        pages = [send(batchers["pages"], i) for i in range(3)]
        await idle()
        # WHEN a request's step due within 1 s asks for the slot
        now = loop.time()
        step = budget.run_step(Turn(2, now + 1.0, now), lambda: log.runs.append(("step", [])))
        await asyncio.gather(step, *pages)
        assert budget.free == 1

    log = on_budget(
        lambda clock: ComputeBudget(1, overdraft=0, clock=clock, threads=InlineExecutor()),
        models,
        scenario,
    )
    # THEN it ran as the first page's run ended, before the queued pages
    assert log.runs == [("pages", [0]), ("step", []), ("pages", [1]), ("pages", [2])]


def test_a_run_no_more_urgent_and_not_far_shorter_waits() -> None:
    # GIVEN one slot and one overdraft; a page's 0.5 s run holds the slot, and crops of
    # pages (0.1 s runs, counted against 28 s like the page) come after it
    models = {
        "pages": (one_at_a_time(horizon_s=28.0), 0.5),
        "crops": (one_at_a_time(horizon_s=28.0), 0.1),
    }

    async def scenario(batchers: Models, budget: ComputeBudget, log: Log) -> None:
        loop = virtual_loop()
        await send(batchers["crops"], 0)  # measured: 0.1 s
        await send(batchers["pages"], 1)  # measured: 0.5 s
        page = send(batchers["pages"], 2)
        await asyncio.sleep(0.1)
        sent = loop.time()
        # WHEN a crop arrives 0.1 s into the page's run
        await send(batchers["crops"], 3)
        await page
        # THEN it waited for the page: its deadline is later, and the page is only 5 ×
        # longer
        assert loop.time() - sent == pytest.approx(0.5)
        assert budget.peak == 1

    on_budget(overdraft_of_one, models, scenario)


def test_work_ten_times_lighter_a_row_than_what_holds_the_slots_overdraws() -> None:
    # GIVEN one slot and one overdraft; a long text takes 0.5 s a row, a short one 20 ms
    # (not short by the 5 ms rule), both counted against 5 s
    models = {
        "long": (one_at_a_time(), 0.5),
        "short": (one_at_a_time(), 0.02),
    }

    async def scenario(batchers: Models, budget: ComputeBudget, log: Log) -> None:
        loop = virtual_loop()
        await send(batchers["short"], 0)
        await send(batchers["long"], 1)
        long = send(batchers["long"], 2)
        await asyncio.sleep(0.1)
        sent = loop.time()
        # WHEN short texts arrive 0.1 s into a long batch (later, so no more urgent)
        await asyncio.gather(*(send(batchers["short"], i) for i in (3, 4)))
        # THEN they ran beside it, one after the other on the overdraft slot
        assert loop.time() - sent == pytest.approx(0.04)
        assert budget.peak == 2
        await long

    on_budget(overdraft_of_one, models, scenario)


# -- wide runs ---------------------------------------------------------------------------


@dataclass
class WideRecording(Recording):
    """A model with a wide session; records whether each run was wide."""

    widened: list[bool] = field(default_factory=list)

    @property
    def wide(self) -> bool:
        return True

    def run(self, batch: list[Prepared], wide: bool = False) -> list[Tensors]:
        self.widened.append(wide)
        return super().run(batch)


def test_a_run_that_finds_the_device_idle_is_wide_and_only_then() -> None:
    # GIVEN two slots that may run wide, one model of 0.1 s runs and one of 0.01 s
    log = Log()
    heavy, light = WideRecording("heavy", log), WideRecording("light", log)

    async def main() -> ComputeBudget:
        loop = virtual_loop()
        budget = ComputeBudget(2, overdraft=0, clock=loop.time, wide=True)
        batchers = [
            DynamicBatcher(
                r.name, r, one_at_a_time(), InlineExecutor(s), clock=loop.time, budget=budget
            )
            for r, s in ((heavy, 0.1), (light, 0.01))
        ]
        for batcher in batchers:
            batcher.start()
        try:
            # WHEN a lone request runs, then two requests of the heavy model and one of
            # the light one arrive together
            await batchers[0].submit(fake_request(0))
            await asyncio.gather(
                batchers[0].submit(fake_request(1)),
                batchers[0].submit(fake_request(2)),
                batchers[1].submit(fake_request(3)),
            )
            # AND a last lone request
            await batchers[1].submit(fake_request(4))
        finally:
            for batcher in batchers:
                await batcher.stop(drain_timeout_s=10)
        return budget

    budget = run_virtual(main)
    # THEN the lone ones ran wide; of the three together, the first two ran narrow side
    # by side (each found another queued) and the last wide (by then alone); each held
    # one slot
    assert heavy.widened == [True, False, True]
    assert light.widened == [False, True]
    assert budget.peak == 2


def test_a_budget_that_may_not_run_wide_never_does() -> None:
    log = Log()
    runner = WideRecording("m", log)

    async def main() -> None:
        loop = virtual_loop()
        budget = ComputeBudget(2, overdraft=0, clock=loop.time)
        batcher = DynamicBatcher(
            "m", runner, one_at_a_time(), InlineExecutor(0.1), clock=loop.time, budget=budget
        )
        batcher.start()
        await batcher.submit(fake_request(0))
        await batcher.stop(drain_timeout_s=10)

    run_virtual(main)
    assert runner.widened == [False]
