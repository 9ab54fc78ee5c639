"""The prepare and finish steps of the PP-OCR models: detection, orientation, recognition.

``ocr_detection`` takes one encoded image per request (``max_batch_size`` 0) and returns
its text lines: ``boxes`` ``[N, 4, 2]`` in the image's pixels, ``box_scores`` ``[N]``,
``crops`` ``[N, 1]``, each line cut out upright as a PNG, in reading order, and
``counts`` ``[1]`` (N: what a pipeline maps the models below over). N varies per image,
which is why a request holds one image: the N crops of one request are the rows of one
request to the two models below (a pipeline bounds N per page before they run:
``spillway.map.max_rows``). A request's length, what the batcher's length buckets go
by, is the detector input's longer side, so small pages queue and compute apart from big
ones.

``ocr_classification`` takes ``crops`` rows and returns ``angle`` (0 or 180),
``angle_score`` and ``crops`` again, those read as upside down (180 with a score over
0.9) turned: the turn happens in this step, as in RapidOCR's classifier, so that
recognition takes its ``crops`` as they come.

``ocr_recognition`` takes ``crops`` rows and returns ``text``, ``text_score`` (the mean
probability of the kept characters) and ``char_positions``: per row a JSON object
``{"timesteps": [...], "step_width": w}``, the CTC step of each character of ``text``
and the width of one step in the crop's pixels (character ``i`` lies near
``(timesteps[i] + 0.5) * step_width``), for word boundaries.

``ocr_lines`` takes a page's recognised rows (``text``, ``char_positions`` and the
upright ``crops``, ``max_batch_size`` 0) and returns ``lines`` ``[N, 1]``, each with the
spaces between words put back (``spillway.models.ocr_words``), ``page`` ``[1, 1]``, the
lines joined by newlines in reading order, and ``pages`` ``[1]`` (1: the count a
pipeline maps a text model over ``page`` with). Its graph is an identity over one number
per line: the work is this module's.

Pixels are resized with OpenCV as RapidOCR 1.4.4 does (its pipeline is the reference the
tests hold these steps to); images are decoded by ``spillway.models.images`` with its
limits. The finish steps need what the prepare step knew (the scaled image, the crops'
sizes): ``OnnxModel.run`` collates, runs and finishes on one thread, so the batch in
flight is kept thread-locally from ``collate`` to ``outputs``.
"""

from __future__ import annotations

import json
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt

from spillway.models import ocr_geometry as geometry
from spillway.models import ocr_words
from spillway.models.config import ImageSpec, ModelConfig
from spillway.models.images import open_image
from spillway.models.processing import (
    GraphTensor,
    Prepared,
    Request,
    Tensors,
    outcomes,
)
from spillway.protocol.errors import (
    InferenceError,
    InvalidImageError,
    InvalidInputError,
    ModelLoadError,
    SpillwayError,
)

CHARSET_FILE = "charset.txt"
"""Beside an ``ocr_recognition`` model: its characters, one a line (the ``character``
entry of the PP-OCR model's metadata), without the CTC blank and the trailing space."""
CLS_SHAPE = (48, 192)
CLS_THRESHOLD = 0.9
"""A crop read as upside down with a score over this is turned."""
REC_HEIGHT = 48
REC_MIN_WIDTH = 320
REC_MAX_WIDTH = 3840
"""The widest crop tensor (80 heights; RapidOCR's is unbounded)."""
_PNG = [cv2.IMWRITE_PNG_COMPRESSION, 1]
_DECODE = ImageSpec(input="image", size=(1, 1))
"""Only the decoding limits and colour of this spec apply (``max_pixels``,
``max_bytes``); sizes come from the OCR steps."""


@dataclass(frozen=True)
class OcrPrepared(Prepared):
    """A request's feeds and what its finish step needs."""

    context: tuple[Any, ...] = field(default=())


def decode_bgr(data: object, what: str) -> geometry.Image:
    """An encoded JPEG or PNG element as a BGR ``uint8`` array (``[H, W, 3]``)."""
    if not isinstance(data, bytes | bytearray):
        raise InvalidImageError(f"{what} must be the bytes of a JPEG or PNG file")
    rgb = np.asarray(open_image(bytes(data), _DECODE, what), dtype=np.uint8)
    return np.ascontiguousarray(rgb[:, :, ::-1])


def encode_png(image: geometry.Image) -> bytes:
    """A BGR image as PNG bytes (fast compression: crops are small and short-lived)."""
    ok, buffer = cv2.imencode(".png", np.ascontiguousarray(image), _PNG)
    if not ok:
        raise InferenceError("a crop could not be encoded")
    return bytes(buffer.tobytes())


