"""The dashboard's sources and board, without a browser: what the page is fed."""

from __future__ import annotations

import json
from pathlib import Path

from spillway.routing.accounting import RouteEvent, RouteRecord, route_metrics
from spillway_cli.dashboard.board import Board
from spillway_cli.dashboard.sources import (
    GpuReading,
    LineTail,
    RouterLogs,
    breaker_sightings,
    parse_prometheus,
)

NOW = 1_800_000_000.0


def event(at: float, backend: str = "gpu", rule: str = "default", ms: float = 10.0) -> RouteEvent:
    return RouteEvent(at, rule, backend, "digits", 1, 0, 0, 0, 0.001, (ms,))


def test_a_tail_returns_only_complete_new_lines_and_rereads_a_truncated_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log"
    tail = LineTail(path)
    assert tail.read() == []  # not there yet
    path.write_text("one\ntw")
    assert tail.read() == ["one"]
    with path.open("a") as handle:
        handle.write("o\nthree\n")
    assert tail.read() == ["two", "three"]
    path.write_text("new\n")  # rotated: shorter than what was read
    assert tail.read() == ["new"]


def test_router_logs_yield_metric_events_and_circuit_sightings(tmp_path: Path) -> None:
    metrics = route_metrics(RouteRecord("default", "cpu", "digits", 200, 12.5, 0.002, True))
    routed = {
        "message": "routed",
        "timestamp": "2026-11-30 21:30:36,081+0000",
        "attempts": ["gpu:circuit_open", "cpu:status_200"],
    }
    log = tmp_path / "router.log"
    log.write_text(f"plain text\n{json.dumps(metrics)}\noffline: {json.dumps(routed)}\n")
    events, sightings = RouterLogs([log]).read()
    assert [(e.backend, e.fallbacks, e.latencies_ms) for e in events] == [("cpu", 1, (12.5,))]
    assert [(s.backend, s.state) for s in sightings] == [("gpu", "open"), ("cpu", "closed")]
    assert breaker_sightings({"message": "refused"}) == []


def test_prometheus_samples_fold_into_one_gpu_reading() -> None:
    text = """# HELP nv_inference_request_success x
nv_inference_request_success{model="digits",version="1"} 40
nv_inference_request_success{model="minilm",version="1"} 2
spillway_batch_size_sum{model="digits",version="1"} 64
spillway_batch_size_count{model="digits",version="1"} 16
spillway_queue_depth{model="digits",version="1"} 3
spillway_busy_fraction{model="digits",version="1"} 0.25
spillway_busy_fraction{model="minilm",version="1"} 0.5
broken line
"""
    reading = GpuReading.of(parse_prometheus(text), NOW)
    assert (reading.success, reading.batches, reading.batch_rows) == (42, 16, 64)
    assert (reading.queue_depth, reading.busy) == (3, 0.5)


def test_the_snapshot_counts_every_event_and_charts_the_recent_ones() -> None:
    board = Board(window_s=60, min_span_s=10, clock=lambda: NOW)
    board.add_events([event(NOW - 3600)])  # counted, too old to chart
    board.add_events([event(NOW - 2, ms=ms) for ms in (5, 7, 100)])
    board.add_events([event(NOW - 1, backend="cpu", rule="serverless-requested", ms=30)])
    snap = board.snapshot()
    assert snap["totals"]["requests"] == 5
    assert snap["backends"]["gpu"]["requests"] == 4
    assert snap["backends"]["gpu"]["p99_ms"] == 100
    assert snap["backends"]["gpu"]["p50_ms"] == 7  # nearest rank of 5, 7, 10, 100
    assert snap["rules"] == {"default": 4, "serverless-requested": 1}
    assert snap["t"][0] == int(NOW) - 9
    assert snap["t"][-1] == int(NOW)
    index = snap["t"].index(int(NOW) - 2)
    assert snap["series"]["rps"]["gpu"][index] == 3
    assert snap["series"]["p99"]["gpu"][index] == 100
    assert snap["series"]["rps"]["cpu"][index + 1] == 1


def test_gpu_rates_come_from_counter_deltas_and_survive_a_restart() -> None:
    board = Board(clock=lambda: NOW)
    board.add_gpu(GpuReading(NOW - 2, 100, 0, 0, 50, 100, 0, 0.1))
    board.add_gpu(GpuReading(NOW - 1, 130, 0, 0, 60, 130, 2, 0.4))
    board.add_gpu(None)  # killed: the last figures stay, marked down
    board.add_gpu(GpuReading(NOW, 5, 0, 0, 2, 6, 0, 0.0))  # restarted: counters from zero
    gpu = board.snapshot()["gpu"]
    assert gpu["up"] is True
    assert gpu["rps"] == [None, 30.0, None]
    assert gpu["mean_batch"] == [2.0, 3.0, 3.0]
    assert (gpu["success"], gpu["mean_batch_total"]) == (5, 3.0)
