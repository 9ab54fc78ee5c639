"""Text detection geometry: the image steps around PP-OCR's DB detector.

The arithmetic follows RapidOCR 1.4.4 (``rapidocr_onnxruntime``: ``main.py``,
``ch_ppocr_det``; Apache-2.0, after PaddleOCR) step for step, so that the served boxes
and crops are the library's to the pixel: the image is scaled into a side range,
letterboxed when it is a thin strip, scaled so its shorter side reaches 736 with both
sides multiples of 32; the probability map is thresholded, each contour's minimum-area
box scored, expanded (unclip) and clipped; boxes are sorted top-to-bottom,
left-to-right and each is cut out with a perspective warp (turned when tall).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt
import pyclipper

Image = npt.NDArray[np.uint8]
Boxes = npt.NDArray[np.float32]

MAX_SIDE = 2000
"""An image's longer side is scaled down to this before detection."""
MIN_SIDE = 30
"""An image's shorter side is scaled up to this."""
MIN_HEIGHT = 30
"""An image at most this high is letterboxed (top and bottom) before detection."""
MAX_WIDTH_RATIO = 8
"""An image wider than this many heights is letterboxed before detection."""
DET_LIMIT_SIDE = 736
"""The detector's input: the shorter side scaled up to this (``limit_type: min``)."""
DET_MAX_SIDE = 4096
"""The detector's input: the longer side never above this (not in RapidOCR, whose
scaling of a narrow strip is unbounded; no image in its usual range reaches it)."""
THRESH = 0.3
BOX_THRESH = 0.5
MAX_CANDIDATES = 1000
UNCLIP_RATIO = 1.6
MIN_SIZE = 3
SAME_LINE_PX = 10
"""Boxes whose top-left corners are this close vertically are read left to right."""
_DILATION = np.ones((2, 2), dtype=np.uint8)


@dataclass(frozen=True)
class DetInput:
    """One image ready for the detector, and how to map its boxes back."""

    tensor: npt.NDArray[np.float32]
    """``[1, 3, H, W]``, H and W multiples of 32."""
    image: Image
    """The scaled, letterboxed BGR image the boxes are found in and cut from."""
    scale: tuple[float, float]
    """Original pixels per ``image`` pixel, ``(x, y)``."""
    top: int
    """Letterbox rows above the image."""
    original: tuple[int, int]
    """The original ``(height, width)``."""


def _resize_to_32(image: Image, ratio: float) -> Image:
    height, width = image.shape[:2]
    new_h = round(int(height * ratio) / 32) * 32
    new_w = round(int(width * ratio) / 32) * 32
    if new_h <= 0 or new_w <= 0:
        return image[:0, :0]
    return np.asarray(cv2.resize(image, (new_w, new_h)), dtype=np.uint8)


def _fit_sides(image: Image) -> tuple[Image, float, float]:
    """RapidOCR's ``reduce_max_side`` then ``increase_min_side``; the scales compose."""
    scale_x = scale_y = 1.0
    for limit, apply in ((MAX_SIDE, max), (MIN_SIDE, min)):
        height, width = image.shape[:2]
        side = apply(height, width)
        if (side > limit) if apply is max else (side < limit):
            resized = _resize_to_32(image, limit / side)
            if resized.size == 0:
                return resized, scale_x, scale_y
            scale_x *= width / resized.shape[1]
            scale_y *= height / resized.shape[0]
            image = resized
    return image, scale_x, scale_y


def _letterbox(image: Image) -> tuple[Image, int]:
    height, width = image.shape[:2]
    if height > MIN_HEIGHT and width / height <= MAX_WIDTH_RATIO:
        return image, 0
    target = max(int(width / MAX_WIDTH_RATIO), MIN_HEIGHT) * 2
    pad = int(abs(target - height) / 2)
    padded = cv2.copyMakeBorder(image, pad, pad, 0, 0, cv2.BORDER_CONSTANT, value=0)
    return np.asarray(padded, dtype=np.uint8), pad


def det_input(bgr: Image) -> DetInput | None:
    """The detector's input for a decoded BGR image; ``None`` when it scales to nothing
    (then it holds no text)."""
    original = (bgr.shape[0], bgr.shape[1])
    image, scale_x, scale_y = _fit_sides(bgr)
    if image.size == 0:
        return None
    image, top = _letterbox(image)
    height, width = image.shape[:2]
    ratio = DET_LIMIT_SIDE / min(height, width) if min(height, width) < DET_LIMIT_SIDE else 1.0
    ratio = min(ratio, DET_MAX_SIDE / max(height, width))
    resized = _resize_to_32(image, ratio)
    if resized.size == 0:
        return None
    normalised = (resized.astype(np.float32) / 255.0 - 0.5) / 0.5
    tensor = np.ascontiguousarray(normalised.transpose(2, 0, 1)[np.newaxis], dtype=np.float32)
    return DetInput(tensor, image, (scale_x, scale_y), top, original)


def _mini_box(contour: npt.NDArray[Any]) -> tuple[Boxes, float]:
    """The minimum-area rectangle's corners from the top-left, clockwise, and its
    shorter side."""
    rect = cv2.minAreaRect(contour)
    points = sorted(cv2.boxPoints(rect).tolist(), key=lambda p: p[0])
    left = (0, 1) if points[1][1] > points[0][1] else (1, 0)
    right = (2, 3) if points[3][1] > points[2][1] else (3, 2)
    box = np.array(
        [points[left[0]], points[right[0]], points[right[1]], points[left[1]]], dtype=np.float32
    )
    return box, float(min(rect[1]))


