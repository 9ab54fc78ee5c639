"""One rule for NaN and infinities, whatever door the numbers came through.

The check sits in the model's validation (``OnnxModel.validate``), which the GPU service,
the CPU fallback and the batch job all call, so JSON data, binary data and gRPC contents
meet it alike; ``tests/integration/test_same_answer.py`` sends the same values to every
server. Here: the rule itself, the declared exception, and JSON's numbers too large for
their datatype, which become infinite exactly as a gRPC client's ``fp32_contents`` do.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from spillway.models.config import ModelConfig
from spillway.models.engine import EngineOptions, OnnxModel
from spillway.protocol.errors import InvalidInputError, NonFiniteInputError
from spillway.protocol.tensors import from_json
from tests import graphs

NON_FINITE = [math.nan, math.inf, -math.inf]


def _dense(tmp_path: Path, non_finite_inputs: tuple[str, ...] = ()) -> OnnxModel:
    config = ModelConfig.model_validate(
        {
            "name": "dense",
            "max_batch_size": 8,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [3]}],
            "spillway": {"non_finite_inputs": list(non_finite_inputs)},
        }
    )
    path = graphs.dense(tmp_path / "dense" / "1" / "model.onnx")
    return OnnxModel("dense", 1, config, path.parent, EngineOptions())


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_a_model_refuses_a_non_finite_input_with_its_own_code(tmp_path: Path, value: float) -> None:
    # GIVEN a model that declares no input as taking non-finite values
    model = _dense(tmp_path)
    x = np.array([[0.5, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]], dtype=np.float32)
    x[1, 2] = value
    # WHEN a request holds one such value among finite ones
    with pytest.raises(NonFiniteInputError) as refused:
        model.validate({"x": x})
    # THEN it is refused as the client's error, naming the input
    assert refused.value.status == 400
    assert refused.value.code == "non_finite_input"
    assert "'x'" in refused.value.message
    # AND the finite rows alone are served
    assert model.validate({"x": x[:1]}) == 1


def test_a_model_that_declares_the_input_computes_with_nan(tmp_path: Path) -> None:
    # GIVEN a model whose input x is declared to take NaN (e.g. a missing value)
    model = _dense(tmp_path, ("x",))
    x = np.array([[math.nan, 1.0, 2.0, 3.0]], dtype=np.float32)
    # WHEN it computes
    y = model.infer({"x": x})["y"]
    # THEN the answer is ONNX Runtime's: NaN propagates through the product
    assert y.shape == (1, 3)
    assert np.isnan(y).all()


def test_non_finite_inputs_must_name_floating_point_inputs() -> None:
    # GIVEN a configuration naming an input that does not exist
    with pytest.raises(ValidationError, match="non_finite_inputs"):
        ModelConfig.model_validate(
            {
                "name": "dense",
                "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
                "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [3]}],
                "spillway": {"non_finite_inputs": ["z"]},
            }
        )


@pytest.mark.parametrize(
    ("data", "datatype"),
    [([1e39], "FP32"), ([70000.0], "FP16"), ([-3.5e38], "FP32")],
    ids=["fp32", "fp16", "fp32-negative"],
)
def test_json_numbers_past_a_float_type_become_infinite(data: list[float], datatype: str) -> None:
    # GIVEN a JSON number too large for its floating-point datatype
    # WHEN it is read
    array = from_json(data, datatype, [1])
    # THEN it is infinite with its sign (as gRPC's float contents make it), and the
    # model's rule decides, not the decoder
    assert np.isinf(array).all()
    assert np.sign(array[0]) == np.sign(data[0])


def test_json_integers_out_of_range_stay_invalid_input() -> None:
    # GIVEN an integer too large for INT32 WHEN read THEN it is refused as out of range
    with pytest.raises(InvalidInputError, match="out of range for INT32") as refused:
        from_json([2**31], "INT32", [1])
    assert refused.value.code == "invalid_input"
