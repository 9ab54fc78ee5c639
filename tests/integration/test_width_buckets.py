"""Width buckets on the GPU service's data plane in this process: a variable-width image
model (PP-OCR's recogniser takes crops this way) batches the requests of one width
bucket together, padded to that bucket's width, and never mixes two buckets in a run.

The graph sums each row's pixels (zero padding after normalisation adds nothing) and
reports the width it was run at, so each answer shows which shape its run had."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper
from PIL import Image

from gpu_service.dataplane import DataPlane
from spillway.protocol.codec import decode_response, encode_request
from tests.integration.test_image_models import serve, write_version

HEIGHT, MAX_WIDTH, BUCKETS = 8, 64, [16, 32]


def sum_and_width() -> onnx.ModelProto:
    """``total[n] = sum of pixels[n]`` and ``width[n] = W`` over ``[N, 1, 8, W]``."""
    pixels = helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["n", 1, HEIGHT, "w"])
    total = helper.make_tensor_value_info("total", TensorProto.FLOAT, ["n", 1])
    width = helper.make_tensor_value_info("width", TensorProto.FLOAT, ["n", 1])
    axes = helper.make_tensor("axes", TensorProto.INT64, [3], [1, 2, 3])
    last = helper.make_tensor("last", TensorProto.INT64, [1], [1])
    nodes = [
        helper.make_node("ReduceSum", ["pixels", "axes"], ["summed"], keepdims=0),
        helper.make_node("Unsqueeze", ["summed", "last"], ["total"]),
        # One per pixel, averaged over channel and height, summed over the width: W.
        helper.make_node("Mul", ["pixels", "zero"], ["zeros"]),
        helper.make_node("Add", ["zeros", "one"], ["ones"]),
        helper.make_node("ReduceMean", ["ones"], ["columns"], axes=[1, 2], keepdims=0),
        helper.make_node("ReduceSum", ["columns", "last"], ["width"], keepdims=1),
    ]
    constants = [
        axes,
        last,
        helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
        helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
    ]
    graph = helper.make_graph(nodes, "sum-and-width", [pixels], [total, width], constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def write_model(root: Path) -> None:
    config = {
        "name": "crops",
        "max_batch_size": 8,
        "input": [{"name": "image", "data_type": "TYPE_STRING", "dims": [1]}],
        "output": [
            {"name": "total", "data_type": "TYPE_FP32", "dims": [1]},
            {"name": "width", "data_type": "TYPE_FP32", "dims": [1]},
        ],
        # A batch leaves at 2 rows or after 30 s: each bucket below fills to 2 rows.
        "dynamic_batching": {
            "preferred_batch_size": [2],
            "max_queue_delay_microseconds": 30_000_000,
        },
        "spillway": {
            "kind": "image",
            "image": {
                "input": "image",
                "color": "GRAY",
                "height": HEIGHT,
                "max_width": MAX_WIDTH,
                "width_buckets": BUCKETS,
                "mean": [0.5],
                "std": [0.5],
            },
        },
    }
    write_version(root, sum_and_width(), config)


def white(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (width, height), 255).save(buffer, format="PNG")
    return buffer.getvalue()


def body(images: list[bytes]) -> tuple[bytes, int | None]:
    inputs = {"image": np.array(images, dtype=np.object_).reshape(-1, 1)}
    return encode_request(inputs, binary=True)


def test_similar_widths_share_a_batch_and_a_different_width_runs_apart(
    tmp_path: Path,
) -> None:
    # GIVEN a variable-width model (height 8, buckets 16 and 32, at most 64 wide), and
    # three requests: crops 10 and 13 wide (bucket 16) and two 50 wide (over the buckets)
    write_model(tmp_path)
    narrow, similar = body([white(5, 4)]), body([white(13, 8)])
    wide = body([white(25, 4), white(100, 16)])

    async def scenario(plane: DataPlane) -> tuple[list[dict[str, Any]], Any]:
        # WHEN they are sent at once
        replies = await asyncio.gather(
            plane.infer("crops", None, *narrow),
            plane.infer("crops", None, *wide),
            plane.infer("crops", None, *similar),
        )
        answers = [decode_response(r.body, r.header_length)[1] for r in replies]
        return answers, plane.registry.get("crops").stats

    # (early dispatch off: each batch leaves on its size alone, whatever the timing)
    answers, stats = serve(tmp_path, scenario, early_dispatch=False)
    # THEN two runs of two rows each: the similar widths together, the wide ones apart
    assert (stats.execution_count, stats.inference_count) == (2, 4)
    assert sorted(stats.batch_sizes) == [2]
    assert stats.batch_sizes[2].count == 2
    # AND each ran at its bucket's width: 16 for the similar pair, 64 for the wide one
    widths = [a["width"].ravel().tolist() for a in answers]
    assert widths == [[16.0], [64.0, 64.0], [16.0]]
    # AND the padding changed no sum: a white pixel normalises to 1, so each total is
    # the row's own pixels (8 high × its width from its aspect ratio, capped at 64)
    totals = [a["total"].ravel().tolist() for a in answers]
    assert totals == [[8.0 * 10], [8.0 * 50, 8.0 * 50], [8.0 * 13]]
