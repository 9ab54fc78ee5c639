"""A user's own models for tests/e2e/test_your_model.py: the export blocks of
docs/your-model.md, run as the user would run them, and three small graphs that each
take a different path through ``spillway models add``.

* ``fixed_batch_one``: a graph whose input is ``[1, 8]`` (no dynamic leading dimension),
  so its config has ``max_batch_size: 0``;
* ``not_batch_safe``: ``y = x - mean(x, axis=0)``, a dynamic batch axis whose rows mix:
  a batch of N differs from the N single runs, so it must never be batched;
* ``two_int64``: two int64 inputs, ``y = 3a + b``, exact arithmetic.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

DOC = Path(__file__).resolve().parents[2] / "docs" / "your-model.md"
OPSET = 17


def doc_blocks() -> dict[str, str]:
    """The doc's Python blocks that start with a ``# <file>.py`` line, by that file name."""
    blocks = re.findall(r"```python\n# (\w+\.py)\n(.*?)```", DOC.read_text(), re.DOTALL)
    return dict(blocks)


def export_python() -> str:
    """The interpreter of the environment where a user trains (``make export-env``:
    torch and transformers, which .venv does not hold); skips where none was made,
    fails where the Makefile named one that is missing."""
    named = os.environ.get("SPILLWAY_EXPORT_PYTHON", "")
    if not named:
        pytest.skip("torch export blocks run in .venv-export (make export-env)")
    assert os.access(named, os.X_OK), f"SPILLWAY_EXPORT_PYTHON={named}: no such interpreter"
    return named


def run_doc_block(name: str, cwd: Path, timeout_s: float = 300) -> None:
    """Run the doc's block ``name`` in ``cwd``, as a user would: a torch block in the
    environment where they train (``export_python``), any other in .venv."""
    code = doc_blocks()[name]
    script = cwd / name
    script.write_text(code)
    python = export_python() if "import torch" in code else sys.executable
    subprocess.run([python, str(script)], cwd=cwd, check=True, timeout=timeout_s)


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def fixed_batch_one(path: Path) -> Path:
    """``y = x @ W + b`` over a fixed ``[1, 8]`` input."""
    rng = np.random.default_rng(1)
    weight = numpy_helper.from_array(rng.standard_normal((8, 3)).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "b")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["y"]),
        ],
        "fixed_batch_one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        [weight, bias],
    )
    return _save(graph, path)


def not_batch_safe(path: Path) -> Path:
    """``y = x - mean(x, axis=0)``: each row's answer depends on the other rows."""
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["x"], ["mean"], axes=[0], keepdims=1),
            helper.make_node("Sub", ["x", "mean"], ["y"]),
        ],
        "not_batch_safe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    return _save(graph, path)


def two_int64(path: Path) -> Path:
    """``y = 3a + b`` over two int64 ``[batch, 3]`` inputs."""
    three = numpy_helper.from_array(np.array(3, np.int64), "three")
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["a", "three"], ["a3"]),
            helper.make_node("Add", ["a3", "b"], ["y"]),
        ],
        "two_int64",
        [
            helper.make_tensor_value_info("a", TensorProto.INT64, ["batch", 3]),
            helper.make_tensor_value_info("b", TensorProto.INT64, ["batch", 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.INT64, ["batch", 3])],
        [three],
    )
    return _save(graph, path)
