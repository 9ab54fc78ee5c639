"""The dashboard's sources and board, without a browser: what the page is fed."""

from __future__ import annotations

import json
from pathlib import Path

from spillway.policy.accounting import RouteEvent, RouteRecord, route_metrics
from spillway_cli.dashboard.board import Board
from spillway_cli.dashboard.sources import (
    GpuReading,
    LineTail,
    Request,
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
    found = RouterLogs([log]).read()
    events, sightings = [r.event for r in found.requests], found.sightings
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
    assert snap["t"][0] == int(NOW) - 10
    assert snap["t"][-1] == int(NOW) - 1  # the running second is incomplete: left out
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


def request(at: float, status: int, model: str = "digits", ms: float = 10.0) -> Request:
    event = RouteEvent(at, "default", "gpu", model, 1, int(status >= 500), 0, 0, 0.0, (ms,))
    return Request(event, status)


def test_client_errors_count_apart_from_server_faults_per_backend_route_and_model() -> None:
    # GIVEN 26 requests for a model nobody serves (404, no model on the line), 10 served,
    # and 2 server faults, read back from the router's own metric lines
    records = [RouteRecord("default", "gpu", None, 404, 3.0, 0.0) for _ in range(26)]
    records += [RouteRecord("default", "gpu", "digits", 200, 9.0, 0.0) for _ in range(10)]
    records += [RouteRecord("default", "gpu", "digits", 503, 1.0, 0.0) for _ in range(2)]
    lines = [json.dumps(route_metrics(r)) for r in records]
    requests = [Request.of(json.loads(line)) for line in lines]
    board = Board(clock=lambda: NOW)
    board.add_requests(requests)
    snap = board.snapshot()
    # THEN the 404s show as client errors, not as "errors 0" nor as server faults
    assert (snap["totals"]["client_errors"], snap["totals"]["errors"]) == (26, 2)
    assert snap["totals"]["statuses"] == {"200": 10, "404": 26, "503": 2}
    assert snap["backends"]["gpu"]["client_errors"] == 26
    assert snap["backends"]["gpu"]["client_error_rate"] == 26 / 38
    assert snap["routes"][0]["client_errors"] == 26
    assert snap["models"]["-"]["client_errors"] == 26
    assert (snap["models"]["digits"]["requests"], snap["models"]["digits"]["errors"]) == (12, 2)
    assert board.seen_models() == ["digits"]


def test_series_hold_complete_seconds_only() -> None:
    board = Board(clock=lambda: NOW + 0.4)
    board.add_requests([request(NOW - 1, 200), request(NOW + 0.1, 200), request(NOW + 0.2, 404)])
    snap = board.snapshot()
    assert snap["t"][-1] == int(NOW) - 1
    assert snap["series"]["rps"]["gpu"][-1] == 1  # not the 2 of the running second
    assert snap["totals"]["requests"] == 3  # totals count every request


def test_an_hour_of_history_with_bounded_memory() -> None:
    now = [NOW]
    board = Board(clock=lambda: now[0], keep_per_second=5)
    hour = 3600
    for second in range(hour + 100):
        at = NOW + second
        now[0] = at + 0.5
        board.add_requests(request(at, 200, ms=float(i)) for i in range(10))
        if second % 300 == 0:
            board.snapshot()
    snap = board.snapshot()
    assert len(snap["t"]) == hour
    assert len(board.seconds) <= hour + 1  # the hour and the running second
    assert all(len(b.latencies.get("gpu", ())) <= 5 for b in board.seconds.values())
    # only the last seconds keep their latencies; older ones keep fixed quantiles
    assert sum(1 for b in board.seconds.values() if b.latencies.get("gpu")) <= 16
    assert all(v is not None and 4 <= v <= 9 for v in snap["series"]["p99"]["gpu"])
    assert snap["series"]["rps"]["gpu"] == [10] * hour


def test_smoothed_quantiles_are_the_same_before_and_after_they_are_fixed() -> None:
    now = [NOW]
    board = Board(clock=lambda: now[0])
    board.add_requests([request(NOW - 3, 200, ms=ms) for ms in (1, 2, 3, 50)])
    board.add_requests([request(NOW - 2, 200, ms=ms) for ms in (4, 5)])
    before = board.snapshot()["series"]
    now[0] = NOW + 60
    after = board.snapshot()["series"]
    for key in ("p50", "p99"):
        live = dict(zip(board.snapshot()["t"], after[key]["gpu"], strict=True))
        assert [live[int(NOW) - 3], live[int(NOW) - 2]] == before[key]["gpu"][-3:-1]
    assert before["p99"]["gpu"][-2] == 50  # nearest rank over the trailing 5 s


def test_slo_objectives_become_lines_and_route_columns() -> None:
    slo = {"routes": {"default": 20.0}, "default_p99_ms": 500.0}
    board = Board(clock=lambda: NOW, slo=slo)
    assert board.snapshot()["slo"]["lines"] == {"default": 20.0}  # before any request
    board.add_requests([request(NOW - 2, 200, ms=30)])
    board.add_events([event(NOW - 2, rule="realtime")])
    snap = board.snapshot()
    assert snap["slo"]["lines"] == {"default": 20.0, "realtime": 500.0}
    assert {r["rule"]: r["slo_p99_ms"] for r in snap["routes"]} == {
        "default": 20.0,
        "realtime": 500.0,
    }
    assert Board(clock=lambda: NOW).snapshot()["slo"] is None


def test_concurrency_is_busy_time_per_second_of_complete_seconds() -> None:
    board = Board(clock=lambda: NOW + 0.5)
    # 20 requests of 250 ms each ended in one second: 5 in flight on average that second
    board.add_requests([request(NOW - 1, 200, ms=250.0) for _ in range(20)])
    board.add_requests([request(NOW, 200, ms=10_000.0)])  # the running second: not yet
    snap = board.snapshot()
    assert snap["series"]["concurrency"]["gpu"][-1] == 5.0
    assert snap["backends"]["gpu"]["concurrency"] == 0.5  # 5 s of work over 10 s


def test_cold_start_lines_are_counted_per_function(tmp_path: Path) -> None:
    line = {
        "_aws": {
            "Timestamp": 1796173589595,
            "CloudWatchMetrics": [
                {
                    "Namespace": "Spillway",
                    "Dimensions": [["function_name", "service"]],
                    "Metrics": [{"Name": "ColdStart", "Unit": "Count"}],
                }
            ],
        },
        "function_name": "spillway-cpu-infer",
        "service": "spillway.cpu_infer",
        "ColdStart": [1.0],
    }
    log = tmp_path / "offline.log"
    log.write_text(f"{json.dumps(line)}\nsls: {json.dumps(line)}\n")
    found = RouterLogs([log]).read()
    assert [(c.function, c.at) for c in found.cold_starts] == [
        ("spillway-cpu-infer", 1796173589.595)
    ] * 2
    board = Board(clock=lambda: NOW)
    board.add_cold_starts(found.cold_starts)
    assert board.snapshot()["cold_starts"] == {"spillway-cpu-infer": 2}
