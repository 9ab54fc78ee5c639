"""Live load: the moving average, "sustained above", and the spill it drives."""

from __future__ import annotations

from pathlib import Path

import pytest

from spillway.policy.health import LoadTracker, parse_load_headers
from tests.unit.test_router import Clock, make_stack, ok

EXAMPLE = Path(__file__).resolve().parents[2] / "policies" / "example.yaml"


def tracker(clock: Clock) -> LoadTracker:
    return LoadTracker(halflife_s=10.0, stale_s=30.0, clock=clock)


def test_the_average_moves_half_way_in_one_half_life() -> None:
    clock = Clock()
    load = tracker(clock)
    load.observe("gpu", 0.0, 0)
    clock.now += 10
    load.observe("gpu", 1.0, 8)
    snapshot = load.snapshot("gpu")
    assert snapshot is not None
    assert snapshot.busy == pytest.approx(0.5)
    assert snapshot.queue_depth == pytest.approx(4.0)
    assert load.snapshot("cpu") is None


def test_sustained_above_needs_the_whole_duration_above_the_threshold() -> None:
    # GIVEN a GPU reporting 95% busy every 10 s
    clock = Clock()
    load = tracker(clock)
    load.observe("gpu", 0.95)
    assert not load.sustained_above("gpu", 0.85, 300)  # starts the 0.85 clock now
    for _ in range(29):
        clock.now += 10
        load.observe("gpu", 0.95)
    assert not load.sustained_above("gpu", 0.85, 300)  # 290 s so far
    clock.now += 10
    load.observe("gpu", 0.95)
    # THEN after 300 s above 0.85 it holds, for that threshold and not a higher one
    assert load.sustained_above("gpu", 0.85, 300)
    assert not load.sustained_above("gpu", 0.96, 0)
    # WHEN the GPU cools, the streak ends at once
    for _ in range(4):
        clock.now += 10
        load.observe("gpu", 0.1)
    assert not load.sustained_above("gpu", 0.85, 0)


def test_a_stale_reading_counts_as_cool() -> None:
    clock = Clock()
    load = tracker(clock)
    load.observe("gpu", 1.0)
    assert load.sustained_above("gpu", 0.5, 0)
    clock.now += 31
    assert not load.sustained_above("gpu", 0.5, 0)


@pytest.mark.parametrize(
    ("headers", "reading"),
    [
        ({"x-spillway-busy": "0.750", "x-spillway-queue-depth": "3"}, (0.75, 3.0)),
        ({"x-spillway-busy": "0.5"}, (0.5, None)),
        ({"x-spillway-busy": "nan"}, None),
        ({"x-spillway-busy": "-1"}, None),
        ({}, None),
    ],
)
def test_load_headers_are_parsed_defensively(
    headers: dict[str, str], reading: tuple[float, float | None] | None
) -> None:
    assert parse_load_headers(headers) == reading


def test_a_hot_gpu_spills_a_tenth_of_low_priority_traffic_until_it_cools() -> None:
    # GIVEN the example policy and a GPU that reports itself 95% busy
    stack = make_stack(gpu=[ok(headers={"x-spillway-busy": "0.95"})], policy_file=EXAMPLE)

    def round_of(n: int) -> list[str]:
        responses = [stack.post() for _ in range(n)]
        for response in responses:
            spilled = response.headers.get("x-spillway-spilled") == "true"
            assert spilled == (response.headers["x-spillway-backend"] == "cpu")
        return [r.headers["x-spillway-backend"] for r in responses]

    # WHEN traffic flows for under 5 minutes, nothing spills
    for _ in range(29):
        assert set(round_of(5)) == {"gpu"}
        stack.clock.now += 10
    # WHEN it has been hot for 5 minutes
    stack.clock.now += 20
    backends = round_of(1000)
    # THEN 10% of the requests go to the CPU fallback, marked as spilled
    assert 95 <= backends.count("cpu") <= 105
    # WHEN the GPU reports it has cooled (and its average drops below 0.85)
    stack.gpu.script = [ok(headers={"x-spillway-busy": "0.10"})]
    for _ in range(3):
        stack.clock.now += 10
        round_of(1)
    # THEN spilling stops
    assert set(round_of(200)) == {"gpu"}
