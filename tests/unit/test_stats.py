"""The busy fraction the router reads from every response."""

from __future__ import annotations

from gpu_service.stats import BusyTracker


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