def _normalised(image: geometry.Image, width: int, height: int) -> npt.NDArray[np.float32]:
    resized = cv2.resize(image, (width, height)).astype(np.float32)
    chw: npt.NDArray[np.float32] = (resized.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    return chw


def _column(values: Sequence[object], datatype: type) -> npt.NDArray[Any]:
    out: npt.NDArray[Any] = np.empty((len(values), 1), dtype=datatype)
    for row, value in enumerate(values):
        out[row, 0] = value
    return out


class _OcrProcessor(ABC):
    """Prepares requests alone (decoding is heavy: off the event loop) and keeps the
    batch of the run in flight for its finish step."""

    batched_prepare = True
    served_outputs: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig, graph_inputs: list[GraphTensor]) -> None:
        kind = config.spillway.kind
        if len(config.input) != 1 or config.input[0].datatype != "BYTES":
            raise ModelLoadError(f"{kind} models take one BYTES input")
        if len(graph_inputs) != 1:
            raise ModelLoadError("a PP-OCR graph has exactly one input")
        outputs = sorted(o.name for o in config.output)
        if outputs != sorted(self.served_outputs):
            raise ModelLoadError(f"{kind} models serve {sorted(self.served_outputs)}")
        self._served = config.input[0].name
        self._graph = graph_inputs[0].name
        self._in_flight = threading.local()

    @abstractmethod
    def prepare(self, inputs: Tensors, rows: int) -> OcrPrepared:
        """Graph feeds and finish context for one validated request."""

    @abstractmethod
    def _finish(self, graph_outputs: Tensors, batch: list[OcrPrepared]) -> Tensors:
        """Served outputs of one run over ``batch``."""

    def prepare_many(self, requests: Sequence[Request]) -> list[Prepared | SpillwayError]:
        return outcomes(lambda request: self.prepare(*request), requests)

    def _elements(self, inputs: Tensors, rows: int) -> list[tuple[object, str]]:
        column = inputs[self._served].reshape(rows, -1)[:, 0]
        return [(e, f"image {row} of input {self._served!r}") for row, e in enumerate(column)]

    def _feeds(self, batch: list[OcrPrepared]) -> Tensors:
        if len(batch) == 1:
            return batch[0].feeds
        return {self._graph: np.concatenate([p.feeds[self._graph] for p in batch])}

    def collate(self, prepared: list[Prepared]) -> Tensors:
        batch = [p for p in prepared if isinstance(p, OcrPrepared)]
        if len(batch) != len(prepared):
            raise InferenceError("an OCR model was given requests it did not prepare")
        self._in_flight.batch = batch
        return self._feeds(batch)

    def outputs(self, graph_outputs: Tensors) -> Tensors:
        batch: list[OcrPrepared] | None = self._in_flight.__dict__.pop("batch", None)
        if batch is None:
            raise InferenceError("OCR outputs without a collated batch on this thread")
        return self._finish(graph_outputs, batch)

    def element_limit(self, name: str) -> int | None:
        """Every PP-OCR input is an encoded image (a page or a crop), bounded by the
        decoding limits' ``max_bytes``."""
        return _DECODE.max_bytes

    def sample_bytes(self, name: str, length: int) -> bytes:
        """A white strip ``length`` pixels wide with a dark bar: a crop of that width."""
        image = np.full((REC_HEIGHT, max(8, length), 3), 255, dtype=np.uint8)
        image[16:32, 4:-4] = 0
        return encode_png(image)


class DetectionProcessor(_OcrProcessor):
    """``ocr_detection``: one image per request in; boxes, scores and crops out."""

    served_outputs = ("boxes", "box_scores", "crops", "counts")

    def __init__(self, config: ModelConfig, graph_inputs: list[GraphTensor]) -> None:
        super().__init__(config, graph_inputs)
        if config.max_batch_size != 0:
            raise ModelLoadError("an ocr_detection model takes one image a request: batch 0")

    def sample_bytes(self, name: str, length: int) -> bytes:
        """A small white page with a dark line: it scales to the detector's smallest
        input (736 × 736), where a crop-sized strip would scale to 4096 pixels high."""
        image = np.full((64, 64, 3), 255, dtype=np.uint8)
        image[28:36, 8:-8] = 0
        return encode_png(image)

    def prepare(self, inputs: Tensors, rows: int) -> OcrPrepared:
        ((element, what),) = self._elements(inputs, 1)
        det = geometry.det_input(decode_bgr(element, what))
        if det is None:  # scales to nothing: no text; the graph still runs on a blank
            blank = np.zeros((1, 3, 32, 32), dtype=np.float32)
            return OcrPrepared({self._graph: blank}, 1, 0, (None,))
        # Its length is the detector input's longer side: with length buckets, a small
        # page neither queues nor computes behind a big one (a 2000-pixel page's run is
        # ten times a 736-pixel one's).
        side = int(max(det.tensor.shape[2:]))
        return OcrPrepared({self._graph: det.tensor}, 1, side, (det,))

    def _finish(self, graph_outputs: Tensors, batch: list[OcrPrepared]) -> Tensors:
        (prepared,) = batch
        det: geometry.DetInput | None = prepared.context[0]
        (probabilities,) = graph_outputs.values()
        if det is None:
            return _detections(np.zeros((0, 4, 2), np.float32), [], [])
        height, width = det.image.shape[:2]
        boxes, scores = geometry.db_boxes(probabilities[0, 0], height, width)
        order = geometry.reading_order(boxes, geometry.kept_boxes(boxes, height, width))
        crops = [encode_png(geometry.crop(det.image, boxes[i])) for i in order]
        return _detections(
            geometry.to_original(boxes[order], det), [scores[i] for i in order], crops
        )


