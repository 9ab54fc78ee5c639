"""The statistics that drive spilling, with exact values on an injected clock.

The GPU service reports its busy fraction (``BusyTracker``) and queue depth on every
answer; the router folds them into time-weighted moving averages (``LoadTracker``) and
asks whether a backend has stayed above a threshold for long enough. A GPU that cools and
heats up again must restart that clock; readings under a second apart must weigh by
the time between them, not count as whole readings."""

from __future__ import annotations

import pytest

from functions.router.health import LoadSnapshot, LoadTracker, parse_load_headers
from gpu_service.stats import BusyTracker
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
