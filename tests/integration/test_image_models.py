"""An ``image`` model served by the GPU service's data plane in this process: encoded
PNGs in as BYTES, decoded and normalised in the prepare step, two requests batched into
one ONNX Runtime run, and the answers equal to ONNX Runtime run directly on a tensor the
test builds by hand from the pixels it wrote."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from PIL import Image

from gpu_service.dataplane import DataPlane
from gpu_service.registry import ModelRegistry
from gpu_service.settings import GpuSettings
from spillway.models.repository import LocalRepository
from spillway.protocol.codec import decode_response, encode_request
from spillway.protocol.errors import SpillwayError
from spillway_cli.modelbuild.common import write_checksums
from tests.unit.test_images import bomb_png

MEAN = np.array([0.5, 0.25, 0.0])
STD = np.array([0.25, 0.5, 2.0])
HEIGHT, WIDTH = 4, 6


def pixel_means() -> onnx.ModelProto:
    """``mean[n, c] = mean over (h, w) of pixels[n, c] + offset[n]``: the graph's input is
    named ``pixels``, not like the served ``image``."""
    pixels = helper.make_tensor_value_info("pixels", TensorProto.FLOAT, [None, 3, HEIGHT, WIDTH])
    offset = helper.make_tensor_value_info("offset", TensorProto.FLOAT, [None, 1])
    mean = helper.make_tensor_value_info("mean", TensorProto.FLOAT, [None, 3])
    nodes = [
        helper.make_node("ReduceMean", ["pixels"], ["m"], axes=[2, 3], keepdims=0),
        helper.make_node("Add", ["m", "offset"], ["mean"]),
    ]
    graph = helper.make_graph(nodes, "pixel-means", [pixels, offset], [mean])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def write_version(root: Path, model: onnx.ModelProto, config: dict[str, Any]) -> Path:
    """``config`` and ``model`` as version 1 (checksummed) in the repository at ``root``;
    the path of the written graph."""
    name = str(config["name"])
    version_dir = root / name / "1"
    version_dir.mkdir(parents=True)
    onnx.save(model, version_dir / "model.onnx")
    write_checksums(version_dir)
    (root / name / "config.json").write_text(json.dumps(config))
    return version_dir / "model.onnx"


def write_image_model(root: Path) -> Path:
    config = {
        "name": "pixels",
        "max_batch_size": 8,
        "input": [
            {"name": "image", "data_type": "TYPE_STRING", "dims": [1]},
            {"name": "offset", "data_type": "TYPE_FP32", "dims": [1]},
        ],
        "output": [{"name": "mean", "data_type": "TYPE_FP32", "dims": [3]}],
        # A batch leaves at 3 rows or after 30 s: the test's two requests make one run.
        "dynamic_batching": {
            "preferred_batch_size": [3],
            "max_queue_delay_microseconds": 30_000_000,
        },
        "spillway": {
            "kind": "image",
            "image": {
                "input": "image",
                "size": [HEIGHT, WIDTH],
                "resize": "letterbox",
                "pad_value": 255,
                "mean": MEAN.tolist(),
                "std": STD.tolist(),
            },
        },
    }
    return write_version(root, pixel_means(), config)


def png(colour: tuple[int, int, int], height: int, width: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def by_hand(colour: tuple[int, int, int]) -> npt.NDArray[np.float32]:
    """The prepared tensor of a 2×6 image of ``colour`` letterboxed into 4×6: itself in
    rows 1 and 2, white pad rows 0 and 3; then ``(pixel / 255 - mean) / std``."""
    image = np.full((HEIGHT, WIDTH, 3), 255.0)
    image[1:3] = colour
    prepared = (image / 255 - MEAN) / STD
    return np.ascontiguousarray(prepared.transpose(2, 0, 1), dtype=np.float32)


def body(images: list[bytes], offsets: list[float]) -> tuple[bytes, int | None]:
    inputs = {
        "image": np.array(images, dtype=np.object_).reshape(-1, 1),
        "offset": np.array(offsets, dtype=np.float32).reshape(-1, 1),
    }
    return encode_request(inputs, binary=True)


def serve(root: Path, scenario: Any, **settings_fields: Any) -> Any:
    """Runs ``scenario(plane)`` against a data plane over the repository at ``root``
    (CPU provider; other settings from ``settings_fields``)."""

    async def main() -> Any:
        settings = GpuSettings(providers=("CPUExecutionProvider",), **settings_fields)
        registry = ModelRegistry(LocalRepository(root), settings)
        await registry.start()
        plane = DataPlane(registry, settings)
        try:
            return await scenario(plane)
        finally:
            await registry.stop(5)
            plane.close()

    return asyncio.run(main())


def test_two_image_requests_are_batched_and_equal_onnx_runtime(tmp_path: Path) -> None:
    # GIVEN an image model and two requests: one image, then two
    onnx_path = write_image_model(tmp_path)
    colours = [(255, 0, 0), (0, 128, 255), (10, 20, 30)]
    first = body([png(colours[0], 2, 6)], [0.0])
    second = body([png(colours[1], 2, 6), png(colours[2], 2, 6)], [1.0, -2.0])

    async def scenario(plane: DataPlane) -> tuple[list[Any], Any]:
        # WHEN both are sent at once
        results = await asyncio.gather(
            plane.infer("pixels", None, *first), plane.infer("pixels", None, *second)
        )
        return [decode_response(r.body, r.header_length)[1]["mean"] for r in results], (
            plane.registry.get("pixels").stats
        )

    (one, two), stats = serve(tmp_path, scenario)
    # THEN they ran as one batch of three rows
    assert (stats.execution_count, stats.inference_count) == (1, 3)
    # AND each answer equals ONNX Runtime on the tensor built by hand
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    feeds = {
        "pixels": np.stack([by_hand(c) for c in colours]),
        "offset": np.array([[0.0], [1.0], [-2.0]], dtype=np.float32),
    }
    (direct,) = session.run(["mean"], feeds)
    np.testing.assert_allclose(one, direct[:1], atol=1e-6)
    np.testing.assert_allclose(two, direct[1:], atol=1e-6)
    # AND that is the closed form: half the rows the colour, half white
    closed = ((np.array(colours) / 255 + 1.0) / 2 - MEAN) / STD + [[0.0], [1.0], [-2.0]]
    np.testing.assert_allclose(direct, closed, atol=1e-5)


@pytest.mark.parametrize(
    ("image", "status", "code"),
    [
        (b"GIF89a not really", 400, "invalid_image"),
        (bomb_png(20000, 20000), 400, "image_too_large"),
    ],
    ids=["not-an-image", "bomb"],
)
def test_a_bad_image_fails_its_own_request_only(
    tmp_path: Path, image: bytes, status: int, code: str
) -> None:
    # GIVEN a good request and a bad one sent together
    write_image_model(tmp_path)
    good = body([png((1, 2, 3), 2, 6)], [0.0])
    bad = body([image], [0.0])

    async def scenario(plane: DataPlane) -> list[Any]:
        return list(
            await asyncio.gather(
                plane.infer("pixels", None, *bad),
                plane.infer("pixels", None, *good),
                return_exceptions=True,
            )
        )

    failed, answered = serve(tmp_path, scenario)
    # THEN the bad one gets its 400 and code, the good one its answer
    assert isinstance(failed, SpillwayError)
    assert (failed.status, failed.code) == (status, code)
    mean = decode_response(answered.body, answered.header_length)[1]["mean"]
    expected = by_hand((1, 2, 3)).mean(axis=(1, 2))
    np.testing.assert_allclose(mean[0], expected, atol=1e-6)


def noise_png(height: int, width: int) -> bytes:
    """Random pixels: a PNG that does not compress (about 3 bytes a pixel)."""
    pixels = np.random.default_rng(7).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_image_sections_max_bytes_replaces_the_services_element_cap(tmp_path: Path) -> None:
    # GIVEN an image model (max_bytes 8 MiB by default) on a service whose per-element cap
    # is 64 KiB, and a page-sized PNG over that cap but under max_bytes
    write_image_model(tmp_path)
    page = noise_png(200, 300)
    assert 64 * 1024 < len(page) < 8 * 1024 * 1024

    async def scenario(plane: DataPlane) -> Any:
        return await plane.infer("pixels", None, *body([page], [0.0]))

    answered = serve(tmp_path, scenario, max_bytes_per_element=64 * 1024)
    # THEN it is decoded and answered: the mean of its letterboxed, normalised pixels
    # (200 × 300 has the model's 4 × 6 aspect ratio: the letterbox is a plain bilinear
    # resize, no padding)
    mean = decode_response(answered.body, answered.header_length)[1]["mean"]
    image = Image.open(io.BytesIO(page)).convert("RGB")
    resized = np.asarray(image.resize((WIDTH, HEIGHT), Image.Resampling.BILINEAR), float)
    expected = ((resized / 255 - MEAN) / STD).mean(axis=(0, 1))
    np.testing.assert_allclose(mean[0], expected, atol=1e-5)


def test_an_image_over_max_bytes_is_413_before_it_is_opened(tmp_path: Path) -> None:
    # GIVEN the model's max_bytes lowered below a valid PNG's length
    write_image_model(tmp_path)
    config_path = tmp_path / "pixels" / "config.json"
    config = json.loads(config_path.read_text())
    config["spillway"]["image"]["max_bytes"] = 1000
    config_path.write_text(json.dumps(config))
    page = noise_png(40, 60)
    assert len(page) > 1000

    async def scenario(plane: DataPlane) -> Any:
        try:
            return await plane.infer("pixels", None, *body([page], [0.0]))
        except SpillwayError as error:
            return error

    refused = serve(tmp_path, scenario, max_bytes_per_element=64 * 1024)
    # THEN the model's own bound applies (not the service's larger one)
    assert isinstance(refused, SpillwayError)
    assert (refused.status, refused.code) == (413, "payload_too_large")
