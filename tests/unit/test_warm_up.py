"""Warm-up: the shapes a version runs before it takes a request, on each provider.

On an accelerator every length bucket and a full batch are run (per-shape kernel
choice); on ONNX Runtime's CPU provider, which keeps no per-shape state, only the
shortest and longest rows and two rows as the batch check. The OCR detector warms on its
smallest input, not on a strip that scales to 4096 pixels high.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import numpy as np

from spillway.models import ocr_geometry as geometry
from spillway.models.config import ModelConfig, SpillwayBlock, TensorConfig
from spillway.models.engine import CPU, CUDA, OnnxModel
from spillway.models.loader import warm_up
from spillway.models.ocr import DetectionProcessor, decode_bgr
from spillway.models.processing import GraphTensor, Tensors


def _config(max_batch_size: int, buckets: list[int]) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": "m",
            "max_batch_size": max_batch_size,
            "input": [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}],
            "spillway": {"kind": "tensor", "length_buckets": buckets},
        }
    )


@dataclass
class RecordingModel:
    """What ``warm_up`` uses of a model: it records each run as ``(rows, length)``."""

    config: ModelConfig
    provider: str
    wide: bool = False
    runs: list[tuple[int, int]] = field(default_factory=list)
    wide_runs: list[tuple[int, int]] = field(default_factory=list)

    def sample_inputs(self, rows: int, length: int = 8) -> Tensors:
        return {"rows": np.full(rows, length)}

    def infer(self, inputs: Tensors) -> Tensors:
        rows = inputs["rows"]
        self.runs.append((len(rows), int(rows[0])))
        return {}

    def prepare(self, inputs: Tensors) -> Tensors:
        return inputs

    def run(self, batch: list[Tensors], wide: bool = False) -> list[Tensors]:
        assert wide
        self.wide_runs += [(len(p["rows"]), int(p["rows"][0])) for p in batch]
        return [{} for _ in batch]


def _warm(provider: str, max_batch_size: int, buckets: list[int]) -> list[tuple[int, int]]:
    model = RecordingModel(_config(max_batch_size, buckets), provider)
    warm_up(cast(OnnxModel, model))
    return model.runs


def test_a_model_with_a_wide_session_runs_it_once_more() -> None:
    # GIVEN a model with a second session on more threads (GPU_WIDE_RUNS)
    model = RecordingModel(_config(64, [320, 640]), CPU, wide=True)
    warm_up(cast(OnnxModel, model))
    # THEN its usual session warmed as any other, and the wide one ran one row once
    assert model.runs == [(1, 318), (1, 638), (2, 318)]
    assert model.wide_runs == [(1, 318)]


def test_an_accelerator_warms_every_bucket_then_a_full_batch() -> None:
    runs = _warm(CUDA, 64, [320, 640, 960, 2560])
    assert runs == [(1, 318), (1, 638), (1, 958), (1, 2558), (64, 318)]


def test_the_cpu_runs_the_shortest_and_longest_row_then_two_rows() -> None:
    assert _warm(CPU, 64, [320, 640, 960, 2560]) == [(1, 318), (1, 2558), (2, 318)]


def test_the_cpu_warms_a_model_without_buckets_or_batching_once() -> None:
    assert _warm(CPU, 0, []) == [(1, 8)]
    assert _warm(CPU, 1, [16]) == [(1, 14)]
    assert _warm(CUDA, 0, []) == [(1, 8)]


def test_the_detector_warms_on_its_smallest_input() -> None:
    # GIVEN a detection processor (its served outputs, whatever they are)
    outputs = [
        TensorConfig(name=n, data_type="TYPE_FP32", dims=(-1,))
        for n in DetectionProcessor.served_outputs
    ]
    config = ModelConfig(
        name="ocr-det",
        max_batch_size=0,
        input=(TensorConfig(name="image", data_type="TYPE_STRING", dims=(1,)),),
        output=tuple(outputs),
        spillway=SpillwayBlock(kind="ocr_detection"),
    )
    processor = DetectionProcessor(config, [GraphTensor("x", "FP32", (1, 3, "h", "w"))])
    # WHEN its warm-up sample is scaled for the detector
    sample = processor.sample_bytes("image", 8)
    det = geometry.det_input(decode_bgr(sample, "the sample"))
    # THEN the detector's input is its smallest, 736 x 736
    assert det is not None
    assert det.tensor.shape == (1, 3, 736, 736)