def _box_score(pred: npt.NDArray[np.float32], box: Boxes) -> float:
    """The mean probability inside the box (RapidOCR's ``score_mode: fast``)."""
    height, width = pred.shape
    xmin = int(np.clip(np.floor(box[:, 0].min()), 0, width - 1))
    xmax = int(np.clip(np.ceil(box[:, 0].max()), 0, width - 1))
    ymin = int(np.clip(np.floor(box[:, 1].min()), 0, height - 1))
    ymax = int(np.clip(np.ceil(box[:, 1].max()), 0, height - 1))
    mask = np.zeros((ymax - ymin + 1, xmax - xmin + 1), dtype=np.uint8)
    shifted = (box - np.array([xmin, ymin], dtype=np.float32)).astype(np.int32)
    cv2.fillPoly(mask, [shifted.reshape(-1, 2)], 1)
    return float(cv2.mean(pred[ymin : ymax + 1, xmin : xmax + 1], mask)[0])


def _unclip(box: Boxes) -> npt.NDArray[Any]:
    """The box grown by ``area * UNCLIP_RATIO / perimeter`` on every side."""
    distance = cv2.contourArea(box) * UNCLIP_RATIO / cv2.arcLength(box, True)
    offset = pyclipper.PyclipperOffset()
    offset.AddPath(box, pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    return np.array(offset.Execute(distance)).reshape((-1, 1, 2))


def db_boxes(pred: npt.NDArray[np.float32], height: int, width: int) -> tuple[Boxes, list[float]]:
    """DB post-processing of one probability map ``[h, w]``: boxes ``[N, 4, 2]`` in a
    ``height``×``width`` image and their scores."""
    mask = cv2.dilate((pred > THRESH).astype(np.uint8), _DILATION)
    contours, _ = cv2.findContours(mask * 255, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    map_h, map_w = pred.shape
    boxes, scores = [], []
    for contour in contours[:MAX_CANDIDATES]:
        points, side = _mini_box(contour)
        if side < MIN_SIZE:
            continue
        score = _box_score(pred, points)
        if score < BOX_THRESH:
            continue
        box, side = _mini_box(_unclip(points))
        if side < MIN_SIZE + 2:
            continue
        box[:, 0] = np.clip(np.round(box[:, 0] / map_w * width), 0, width)
        box[:, 1] = np.clip(np.round(box[:, 1] / map_h * height), 0, height)
        boxes.append(box.astype(np.int32))
        scores.append(score)
    return np.array(boxes, dtype=np.float32).reshape(-1, 4, 2), scores


def _clockwise(box: Boxes) -> Boxes:
    by_x = box[np.argsort(box[:, 0], kind="stable")]
    left = by_x[:2][np.argsort(by_x[:2, 1], kind="stable")]
    right = by_x[2:][np.argsort(by_x[2:, 1], kind="stable")]
    return np.array([left[0], right[0], right[1], left[1]], dtype=np.float32)


def kept_boxes(boxes: Boxes, height: int, width: int) -> list[int]:
    """Orders each box's corners clockwise from the top-left and clips them to the image
    in place; the indices of the boxes wider and higher than 3 pixels."""
    kept = []
    for index in range(len(boxes)):
        box = _clockwise(boxes[index])
        box[:, 0] = np.clip(box[:, 0], 0, width - 1).astype(np.int32)
        box[:, 1] = np.clip(box[:, 1], 0, height - 1).astype(np.int32)
        boxes[index] = box
        if int(np.linalg.norm(box[0] - box[1])) > 3 and int(np.linalg.norm(box[0] - box[3])) > 3:
            kept.append(index)
    return kept


def reading_order(boxes: Boxes, indices: list[int]) -> list[int]:
    """``indices`` sorted top-to-bottom, then left-to-right within a line (RapidOCR's
    ``sorted_boxes``)."""
    order = sorted(indices, key=lambda i: (boxes[i][0][1], boxes[i][0][0]))
    for i in range(len(order) - 1):
        for j in range(i, -1, -1):
            upper, lower = boxes[order[j]][0], boxes[order[j + 1]][0]
            if abs(lower[1] - upper[1]) < SAME_LINE_PX and lower[0] < upper[0]:
                order[j], order[j + 1] = order[j + 1], order[j]
            else:
                break
    return order


def crop(image: Image, box: Boxes) -> Image:
    """The box cut out of ``image`` upright (perspective warp), turned a quarter when at
    least 1.5 times as high as wide."""
    width = int(max(np.linalg.norm(box[0] - box[1]), np.linalg.norm(box[2] - box[3])))
    height = int(max(np.linalg.norm(box[0] - box[3]), np.linalg.norm(box[1] - box[2])))
    target = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float32)
    matrix = cv2.getPerspectiveTransform(box, target)
    out = np.asarray(
        cv2.warpPerspective(
            image, matrix, (width, height), borderMode=cv2.BORDER_REPLICATE, flags=cv2.INTER_CUBIC
        ),
        dtype=np.uint8,
    )
    if out.shape[0] / out.shape[1] >= 1.5:
        out = np.rot90(out)
    return out


def to_original(boxes: Boxes, det: DetInput) -> Boxes:
    """Boxes in ``det.image`` mapped back to the original image's pixels."""
    out = boxes.astype(np.float32, copy=True)
    out[:, :, 1] -= det.top
    out[:, :, 0] *= det.scale[0]
    out[:, :, 1] *= det.scale[1]
    height, width = det.original
    out[:, :, 0] = np.clip(out[:, :, 0], 0, width)
    out[:, :, 1] = np.clip(out[:, :, 1], 0, height)
    return out
