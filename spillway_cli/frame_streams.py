"""The frame-stream scenario: S concurrent streams of F frames each, W frames in flight
per stream, through one door at a time (``spillway_cli.stream_drivers``: the WebSocket
API and HTTP through the router, gRPC streams straight to the GPU service). A frame set
is digits images (``Frames``) or rendered text pages for the OCR detector (``OcrPages``,
where the repository has it).

What is counted for each stream: every answer in the order it arrived (its seq, whether
it was right, backend, fallback and send-to-answer latency), errors by code, frames
refused with ``slow_down`` (sent again), frames reported failed without an answer of
their own (a gRPC stream that ended under them) and frames never sent. A digits label is
checked against ONNX Runtime run directly on the model file over the same frame; an OCR
page's boxes against its line count and the detector's own code run in this process.
The GPU service's batch sizes while a door's streams share it come from its statistics
before and after.

``make demo``'s frame-stream step, ``bench.stream_bench`` and the tests all run
``run_door``.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

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


class FrameSet(Protocol):
    """The frames of one model, and how to tell a right answer from a wrong one."""

    @property
    def model(self) -> str:
        """The model every frame is for."""
        ...

    @property
    def what(self) -> str:
        """What a frame is, for a terminal: ``digits frames``, ``OCR pages``."""
        ...

    @property
    def outputs(self) -> tuple[str, ...]:
        """The outputs each frame asks for (as JSON where the door lets it choose)."""
        ...

    @property
    def parameters(self) -> dict[str, Any]:
        """Request parameters each frame sent to the router carries (its routing hints)."""
        ...

    def tensors(self, stream: int, seq: int, frames: int) -> dict[str, np.ndarray[Any, Any]]:
        """Frame ``seq`` of ``stream``: its inputs by name."""
        ...

    def right(
        self, stream: int, seq: int, frames: int, got: Mapping[str, np.ndarray[Any, Any]]
    ) -> bool:
        """Whether ``got`` (the answer's outputs by name) is that frame's right answer."""
        ...


def _pick(stream: int, seq: int, frames: int, count: int) -> int:
    """Which of ``count`` items is frame ``seq`` of ``stream``."""
    return (stream * frames + seq) % count


@dataclass(frozen=True)
class Frames:
    """The held-out digits images and the label ONNX Runtime gives each, computed once
    from the model file itself (not through any server)."""

    images: np.ndarray[Any, Any]
    labels: np.ndarray[Any, Any]
    model: str = MODEL
    what: str = "digits frames"
    outputs: tuple[str, ...] = ("label",)
    parameters: dict[str, Any] = field(default_factory=dict)

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
        return _pick(stream, seq, frames, len(self.images))

    def image(self, stream: int, seq: int, frames: int) -> np.ndarray[Any, Any]:
        """The frame as the model's input: shape [1, 8, 8], FP32."""
        image: np.ndarray[Any, Any] = self.images[self.index(stream, seq, frames)][None]
        return image

    def expected(self, stream: int, seq: int, frames: int) -> int:
        return int(self.labels[self.index(stream, seq, frames)])

    def tensors(self, stream: int, seq: int, frames: int) -> dict[str, np.ndarray[Any, Any]]:
        return {"image": self.image(stream, seq, frames)}

    def right(
        self, stream: int, seq: int, frames: int, got: Mapping[str, np.ndarray[Any, Any]]
    ) -> bool:
        label = got.get("label")
        return (
            label is not None
            and label.size == 1
            and int(label.ravel()[0]) == self.expected(stream, seq, frames)
        )


OCR_MODEL = "ocr-det"
OCR_TEXT = (
    "frame 12 of the loading dock camera",
    "two pallets left at gate B after 18:40",
    "shipment 7731 scanned twice at the door",
    "the north lane is closed for repairs",
    "driver badge expires on 30 June 2027",
    "keep the fire exit clear at all times",
    "forklift 3 is due for its service today",
)
OCR_BUDGET_MS = 20_000
"""The latency budget a page asks of the router: a page is 0.3-0.7 s of a CPU core, so
pages queued behind one another pass the router's default deadline (5 s) on a 2-core
machine long before they would on a GPU."""
OCR_PAGES = 8
"""Distinct pages, of 1 to 4 lines each."""
BOX_TOLERANCE_PX = 2.0
"""How far a box corner may lie from the reference's: the same model run by another
execution provider (a GPU's) may move an edge by a pixel."""


@dataclass(frozen=True)
class OcrPages:
    """Rendered pages of 1 to 4 text lines for the OCR detector (``ocr-det``: a PNG in;
    boxes, scores and their count out). A right answer finds as many boxes as the page
    has lines, each within ``BOX_TOLERANCE_PX`` of the boxes the detector's own code (the
    CPU fallback's, run in this process on the model file) finds on the same page.

    A page's PNG is 5-17 KB: base64 in a WebSocket text frame (23 KB at most) it fits one
    of API Gateway's 32 KiB frames, far below its 128 KiB message limit."""

    pages: tuple[bytes, ...]
    lines: tuple[int, ...]
    boxes: tuple[np.ndarray[Any, Any], ...]
    model: str = OCR_MODEL
    what: str = "OCR pages"
    outputs: tuple[str, ...] = ("boxes", "box_scores", "counts")
    parameters: dict[str, Any] = field(default_factory=lambda: {"latency_budget_ms": OCR_BUDGET_MS})

    @classmethod
    def load(cls, models: Path) -> OcrPages | None:
        """The pages and their reference boxes; ``None`` when the repository has no
        OCR detector (``make models`` builds it)."""
        if not (models / OCR_MODEL / "1" / "model.onnx").is_file():
            return None
        from spillway.fallback.service import CpuService
        from spillway.fallback.settings import CpuSettings
        from spillway.protocol.codec import decode_response, encode_request
        from spillway_cli.modelbuild.ocr import render_lines

        detector = CpuService.load(CpuSettings(repository=str(models), models=[OCR_MODEL]))
        pages, lines, boxes = [], [], []
        for page in range(OCR_PAGES):
            text = [OCR_TEXT[(page + k) % len(OCR_TEXT)] for k in range(page % 4 + 1)]
            png = render_lines(text, size=24, min_side=320)
            body, length = encode_request(
                {"image": np.array([png], dtype=np.object_)}, binary=True, outputs=["boxes"]
            )
            answer = detector.infer(OCR_MODEL, None, body, length)
            found = decode_response(answer.body, answer.header_length)[1]["boxes"]
            pages.append(png)
            lines.append(len(text))
            boxes.append(np.asarray(found, dtype=np.float64))
        return cls(tuple(pages), tuple(lines), tuple(boxes))

    def tensors(self, stream: int, seq: int, frames: int) -> dict[str, np.ndarray[Any, Any]]:
        page = self.pages[_pick(stream, seq, frames, len(self.pages))]
        return {"image": np.array([page], dtype=np.object_)}

    def right(
        self, stream: int, seq: int, frames: int, got: Mapping[str, np.ndarray[Any, Any]]
    ) -> bool:
        page = _pick(stream, seq, frames, len(self.pages))
        counts, boxes = got.get("counts"), got.get("boxes")
        if counts is None or boxes is None or counts.size != 1:
            return False
        want = self.boxes[page]
        return (
            int(counts.ravel()[0]) == self.lines[page] == len(want)
            and boxes.shape == want.shape
            and bool(np.allclose(boxes, want, atol=BOX_TOLERANCE_PX))
        )


def frame_sets(models: Path) -> list[FrameSet]:
    """The digits frames, and the OCR pages where the repository has the detector."""
    sets: list[FrameSet] = [Frames.load(models)]
    ocr = OcrPages.load(models)
    if ocr is not None:
        sets.append(ocr)
    return sets


def json_outputs(outputs: object) -> dict[str, np.ndarray[Any, Any]]:
    """A V2 JSON answer's ``outputs`` as arrays by name (an output that is not a plain
    JSON tensor is left out, so the answer counts as wrong)."""
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for output in outputs if isinstance(outputs, list) else []:
        try:
            arrays[str(output["name"])] = np.asarray(output["data"]).reshape(output["shape"])
        except (KeyError, TypeError, ValueError):
            continue
    return arrays


@dataclass(frozen=True)
class Answer:
    """One frame's answer as the client saw it, in arrival order."""

    seq: int
    right: bool
    """Whether it was the frame's right answer (``FrameSet.right``)."""
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
    """Answers that are not their frame's right answer (for digits: a label other than
    ONNX Runtime's on the same frame)."""
    notices: int = 0
    """Frames without ``id`` from the WebSocket API itself (``Endpoint request timed
    out``, ``Internal server error``): not answers; the frame's own answer still comes."""
    last_at: float = 0.0

    def answered(self, seq: int, right: bool, backend: str, fallback: str | None) -> None:
        now = time.monotonic()
        self.last_at = now
        self.wrong += not right
        self.answers.append(Answer(seq, right, backend, fallback, now - self.sent_at[seq]))

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
    model: str = MODEL
    what: str = "digits frames"
    """The frame set's ``what``."""

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
            "model": self.model,
            "streams": self.scenario.streams,
            "frames_per_stream": self.scenario.frames,
            "window": self.scenario.window,
            "frames": total,
            "answered": len(answers),
            "answered_ok": sum(len(s.answers) - s.wrong for s in self.streams),
            "wrong_answers": sum(s.wrong for s in self.streams),
            "errors": dict(sorted(errors.items())),
            "refused_slow_down": sum(s.refused for s in self.streams),
            "failed_unanswered": sum(s.failed_unanswered for s in self.streams),
            "not_sent": sum(s.not_sent for s in self.streams),
            "gateway_notices": sum(s.notices for s in self.streams),
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
        """Every frame answered once, rightly (``FrameSet.right``), in seq order when the
        door orders its answers."""
        got = self.summary()
        name = f"{DOOR_NAMES[self.door]}, {self.what}"
        made = [
            equal(f"{name}: answered right", got["answered_ok"], got["frames"]),
            equal(f"{name}: answered twice", got["duplicated"], 0),
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
        failed = sum(got["errors"].values())
        if got["missing"] > failed:
            order += f"; {got['missing'] - failed} frames unanswered"
        if failed:
            order += "; answered with an error: " + ", ".join(
                f"{code} x{count}" for code, count in got["errors"].items()
            )
        if got["gateway_notices"]:
            order += f"; {got['gateway_notices']} frames without id from the API (timeouts)"
        return (
            f"{DOOR_NAMES[self.door]}, {self.what}: {got['frames_per_s_total']:.1f} frames/s "
            f"({got['frames_per_s_per_stream_p50']:.2f} a stream), p50 "
            f"{got['latency_p50_ms']:.0f} ms, p99 {got['latency_p99_ms']:.0f} ms\n"
            f"      {got['answered_ok']}/{got['frames']} answered right, "
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
