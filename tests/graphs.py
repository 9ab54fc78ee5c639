"""Tiny ONNX graphs for the tests of adding a model: each built here, none downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

WEIGHTS = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
"""The dense layer of ``dense``: ``y = x @ WEIGHTS`` maps 4 features to 3."""


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def dense(path: Path, batch: int | str | None = "batch") -> Path:
    """``y = x @ WEIGHTS``, x ``[batch, 4]`` FP32: batch-safe; ``batch`` is the leading
    dimension (a name: dynamic; 1: a fixed batch of one)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "dense", [x], [y], [numpy_helper.from_array(WEIGHTS, "w")])
    return _save(graph, path)


def centred(path: Path) -> Path:
    """``y = x - mean(x, axis 0)``: every row's answer depends on the other rows of its
    batch (not batch-safe)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["m"], axes=[0], keepdims=1),
        helper.make_node("Sub", ["x", "m"], ["y"]),
    ]
    return _save(helper.make_graph(nodes, "centred", [x], [y]), path)


def two_int_inputs(path: Path) -> Path:
    """``sum = a + b`` and ``product = a * b`` over int64 ``[batch, 3]`` inputs."""
    a = helper.make_tensor_value_info("a", TensorProto.INT64, ["batch", 3])
    b = helper.make_tensor_value_info("b", TensorProto.INT64, ["batch", 3])
    total = helper.make_tensor_value_info("sum", TensorProto.INT64, ["batch", 3])
    product = helper.make_tensor_value_info("product", TensorProto.INT64, ["batch", 3])
    nodes = [
        helper.make_node("Add", ["a", "b"], ["sum"]),
        helper.make_node("Mul", ["a", "b"], ["product"]),
    ]
    return _save(helper.make_graph(nodes, "ints", [a, b], [total, product]), path)


def mean_pooled_encoder(path: Path, vocabulary: int, dim: int = 8) -> Path:
    """A text encoder: token embeddings averaged over the attention mask, ``[batch, dim]``
    out, from ``input_ids`` and ``attention_mask`` (int64 ``[batch, sequence]``)."""
    rng = np.random.default_rng(7)
    table = rng.standard_normal((vocabulary, dim)).astype(np.float32)
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])
    out = helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", dim])
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["tokens"]),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["m", "last"], ["m3"]),
        helper.make_node("Mul", ["tokens", "m3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "one"], ["total"], keepdims=0),
        helper.make_node("ReduceSum", ["m", "one"], ["count"], keepdims=1),
        helper.make_node("Div", ["total", "count"], ["embedding"]),
    ]
    inits = [
        numpy_helper.from_array(table, "table"),
        numpy_helper.from_array(np.array([2], np.int64), "last"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
    ]
    return _save(helper.make_graph(nodes, "encoder", [ids, mask], [out], inits), path)
