"""The processor of a model, by its kind: one place that knows every kind.

``processing`` holds the processors of plain tensors, images and text; ``ocr`` those of the
PP-OCR models, which build on ``processing`` (and import OpenCV, so they load only when an
OCR model does).
"""

from __future__ import annotations

from pathlib import Path

from spillway.models.config import ModelConfig
from spillway.models.processing import (
    GraphTensor,
    ImageClassifierProcessor,
    ImageProcessor,
    Processor,
    TensorProcessor,
    TextEmbeddingProcessor,
)

OCR_KINDS = ("ocr_detection", "ocr_classification", "ocr_recognition", "ocr_lines")


def make_processor(
    config: ModelConfig, version_dir: Path, graph_inputs: list[GraphTensor]
) -> Processor:
    """The processor for a model's kind."""
    kind = config.spillway.kind
    if kind == "image_classifier":
        return ImageClassifierProcessor(config, graph_inputs)
    if kind == "text_embedding":
        return TextEmbeddingProcessor(config, version_dir)
    if kind == "image":
        return ImageProcessor(config, graph_inputs)
    if kind in OCR_KINDS:
        from spillway.models.ocr import ocr_processor  # OpenCV only when an OCR model loads

        return ocr_processor(config, version_dir, graph_inputs)
    return TensorProcessor(config, graph_inputs)
