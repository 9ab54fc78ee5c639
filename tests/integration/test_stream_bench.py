"""The frame-stream benchmark, short: 5 streams x 10 digits frames, then 2 streams x 2 OCR
pages, through each door (WebSocket API and HTTP through the router, gRPC streams to the
GPU service) on a stack of its own; every frame answered once and rightly (ONNX Runtime's
label; a page's boxes), in seq order where the door orders answers, and the GPU service's
batches read from its statistics."""

from __future__ import annotations

import json
from pathlib import Path

from bench import stream_bench
from spillway_cli.frame_streams import DOOR_NAMES


def test_the_stream_benchmark_runs_every_door(models_dir: Path, tmp_path: Path) -> None:
    # WHEN the benchmark runs short on its own stack
    argv = ["--models", str(models_dir), "--streams", "5", "--frames", "10", "--window", "4"]
    argv += ["--ocr-streams", "2", "--ocr-frames", "2", "--ocr-window", "1"]
    stream_bench.main([*argv, "--out", str(tmp_path)])
    results = json.loads((tmp_path / "bench-streams.json").read_text())
    runs = {run["door"]: run for run in results["runs"]}
    # THEN every door answered all 50 frames, once each, with the right label
    assert list(runs) == ["websocket", "grpc", "http"]
    for door, run in runs.items():
        assert (run["frames"], run["answered_ok"], run["wrong_answers"]) == (50, 50, 0), door
        assert (run["missing"], run["duplicated"], run["errors"]) == (0, 0, {}), door
        assert run["frames_per_s_total"] > 0, door
        assert run["latency_p99_ms"] >= run["latency_p50_ms"] > 0, door
        # the GPU service ran them: at least a frame a run, and every frame counted
        assert run["gpu_inferences"] >= 50, door
        assert run["gpu_mean_batch"] >= 1.0, door
    # AND the streaming doors kept each stream's seq order
    assert (runs["websocket"]["order_kept"], runs["grpc"]["order_kept"]) == (True, True)
    assert runs["grpc"]["backends"] == {"gpu": 50}
    assert runs["websocket"]["backends"] == {"gpu": 50}
    # AND every door answered the 4 OCR pages rightly (through the router, the GPU service
    # or the CPU fallback, as the router chose; gRPC streams, the GPU service)
    pages = {run["door"]: run for run in results["ocr_runs"]}
    assert list(pages) == ["websocket", "grpc", "http"]
    for door, run in pages.items():
        assert (run["model"], run["frames"], run["answered_ok"]) == ("ocr-det", 4, 4), door
        assert (run["missing"], run["duplicated"], run["errors"]) == (0, 0, {}), door
        assert sum(run["backends"].values()) == 4, door
    assert pages["grpc"]["gpu_inferences"] >= 4
    assert results["ocr_scenario"] == {"streams": 2, "frames": 2, "window": 1, "timeout_s": 600.0}
    # AND the markdown tables have a row per door, digits and OCR pages
    table = (tmp_path / "bench-streams.md").read_text()
    assert all(table.count(f"| {DOOR_NAMES[door]} | ") == 2 for door in runs)
    assert "2 streams x 2 pages" in table
