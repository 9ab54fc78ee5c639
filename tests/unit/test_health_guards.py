"""The statistics that drive spilling, with exact values on an injected clock.

The GPU service reports its busy fraction (``BusyTracker``) and queue depth on every
answer; the router folds them into time-weighted moving averages (``LoadTracker``) and
asks whether a backend has stayed above a threshold for long enough. A GPU that cools and
heats up again must restart that clock; readings under a second apart must weigh by
the time between them, not count as whole readings."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

import pytest

from gpu_service.stats import BusyTracker
from spillway.policy.health import (
    CircuitBreaker,
    LoadSnapshot,
    LoadTracker,
    RetryBudget,
    in_thread,
    parse_load_headers,
)
from tests.unit.test_router import Clock

HALFLIFE_S = 10.0
STALE_S = 30.0


def weight(seconds: float) -> float:
    """The share of a new reading in the average after ``seconds``."""
    return float(1.0 - 2.0 ** (-seconds / HALFLIFE_S))


def tracker(clock: Clock) -> LoadTracker:
    return LoadTracker(halflife_s=HALFLIFE_S, stale_s=STALE_S, clock=clock)


# -- LoadTracker ------------------------------------------------------------------------------


def test_the_first_reading_is_taken_as_it_is() -> None:
    clock = Clock()
    load = tracker(clock)
    load.observe("gpu", 0.3, 5)
    clock.now += 2.5
    assert load.snapshot("gpu") == LoadSnapshot(busy=0.3, queue_depth=5.0, age_s=2.5)


def test_a_first_reading_without_a_queue_depth_counts_an_empty_queue() -> None:
    clock = Clock()
    load = tracker(clock)
    load.observe("gpu", 0.4)
    assert load.snapshot("gpu") == LoadSnapshot(busy=0.4, queue_depth=0.0, age_s=0.0)


def test_a_later_reading_without_a_queue_depth_keeps_the_depth() -> None:
    clock = Clock()
    load = tracker(clock)
    load.observe("gpu", 0.0, 6)
    clock.now += 10
    load.observe("gpu", 1.0)
    snapshot = load.snapshot("gpu")
    assert snapshot is not None
    assert snapshot.busy == pytest.approx(0.5)
    assert snapshot.queue_depth == 6.0


def test_readings_are_clamped_to_the_unit_interval() -> None:
    clock = Clock()
    load = tracker(clock)
    load.observe("hot", 7.0)
    load.observe("cold", -3.0)
    assert load.snapshot("hot") == LoadSnapshot(1.0, 0.0, 0.0)
    assert load.snapshot("cold") == LoadSnapshot(0.0, 0.0, 0.0)


def test_readings_under_a_second_apart_weigh_by_the_time_between_them() -> None:
    # GIVEN a cool GPU (0.0), then ten readings of 1.0 a tenth of a second apart
    clock = Clock()
    load = tracker(clock)
    load.observe("gpu", 0.0, 0)
    expected = 0.0
    for _ in range(10):
        clock.now += 0.1
        load.observe("gpu", 1.0, 10)
        expected += weight(0.1) * (1.0 - expected)
        reading = load.snapshot("gpu")
        assert reading is not None
        assert reading.busy == pytest.approx(expected, rel=1e-12)
    snapshot = load.snapshot("gpu")
    assert snapshot is not None
    # THEN after one second the average is what one reading after a second gives:
    # 1 - 2^(-1/10) = 0.0670, not ten whole readings' worth
    assert snapshot.busy == pytest.approx(weight(1.0), rel=1e-9)
    assert snapshot.busy == pytest.approx(0.06696700846, rel=1e-9)
    assert snapshot.queue_depth == pytest.approx(10 * weight(1.0), rel=1e-9)


def test_a_reading_at_the_same_instant_does_not_move_the_average() -> None:
    clock = Clock()
    load = tracker(clock)
    load.observe("gpu", 0.2, 1)
    load.observe("gpu", 1.0, 9)  # no time has passed: weight 0
    assert load.snapshot("gpu") == LoadSnapshot(0.2, 1.0, 0.0)


def test_a_reading_from_a_clock_that_went_back_does_not_move_the_average() -> None:
    clock = Clock()
    load = tracker(clock)
    load.observe("gpu", 0.2, 1)
    clock.now -= 5
    load.observe("gpu", 1.0, 9)
    snapshot = load.snapshot("gpu")
    assert snapshot is not None
    assert (snapshot.busy, snapshot.queue_depth) == (0.2, 1.0)


def test_backends_are_averaged_apart() -> None:
    clock = Clock()
    load = tracker(clock)
    load.observe("gpu", 1.0, 4)
    load.observe("cpu", 0.0, 0)
    clock.now += 10
    load.observe("gpu", 0.0, 0)
    assert load.snapshot("gpu") == LoadSnapshot(0.5, 2.0, 0.0)
    assert load.snapshot("cpu") == LoadSnapshot(0.0, 0.0, 10.0)


def test_a_gpu_that_cools_and_heats_up_again_restarts_its_clock() -> None:
    # GIVEN a GPU 100% busy, asked about 0.85 from t=0
    clock = Clock()
    start = clock.now
    load = tracker(clock)
    load.observe("gpu", 1.0)
    assert not load.sustained_above("gpu", 0.85, 20)
    clock.now = start + 10
    load.observe("gpu", 1.0)
    assert not load.sustained_above("gpu", 0.85, 20)  # 10 s of 20
    clock.now = start + 20
    load.observe("gpu", 1.0)
    assert load.sustained_above("gpu", 0.85, 20)  # exactly 20 s: holds
    # WHEN it cools: one reading of 0.0 a half-life later halves the average (0.5)
    clock.now = start + 30
    load.observe("gpu", 0.0)
    assert not load.sustained_above("gpu", 0.85, 0)
    # AND heats up again: 0.75 at t=40 (still below), 0.875 at t=50 (above again)
    clock.now = start + 40
    load.observe("gpu", 1.0)
    assert not load.sustained_above("gpu", 0.85, 0)
    clock.now = start + 50
    load.observe("gpu", 1.0)
    snapshot = load.snapshot("gpu")
    assert snapshot is not None
    assert snapshot.busy == pytest.approx(0.875)
    # THEN the streak counts from t=50, not from t=0
    assert load.sustained_above("gpu", 0.85, 0)
    assert not load.sustained_above("gpu", 0.85, 0.001)
    clock.now = start + 60
    load.observe("gpu", 1.0)
    assert not load.sustained_above("gpu", 0.85, 20)  # 10 s of the new streak
    clock.now = start + 70
    load.observe("gpu", 1.0)
    assert load.sustained_above("gpu", 0.85, 20)  # 20 s of it


def test_a_threshold_first_asked_while_cool_starts_when_the_average_crosses_it() -> None:
    clock = Clock()
    start = clock.now
    load = tracker(clock)
    load.observe("gpu", 0.0)
    assert not load.sustained_above("gpu", 0.4, 0)  # asked while below: no streak
    clock.now = start + 10
    load.observe("gpu", 1.0)  # 0.5: crosses 0.4 now
    clock.now = start + 15
    assert load.sustained_above("gpu", 0.4, 5)
    assert not load.sustained_above("gpu", 0.4, 5.001)


def test_an_average_equal_to_the_threshold_is_not_above_it() -> None:
    clock = Clock()
    load = tracker(clock)
    load.observe("gpu", 0.5)
    assert not load.sustained_above("gpu", 0.5, 0)
    clock.now += 10
    load.observe("gpu", 0.5)
    assert not load.sustained_above("gpu", 0.5, 0)
    assert load.sustained_above("gpu", 0.4999, 0)


def test_a_reading_exactly_stale_s_old_still_counts() -> None:
    clock = Clock()
    load = tracker(clock)
    load.observe("gpu", 1.0)
    assert load.sustained_above("gpu", 0.5, 0)
    clock.now += STALE_S
    assert load.sustained_above("gpu", 0.5, STALE_S)
    clock.now += 0.001
    assert not load.sustained_above("gpu", 0.5, 0)
    assert not load.sustained_above("other", 0.0, 0)  # never read: cool


@pytest.mark.parametrize(
    ("headers", "reading"),
    [
        ({"x-spillway-busy": "0", "x-spillway-queue-depth": "0"}, (0.0, 0.0)),
        ({"x-spillway-busy": "1", "x-spillway-queue-depth": "-2"}, (1.0, None)),
        ({"x-spillway-busy": "0.5", "x-spillway-queue-depth": "many"}, (0.5, None)),
        ({"x-spillway-busy": "inf"}, None),
        ({"x-spillway-busy": "busy"}, None),
        ({"x-spillway-queue-depth": "3"}, None),
    ],
)
def test_load_headers_at_their_edges(
    headers: dict[str, str], reading: tuple[float, float | None] | None
) -> None:
    assert parse_load_headers(headers) == reading


# -- BusyTracker ------------------------------------------------------------------------------


def test_busy_fraction_is_exact_for_batches_under_a_second() -> None:
    busy = BusyTracker(window_s=10.0)
    busy.start(0.0)
    busy.stop(0.25)
    busy.start(0.5)
    busy.stop(0.75)
    assert busy.fraction(1.0) == 0.5


def test_overlapping_batches_count_their_time_once() -> None:
    # GIVEN two batches computing at once from 0.2 s to 0.4 s
    busy = BusyTracker(window_s=10.0)
    busy.start(0.0)
    busy.start(0.2)
    busy.stop(0.4)
    assert busy.fraction(0.5) == pytest.approx(1.0)  # one still running
    busy.stop(0.6)
    # THEN the GPU was busy 0.6 s of 1.0 s, not 0.8 s
    assert busy.fraction(1.0) == pytest.approx(0.6)


def test_a_running_batch_counts_up_to_now() -> None:
    busy = BusyTracker(window_s=10.0)
    busy.start(0.0)
    busy.stop(1.0)
    busy.start(3.0)
    assert busy.fraction(4.0) == pytest.approx(0.5)  # busy 0-1 and 3-4 of 4 s


def test_no_time_passed_reads_whether_a_batch_runs() -> None:
    assert BusyTracker().fraction(3.0) == 0.0
    busy = BusyTracker()
    busy.start(5.0)
    assert busy.fraction(5.0) == 1.0
    busy.stop(5.0)
    assert busy.fraction(5.0) == 0.0


def test_a_stop_without_a_start_never_counts_negative_batches() -> None:
    busy = BusyTracker(window_s=10.0)
    busy.stop(0.0)
    busy.start(1.0)
    busy.stop(2.0)
    assert busy.fraction(2.0) == 0.5
    busy.stop(3.0)  # one stop too many: idle from here
    assert busy.fraction(4.0) == 0.25


def test_the_window_keeps_a_sample_exactly_window_s_old() -> None:
    busy = BusyTracker(window_s=10.0)
    busy.start(0.0)
    busy.stop(5.0)
    assert busy.fraction(10.0) == 0.5  # the sample at t=0 is exactly 10 s old: kept
    # a moment later it is dropped and the window starts at t=5, idle since
    assert busy.fraction(10.5) == 0.0
    assert list(busy._samples) == [(5.0, 5.0)]


# -- CircuitBreaker and RetryBudget: defaults, edges, probe counts ---------------------------


def state(breaker: CircuitBreaker) -> str:
    """The state now (read through a call: each read is a fresh look)."""
    return breaker.state


class Jobs:
    """Holds probe jobs until the test runs them (a probe in flight until then)."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []

    def __call__(self, job: Callable[[], None]) -> None:
        self.pending.append(job)

    def run_all(self) -> None:
        jobs, self.pending = self.pending, []
        for job in jobs:
            job()


