"""Variable-width images: each image resized to a fixed height with its aspect ratio
kept, a request's rows padded on the right to one width bucket, the bucket the batcher
queues the request by, and the graph's width checked dynamic at load.

Expected widths and tensors are written here by hand from the images the test makes,
and checked against rapidocr's own recogniser pre-processing where it is installed."""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image
from pydantic import ValidationError

from gpu_service.batching_policy import batching_policy
from gpu_service.settings import GpuSettings
from spillway.models.config import ImageSpec, ModelConfig
from spillway.models.images import ImageTensors, bucket_width, row_width
from spillway.models.processing import GraphTensor, ImageProcessor, Prepared
from spillway.protocol.errors import ModelLoadError


def grey(width: int, height: int, value: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (width, height), value).save(buffer, format="PNG")
    return buffer.getvalue()


def spec(**fields: Any) -> ImageSpec:
    return ImageSpec.model_validate({"input": "image", "height": 4, "max_width": 20, **fields})


def stack(images: list[bytes], **fields: Any) -> npt.NDArray[Any]:
    tensors = ImageTensors(spec(**fields))
    return tensors.stack(np.array(images, dtype=np.object_), "image")


# -- width and bucket arithmetic -------------------------------------------------------------


@pytest.mark.parametrize(
    ("width", "height", "expected"),
    [
        (64, 32, 96),  # twice as wide as high: 2 × 48
        (48, 48, 48),
        (10, 48, 10),  # narrower than high
        (1, 1000, 1),  # never below one pixel
        (100, 30, 160),  # 48 × 10/3
        (7, 3, 112),  # 48 × 7/3
        (101, 30, 162),  # 161.6 rounds up
        (1000, 10, 320),  # 4800 capped at max_width
    ],
)
def test_a_row_takes_the_height_and_the_width_of_its_aspect_ratio(
    width: int, height: int, expected: int
) -> None:
    recogniser = spec(height=48, max_width=320)
    assert row_width(width, height, recogniser) == expected


@pytest.mark.parametrize(
    ("widest", "expected"),
    [(1, 80), (80, 80), (81, 160), (160, 160), (161, 320), (250, 320), (320, 320)],
)
def test_a_request_pads_to_the_first_bucket_that_holds_its_widest_row(
    widest: int, expected: int
) -> None:
    assert bucket_width(widest, spec(height=48, max_width=320, width_buckets=[80, 160])) == expected


def test_without_buckets_every_request_pads_to_max_width() -> None:
    assert [bucket_width(w, spec()) for w in (1, 7, 20)] == [20, 20, 20]


# -- the tensors --------------------------------------------------------------------------


def test_rows_keep_their_aspect_ratio_and_pad_right_with_zero_after_normalisation() -> None:
    # GIVEN a 2×2 and a 5×2 image (w×h) into height 4: widths 4 and 10, bucket 12
    out = stack([grey(2, 2, 255), grey(5, 2, 51)], width_buckets=[6, 12], mean=[0.5], std=[0.5])
    # THEN each row is its normalised value over its own width, then zeros to 12
    first, second = (255 / 255 - 0.5) / 0.5, (51 / 255 - 0.5) / 0.5
    expected = np.zeros((2, 3, 4, 12), np.float32)
    expected[0, :, :, :4] = first
    expected[1, :, :, :10] = second
    assert out.shape == (2, 3, 4, 12)
    np.testing.assert_allclose(out, expected, atol=1e-6)


def test_nhwc_gray_pads_the_width_axis() -> None:
    out = stack([grey(1, 4, 200)], layout="NHWC", color="GRAY", scale=1.0, width_buckets=[3])
    expected = np.zeros((1, 4, 3, 1), np.float32)
    expected[0, :, :1, 0] = 200.0
    np.testing.assert_array_equal(out, expected)


def test_a_row_wider_than_max_width_is_squeezed_to_it() -> None:
    # GIVEN a 100×2 image: 200 wide at height 4, capped at 20
    out = stack([grey(100, 2, 255)], scale=1.0, color="GRAY", width_buckets=[8])
    assert out.shape == (1, 1, 4, 20)
    np.testing.assert_array_equal(out, np.full((1, 1, 4, 20), 255.0))


def test_the_tensor_equals_rapidocrs_recogniser_input() -> None:
    # GIVEN rapidocr's own padding of a crop to 48 × 320 (its default recogniser shape)
    module = pytest.importorskip("rapidocr_onnxruntime.ch_ppocr_rec.text_recognize")
    ours = spec(height=48, max_width=320, mean=[0.5], std=[0.5], color="BGR")
    owner = SimpleNamespace(rec_image_shape=[3, 48, 320])
    for width, height in [(30, 10), (100, 30), (101, 30), (7, 3), (50, 100), (900, 40)]:
        # WHEN a solid crop (so both resizers agree on every pixel) goes through each
        crop = np.full((height, width, 3), 200, np.uint8)
        theirs = module.TextRecognizer.resize_norm_img(owner, crop, 320 / 48)
        mine = ImageTensors(ours).stack(np.array([grey(width, height, 200)], np.object_), "x")
        # THEN the tensors are equal: same width, same values, same zero padding
        np.testing.assert_allclose(mine[0], theirs, atol=1e-6, err_msg=f"{width}x{height}")


