"""The frame-stream scenario: S concurrent streams of F digits frames each, W frames in
flight per stream, through one door at a time (``spillway_cli.stream_drivers``: the
WebSocket API and HTTP through the router, gRPC streams straight to the GPU service).

What is counted for each stream: every answer in the order it arrived (its seq, label,
backend, fallback and send-to-answer latency), errors by code, frames refused with
``slow_down`` (sent again), frames reported failed without an answer of their own (a
gRPC stream that ended under them) and frames never sent. Every label is checked against
ONNX Runtime run directly on the model file over the same frame. The GPU service's batch
sizes while a door's streams share it come from its statistics before and after.

``make demo``'s frame-stream step, ``bench.stream_bench`` and the tests all run
``run_door``.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from spillway_cli.console import Check, equal

MODEL = "digits"
DOORS = ("websocket", "grpc", "http")
DOOR_NAMES = {
    "websocket": "WebSocket API (router)",
    "grpc": "gRPC streams (GPU service)",
    "http": "HTTP POST per frame (router)",
}


@dataclass(frozen=True)
class Scenario:
    """How many streams, frames per stream and frames in flight per stream."""

    streams: int = 50
    frames: int = 20
    window: int = 8
    """At most the WebSocket API's bound on frames in flight (``WS_MAX_IN_FLIGHT``, 32)."""
    timeout_s: float = 600.0
    """How long a door's run may take before the frames still unanswered count as missing
    (generous: a loaded 2-core machine is slow, not failing)."""

    @property
    def total(self) -> int:
        return self.streams * self.frames