def _detections(boxes: geometry.Boxes, scores: list[float], crops: list[bytes]) -> Tensors:
    return {
        "boxes": boxes.reshape(-1, 4, 2).astype(np.float32),
        "box_scores": np.asarray(scores, dtype=np.float32).reshape(-1),
        "crops": _column(crops, np.object_),
        "counts": np.array([len(crops)], dtype=np.int32),
    }


class ClassificationProcessor(_OcrProcessor):
    """``ocr_classification``: crops in; their orientation out, and the crops turned
    where they read upside down."""

    served_outputs = ("angle", "angle_score", "crops")

    def prepare(self, inputs: Tensors, rows: int) -> OcrPrepared:
        height, width = CLS_SHAPE
        tensor = np.zeros((rows, 3, height, width), dtype=np.float32)
        crops = []
        for row, (element, what) in enumerate(self._elements(inputs, rows)):
            image = decode_bgr(element, what)
            own = min(width, math.ceil(height * image.shape[1] / float(image.shape[0])))
            tensor[row, :, :, :own] = _normalised(image, own, height)
            crops.append((element, image))
        return OcrPrepared({self._graph: tensor}, rows, 0, tuple(crops))

    def _finish(self, graph_outputs: Tensors, batch: list[OcrPrepared]) -> Tensors:
        (probabilities,) = graph_outputs.values()
        labels = probabilities.argmax(axis=1)
        scores = probabilities.max(axis=1).astype(np.float32)
        crops = [crop for prepared in batch for crop in prepared.context]
        turned = [
            encode_png(cv2.rotate(image, cv2.ROTATE_180))
            if label == 1 and score > CLS_THRESHOLD
            else bytes(element)
            for (element, image), label, score in zip(crops, labels, scores, strict=True)
        ]
        return {
            "angle": (labels.astype(np.int32) * 180).reshape(-1, 1),
            "angle_score": scores.reshape(-1, 1),
            "crops": _column(turned, np.object_),
        }


def read_charset(version_dir: Path) -> list[str]:
    """The CTC classes of a recognition model: blank, its characters, then space."""
    path = version_dir / CHARSET_FILE
    if not path.is_file():
        raise ModelLoadError(f"ocr_recognition models need {CHARSET_FILE} beside the model")
    return ["", *path.read_text(encoding="utf-8").splitlines(), " "]


class RecognitionProcessor(_OcrProcessor):
    """``ocr_recognition``: crops in; text, score and character positions out.

    A crop is resized to height 48 with its aspect ratio kept; the request's rows are
    padded on the right to ``max(320, 48 * widest ratio)`` (at most 3840), its length,
    and a run over several requests pads to the widest."""

    served_outputs = ("text", "text_score", "char_positions")

    def __init__(
        self, config: ModelConfig, version_dir: Path, graph_inputs: list[GraphTensor]
    ) -> None:
        super().__init__(config, graph_inputs)
        self._charset = read_charset(version_dir)

    def prepare(self, inputs: Tensors, rows: int) -> OcrPrepared:
        images = [decode_bgr(element, what) for element, what in self._elements(inputs, rows)]
        ratios = [image.shape[1] / float(image.shape[0]) for image in images]
        width = min(REC_MAX_WIDTH, int(REC_HEIGHT * max(REC_MIN_WIDTH / REC_HEIGHT, *ratios)))
        tensor = np.zeros((rows, 3, REC_HEIGHT, width), dtype=np.float32)
        sizes = []
        for row, (image, ratio) in enumerate(zip(images, ratios, strict=True)):
            own = max(1, min(width, math.ceil(REC_HEIGHT * ratio)))
            tensor[row, :, :, :own] = _normalised(image, own, REC_HEIGHT)
            sizes.append((image.shape[1], own))
        return OcrPrepared({self._graph: tensor}, rows, width, tuple(sizes))

    def _feeds(self, batch: list[OcrPrepared]) -> Tensors:
        widest = max(p.length for p in batch)
        if all(p.length == widest for p in batch):
            return super()._feeds(batch)
        padded = [
            np.pad(p.feeds[self._graph], [(0, 0), (0, 0), (0, 0), (0, widest - p.length)])
            for p in batch
        ]
        return {self._graph: np.concatenate(padded)}

    def _finish(self, graph_outputs: Tensors, batch: list[OcrPrepared]) -> Tensors:
        (probabilities,) = graph_outputs.values()
        steps = probabilities.shape[1]
        width = max(p.length for p in batch)
        sizes = [size for prepared in batch for size in prepared.context]
        best, confidence = probabilities.argmax(axis=2), probabilities.max(axis=2)
        texts, scores, positions = [], [], []
        for row, (crop_width, own) in enumerate(sizes):
            keep = best[row] != 0
            keep[1:] &= best[row][1:] != best[row][:-1]
            kept = np.flatnonzero(keep)
            texts.append("".join(self._charset[i] for i in best[row][kept]).encode("utf-8"))
            scores.append(float(confidence[row][kept].mean()) if kept.size else 0.0)
            step_width = width / steps * crop_width / own
            positions.append(
                json.dumps({"timesteps": kept.tolist(), "step_width": step_width}).encode()
            )
        return {
            "text": _column(texts, np.object_),
            "text_score": np.asarray(scores, dtype=np.float32).reshape(-1, 1),
            "char_positions": _column(positions, np.object_),
        }


