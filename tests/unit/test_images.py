"""The image input kind: encoded JPEG/PNG bytes decoded, converted, resized and
normalised in the prepare step, and refused (with a stable code) before decoding when
they are too long or declare too many pixels.

Expected tensors are computed here by hand from the pixels the test wrote, never by the
code under test."""

from __future__ import annotations

import io
import struct
import time
import tracemalloc
import zlib
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image
from PIL import _imaging as pillow_core
from pydantic import ValidationError

from spillway.models.config import ImageSpec, ModelConfig
from spillway.models.images import ImageTensors
from spillway.protocol.errors import (
    ImageTooLargeError,
    InvalidImageError,
    PayloadTooLargeError,
    SpillwayError,
)

# A 2×3 RGB image (rows, columns, channels), values chosen by hand.
PIXELS = np.array(
    [
        [[255, 0, 0], [0, 255, 0], [0, 0, 255]],
        [[10, 20, 30], [40, 50, 60], [200, 100, 0]],
    ],
    dtype=np.uint8,
)


def encode(pixels: npt.NDArray[np.uint8], fmt: str = "PNG", **options: Any) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, **options)
    return buffer.getvalue()


def spec(**fields: Any) -> ImageSpec:
    return ImageSpec.model_validate({"input": "image", "size": [2, 3], **fields})


def tensors(data: list[bytes], **fields: Any) -> npt.NDArray[Any]:
    return ImageTensors(spec(**fields)).stack(np.array(data, dtype=np.object_), "image")


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header declaring ``width``×``height`` grey pixels, with one row of
    data: a few hundred bytes that would decode to ``width * height`` bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    data = zlib.compress(b"\x00" * (width + 1))
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    )


def test_png_decodes_to_the_normalised_pixels_in_nchw() -> None:
    # GIVEN a 2×3 PNG and ImageNet-style normalisation, no resize needed
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    # WHEN it is prepared
    out = tensors([encode(PIXELS)], mean=list(mean), std=list(std))
    # THEN the tensor is (pixel / 255 - mean) / std, channels first
    expected = (PIXELS / 255.0 - np.array(mean)) / np.array(std)
    assert out.shape == (1, 3, 2, 3)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out[0], expected.transpose(2, 0, 1), rtol=1e-6, atol=1e-6)


def test_nhwc_bgr_and_scale_reorder_and_scale_the_channels() -> None:
    out = tensors([encode(PIXELS)], layout="NHWC", color="BGR", scale=1.0, mean=[1.0, 2.0, 3.0])
    expected = PIXELS[:, :, ::-1].astype(np.float64) - np.array([1.0, 2.0, 3.0])
    assert out.shape == (1, 2, 3, 3)
    np.testing.assert_array_equal(out[0], expected)


def test_gray_uses_the_luma_of_each_pixel() -> None:
    out = tensors([encode(PIXELS)], color="GRAY", scale=1.0)
    # ITU-R 601 luma, as integers (Pillow rounds each pixel to a byte)
    red, green, blue = (PIXELS[:, :, c].astype(np.float64) for c in range(3))
    luma = (red * 299 + green * 587 + blue * 114) / 1000
    assert out.shape == (1, 1, 2, 3)
    np.testing.assert_allclose(out[0, 0], luma, atol=1.0)
    assert np.all(out == np.round(out))


def test_nearest_stretch_repeats_each_pixel() -> None:
    out = tensors([encode(PIXELS)], size=[4, 6], interpolation="nearest", scale=1.0)
    expected = PIXELS.repeat(2, axis=0).repeat(2, axis=1)
    np.testing.assert_array_equal(out[0], expected.transpose(2, 0, 1))


def test_letterbox_keeps_the_aspect_ratio_on_the_pad_value() -> None:
    # GIVEN a 2×3 image into 6×6: scaled ×2 to 4×6, one pad row above and below
    out = tensors(
        [encode(PIXELS)],
        size=[6, 6],
        resize="letterbox",
        interpolation="nearest",
        pad_value=7,
        scale=1.0,
        layout="NHWC",
    )
    expected = np.full((6, 6, 3), 7.0)
    expected[1:5] = PIXELS.repeat(2, axis=0).repeat(2, axis=1)
    np.testing.assert_array_equal(out[0], expected)


def test_jpeg_decodes_close_to_its_colour() -> None:
    # GIVEN a solid-colour JPEG (lossy, so close rather than equal)
    colour = np.array([200, 100, 50], dtype=np.uint8)
    jpeg = encode(np.tile(colour, (16, 16, 1)), "JPEG", quality=95)
    assert jpeg[:2] == b"\xff\xd8"
    # WHEN it is prepared with the PNG twin in one request
    out = tensors([jpeg, encode(np.tile(colour, (16, 16, 1)))], size=[8, 8], scale=1.0)
    # THEN both rows hold the colour (the JPEG within 3 levels)
    assert out.shape == (2, 3, 8, 8)
    np.testing.assert_array_equal(out[1], np.broadcast_to(colour[:, None, None], (3, 8, 8)))
    assert np.abs(out[0] - colour[:, None, None]).max() <= 3


@pytest.mark.parametrize(
    ("width", "height", "max_pixels"),
    [(20000, 20000, 16 * 1024 * 1024), (5000, 5000, 1_000_000)],
    ids=["over-pillow-limit", "over-max-pixels"],
)
def test_a_decompression_bomb_is_refused_before_decoding(
    width: int, height: int, max_pixels: int
) -> None:
    # GIVEN a tiny PNG declaring a huge image
    bomb = bomb_png(width, height)
    assert len(bomb) < 64 * 1024
    images = ImageTensors(spec(max_pixels=max_pixels))
    allocated = pillow_core.get_stats()["new_count"]
    tracemalloc.start()
    started = time.monotonic()
    # WHEN it is prepared
    with pytest.raises(ImageTooLargeError) as caught:
        images.stack(np.array([bomb], dtype=np.object_), "image")
    elapsed = time.monotonic() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # THEN a 400 with its code, quickly, and no image memory was ever allocated
    assert (caught.value.status, caught.value.code) == (400, "image_too_large")
    assert elapsed < 1.0
    assert peak < 50 * 1024 * 1024
    assert pillow_core.get_stats()["new_count"] == allocated