@dataclass(frozen=True)
class Frames:
    """The held-out digits images and the label ONNX Runtime gives each, computed once
    from the model file itself (not through any server)."""

    images: np.ndarray[Any, Any]
    labels: np.ndarray[Any, Any]

    @classmethod
    def load(cls, models: Path) -> Frames:
        images = np.load(models / MODEL / "samples" / "images.npy", allow_pickle=False)
        images = np.asarray(images, dtype=np.float32)
        session = ort.InferenceSession(
            str(models / MODEL / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
        )
        name = session.get_inputs()[0].name
        label = session.run(["label"], {name: images.reshape(len(images), -1)})[0]
        return cls(images, np.asarray(label).reshape(-1))

    def index(self, stream: int, seq: int, frames: int) -> int:
        """Which image is frame ``seq`` of ``stream``."""
        return (stream * frames + seq) % len(self.images)

    def image(self, stream: int, seq: int, frames: int) -> np.ndarray[Any, Any]:
        """The frame as the model's input: shape [1, 8, 8], FP32."""
        image: np.ndarray[Any, Any] = self.images[self.index(stream, seq, frames)][None]
        return image

    def expected(self, stream: int, seq: int, frames: int) -> int:
        return int(self.labels[self.index(stream, seq, frames)])

    def v2_inputs(self, stream: int, seq: int, frames: int) -> dict[str, Any]:
        """The frame as a V2 JSON request asking for the label only."""
        image = self.image(stream, seq, frames)
        return {
            "inputs": [
                {
                    "name": "image",
                    "shape": list(image.shape),
                    "datatype": "FP32",
                    "data": image.ravel().tolist(),
                }
            ],
            "outputs": [{"name": "label"}],
        }


@dataclass(frozen=True)
class Answer:
    """One frame's answer as the client saw it, in arrival order."""

    seq: int
    label: int
    backend: str
    fallback: str | None
    latency_s: float


@dataclass
class StreamLog:
    """One stream's traffic."""

    stream: int
    frames: int
    sent_at: dict[int, float] = field(default_factory=dict)
    """When each frame was first sent (a refused frame sent again keeps its first time)."""
    answers: list[Answer] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    """Frames answered with an error, by code."""
    refused: int = 0
    """``slow_down`` answers (the frame was sent again)."""
    failed_unanswered: int = 0
    """Frames sent that got no answer of their own: reported failed by the transport."""
    not_sent: int = 0
    """Frames never sent (the stream had ended)."""
    wrong: int = 0
    """Answers whose label differs from ONNX Runtime's on the same frame."""
    last_at: float = 0.0

    def answered(self, seq: int, label: int, backend: str, fallback: str | None, exp: int) -> None:
        now = time.monotonic()
        self.last_at = now
        self.wrong += label != exp
        self.answers.append(Answer(seq, label, backend, fallback, now - self.sent_at[seq]))

    def failed(self, code: str) -> None:
        self.last_at = time.monotonic()
        self.errors[code] += 1

    @property
    def done(self) -> int:
        """Frames settled: answered (a frame answered twice counts once: the stream still
        waits for every other frame), answered with an error, or reported failed."""
        answered = len({answer.seq for answer in self.answers})
        return answered + sum(self.errors.values()) + self.failed_unanswered

    def order(self) -> tuple[int, int, int]:
        """(out of order, missing, duplicated) of the answered seqs, in arrival order."""
        seen: set[int] = set()
        late = duplicated = 0
        highest = -1
        for answer in self.answers:
            if answer.seq in seen:
                duplicated += 1
                continue
            seen.add(answer.seq)
            late += answer.seq < highest
            highest = max(highest, answer.seq)
        return late, self.frames - len(seen), duplicated

    def per_s(self) -> float:
        """This stream's answered frames per second, first send to last answer."""
        if not self.answers or not self.sent_at:
            return 0.0
        return len(self.answers) / max(self.last_at - min(self.sent_at.values()), 1e-9)


@dataclass
class Progress:
    """Frames settled over every stream of a run; calls ``hook`` once when a share of
    them is (the kill-under-load step)."""

    target: int
    hook: Callable[[], None] | None = None
    settled: int = 0
    fired_at: int | None = None

    def settle(self) -> None:
        self.settled += 1
        if self.hook is not None and self.fired_at is None and self.settled >= self.target:
            self.fired_at = self.settled
            self.hook()


@dataclass
class DoorRun:
    """One door's run: its streams, how long it took, the GPU service's batches."""

    door: str
    scenario: Scenario
    streams: list[StreamLog]
    seconds: float
    batches: dict[int, int] = field(default_factory=dict)
    """Executions per batch size on the GPU service during the run (delta)."""
    inferences: int = 0
    executions: int = 0
    killed_after: int | None = None
    """Frames settled when the GPU service was killed (``None``: not killed)."""

    def summary(self) -> dict[str, Any]:
        """Every figure of the run, JSON-ready."""
        answers = [a for s in self.streams for a in s.answers]
        latencies = np.array([a.latency_s for a in answers]) * 1e3 if answers else np.zeros(1)
        order = [s.order() for s in self.streams]
        errors: Counter[str] = Counter()
        for stream in self.streams:
            errors.update(stream.errors)
        total = self.scenario.total
        return {
            "door": self.door,
            "streams": self.scenario.streams,
            "frames_per_stream": self.scenario.frames,
            "window": self.scenario.window,
            "frames": total,
            "answered": len(answers),
            "answered_ok": sum(len(s.answers) - s.wrong for s in self.streams),
            "wrong_labels": sum(s.wrong for s in self.streams),
            "errors": dict(sorted(errors.items())),
            "refused_slow_down": sum(s.refused for s in self.streams),
            "failed_unanswered": sum(s.failed_unanswered for s in self.streams),
            "not_sent": sum(s.not_sent for s in self.streams),
            "out_of_order": sum(o[0] for o in order),
            "missing": sum(o[1] for o in order),
            "duplicated": sum(o[2] for o in order),
            "order_kept": all(o == (0, 0, 0) for o in order),
            "seconds": round(self.seconds, 3),
            "frames_per_s_total": round(len(answers) / self.seconds, 1) if self.seconds else 0,
            "frames_per_s_per_stream_p50": round(
                float(np.median([s.per_s() for s in self.streams])), 2
            ),
            "latency_p50_ms": round(float(np.percentile(latencies, 50)), 1),
            "latency_p99_ms": round(float(np.percentile(latencies, 99)), 1),
            "backends": dict(sorted(Counter(a.backend for a in answers).items())),
            "fallbacks": sum(a.fallback is not None for a in answers),
            "gpu_batches": {str(k): v for k, v in sorted(self.batches.items())},
            "gpu_max_batch": max(self.batches, default=0),
            "gpu_inferences": self.inferences,
            "gpu_executions": self.executions,
            "gpu_mean_batch": round(self.inferences / self.executions, 2)
            if self.executions
            else 0.0,
            "killed_after": self.killed_after,
        }

    def checks(self, *, in_order: bool = True) -> list[Check]:
        """Every frame answered once, with ONNX Runtime's label, in seq order when the
        door orders its answers."""
        got = self.summary()
        name = DOOR_NAMES[self.door]
        made = [
            equal(
                f"{name}: frames answered with the right label", got["answered_ok"], got["frames"]
            ),
            equal(f"{name}: frames answered twice", got["duplicated"], 0),
        ]
        if in_order:
            made.append(equal(f"{name}: answers out of seq order", got["out_of_order"], 0))
        return made

    def line(self) -> str:
        """Two lines for a terminal: speed, then correctness and the GPU's batches."""
        got = self.summary()
        order = "yes" if got["out_of_order"] == got["duplicated"] == 0 else "no"
        if self.door == "http":
            order = f"n/a ({got['out_of_order']} answers overtook an earlier frame)"
        if got["missing"]:
            order += f"; {got['missing']} frames unanswered"
        return (
            f"{DOOR_NAMES[self.door]}: {got['frames_per_s_total']:.1f} frames/s "
            f"({got['frames_per_s_per_stream_p50']:.2f} a stream), p50 "
            f"{got['latency_p50_ms']:.0f} ms, p99 {got['latency_p99_ms']:.0f} ms\n"
            f"      {got['answered_ok']}/{got['frames']} answered with the right label, "
            f"in seq order: {order}; GPU batches: {batch_text(got)}"
        )


def batch_text(got: dict[str, Any]) -> str:
    """The GPU service's batches of a run summary: mean, largest, runs."""
    if not got["gpu_executions"]:
        return "none read"
    return (
        f"mean {got['gpu_mean_batch']}, largest {got['gpu_max_batch']}, "
        f"{got['gpu_executions']} runs"
    )


# -- the GPU service's batch statistics ----------------------------------------------------


def gpu_stats(gpu_url: str, model: str = MODEL) -> tuple[dict[int, int], int, int]:
    """(executions per batch size, inferences, executions) of ``model`` so far; zeros
    when the service does not answer (it was killed)."""
    try:
        url = f"{gpu_url}/v2/models/{model}/stats"
        with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310 - 127.0.0.1
            entries = json.loads(response.read())["model_stats"]
    except OSError:
        return {}, 0, 0
    batches: Counter[int] = Counter()
    inferences = executions = 0
    for entry in entries:  # every loaded version
        inferences += int(entry["inference_count"])
        executions += int(entry["execution_count"])
        for row in entry["batch_stats"]:
            batches[int(row["batch_size"])] += int(row["compute_infer"]["count"])
    return dict(batches), inferences, executions


def batch_delta(
    before: tuple[dict[int, int], int, int], after: tuple[dict[int, int], int, int]
) -> tuple[dict[int, int], int, int]:
    """What ran between two ``gpu_stats`` readings (a restarted service starts from 0)."""
    if after[2] < before[2]:
        return after
    sizes = {k: v - before[0].get(k, 0) for k, v in after[0].items()}
    return {k: v for k, v in sizes.items() if v > 0}, after[1] - before[1], after[2] - before[2]
