"""``mlp-bench``: a 3-layer 1024-wide MLP written directly as an ONNX graph, for benchmarks.

``input`` FP32 ``[batch, 1024]`` → (MatMul + Add, Relu) x2 → MatMul + Add → ``output``.
Weights are drawn from a fixed seed and the graph carries nothing that varies between
builds, so two builds give byte-identical ``model.onnx`` files.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from spillway.models.config import DynamicBatching, ModelConfig, QueuePolicy, TensorConfig
from spillway_cli.modelbuild.common import (
    ONNX_FILE,
    VERSION,
    BuildReport,
    log_report,
    make_report,
    save_onnx,
    staged_model_dir,
    write_checksums,
    write_config,
)

if TYPE_CHECKING:
    import onnx

logger = logging.getLogger(__name__)

NAME = "mlp-bench"
WIDTH = 1024
LAYERS = 3
SEED = 20261129
ONNX_OPSET = 17
ONNX_IR_VERSION = 8  # the IR version that goes with opset 17; runtimes back to ORT 1.13 load it
MAX_ABS_DIFF = 1e-3
_BATCH_DIM = "batch"

Weights = list[tuple[NDArray[np.float32], NDArray[np.float32]]]


def mlp_config() -> ModelConfig:
    """The served configuration: ``input`` [1024] in, ``output`` [1024] out."""
    return ModelConfig(
        name=NAME,
        max_batch_size=256,
        input=(TensorConfig(name="input", data_type="TYPE_FP32", dims=(WIDTH,)),),
        output=(TensorConfig(name="output", data_type="TYPE_FP32", dims=(WIDTH,)),),
        dynamic_batching=DynamicBatching(
            preferred_batch_size=(32, 64, 128),
            max_queue_delay_microseconds=1000,
            default_queue_policy=QueuePolicy(max_queue_size=1024),
        ),
    )


def mlp_weights(seed: int = SEED) -> Weights:
    """The ``(weight, bias)`` pairs; the 1/sqrt(width) scale keeps activations O(1)."""
    rng = np.random.default_rng(seed=seed)
    scale = np.float32(1.0 / math.sqrt(WIDTH))
    weights: Weights = []
    for _ in range(LAYERS):
        w = rng.standard_normal((WIDTH, WIDTH), dtype=np.float32) * scale
        b = rng.standard_normal(WIDTH, dtype=np.float32) * np.float32(0.01)
        weights.append((w, b))
    return weights


def mlp_reference(x: NDArray[np.float32], weights: Weights) -> NDArray[np.float32]:
    """The same network in numpy, for checking the ONNX graph."""
    h = x
    for i, (w, b) in enumerate(weights):
        h = h @ w + b
        if i < len(weights) - 1:
            h = np.maximum(h, np.float32(0.0))
    return h


def mlp_model(weights: Weights) -> onnx.ModelProto:
    """The ONNX model for ``weights``; deterministic for the same weights."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = []
    initializers = []
    current = "input"
    for i, (w, b) in enumerate(weights):
        initializers += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        last = i == len(weights) - 1
        added = "output" if last else f"z{i}"
        nodes += [
            helper.make_node("MatMul", [current, f"w{i}"], [f"m{i}"], name=f"matmul{i}"),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [added], name=f"add{i}"),
        ]
        if not last:
            nodes.append(helper.make_node("Relu", [added], [f"h{i}"], name=f"relu{i}"))
            current = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "mlp_bench",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [_BATCH_DIM, WIDTH])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [_BATCH_DIM, WIDTH])],
        initializer=initializers,
    )
    return helper.make_model(
        graph,
        producer_name="spillway",
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
        ir_version=ONNX_IR_VERSION,
    )


def _verify(model: onnx.ModelProto, weights: Weights) -> dict[str, float]:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(seed=0).standard_normal((8, WIDTH), dtype=np.float32)
    (got,) = session.run(["output"], {"input": x})
    diff = float(np.max(np.abs(got - mlp_reference(x, weights))))
    if got.shape != (8, WIDTH) or not diff <= MAX_ABS_DIFF:
        raise RuntimeError(f"mlp-bench: ONNX output {got.shape} differs from numpy by {diff}")
    return {"max_abs_diff": diff, "output_std": float(np.std(got))}


def build_mlp(out: Path) -> BuildReport:
    """Write ``out/mlp-bench`` and check it against numpy; raises RuntimeError on mismatch."""
    started = time.monotonic()
    weights = mlp_weights()
    model = mlp_model(weights)
    metrics = _verify(model, weights)
    with staged_model_dir(out, NAME) as model_dir:
        version_dir = model_dir / VERSION
        save_onnx(model, version_dir / ONNX_FILE)
        write_checksums(version_dir)
        write_config(model_dir, mlp_config())
        report = make_report(NAME, version_dir, metrics, started)
    log_report(report)
    return report