def test_the_breaker_defaults_are_five_failures_five_seconds_and_a_120_s_cap() -> None:
    clock = Clock()
    breaker = CircuitBreaker("gpu", clock=clock)
    assert breaker.name == "gpu"
    assert (breaker.state, breaker.reset_s, breaker.opened_count, breaker.probes) == (
        "closed",
        5.0,
        0,
        0,
    )
    for _ in range(4):
        breaker.failure()
    assert state(breaker) == "closed"
    breaker.failure()
    assert state(breaker) == "open"
    assert breaker.retry_after_s() == 5.0
    # every failed trial doubles the wait: 10, 20, 40, 80, then the 120 s cap
    waits = []
    for _ in range(6):
        clock.now += breaker.retry_after_s()
        assert breaker.allow()
        breaker.failure()
        waits.append(breaker.retry_after_s())
    assert waits == [10.0, 20.0, 40.0, 80.0, 120.0, 120.0]


def test_retry_after_counts_down_to_zero_and_is_zero_unless_open() -> None:
    clock = Clock()
    breaker = CircuitBreaker("gpu", failures=1, reset_s=8.0, max_reset_s=8.0, clock=clock)
    assert breaker.retry_after_s() == 0.0
    breaker.failure()
    clock.now += 3
    assert breaker.retry_after_s() == 5.0
    clock.now += 6
    assert breaker.retry_after_s() == 0.0  # past its wait, not yet asked: still open inside
    assert breaker.allow()  # the trial
    assert breaker.retry_after_s() == 0.0  # half-open
    breaker.success()
    assert breaker.retry_after_s() == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"failures": 0}, "need failures >= 1 and 0 < reset_s <= max_reset_s"),
        ({"reset_s": 0.0}, "need failures >= 1 and 0 < reset_s <= max_reset_s"),
        ({"reset_s": 0.5, "max_reset_s": 0.4}, "need failures >= 1 and 0 < reset_s <= max_reset_s"),
        ({"probe_interval_s": 0.0}, "need probe_interval_s > 0"),
    ],
)
def test_breaker_arguments_are_checked_at_their_edges(
    kwargs: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        CircuitBreaker("gpu", clock=Clock(), **kwargs)  # type: ignore[arg-type]


def test_breaker_arguments_at_their_edges_are_taken() -> None:
    clock = Clock()
    breaker = CircuitBreaker(
        "gpu", failures=1, reset_s=0.5, max_reset_s=0.5, probe_interval_s=0.001, clock=clock
    )
    breaker.failure()
    assert breaker.retry_after_s() == 0.5
    clock.now += 0.5
    assert breaker.allow()
    breaker.failure()
    assert breaker.retry_after_s() == 0.5  # already at its cap


def test_a_refused_circuit_on_a_clock_starting_at_zero_is_probed_at_once() -> None:
    clock = Clock()
    clock.now = 0.0
    jobs = Jobs()
    breaker = CircuitBreaker("gpu", failures=1, clock=clock, probe=lambda: False, run=jobs)
    breaker.failure(refused=True)
    clock.now = 0.5
    assert not breaker.allow()
    assert (breaker.probes, len(jobs.pending)) == (1, 1)


def test_probes_are_counted_one_by_one_and_a_stuck_one_is_replaced_after_10_s() -> None:
    clock = Clock()
    jobs = Jobs()
    breaker = CircuitBreaker(
        "gpu", failures=1, reset_s=60.0, max_reset_s=60.0, clock=clock,
        probe=lambda: False, probe_interval_s=1.0, run=jobs,
    )  # fmt: skip
    breaker.failure(refused=True)
    assert not breaker.allow()
    assert breaker.probes == 1
    # WHEN the probe never comes back, 9.999 s later none is started (single flight)
    clock.now += 9.999
    assert not breaker.allow()
    assert breaker.probes == 1
    # THEN at exactly 10 s it counts as lost and the next request starts one more
    clock.now += 0.001
    assert not breaker.allow()
    assert (breaker.probes, len(jobs.pending)) == (2, 2)
    jobs.run_all()
    clock.now += 1.0
    assert not breaker.allow()
    assert breaker.probes == 3


def test_no_probe_without_a_probe_function_or_during_a_half_open_trial() -> None:
    clock = Clock()
    jobs = Jobs()
    plain = CircuitBreaker("gpu", failures=1, clock=clock, run=jobs)
    plain.failure(refused=True)
    assert not plain.allow()
    assert (plain.probes, jobs.pending) == (0, [])
    # a probed circuit whose wait has passed: the trial goes, the next request waits
    probed = CircuitBreaker("gpu", failures=1, clock=clock, probe=lambda: True, run=jobs)
    probed.failure(refused=True)
    clock.now += 5
    assert probed.allow()  # the trial
    assert not probed.allow()
    assert (probed.probes, jobs.pending) == (0, [])


def test_a_late_failure_while_open_does_not_stop_the_probing() -> None:
    # GIVEN a circuit opened by refusals, and a timeout of a request let in before
    clock = Clock()
    jobs = Jobs()
    breaker = CircuitBreaker("gpu", failures=1, clock=clock, probe=lambda: True, run=jobs)
    breaker.failure(refused=True)
    breaker.failure(refused=False)
    # WHEN a request finds it open THEN it is still probed, and the probe half-opens it
    assert not breaker.allow()
    assert breaker.probes == 1
    jobs.run_all()
    assert breaker.state == "half_open"


def test_a_retry_needs_a_whole_token_give_or_take_rounding() -> None:
    assert RetryBudget(0.0, initial=1.0 - 1e-9).try_spend()
    assert not RetryBudget(0.0, initial=1.0 - 2e-9).try_spend()


def test_the_retry_budget_banks_at_most_ten_tokens_by_default() -> None:
    budget = RetryBudget(1.0, initial=0.0)
    for _ in range(20):
        budget.deposit()
    spent = 0
    while budget.try_spend():
        spent += 1
    assert (spent, budget.requests, budget.retries) == (10, 20, 10)


def test_a_spent_retry_takes_its_token() -> None:
    budget = RetryBudget(0.0, initial=1.0)
    assert budget.try_spend()
    assert not budget.try_spend()
    two = RetryBudget(0.5, initial=1.5)
    assert two.try_spend()
    two.deposit()  # 0.5 + 0.5
    assert two.try_spend()
    assert not two.try_spend()


def test_the_default_probe_interval_is_one_second() -> None:
    clock = Clock()
    jobs = Jobs()
    breaker = CircuitBreaker(
        "gpu", failures=1, reset_s=60.0, clock=clock, probe=lambda: False, run=jobs
    )
    breaker.failure(refused=True)
    assert not breaker.allow()
    jobs.run_all()  # not ready
    clock.now += 0.999
    assert not breaker.allow()
    assert breaker.probes == 1
    clock.now += 0.001
    assert not breaker.allow()
    assert breaker.probes == 2


def test_probes_run_on_a_named_daemon_thread() -> None:
    ran = threading.Event()
    seen: list[tuple[str, bool]] = []

    def job() -> None:
        current = threading.current_thread()
        seen.append((current.name, current.daemon))
        ran.set()

    in_thread(job)
    assert ran.wait(10)
    assert seen == [("breaker-probe", True)]
    assert seen[0][0] != threading.main_thread().name