def test_warm_up_images_land_in_their_buckets() -> None:
    tensors = ImageTensors(spec(width_buckets=[6, 12], scale=1.0))
    widths = [tensors.width(tensors.stack(np.array([tensors.sample(w)], np.object_), "x"))
              for w in (4, 10, 20)]  # fmt: skip
    assert widths == [6, 12, 20]


# -- the processor and the batcher's bucket -----------------------------------------------


def _config(image: dict[str, Any]) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": "crops",
            "max_batch_size": 8,
            "input": [{"name": "image", "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [{"name": "total", "data_type": "TYPE_FP32", "dims": [1]}],
            "dynamic_batching": {"max_queue_delay_microseconds": 1000},
            "spillway": {"kind": "image", "image": {"input": "image", **image}},
        }
    )


VARIABLE = {"height": 4, "max_width": 20, "width_buckets": [6, 12], "scale": 1.0}
DYNAMIC = [GraphTensor("pixels", "FP32", ("n", 3, 4, "w"))]


def test_a_requests_length_is_its_bucket_width_and_the_policy_buckets_by_it() -> None:
    # GIVEN a processor over a graph with a dynamic width
    config = _config(VARIABLE)
    processor = ImageProcessor(config, DYNAMIC)
    policy = batching_policy(config, GpuSettings())
    # WHEN requests whose widest rows are 4, 10 and 16 pixels are prepared
    lengths = []
    for widths in ([2, 1], [5], [8, 3]):
        images = np.array([[grey(w, 2, 9)] for w in widths], dtype=np.object_)
        prepared = processor.prepare({"image": images}, len(widths))
        assert prepared.feeds["pixels"].shape == (len(widths), 3, 4, prepared.length)
        lengths.append(prepared.length)
    # THEN each pads to its bucket (16 is over every bucket: max_width) and queues there
    assert lengths == [6, 12, 20]
    assert policy.length_buckets == (6, 12)
    assert [policy.bucket_of(length) for length in lengths] == [0, 1, 2]


def test_a_run_over_several_widths_pads_to_the_widest() -> None:
    # GIVEN requests of two buckets in one run (the CPU fallback or a batch job)
    processor = ImageProcessor(_config(VARIABLE), DYNAMIC)
    narrow = np.ones((1, 3, 4, 6), np.float32)
    wide = np.full((2, 3, 4, 12), 2.0, np.float32)
    # WHEN they are collated
    requests = [Prepared({"pixels": narrow}, 1, 6), Prepared({"pixels": wide}, 2, 12)]
    feeds = processor.collate(requests)
    # THEN the narrow rows gain zero columns on the right
    expected = np.zeros((3, 3, 4, 12), np.float32)
    expected[0, :, :, :6] = 1.0
    expected[1:] = 2.0
    np.testing.assert_array_equal(feeds["pixels"], expected)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        (("n", 3, 4, 32), r"\[N, 3, 4, W \(dynamic\)\]"),
        (("n", 3, 5, "w"), r"\[N, 3, 4, W \(dynamic\)\]"),
        (("n", 3, 4), "shape"),
    ],
    ids=["fixed-width", "other-height", "rank-3"],
)
def test_a_graph_without_a_dynamic_width_is_refused_at_load(
    shape: tuple[int | str, ...], message: str
) -> None:
    with pytest.raises(ModelLoadError, match=message):
        ImageProcessor(_config(VARIABLE), [GraphTensor("pixels", "FP32", shape)])


def test_a_fixed_size_model_keeps_one_bucket() -> None:
    config = _config({"size": [4, 6]})
    processor = ImageProcessor(config, [GraphTensor("pixels", "FP32", ("n", 3, 4, 6))])
    prepared = processor.prepare({"image": np.array([[grey(3, 3, 1)]], np.object_)}, 1)
    assert prepared.length == 0
    assert config.spillway.batch_buckets == ()


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ({"height": 4}, "height and max_width go together"),
        ({"max_width": 4, "size": [4, 4]}, "height and max_width go together"),
        ({}, "size, or else height and max_width"),
        ({"size": [4, 4], "width_buckets": [2]}, "width_buckets go with height"),
        ({**VARIABLE, "width_buckets": [12, 6]}, "strictly increasing"),
        ({**VARIABLE, "width_buckets": [6, 6]}, "strictly increasing"),
        ({**VARIABLE, "width_buckets": [6, 24]}, "at most at max_width 20"),
        ({**VARIABLE, "resize": "letterbox"}, "keeps its aspect ratio"),
        ({**VARIABLE, "width_buckets": [0]}, "greater than or equal to 1"),
    ],
)  # fmt: skip
def test_a_bad_variable_width_section_is_refused(image: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _config(image)
