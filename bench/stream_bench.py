"""Frame streams: S concurrent streams of digits frames (W in flight per stream) through
the WebSocket API and HTTP through the router, and gRPC streams straight to the GPU
service, one door after the other on one local stack, in one run.

Per door: frames/s in all and per stream (the median stream), p50/p99 per frame (send to
answer), whether each stream's answers came in seq order (out-of-order, missing and
duplicated counts), errors by code, and the GPU service's batch sizes while the streams
shared it (``/v2/models/digits/stats`` before and after). Every label is checked against
ONNX Runtime run on the model file over the same frame.

``--kill`` adds the GPU service killed (SIGKILL, by PID) after a third of the frames,
once during WebSocket streams (the router falls back to the CPU fallback: every frame
still answered once, in order) and once during gRPC streams (no router in front: each
stream ends with UNAVAILABLE; the frames it had in flight are reported failed, those
after them not sent), the service restarted after each.

Starts its own stack (``spillway_cli.local.stack.LocalStack``) and writes ``bench-streams.json``
and ``bench-streams.md`` to ``--out``.

    .venv/bin/python -m bench.stream_bench [--streams 50] [--frames 20] [--window 8]
        [--doors websocket,grpc,http] [--kill] [--out docs]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.serving_bench import load_average
from spillway_cli.frame_streams import (
    DOOR_NAMES,
    DOORS,
    DoorRun,
    Frames,
    FrameSet,
    OcrPages,
    Scenario,
    batch_text,
)
from spillway_cli.local.stack import LocalStack
from spillway_cli.stream_drivers import Endpoints, gpu_killer, restart_gpu, run_door

ROOT = Path(__file__).resolve().parent.parent


def measure(
    stack: LocalStack,
    scenario: Scenario,
    doors: list[str],
    kill: bool,
    ocr: Scenario | None = None,
) -> dict[str, Any]:
    """Every door at ``scenario``'s concurrency with digits frames, then with OCR pages
    at ``ocr``'s (when given and the repository has the detector), each after a warm-up;
    then the kill runs (digits); the figures, JSON-ready."""
    frames = Frames.load(stack.models)
    endpoints = Endpoints.of_stack(stack)
    load = [load_average()]
    runs = _doors(endpoints, scenario, doors, frames)
    pages = OcrPages.load(stack.models) if ocr is not None and ocr.streams else None
    ocr_runs = _doors(endpoints, ocr, doors, pages) if ocr is not None and pages else []
    killed: list[DoorRun] = []
    for door in [d for d in ("websocket", "grpc") if kill and d in doors]:
        killed.append(run_door(door, endpoints, scenario, frames, gpu_killer(stack)))
        print(f"GPU service killed under {killed[-1].line()}", flush=True)
        restart_gpu(stack)
    load.append(load_average())
    return {
        "scenario": asdict(scenario),
        "machine": machine(),
        "load_average": load,
        "runs": [r.summary() for r in runs],
        "ocr_scenario": asdict(ocr) if ocr_runs and ocr is not None else None,
        "ocr_runs": [r.summary() for r in ocr_runs],
        "killed": [r.summary() for r in killed],
    }


def _doors(
    endpoints: Endpoints, scenario: Scenario, doors: list[str], frames: FrameSet
) -> list[DoorRun]:
    """Each door's run of ``scenario``, after a warm-up of 2 streams."""
    warm = Scenario(streams=2, frames=scenario.window, window=scenario.window)
    runs: list[DoorRun] = []
    for door in doors:
        run_door(door, endpoints, warm, frames)
        runs.append(run_door(door, endpoints, scenario, frames))
        print(runs[-1].line(), flush=True)
    return runs


def machine() -> dict[str, Any]:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    cpu = names[0] if names else platform.processor() or "unknown"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
    }