@pytest.mark.parametrize(
    "data",
    [
        b"not an image at all",
        encode(PIXELS)[:60],  # a PNG cut inside its data
        encode(PIXELS, "GIF"),  # an image, but not a format the kind accepts
        b"",
    ],
    ids=["text", "truncated-png", "gif", "empty"],
)
def test_what_is_not_a_whole_jpeg_or_png_is_invalid_image(data: bytes) -> None:
    with pytest.raises(InvalidImageError) as caught:
        tensors([data])
    assert (caught.value.status, caught.value.code) == (400, "invalid_image")
    assert "image 0 of input 'image'" in caught.value.message


def test_an_image_over_max_bytes_is_413_before_it_is_opened() -> None:
    png = encode(PIXELS)
    with pytest.raises(PayloadTooLargeError) as caught:
        tensors([png], max_bytes=len(png) - 1)
    assert (caught.value.status, caught.value.code) == (413, "payload_too_large")
    assert tensors([png], max_bytes=len(png)).shape == (1, 3, 2, 3)


def turned(pixels: npt.NDArray[np.uint8], orientation: int) -> bytes:
    """``pixels`` stored as a camera stores a turned shot: the PNG holds them turned (by
    numpy, not Pillow) and its EXIF Orientation says how to show them upright."""
    stored = {3: np.rot90(pixels, 2), 6: np.rot90(pixels, 1), 8: np.rot90(pixels, -1)}
    exif = Image.Exif()
    exif[0x0112] = orientation  # Orientation
    return encode(np.ascontiguousarray(stored[orientation]), exif=exif.tobytes())


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_an_image_is_read_upright_by_its_exif_orientation(orientation: int) -> None:
    # GIVEN the 2x3 image stored turned, with the EXIF orientation that undoes the turn
    data = turned(PIXELS, orientation)
    assert Image.open(io.BytesIO(data)).size == ((3, 2) if orientation == 3 else (2, 3))
    # WHEN it is prepared THEN the tensor is the upright image's, pixel for pixel
    np.testing.assert_array_equal(tensors([data]), tensors([encode(PIXELS)]))
    np.testing.assert_allclose(tensors([data])[0, 0] * 255, PIXELS[:, :, 0], atol=1e-3)


def test_every_refusal_is_a_spillway_error_of_the_row_it_names() -> None:
    with pytest.raises(SpillwayError, match="image 1 of input 'image'"):
        tensors([encode(PIXELS), b"junk"])


# -- the image section of config.json ------------------------------------------------------


def _config(
    image: dict[str, Any] | None,
    kind: str = "image",
    dims: list[int] | None = None,
    served: tuple[str, str] = ("image", "TYPE_STRING"),
) -> dict[str, Any]:
    block: dict[str, Any] = {"kind": kind}
    if image is not None:
        block["image"] = {"input": "image", "size": [4, 4], **image}
    name, data_type = served
    return {
        "name": "pixels",
        "max_batch_size": 4,
        "input": [{"name": name, "data_type": data_type, "dims": dims or [1]}],
        "output": [{"name": "mean", "data_type": "TYPE_FP32", "dims": [3]}],
        "spillway": block,
    }


def test_a_valid_image_section_keeps_its_values() -> None:
    config = ModelConfig.model_validate(_config({"mean": [0.5], "layout": "NHWC"}))
    image = config.spillway.image
    assert image is not None
    assert (image.size, image.layout, image.mean, image.channels) == ((4, 4), "NHWC", (0.5,), 3)
    served = config.to_json_dict()["spillway"]
    assert isinstance(served, dict)
    assert served["image"] == {
        "input": "image",
        "layout": "NHWC",
        "color": "RGB",
        "size": [4, 4],
        "resize": "stretch",
        "interpolation": "bilinear",
        "pad_value": 0,
        "scale": 1 / 255,
        "mean": [0.5],
        "std": [1.0],
        "max_pixels": 16 * 1024 * 1024,
        "max_bytes": 8 * 1024 * 1024,
    }


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (_config({"mean": [0.1, 0.2]}), "mean needs 1 or 3 values"),
        (_config({"color": "GRAY", "std": [1, 1, 1]}), "std needs 1 or 1 values"),
        (_config({"std": [0.0]}), "std values must be positive"),
        (_config({"size": [0, 4]}), "greater than or equal to 1"),
        (_config({"size": [4, 9000]}), "less than or equal to 8192"),
        (_config({"max_pixels": 2**40}), "less than or equal to"),
        (_config({"scale": 0}), "greater than 0"),
        (_config({"layout": "CHW"}), "NCHW"),
        (_config({"unknown": 1}), "Extra inputs are not permitted"),
        (_config(None), 'an image section goes with kind "image"'),
        (_config({}, kind="tensor"), 'an image section goes with kind "image"'),
        (_config({}, dims=[2]), "must be a served BYTES input of dims [1]"),
        (_config({}, served=("x", "TYPE_STRING")), "image input 'image'"),
        (_config({}, served=("image", "TYPE_FP32")), "BYTES"),
    ],
)  # fmt: skip
def test_a_bad_image_section_is_refused(document: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("(", r"\(")):
        ModelConfig.model_validate(document)
