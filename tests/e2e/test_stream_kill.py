"""The GPU service killed (SIGKILL, by PID) under frame streams, a third of the way in.

Through the WebSocket API the router falls back to the CPU fallback: every frame is still
answered exactly once, in seq order, with ONNX Runtime's label, the later ones by the
CPU fallback naming the GPU's failure. gRPC streams have no router in front: each stream
ends with UNAVAILABLE; what was answered, reported failed and never sent adds up to the
stream's frames, and nothing is answered twice. The GPU service is started again after
each test (the stack is the session's)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spillway_cli.frame_streams import DoorRun, Frames, Scenario
from spillway_cli.local.stack import LocalStack
from spillway_cli.stream_drivers import Endpoints, gpu_killer, restart_gpu, run_door

SCENARIO = Scenario(streams=10, frames=30, window=8)


@pytest.fixture
def killed(stack: LocalStack, models_dir: Path) -> Iterator[Callable[[str], DoorRun]]:
    """Runs a door's streams with the GPU service killed under them; restarts it after."""
    frames = Frames.load(models_dir)

    def run(door: str) -> DoorRun:
        return run_door(door, Endpoints.of_stack(stack), SCENARIO, frames, gpu_killer(stack))

    try:
        yield run
    finally:
        if stack.children["gpu"].proc.poll() is not None:
            restart_gpu(stack)


def test_websocket_streams_lose_no_frame_when_the_gpu_service_dies(
    killed: Callable[[str], DoorRun],
) -> None:
    # GIVEN 10 WebSocket streams of 30 frames, 8 in flight each
    # WHEN the GPU service is killed once a third of the frames are settled
    run = killed("websocket")
    got = run.summary()
    # THEN the kill happened a third of the way in
    assert got["killed_after"] == SCENARIO.total // 3
    # AND every frame was answered exactly once, in seq order, with the right label
    assert (got["answered"], got["answered_ok"]) == (SCENARIO.total, SCENARIO.total), got
    assert (got["missing"], got["duplicated"], got["out_of_order"]) == (0, 0, 0), got
    assert (got["errors"], got["failed_unanswered"], got["not_sent"]) == ({}, 0, 0), got
    # AND the GPU answered the first ones, the CPU fallback the later ones, naming why
    assert set(got["backends"]) == {"gpu", "cpu"}
    answers = [a for stream in run.streams for a in stream.answers]
    assert any(a.backend == "cpu" and a.fallback for a in answers)
    assert got["backends"]["gpu"] >= 1
    # (frames in flight when it died, at most streams x window, may be either)
    in_flight = SCENARIO.streams * SCENARIO.window
    assert got["backends"]["cpu"] >= SCENARIO.total - got["killed_after"] - in_flight


def test_grpc_streams_report_every_frame_when_the_gpu_service_dies(
    killed: Callable[[str], DoorRun],
) -> None:
    # GIVEN 10 gRPC streams of 30 frames, 8 in flight each
    # WHEN the GPU service is killed once a third of the frames are settled
    run = killed("grpc")
    got = run.summary()
    assert got["killed_after"] is not None
    # THEN each stream's frames add up: answered + reported failed + not sent
    for stream in run.streams:
        sent = len(stream.sent_at)
        assert sent + stream.not_sent == SCENARIO.frames, stream.stream
        assert len(stream.answers) + stream.failed_unanswered == sent, stream.stream
        assert sum(stream.errors.values()) == 0, stream.stream
        late, _, duplicated = stream.order()
        assert (late, duplicated, stream.wrong) == (0, 0, 0), stream.stream
    # AND the service's death ended the streams: not every frame was answered
    assert got["answered"] < SCENARIO.total
    assert got["failed_unanswered"] + got["not_sent"] == SCENARIO.total - got["answered"]
    assert got["backends"] == {"gpu": got["answered"]}
