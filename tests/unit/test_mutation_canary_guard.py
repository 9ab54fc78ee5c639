"""The canary guard's judgement on its own, value by value (what the mutation run of
spillway/canary/guard.py found reached only through the router's tests, or not at all:
docs/mutation.md): which answers count, the size classes, the sliding window, and the
edges of the fault-rate and p99 tests."""

from __future__ import annotations

import pytest

from spillway.canary.guard import (
    WINDOW_CAP,
    SizeClass,
    Window,
    WindowSummary,
    outcome,
    size_class,
    verdict,
)
from spillway.models.canary_spec import RollbackBounds
from spillway.policy.backend import BackendResponse
from spillway.policy.facts import RequestFacts
from spillway.protocol.replies import FAULT_HEADER

BOUNDS = RollbackBounds(min_requests=50)
SIZE = (8, 9)


def window(count: int, faults: int, latency_s: float) -> WindowSummary:
    """``count`` like-sized requests, each served in ``latency_s`` unless it faulted."""
    return WindowSummary(count, faults, {SIZE: [latency_s] * (count - faults)})


def timed(latencies: dict[SizeClass, list[float]]) -> WindowSummary:
    """A window without faults: the latencies of each size class."""
    by_class = {size: sorted(values) for size, values in latencies.items()}
    return WindowSummary(sum(len(v) for v in by_class.values()), 0, by_class)


# --- what counts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "headers", "expected"),
    [
        (200, {}, "ok"),
        (299, {}, "ok"),
        (199, {}, None),
        (300, {}, None),
        (502, {}, "fault"),
        (500, {FAULT_HEADER: "server"}, "fault"),
        (503, {FAULT_HEADER: "server"}, "fault"),
        (500, {}, None),
        (503, {FAULT_HEADER: "client"}, None),
        (499, {FAULT_HEADER: "server"}, None),
        (404, {}, None),
        (429, {}, None),
    ],
)
def test_what_an_answer_says_about_the_version(
    status: int, headers: dict[str, str], expected: str | None
) -> None:
    assert outcome(BackendResponse(status, headers, b"", 0.01)) == expected


@pytest.mark.parametrize(
    ("payload_bytes", "elements", "tokens", "expected"),
    [
        (0, None, None, (-1, -1)),
        (1, 1, None, (0, 0)),
        (2, None, 2, (2, 2)),
        (3, 2, 1, (3, 3)),
        (5, 3, 2, (4, 4)),
        (6, 6, 0, (5, 5)),
        (1000, 600, 400, (19, 19)),
    ],
)
def test_size_classes_are_half_octaves_of_bytes_and_of_input_size(
    payload_bytes: int, elements: int | None, tokens: int | None, expected: tuple[int, int]
) -> None:
    facts = RequestFacts(
        method="POST",
        path="/v2/models/digits/infer",
        operation="infer",
        model="digits",
        payload_bytes=payload_bytes,
        input_elements=elements,
        input_tokens=tokens,
    )
    assert size_class(facts) == expected


# --- the window -------------------------------------------------------------------------


def test_the_window_keeps_the_last_span_and_sorts_served_latencies_by_class() -> None:
    # GIVEN outcomes at 0, 10, 15 and 20 s, one a fault
    events = Window()
    events.add(0.0, 0.5, False, (1, 1))
    events.add(10.0, 0.3, False, (1, 1))
    events.add(15.0, 0.9, True, (1, 1))
    events.add(20.0, 0.1, False, (1, 1))
    events.add(20.0, 0.2, False, (2, 2))
    # WHEN it is summed up at 20 s over the last 10 s
    summary = events.summary(now=20.0, span_s=10.0)
    # THEN the outcome exactly 10 s old is in, the older one out; the fault is counted
    # but its latency is not
    assert summary == WindowSummary(4, 1, {(1, 1): [0.1, 0.3], (2, 2): [0.2]})
    assert summary.fault_rate == 0.25
    # AND what was dropped stays dropped
    assert events.summary(now=20.0, span_s=100.0).count == 4


def test_the_window_holds_at_most_its_cap() -> None:
    events = Window()
    for at in range(WINDOW_CAP + 1):
        events.add(float(at), 0.01, at == 0, SIZE)
    summary = events.summary(now=float(WINDOW_CAP), span_s=1e9)
    # the oldest (the fault) fell out
    assert (summary.count, summary.faults) == (WINDOW_CAP, 0)


def test_an_empty_window_has_no_fault_rate() -> None:
    assert Window().summary(now=5.0, span_s=1.0) == WindowSummary(0, 0, {})
    assert WindowSummary(0, 0).fault_rate == 0.0


# --- the fault-rate test ----------------------------------------------------------------


def test_the_stable_version_is_the_baseline_once_it_has_enough_requests() -> None:
    # GIVEN both versions failing 20 %, the stable one over exactly min_requests
    canary, stable = window(50, 10, 0.01), window(50, 10, 0.01)
    # THEN the canary is no worse: no rollback
    assert verdict(canary, stable, BOUNDS) is None
    assert verdict(canary, window(500, 100, 0.01), BOUNDS) is None


