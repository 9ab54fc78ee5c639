"""``spillway models add --image`` on a tiny image graph built here: the configuration of
the image kind written from the graph, proven and profiled on generated PNGs, then served
by the GPU service's data plane in this process and compared with numpy on the decoded,
normalised pixels."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper
from PIL import Image

from gpu_service.dataplane import DataPlane
from spillway.protocol.codec import decode_response, encode_request
from spillway.protocol.errors import SpillwayError
from tests.integration.test_image_models import serve
from tests.integration.test_models_add import ROOMY_P99, add, config_json
from tests.unit.test_images import bomb_png

MEAN = np.array([0.5, 0.25, 0.0], np.float32)
STD = np.array([0.25, 0.5, 2.0], np.float32)
HEIGHT, WIDTH = 4, 6


def channel_means(path: Path) -> Path:
    """``mean[n, c]`` = the mean over height and width of ``pixels[n, c]``, pixels
    ``[batch, 3, HEIGHT, WIDTH]`` FP32 (NCHW)."""
    pixels = helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["n", 3, HEIGHT, WIDTH])
    mean = helper.make_tensor_value_info("mean", TensorProto.FLOAT, ["n", 3])
    node = helper.make_node("ReduceMean", ["pixels"], ["mean"], axes=[2, 3], keepdims=0)
    model = helper.make_model(
        helper.make_graph([node], "channel-means", [pixels], [mean]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


def png(pixels: npt.NDArray[np.uint8]) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def expected(data: bytes) -> npt.NDArray[np.float32]:
    """numpy on the decoded pixels: resized (bilinear) to WIDTH×HEIGHT, ``(pixel / 255 -
    MEAN) / STD``, then the mean of each channel."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    if image.size != (WIDTH, HEIGHT):
        image = image.resize((WIDTH, HEIGHT), Image.Resampling.BILINEAR)
    normalised = (np.asarray(image, np.float32) / 255 - MEAN) / STD
    means: npt.NDArray[np.float32] = normalised.mean(axis=(0, 1))
    return means


def request(images: list[bytes]) -> tuple[bytes, int | None]:
    return encode_request({"pixels": np.array(images, np.object_).reshape(-1, 1)}, binary=True)


def test_an_image_model_is_added_and_served_on_png_bytes(tmp_path: Path) -> None:
    # GIVEN a graph taking NCHW float pixels WHEN added with --image and normalisation
    model = channel_means(tmp_path / "means.onnx")
    code, output = add(
        tmp_path,
        model,
        "means",
        *("--image", "--mean", "0.5,0.25,0", "--std", "0.25,0.5,2", *ROOMY_P99),
    )
    # THEN it was proven and profiled on generated images
    assert code == 0, output
    assert "batch-safe: a batch of 8 equals its 8 single-row runs" in output
    assert "batch    p50 ms    p99 ms     rows/s" in output
    # AND the configuration is the image kind: one encoded image per row in
    document = config_json(tmp_path, "means")
    assert document["input"] == [{"name": "pixels", "data_type": "TYPE_STRING", "dims": [1]}]
    assert document["output"] == [{"name": "mean", "data_type": "TYPE_FP32", "dims": [3]}]
    assert document["spillway"]["kind"] == "image"
    section = document["spillway"]["image"]
    assert (section["input"], section["layout"], section["color"]) == ("pixels", "NCHW", "RGB")
    assert (section["size"], section["mean"], section["std"]) == (
        [HEIGHT, WIDTH],
        [0.5, 0.25, 0.0],
        [0.25, 0.5, 2.0],
    )
    # WHEN the GPU service serves it: two requests (one image at the model's size, two
    # larger ones resized), and a PNG header declaring 20000x20000 pixels
    rng = np.random.default_rng(7)
    first = [png(rng.integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8))]
    second = [png(rng.integers(0, 256, (8, 12, 3), dtype=np.uint8)) for _ in range(2)]

    async def scenario(plane: DataPlane) -> list[Any]:
        answers = await asyncio.gather(
            plane.infer("means", None, *request(first)),
            plane.infer("means", None, *request(second)),
            plane.infer("means", None, *request([bomb_png(20000, 20000)])),
            return_exceptions=True,
        )
        return list(answers)

    one, two, bomb = serve(tmp_path / "repo", scenario, cache_dir=tmp_path / "cache")
    # THEN each answer is numpy's on the decoded, normalised pixels
    for answer, images in ((one, first), (two, second)):
        means = decode_response(answer.body, answer.header_length)[1]["mean"]
        np.testing.assert_allclose(means, [expected(i) for i in images], atol=1e-5)
    # AND the bomb is a 400 before a pixel is decoded
    assert isinstance(bomb, SpillwayError)
    assert (bomb.status, bomb.code) == (400, "image_too_large")
