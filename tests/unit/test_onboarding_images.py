"""Adding an image model: the image kind's configuration from a graph signature, and the
refusals (pure functions, no model run)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from spillway.models.onboarding import BatchProof, configure, generated_inputs, random_png
from spillway.models.processing import GraphTensor
from spillway.models.signature import GraphSignature, ImageOptions, image_config
from spillway.protocol.errors import ModelLoadError

SCORES = (GraphTensor("scores", "FP32", ("batch", 10)),)
NCHW = GraphSignature((GraphTensor("pixels", "FP32", ("batch", 3, 32, 48)),), SCORES)
NHWC_DYNAMIC = GraphSignature((GraphTensor("image", "FP16", ("batch", "h", "w", 3)),), SCORES)


def test_an_nchw_graph_serves_its_pixels_as_encoded_images() -> None:
    # GIVEN an NCHW float input of fixed size WHEN configured as an image model
    options = ImageOptions(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    config = image_config("cnn", NCHW, options, max_batch_size=32)
    # THEN the input is one encoded image per row, under the graph input's name
    assert [(t.name, t.data_type, t.dims) for t in config.input] == [
        ("pixels", "TYPE_STRING", (1,))
    ]
    assert [(t.name, t.data_type, t.dims) for t in config.output] == [
        ("scores", "TYPE_FP32", (10,))
    ]
    assert config.max_batch_size == 32
    # AND the image section has the graph's layout and size and the normalisation given
    assert config.spillway.kind == "image"
    image = config.spillway.image
    assert image is not None
    assert (image.input, image.layout, image.color, image.size) == (
        "pixels",
        "NCHW",
        "RGB",
        (32, 48),
    )
    assert (image.mean, image.std, image.resize) == (options.mean, options.std, "stretch")


def test_an_nhwc_graph_with_a_dynamic_size_takes_the_size_given() -> None:
    # GIVEN an NHWC input with dynamic height and width WHEN configured with a size
    options = ImageOptions(size=(224, 224), color="BGR", resize="letterbox", scale=1.0)
    config = image_config("det", NHWC_DYNAMIC, options, max_batch_size=8)
    # THEN NHWC at that size, the options in the section
    image = config.spillway.image
    assert image is not None
    assert (image.layout, image.size, image.color, image.resize, image.scale) == (
        "NHWC",
        (224, 224),
        "BGR",
        "letterbox",
        1.0,
    )
    assert config.input[0].dims == (1,)


def test_one_channel_is_gray() -> None:
    gray = GraphSignature((GraphTensor("x", "FP32", (None, 1, 28, 28)),), SCORES)
    image = image_config("digits", gray, ImageOptions(), max_batch_size=8).spillway.image
    assert image is not None
    assert (image.color, image.layout, image.size) == ("GRAY", "NCHW", (28, 28))
    # AND RGB for one channel is refused in one line
    with pytest.raises(ModelLoadError, match="has 1 channel"):
        image_config("digits", gray, ImageOptions(color="RGB"), max_batch_size=8)


@pytest.mark.parametrize(
    ("signature", "options", "message"),
    [
        (
            GraphSignature((GraphTensor("x", "FP32", ("batch", 4)),), SCORES),
            ImageOptions(),
            "needs a rank-4 float input",
        ),
        (
            GraphSignature((GraphTensor("x", "INT64", ("batch", 3, 8, 8)),), SCORES),
            ImageOptions(),
            "needs a rank-4 float input",
        ),
        (NHWC_DYNAMIC, ImageOptions(), r"dynamic height or width: give .* \(--image-size H W\)"),
        (NCHW, ImageOptions(size=(64, 64)), "image size 64x64 does not fit"),
        (
            GraphSignature((GraphTensor("x", "FP32", ("batch", 5, 8, 8)),), SCORES),
            ImageOptions(),
            "1 or 3 channels at neither dimension 1",
        ),
        (NCHW, ImageOptions(mean=(1.0, 2.0)), "mean needs 1 or 3 values"),
    ],
    ids=["rank-2", "int64", "dynamic-size", "size-mismatch", "channels", "mean"],
)
def test_refusals_are_one_line(
    signature: GraphSignature, options: ImageOptions, message: str
) -> None:
    with pytest.raises(ModelLoadError, match=message) as info:
        image_config("m", signature, options, max_batch_size=8)
    assert "\n" not in info.value.message


def test_an_image_model_that_is_not_batch_safe_takes_one_image_per_request() -> None:
    # GIVEN an image draft whose proof failed WHEN configured
    draft = image_config("cnn", NCHW, ImageOptions(), max_batch_size=32)
    config = configure(draft, BatchProof(False, 8, "differs"), None)
    # THEN no batching; the image input stays one image, the outputs take whole shapes
    assert config.max_batch_size == 0
    assert config.input[0].dims == (1,)
    assert config.output[0].dims == (-1, 10)


def test_generated_inputs_are_pngs_at_the_models_size() -> None:
    # GIVEN an image model WHEN inputs are generated for the proof
    config = image_config("cnn", NCHW, ImageOptions(), max_batch_size=32)
    inputs = generated_inputs(config, 3)
    # THEN one PNG per row, of the model's size, all different
    assert inputs["pixels"].shape == (3, 1)
    images = [Image.open(io.BytesIO(data)) for data in inputs["pixels"].ravel()]
    assert {(image.format, image.size) for image in images} == {("PNG", (48, 32))}
    assert len(set(inputs["pixels"].ravel())) == 3
    # AND a fixed seed makes them again
    assert generated_inputs(config, 3)["pixels"].tolist() == inputs["pixels"].tolist()
    image = config.spillway.image
    assert image is not None
    assert random_png(image, np.random.default_rng(1)) == random_png(
        image, np.random.default_rng(1)
    )