def test_a_stable_version_with_too_few_requests_is_not_the_baseline() -> None:
    # GIVEN a stable version with 10 requests, half failed, and a canary failing 20 %
    reason = verdict(window(60, 12, 0.01), window(10, 5, 0.01), BOUNDS)
    # THEN the canary is judged against no faults at all
    assert reason == (
        "fault rate 20.0% over 60 requests against 0.0% for the stable version (bound +1.0%)"
    )


def test_equal_rates_with_no_margin_are_no_regression() -> None:
    bounds = RollbackBounds(min_requests=50, max_error_rate_increase=0.0)
    assert verdict(window(50, 0, 0.01), window(50, 0, 0.01), bounds) is None
    assert verdict(window(1000, 100, 0.01), window(1000, 100, 0.01), BOUNDS) is None


def test_a_canary_failing_every_request_is_rolled_back() -> None:
    reason = verdict(window(50, 50, 0.01), window(50, 0, 0.01), BOUNDS)
    assert reason == (
        "fault rate 100.0% over 50 requests against 0.0% for the stable version (bound +1.0%)"
    )


def test_an_excess_of_exactly_the_significance_rolls_back() -> None:
    # GIVEN 8 faults in 16 (rate 0.5, standard error 0.125) against none, margin 0.125
    bounds = RollbackBounds(min_requests=16, max_error_rate_increase=0.125)
    # THEN the excess, 0.375, is exactly 3 standard errors: rolled back
    reason = verdict(window(16, 8, 0.01), window(16, 0, 0.01), bounds)
    assert reason is not None
    assert reason.startswith("fault rate 50.0% over 16 requests")


# --- the p99 test -----------------------------------------------------------------------


def test_the_p99_is_the_99th_of_100_and_the_message_names_the_largest_class() -> None:
    # GIVEN the stable version at 10 ms and a canary at 1..100 ms in one class
    canary = timed({(8, 9): [ms / 1000 for ms in range(1, 101)]})
    stable = timed({(8, 9): [0.010] * 100})
    # THEN it is rolled back, its p99 being 99 ms against 10 ms
    assert verdict(canary, stable, BOUNDS) == (
        "p99 99.0 ms against 10.0 ms for the stable version on like-sized requests "
        "(100 canary requests in 1 size classes compared; bound x1.5)"
    )


def test_the_message_names_the_class_with_most_canary_requests() -> None:
    canary = timed({(8, 9): [0.050] * 150, (10, 10): [0.040] * 100})
    stable = timed({(8, 9): [0.010] * 100, (10, 10): [0.020] * 100})
    assert verdict(canary, stable, BOUNDS) == (
        "p99 50.0 ms against 10.0 ms for the stable version on like-sized requests "
        "(250 canary requests in 2 size classes compared; bound x1.5)"
    )


def test_the_ratio_bound_applies_when_it_is_the_larger() -> None:
    # GIVEN the stable version at 100 ms: its bound is 150 ms (x1.5), not 110 ms (+10 ms)
    stable = timed({(8, 9): [0.100] * 100})
    assert verdict(timed({(8, 9): [0.120] * 100}), stable, BOUNDS) is None
    assert verdict(timed({(8, 9): [0.151] * 100}), stable, BOUNDS) is not None


def test_a_canary_exactly_at_its_bound_is_not_slower() -> None:
    # GIVEN the stable version at 1 ms: its bound is 1 ms + 10 ms
    bound = 0.001 + 10.0 / 1000
    stable = timed({(8, 9): [0.001] * 100})
    # THEN a canary exactly at the bound stays, one just above is rolled back
    assert verdict(timed({(8, 9): [bound] * 100}), stable, BOUNDS) is None
    assert verdict(timed({(8, 9): [bound * 1.001] * 100}), stable, BOUNDS) is not None


def test_classes_the_stable_version_has_too_few_requests_in_are_not_compared() -> None:
    # GIVEN a slow canary class the stable version served only 5 requests of
    canary = timed({(8, 9): [0.010] * 100, (10, 10): [1.0] * 100})
    stable = timed({(8, 9): [0.010] * 100, (10, 10): [0.010] * 5, (12, 12): [0.010] * 100})
    # THEN only the like-sized class both versions filled is compared: no rollback
    assert verdict(canary, stable, BOUNDS) is None


def test_the_message_gives_both_p99s_in_milliseconds() -> None:
    # GIVEN the stable version at 100 ms and the canary at 200 ms
    reason = verdict(timed({(8, 9): [0.200] * 100}), timed({(8, 9): [0.100] * 100}), BOUNDS)
    # THEN the message says so, to a tenth of a millisecond
    assert reason == (
        "p99 200.0 ms against 100.0 ms for the stable version on like-sized requests "
        "(100 canary requests in 1 size classes compared; bound x1.5)"
    )
