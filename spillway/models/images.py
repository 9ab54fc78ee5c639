"""Encoded images to tensors: the prepare step of ``image`` models.

An encoded image is untrusted input whose cost is not its size: a few hundred bytes of
PNG may declare 20000×20000 pixels. So the encoded length is checked before the bytes
are opened, the pixel count the header declares before anything is decoded, and only
JPEG and PNG are ever parsed. An image is turned upright by its EXIF orientation.

A variable-width spec (``height``, ``max_width``, ``width_buckets``) resizes each image
to the height with its aspect ratio kept and pads the request's rows on the right to one
bucket width, so requests whose rows have similar widths share a shape and a batch.
"""

from __future__ import annotations

import io
import math
import struct
import zlib
from typing import Any

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageOps, UnidentifiedImageError

from spillway.models.config import ImageSpec
from spillway.protocol.errors import ImageTooLargeError, InvalidImageError, PayloadTooLargeError

FORMATS = ("JPEG", "PNG")
_RESAMPLING = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
_CORRUPT = (OSError, ValueError, SyntaxError, EOFError, struct.error, zlib.error)
"""What Pillow raises on a damaged file, depending on where the damage is."""


def open_image(data: bytes, spec: ImageSpec, what: str) -> Image.Image:
    """The decoded image in ``spec.color``'s mode (``L`` or ``RGB``); ``what`` names the
    element in error messages."""
    if len(data) > spec.max_bytes:
        raise PayloadTooLargeError(f"{what} has {len(data)} bytes, over max_bytes {spec.max_bytes}")
    try:
        # Opening reads the header only: the size is known before any pixel is decoded.
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise ImageTooLargeError(f"{what} declares too many pixels") from None
    except (UnidentifiedImageError, *_CORRUPT):
        raise InvalidImageError(f"{what} is not a JPEG or PNG image") from None
    width, height = image.size
    if width * height > spec.max_pixels:
        raise ImageTooLargeError(
            f"{what} declares {width}x{height} pixels, over max_pixels {spec.max_pixels}"
        )
    try:
        image.load()
        # A camera stores a turned photo as shot and says how to turn it in its EXIF
        # Orientation tag (JPEG, and PNG's eXIf chunk): shown as the user sees it, not as
        # stored, so a portrait page is read upright.
        upright = ImageOps.exif_transpose(image) or image
        return upright.convert("L" if spec.color == "GRAY" else "RGB")
    except _CORRUPT:
        raise InvalidImageError(f"{what} is a corrupt or truncated image") from None


def row_width(width: int, height: int, spec: ImageSpec) -> int:
    """The width a ``width``×``height`` image takes at a variable-width spec's height."""
    if spec.max_width is None:
        raise ValueError("row_width needs a variable-width image spec")
    # PP-OCR's arithmetic, a float ratio then ceil, so that a crop gets the width its
    # recogniser computes for it, to the pixel.
    return min(spec.max_width, math.ceil(spec.tensor_height * (width / float(height))))


def bucket_width(widest: int, spec: ImageSpec) -> int:
    """The width a request whose widest row is ``widest`` pads to: the first width bucket
    that holds it, else ``max_width``."""
    if spec.max_width is None:
        raise ValueError("bucket_width needs a variable-width image spec")
    return next((edge for edge in spec.width_buckets or () if widest <= edge), spec.max_width)


