"""A ResNet-50-shaped ONNX graph with random weights: the compute-heavy model of the GPU
benchmark, built here with ``onnx.helper`` (nothing downloaded, no deep-learning framework).

The layout is ResNet-50's: a 7x7/2 stem and a 3x3/2 max pool, four stages of bottleneck
blocks (3, 4, 6, 3 blocks; 1x1, 3x3, 1x1 convolutions, a projection shortcut on each
stage's first block), global average pooling and a 1000-way dense layer: 53 convolutions
and about 25.5 million weights at ``width=1``. Batch normalisation is folded into each
convolution's bias, as an exported inference graph has it. Only the throughput matters, so
the weights are random (He-scaled, the last convolution of each block damped so the
activations stay finite through 16 residual sums).

``width`` divides every channel count and ``size`` sets the image side, so tests can build
a small graph of the same shape.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

STAGES = ((64, 256, 3, 1), (128, 512, 4, 2), (256, 1024, 6, 2), (512, 2048, 3, 2))
"""(bottleneck channels, output channels, blocks, first stride) of each stage."""
CLASSES = 1000
INPUT, OUTPUT = "image", "logits"


class _Graph:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.weights: list[onnx.TensorProto] = []
        self.count = 0

    def _name(self, kind: str) -> str:
        self.count += 1
        return f"{kind}{self.count}"

    def _weight(self, name: str, shape: tuple[int, ...], std: float) -> str:
        values = (self.rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)
        self.weights.append(numpy_helper.from_array(values, name))
        return name

    def conv(
        self, x: str, c_in: int, c_out: int, k: int, stride: int, *, relu: bool, damp: float = 1.0
    ) -> str:
        name = self._name("conv")
        std = damp * float(np.sqrt(2.0 / (c_in * k * k)))
        w = self._weight(f"{name}.w", (c_out, c_in, k, k), std)
        b = self._weight(f"{name}.b", (c_out,), 0.01)
        pad = k // 2
        self.nodes.append(
            helper.make_node(
                "Conv",
                [x, w, b],
                [name],
                kernel_shape=[k, k],
                strides=[stride, stride],
                pads=[pad, pad, pad, pad],
            )
        )
        return self.relu(name) if relu else name

    def relu(self, x: str) -> str:
        name = self._name("relu")
        self.nodes.append(helper.make_node("Relu", [x], [name]))
        return name

    def add_relu(self, a: str, b: str) -> str:
        name = self._name("add")
        self.nodes.append(helper.make_node("Add", [a, b], [name]))
        return self.relu(name)

    def op(self, kind: str, x: str, **attributes: Any) -> str:
        name = self._name(kind.lower())
        self.nodes.append(helper.make_node(kind, [x], [name], **attributes))
        return name


def resnet50(width: int = 1, size: int = 224, seed: int = 0) -> onnx.ModelProto:
    """The graph: ``image`` [N, 3, size, size] FP32 -> ``logits`` [N, 1000] FP32."""
    g = _Graph(seed)
    x = g.conv(INPUT, 3, 64 // width, 7, 2, relu=True)
    x = g.op("MaxPool", x, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    channels = 64 // width
    for mid, out, blocks, stride in STAGES:
        mid, out = mid // width, out // width
        for block in range(blocks):
            step = stride if block == 0 else 1
            y = g.conv(x, channels, mid, 1, 1, relu=True)
            y = g.conv(y, mid, mid, 3, step, relu=True)
            y = g.conv(y, mid, out, 1, 1, relu=False, damp=0.2)
            shortcut = g.conv(x, channels, out, 1, step, relu=False) if block == 0 else x
            x = g.add_relu(y, shortcut)
            channels = out
    x = g.op("GlobalAveragePool", x)
    x = g.op("Flatten", x, axis=1)
    w = g._weight("fc.w", (channels, CLASSES), float(np.sqrt(1.0 / channels)))
    b = g._weight("fc.b", (CLASSES,), 0.0)
    g.nodes.append(helper.make_node("Gemm", [x, w, b], [OUTPUT]))
    graph = helper.make_graph(
        g.nodes,
        "resnet50-shaped",
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, ["N", 3, size, size])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["N", CLASSES])],
        g.weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def config(name: str, max_batch: int, delay_us: int, size: int = 224) -> dict[str, object]:
    """The model's repository config: batched images in, logits out."""
    return {
        "name": name,
        "platform": "onnxruntime_onnx",
        "max_batch_size": max_batch,
        "input": [{"name": INPUT, "data_type": "TYPE_FP32", "dims": [3, size, size]}],
        "output": [{"name": OUTPUT, "data_type": "TYPE_FP32", "dims": [CLASSES]}],
        "dynamic_batching": {"max_queue_delay_microseconds": delay_us},
    }
