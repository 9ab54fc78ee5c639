"""The frame-stream benchmark, short: 5 streams x 10 digits frames through each door
(WebSocket API and HTTP through the router, gRPC streams to the GPU service) on a stack
of its own; every frame answered once with ONNX Runtime's label, in seq order where the
door orders answers, and the GPU service's batches read from its statistics."""

from __future__ import annotations

import json
from pathlib import Path

from bench import stream_bench
from spillway_cli.frame_streams import DOOR_NAMES


def test_the_stream_benchmark_runs_every_door(models_dir: Path, tmp_path: Path) -> None:
    # WHEN the benchmark runs short on its own stack
    argv = ["--models", str(models_dir), "--streams", "5", "--frames", "10", "--window", "4"]
    stream_bench.main([*argv, "--out", str(tmp_path)])
    results = json.loads((tmp_path / "bench-streams.json").read_text())
    runs = {run["door"]: run for run in results["runs"]}
    # THEN every door answered all 50 frames, once each, with the right label
    assert list(runs) == ["websocket", "grpc", "http"]
    for door, run in runs.items():
        assert (run["frames"], run["answered_ok"], run["wrong_labels"]) == (50, 50, 0), door
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
    # AND the markdown table has a row per door
    table = (tmp_path / "bench-streams.md").read_text()
    assert all(f"| {DOOR_NAMES[door]} | " in table for door in runs)
