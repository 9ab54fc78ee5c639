"""A fake model for the batch-job unit tests (no tests here): sums rows, fails on poison."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spillway.models.config import ModelConfig, TensorConfig
from spillway.models.processing import Prepared, Tensors, outcomes
from spillway.protocol.errors import InvalidInputError, SpillwayError
from spillway.protocol.tensors import check_finite
from tests.fakes import sum_rows


def fake_config(max_batch_size: int = 4) -> ModelConfig:
    """``x`` FP32 ``[2]`` in, ``y`` FP32 ``[1]`` out."""
    return ModelConfig(
        name="fake",
        max_batch_size=max_batch_size,
        input=(TensorConfig(name="x", data_type="TYPE_FP32", dims=(2,)),),
        output=(TensorConfig(name="y", data_type="TYPE_FP32", dims=(1,)),),
    )


@dataclass
class FakeModel:
    """``y = x0 + x1`` per row. A batch holding a negative value fails as a whole, like a
    runtime error would; the rows of every run are recorded."""

    config: ModelConfig = field(default_factory=fake_config)
    name: str = "fake"
    version: int = 1
    runs: list[int] = field(default_factory=list)

    @property
    def batching(self) -> bool:
        return True

    def prepare(self, inputs: Tensors) -> Prepared:
        if set(inputs) != {"x"}:
            raise InvalidInputError(f"inputs must be exactly ['x'], got {sorted(inputs)}")
        x = inputs["x"]
        if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != 2:
            raise InvalidInputError(f"input 'x' must be FP32 [-1, 2], got {list(x.shape)}")
        check_finite("x", x)  # the engine's rule for floating-point inputs
        return Prepared({"x": x}, len(x))

    def prepare_many(self, requests: Sequence[Tensors]) -> list[Prepared | SpillwayError]:
        return outcomes(self.prepare, requests)

    def run(self, batch: list[Prepared]) -> list[Tensors]:
        self.runs.append(sum(p.rows for p in batch))
        return sum_rows(batch)


def line(record_id: str, x: Any) -> str:
    """One input line for the fake model."""
    return json.dumps({"id": record_id, "data": {"x": x}})
