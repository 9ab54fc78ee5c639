"""The demo's frame-stream section: digits frames and OCR pages streamed through the
WebSocket API and through gRPC streams (the scenario and its doors:
``spillway_cli.frame_streams``, ``spillway_cli.stream_drivers``)."""

from __future__ import annotations

from pathlib import Path

from spillway_cli.console import Check
from spillway_cli.demo.report import say
from spillway_cli.frame_streams import Scenario, frame_sets
from spillway_cli.local.stack import LocalStack
from spillway_cli.stream_drivers import Endpoints, run_door


def scenario_frame_streams(stack: LocalStack, models: Path) -> list[Check]:
    """50 streams of 20 digits frames, 2 in flight a stream, then 20 streams of 2 OCR
    pages (rendered text, to the OCR detector), 1 in flight a stream, each through the
    WebSocket API (router) and through gRPC streams (GPU service): every frame answered
    once, in seq order, rightly: a digits frame with the label ONNX Runtime gives it, a
    page with a box for each of its lines where the detector's own code finds them.

    Two digits frames in flight a stream, not more: the local WebSocket API answers 10-20
    frames/s on a loaded 2-core machine (docs/benchmarks.md, "Frame streams"), so 400
    frames in flight would wait past API Gateway's 29 s integration timeout; 100 wait
    about 8 s. OCR pages are 20 streams: a page is about half a second of this machine's
    CPU, so 50 at once would wait about 25 s. A page travels in a text frame as base64
    (API Gateway closes the connection on a binary frame).

    The WebSocket API is ``spillway serve websocket`` under every router runtime (under
    serverless-offline too: its own WebSocket server started a Python process for every
    invocation that found none idle, and took binary frames API Gateway refuses)."""
    sets = frame_sets(models)
    made: list[Check] = []
    for frames in sets:
        scenario = (
            Scenario(streams=50, frames=20, window=2)
            if frames.model == "digits"
            else Scenario(streams=20, frames=2, window=1)
        )
        say(
            f"   {scenario.streams} streams x {scenario.frames} "
            f"{frames.what}, {scenario.window} in flight a stream"
        )
        for door in ("websocket", "grpc"):
            run = run_door(door, Endpoints.of_stack(stack), scenario, frames)
            say(f"     {run.line()}")
            made += run.checks()
    if len(sets) == 1:
        say("   (no OCR detector in this repository: no OCR pages)")
    return made