def table(results: dict[str, Any]) -> str:
    """The markdown tables of a run."""
    sc, host = results["scenario"], results["machine"]
    lines = [
        f"{sc['streams']} streams x {sc['frames']} digits frames, {sc['window']} in flight a "
        f"stream; {host['date']}, {host['cpus']} CPUs ({host['cpu']}), load average "
        f"{' -> '.join(results['load_average'])}.",
        "",
        *_door_rows(results["runs"]),
    ]
    ocr = results.get("ocr_scenario")
    if ocr:
        lines += [
            "",
            f"OCR pages (rendered text as PNG, to `ocr-det`: base64 in a text frame through "
            f"the WebSocket API, binary data through HTTP and gRPC; right: a box for each "
            f"line, where the detector's own code finds them): {ocr['streams']} streams x "
            f"{ocr['frames']} pages, {ocr['window']} in flight a stream, same stack and run:",
            "",
            *_door_rows(results["ocr_runs"]),
        ]
    if results["killed"]:
        lines += [
            "",
            "GPU service killed (SIGKILL) after a third of the frames:",
            "",
            "| door | frames | answered once | answered twice | unanswered | by the GPU "
            "| by the CPU fallback | of them reported failed | of them not sent | in seq order |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for run in results["killed"]:
            backends = run["backends"]
            once = run["answered"] - run["duplicated"]
            lines.append(
                f"| {DOOR_NAMES[run['door']]} | {run['frames']} | {once} | {run['duplicated']} "
                f"| {run['missing']} | {backends.get('gpu', 0)} | {backends.get('cpu', 0)} "
                f"| {run['failed_unanswered']} | {run['not_sent']} | "
                f"{'yes' if run['out_of_order'] == 0 else 'no'} |"
            )
    return "\n".join(lines) + "\n"


def _door_rows(runs: list[dict[str, Any]]) -> list[str]:
    """A markdown table with a row per door's run."""
    rows = [
        "| door | frames/s | frames/s a stream (median) | p50 ms | p99 ms | answered right "
        "| in seq order (late/missing/dup) | errors | GPU batches |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        order = "yes" if run["order_kept"] else "no"
        if run["door"] == "http":
            order = "n/a"
        counts = f"{run['out_of_order']}/{run['missing']}/{run['duplicated']}"
        errors = ", ".join(f"{k} x{v}" for k, v in run["errors"].items()) or "none"
        rows.append(
            f"| {DOOR_NAMES[run['door']]} | {run['frames_per_s_total']} | "
            f"{run['frames_per_s_per_stream_p50']} | {run['latency_p50_ms']} | "
            f"{run['latency_p99_ms']} | {run['answered_ok']}/{run['frames']} | {order} "
            f"({counts}) | {errors} | {batch_text(run)} |"
        )
    return rows


def write(results: dict[str, Any], out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-streams.json").write_text(json.dumps(results, indent=2) + "\n")
    text = table(results)
    (out / "bench-streams.md").write_text(
        "# Frame streams benchmark\n\nWritten by `python -m bench.stream_bench` "
        '(docs/benchmarks.md, "Frame streams").\n\n' + text
    )
    return text


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=os.environ.get("SPILLWAY_MODELS_DIR", "models"))
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--frames", type=int, default=20, help="frames a stream")
    parser.add_argument("--window", type=int, default=8, help="frames in flight a stream")
    parser.add_argument("--doors", default=",".join(DOORS))
    parser.add_argument("--ocr-streams", type=int, default=20, help="0: no OCR pages")
    parser.add_argument("--ocr-frames", type=int, default=3, help="OCR pages a stream")
    parser.add_argument("--ocr-window", type=int, default=1, help="OCR pages in flight")
    parser.add_argument("--kill", action="store_true", help="also kill the GPU service")
    parser.add_argument("--router-runtime", default="wsgi")
    parser.add_argument("--out", default=str(ROOT / "docs"))
    args = parser.parse_args(argv)
    scenario = Scenario(args.streams, args.frames, args.window)
    work = Path(tempfile.mkdtemp(prefix="spillway-streams-"))
    stack = LocalStack(
        Path(args.models).resolve(), work / "stack", router_runtime=args.router_runtime
    )
    stack.start()
    try:
        ocr = Scenario(args.ocr_streams, args.ocr_frames, args.ocr_window)
        results = measure(stack, scenario, args.doors.split(","), args.kill, ocr)
    finally:
        stack.stop()
    print(write(results, Path(args.out)))
    return results


if __name__ == "__main__":
    main()