def fit(image: Image.Image, spec: ImageSpec) -> Image.Image:
    """``image`` resized to ``spec.size``: stretched, or letterboxed (aspect ratio kept,
    centred on ``pad_value``); or to ``spec.height``, its width from its aspect ratio."""
    resample = _RESAMPLING[spec.interpolation]
    if spec.size is None:
        target = (row_width(image.width, image.height, spec), spec.tensor_height)
        return image if image.size == target else image.resize(target, resample)
    height, width = spec.size
    if spec.resize == "stretch" or image.size == (width, height):
        return image if image.size == (width, height) else image.resize((width, height), resample)
    ratio = min(width / image.width, height / image.height)
    inner = (
        min(width, max(1, round(image.width * ratio))),
        min(height, max(1, round(image.height * ratio))),
    )
    fill: Any = spec.pad_value if image.mode == "L" else (spec.pad_value,) * 3
    canvas = Image.new(image.mode, (width, height), fill)
    canvas.paste(image.resize(inner, resample), ((width - inner[0]) // 2, (height - inner[1]) // 2))
    return canvas


class ImageTensors:
    """Encoded images to one float tensor ``[N, C, H, W]`` or ``[N, H, W, C]``."""

    def __init__(self, spec: ImageSpec, dtype: npt.DTypeLike = np.float32) -> None:
        self.spec = spec
        self.dtype = np.dtype(dtype)
        self._scale = np.float32(spec.scale)
        self._mean = np.asarray(spec.mean, dtype=np.float32)
        self._std = np.asarray(spec.std, dtype=np.float32)

    @property
    def shape(self) -> tuple[int | None, ...]:
        """One image's tensor shape, without the batch dimension (width ``None`` when it
        varies)."""
        spec = self.spec
        height, width = spec.tensor_height, None if spec.size is None else spec.size[1]
        if spec.layout == "NCHW":
            return spec.channels, height, width
        return height, width, spec.channels

    @property
    def _width_axis(self) -> int:
        return 3 if self.spec.layout == "NCHW" else 2

    def width(self, tensor: npt.NDArray[Any]) -> int:
        """A stacked tensor's bucket key: its padded width when the width varies, else 0
        (every request alike)."""
        return 0 if self.spec.size is not None else int(tensor.shape[self._width_axis])

    def widen(self, tensor: npt.NDArray[Any], width: int) -> npt.NDArray[Any]:
        """A stacked tensor padded on the right to ``width`` (0, like a bucket's pad)."""
        extra = width - tensor.shape[self._width_axis]
        if extra <= 0:
            return tensor
        pads = [(0, 0)] * tensor.ndim
        pads[self._width_axis] = (0, extra)
        return np.pad(tensor, pads)

    def one(self, data: bytes, what: str) -> npt.NDArray[np.float32]:
        """One encoded image as a normalised ``[H, W, C]`` float32 array."""
        image = fit(open_image(data, self.spec, what), self.spec)
        pixels = np.asarray(image, dtype=np.float32)
        if pixels.ndim == 2:
            pixels = pixels[:, :, np.newaxis]
        if self.spec.color == "BGR":
            pixels = pixels[:, :, ::-1]
        normalised: npt.NDArray[np.float32] = (pixels * self._scale - self._mean) / self._std
        return normalised

    def stack(self, elements: npt.NDArray[Any], name: str) -> npt.NDArray[Any]:
        """The tensor of a request's image elements, one per row, in the spec's layout."""
        images = [
            self.one(_element_bytes(e), f"image {row} of input {name!r}")
            for row, e in enumerate(elements)
        ]
        batch = np.stack(images) if self.spec.size is not None else self._padded(images)
        if self.spec.layout == "NCHW":
            batch = batch.transpose(0, 3, 1, 2)
        return np.ascontiguousarray(batch, dtype=self.dtype)

    def _padded(self, images: list[npt.NDArray[np.float32]]) -> npt.NDArray[np.float32]:
        """Variable-width ``[H, w, C]`` rows stacked on the request's bucket width."""
        width = bucket_width(max(image.shape[1] for image in images), self.spec)
        height, _, channels = images[0].shape
        # PP-OCR pads with 0 after normalisation: the recogniser was trained on that.
        batch = np.zeros((len(images), height, width, channels), np.float32)
        for row, image in enumerate(images):
            batch[row, :, : image.shape[1]] = image
        return batch

    def sample(self, width: int = 8) -> bytes:
        """A small PNG (mid grey) for warming a model up: any image becomes a tensor of
        the model's shape; at a variable-width spec's height, ``width`` wide."""
        size = (8, 8) if self.spec.height is None else (width, self.spec.height)
        buffer = io.BytesIO()
        Image.new("L", size, 128).save(buffer, format="PNG")
        return buffer.getvalue()


def _element_bytes(element: object) -> bytes:
    if isinstance(element, bytes | bytearray):
        return bytes(element)
    raise InvalidImageError("an image element must be the bytes of a JPEG or PNG file")