class LinesProcessor(_OcrProcessor):
    """``ocr_lines``: a page's recognised rows in; its lines with word spaces and the
    page's text out."""

    served_outputs = ("lines", "page", "pages")
    served_inputs = ("char_positions", "crops", "text")

    def __init__(self, config: ModelConfig, graph_inputs: list[GraphTensor]) -> None:
        kind = config.spillway.kind
        inputs = sorted((t.name, t.datatype) for t in config.input)
        if inputs != [(name, "BYTES") for name in self.served_inputs]:
            raise ModelLoadError(f"{kind} models take BYTES {list(self.served_inputs)}")
        if config.max_batch_size != 0:
            raise ModelLoadError(f"{kind} models take one page's rows a request: batch 0")
        if sorted(o.name for o in config.output) != sorted(self.served_outputs):
            raise ModelLoadError(f"{kind} models serve {sorted(self.served_outputs)}")
        if len(graph_inputs) != 1:
            raise ModelLoadError(f"an {kind} graph has exactly one input")
        self._graph = graph_inputs[0].name
        self._in_flight = threading.local()

    def prepare(self, inputs: Tensors, rows: int) -> OcrPrepared:
        columns = [inputs[name].reshape(-1) for name in ("text", "char_positions", "crops")]
        if len({len(c) for c in columns}) != 1:
            raise InvalidInputError("text, char_positions and crops need one row each per line")
        lines = []
        for row, (text, where, crop) in enumerate(zip(*columns, strict=True)):
            what = f"row {row}"
            if not isinstance(text, bytes | bytearray) or not isinstance(where, bytes | bytearray):
                raise InvalidInputError(f"{what}: text and char_positions are bytes")
            decoded = bytes(text).decode("utf-8", errors="replace")
            centres = ocr_words.positions(bytes(where), decoded)
            lines.append(ocr_words.spaced(decoded, centres, decode_bgr(crop, f"crop of {what}")))
        feeds = {self._graph: np.zeros(len(lines), dtype=np.float32)}
        return OcrPrepared(feeds, 1, 0, tuple(lines))

    def _finish(self, graph_outputs: Tensors, batch: list[OcrPrepared]) -> Tensors:
        lines = [line for prepared in batch for line in prepared.context]
        return {
            "lines": _column([line.encode() for line in lines], np.object_),
            "page": np.array([["\n".join(lines).encode()]], dtype=np.object_),
            "pages": np.array([1], dtype=np.int32),
        }

    def sample_bytes(self, name: str, length: int) -> bytes:
        """A crop, or the text and positions of one character in it."""
        if name == "text":
            return b"a"
        if name == "char_positions":
            return json.dumps({"timesteps": [1], "step_width": 8.0}).encode()
        return super().sample_bytes(name, length)


def ocr_processor(
    config: ModelConfig, version_dir: Path, graph_inputs: list[GraphTensor]
) -> _OcrProcessor:
    """The processor of an ``ocr_*`` kind."""
    kind = config.spillway.kind
    if kind == "ocr_detection":
        return DetectionProcessor(config, graph_inputs)
    if kind == "ocr_classification":
        return ClassificationProcessor(config, graph_inputs)
    if kind == "ocr_recognition":
        return RecognitionProcessor(config, version_dir, graph_inputs)
    if kind == "ocr_lines":
        return LinesProcessor(config, graph_inputs)
    raise ModelLoadError(f"no OCR processor for kind {kind!r}")
