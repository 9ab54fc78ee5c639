"""Word boundaries in a recognised text line: the spaces PP-OCR leaves out.

PP-OCRv4's recogniser drops most spaces between English words in small print
("theoldelephantwalked"). A line's crop still shows them: an inter-word space is a run
of blank pixel columns several times wider than the gaps between the letters of a word.
``spaced`` puts a space between two consecutive characters when the widest blank run
between their positions (``char_positions``: the CTC step of each character and the
width of a step in the crop's pixels) is at least ``WORD_GAP`` of the crop's height.

The CTC steps alone are too coarse for it (a step is a third to half a letter wide, and
letters differ in width): on rendered English sentences the steps' gaps against the
line's median gap made the word error rate worse, the blank columns cut it from 0.47 to
0.10 (docs/ocr.md).
"""

from __future__ import annotations

import json

import cv2
import numpy as np

from spillway.models import ocr_geometry as geometry
from spillway.protocol.errors import InvalidInputError

WORD_GAP = 0.17
"""A blank run at least this fraction of the crop's height between two characters is a
space (letters of one word leave under 0.1, words 0.25 or more in common fonts)."""
INK_CONTRAST = 64
"""A pixel this far (0-255) from the crop's median grey is ink."""


def blank_runs(image: geometry.Image) -> list[tuple[int, int]]:
    """``[start, end)`` column ranges without ink between the line's first and last ink
    column (the background is the crop's median grey: dark text on light, or light on
    dark)."""
    grey = cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_BGR2GRAY).astype(np.int16)
    ink: np.ndarray = np.asarray((np.abs(grey - np.median(grey)) > INK_CONTRAST).any(axis=0))
    columns = np.flatnonzero(ink)
    if columns.size == 0:
        return []
    inside = ink[columns[0] : columns[-1] + 1]
    edges = np.flatnonzero(np.diff(np.concatenate(([1], inside.astype(np.int8), [1]))))
    starts, ends = edges[0::2], edges[1::2]
    return [(int(s + columns[0]), int(e + columns[0])) for s, e in zip(starts, ends, strict=True)]


def positions(char_positions: bytes | str, text: str) -> list[float]:
    """Each character's centre in the crop's pixels, from ``char_positions``."""
    try:
        found = json.loads(char_positions)
        steps, width = found["timesteps"], float(found["step_width"])
        centres = [(float(step) + 0.5) * width for step in steps]
    except (ValueError, KeyError, TypeError) as error:
        raise InvalidInputError(f"char_positions is not a positions object: {error}") from error
    if len(centres) != len(text):
        raise InvalidInputError(
            f"char_positions has {len(centres)} positions for {len(text)} characters"
        )
    return centres


def spaced(text: str, centres: list[float], image: geometry.Image) -> str:
    """``text`` with a space wherever a blank run between two characters is a word gap."""
    runs = blank_runs(image)
    least = WORD_GAP * image.shape[0]
    out = text[:1]
    for i in range(1, len(text)):
        left, right = centres[i - 1], centres[i]
        if " " not in (text[i - 1], text[i]) and any(
            min(end, right) - max(start, left) >= least for start, end in runs
        ):
            out += " "
        out += text[i]
    return out
