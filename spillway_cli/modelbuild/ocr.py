"""``ocr-det``, ``ocr-cls`` and ``ocr-rec``: PP-OCR text detection, orientation and
recognition, the ONNX files of the pinned RapidOCR wheel.

``rapidocr_onnxruntime`` 1.4.4 (Apache-2.0) is installed at setup with ``--no-deps`` and
its wheel's hash pinned (``requirements/weights.txt``); the build reads its model files
without importing the package, checks each file's sha256 against the digests below and
copies it unchanged. The recogniser's character set comes from its metadata
(``character``) into ``charset.txt`` beside it. Nothing is downloaded.

Each model is then loaded through the serving engine and checked on a rendered line:
the detector finds it, the classifier reads it upright and turned, the recogniser reads
its text.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from spillway.models.config import DynamicBatching, ModelConfig, SpillwayBlock, TensorConfig
from spillway.models.engine import EngineOptions, OnnxModel
from spillway.models.ocr import CHARSET_FILE
from spillway_cli.modelbuild.common import (
    ONNX_FILE,
    VERSION,
    BuildReport,
    atomic_write_bytes,
    atomic_write_text,
    log_report,
    make_report,
    sha256_file,
    staged_model_dir,
    write_checksums,
    write_config,
)

logger = logging.getLogger(__name__)

PACKAGE = "rapidocr_onnxruntime"
DISTRIBUTION = "rapidocr-onnxruntime"
PACKAGE_VERSION = "1.4.4"
BATCH = 64
CHECK_TEXT = "Spillway reads 42 lines"


@dataclass(frozen=True)
class OcrModel:
    """One PP-OCR model of the wheel and how it is served."""

    name: str
    source: str
    sha256: str
    config: ModelConfig


def _bytes(name: str) -> TensorConfig:
    return TensorConfig(name=name, data_type="TYPE_STRING", dims=(1,))


def _spillway(kind: str, description: str, buckets: tuple[int, ...] = ()) -> SpillwayBlock:
    return SpillwayBlock.model_validate(
        {"kind": kind, "description": description, "length_buckets": buckets}
    )


DET_BUCKETS = (1024,)
"""Detector input sides (its ``Prepared.length``) that pages queue and compute apart by:
a page up to 1024 pixels a side (a photo, a receipt, a 720-pixel scan: 736 at the
detector) never waits behind a big page's ten-times-longer run (an A4 scan, or a
2000 x 2000 page of tiny marks), and the big pages' compute threads run at a lower OS
priority."""


DET = OcrModel(
    name="ocr-det",
    source="ch_PP-OCRv4_det_infer.onnx",
    sha256="d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
    config=ModelConfig(
        name="ocr-det",
        max_batch_size=0,
        input=(_bytes("image"),),
        output=(
            TensorConfig(name="boxes", data_type="TYPE_FP32", dims=(-1, 4, 2)),
            TensorConfig(name="box_scores", data_type="TYPE_FP32", dims=(-1,)),
            TensorConfig(name="crops", data_type="TYPE_STRING", dims=(-1, 1)),
            TensorConfig(name="counts", data_type="TYPE_INT32", dims=(1,)),
        ),
        spillway=_spillway(
            "ocr_detection",
            "PP-OCRv4 text detection (DB): one JPEG/PNG in; text line boxes, scores, "
            "PNG crops in reading order and their count out",
            DET_BUCKETS,
        ),
    ),
)
CLS = OcrModel(
    name="ocr-cls",
    source="ch_ppocr_mobile_v2.0_cls_infer.onnx",
    sha256="e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
    config=ModelConfig(
        name="ocr-cls",
        max_batch_size=BATCH,
        input=(_bytes("crops"),),
        output=(
            TensorConfig(name="angle", data_type="TYPE_INT32", dims=(1,)),
            TensorConfig(name="angle_score", data_type="TYPE_FP32", dims=(1,)),
            _bytes("crops"),
        ),
        dynamic_batching=DynamicBatching(),
        spillway=_spillway(
            "ocr_classification",
            "PP-OCR text line orientation (0 or 180): crops in; angle, score and the "
            "crops turned upright out",
        ),
    ),
)
REC = OcrModel(
    name="ocr-rec",
    source="ch_PP-OCRv4_rec_infer.onnx",
    sha256="48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
    config=ModelConfig(
        name="ocr-rec",
        max_batch_size=BATCH,
        input=(_bytes("crops"),),
        output=(
            _bytes("text"),
            TensorConfig(name="text_score", data_type="TYPE_FP32", dims=(1,)),
            _bytes("char_positions"),
        ),
        dynamic_batching=DynamicBatching(),
        spillway=_spillway(
            "ocr_recognition",
            "PP-OCRv4 text recognition (CTC, Chinese and English): crops in; text, "
            "score and character positions out",
            (320, 640, 960, 1280, 1920, 2560),
        ),
    ),
)


def package_models_dir() -> Path:
    """The installed wheel's ``models`` folder, found without importing the package
    (whose imports need OpenCV's GUI build)."""
    version = importlib.metadata.version(DISTRIBUTION)
    if version != PACKAGE_VERSION:
        raise RuntimeError(f"{DISTRIBUTION} {version} is installed; the build needs 1.4.4")
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{PACKAGE} is not installed (make setup installs it)")
    return Path(spec.origin).parent / "models"


def source_file(model: OcrModel) -> Path:
    """The model's ONNX file in the wheel, its sha256 checked."""
    path = package_models_dir() / model.source
    digest = sha256_file(path)
    if digest != model.sha256:
        raise RuntimeError(f"{model.name}: {path.name} has sha256 {digest}, not {model.sha256}")
    return path


def charset(onnx_path: Path) -> str:
    """The recogniser's characters, one a line, from the model's metadata."""
    import onnx

    metadata = {p.key: p.value for p in onnx.load(str(onnx_path)).metadata_props}
    if "character" not in metadata:
        raise RuntimeError(f"{onnx_path.name} has no character metadata")
    return str(metadata["character"])


def render_lines(
    lines: Sequence[str], size: int = 32, angle: float = 0.0, pad: int = 24, min_side: int = 0
) -> bytes:
    """``lines`` in Pillow's built-in font, black on white, one under the other, as PNG
    bytes: ``angle`` degrees counter-clockwise, on at least ``min_side`` pixels a side
    (the detector scales a page's shorter side up to 736, so a page costs less than a
    strip)."""
    font = ImageFont.load_default(size=size)
    boxes = [font.getbbox(line) for line in lines]
    step = round(size * 1.8)
    width = int(max(max(right - left for left, _, right, _ in boxes) + 2 * pad, min_side))
    tallest = max(bottom - top for _, top, _, bottom in boxes)
    height = int(max(step * (len(lines) - 1) + tallest + 2 * pad, min_side))
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    for row, (line, (left, top, _, _)) in enumerate(zip(lines, boxes, strict=True)):
        draw.text((pad - left, pad - top + row * step), line, fill="black", font=font)
    if angle:
        image = image.rotate(
            angle, expand=True, fillcolor="white", resample=Image.Resampling.BICUBIC
        )
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _crops(*elements: bytes) -> np.ndarray:
    return np.array([[e] for e in elements], dtype=np.object_)


def _check_det(model: OnnxModel) -> dict[str, float]:
    out = model.infer(
        {"image": np.array([render_lines([CHECK_TEXT], min_side=480)], dtype=np.object_)}
    )
    if out["boxes"].shape != (1, 4, 2) or out["counts"].tolist() != [1]:
        raise RuntimeError(f"ocr-det: {len(out['boxes'])} boxes on one rendered line")
    return {"box_score": float(out["box_scores"][0])}


def _check_cls(model: OnnxModel) -> dict[str, float]:
    line = render_lines([CHECK_TEXT], pad=4)
    out = model.infer({"crops": _crops(line, render_lines([CHECK_TEXT], pad=4, angle=180))})
    if out["angle"].reshape(-1).tolist() != [0, 180]:
        raise RuntimeError(f"ocr-cls: angles {out['angle'].reshape(-1).tolist()}, not [0, 180]")
    return {"angle_score": float(out["angle_score"].min())}


def _check_rec(model: OnnxModel) -> dict[str, float]:
    out = model.infer({"crops": _crops(render_lines([CHECK_TEXT], pad=4))})
    text = out["text"][0, 0].decode()
    if text != CHECK_TEXT:
        raise RuntimeError(f"ocr-rec: read {text!r}, not {CHECK_TEXT!r}")
    return {"text_score": float(out["text_score"][0, 0])}


def _build(
    out: Path, model: OcrModel, check: Callable[[OnnxModel], dict[str, float]]
) -> BuildReport:
    started = time.monotonic()
    source = source_file(model)
    with staged_model_dir(out, model.name) as model_dir:
        version_dir = model_dir / VERSION
        atomic_write_bytes(version_dir / ONNX_FILE, source.read_bytes())
        if model is REC:
            atomic_write_text(version_dir / CHARSET_FILE, charset(source))
        write_checksums(version_dir)
        write_config(model_dir, model.config)
        served = OnnxModel(model.name, int(VERSION), model.config, version_dir, EngineOptions())
        metrics = check(served)
        report = make_report(model.name, version_dir, metrics, started)
    log_report(report)
    return report


def build_ocr_det(out: Path) -> BuildReport:
    """Copy, check and write ``out/ocr-det``; raises RuntimeError on a failed check."""
    return _build(out, DET, _check_det)


def build_ocr_cls(out: Path) -> BuildReport:
    """Copy, check and write ``out/ocr-cls``; raises RuntimeError on a failed check."""
    return _build(out, CLS, _check_cls)


def build_ocr_rec(out: Path) -> BuildReport:
    """Copy, check and write ``out/ocr-rec``; raises RuntimeError on a failed check."""
    return _build(out, REC, _check_rec)
