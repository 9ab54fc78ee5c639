"""The OCR models against RapidOCR 1.4.4, the library their files and steps come from.

GIVEN sentences rendered with Pillow's built-in font (a few sizes, slight rotations,
one page upside down) and the three models built from the pinned wheel
WHEN each image goes through ocr-det, then its crops through ocr-cls and ocr-rec, in
process through the serving engine, and through RapidOCR's own pipeline
THEN both find the same lines in the same order, their boxes agree within a pixel or
two, the texts are equal, and the character error rate against the rendered text is
small.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from rapidocr_onnxruntime import RapidOCR

from spillway.models.config import CHECKSUM_FILE
from spillway.models.engine import EngineOptions, OnnxModel
from spillway.models.ocr import CHARSET_FILE, CLS_THRESHOLD
from spillway.protocol.errors import InvalidImageError
from spillway_cli.modelbuild.common import VERSION
from spillway_cli.modelbuild.ocr import (
    CLS,
    DET,
    REC,
    OcrModel,
    build_ocr_cls,
    build_ocr_det,
    build_ocr_rec,
    render_lines,
)

BOX_TOLERANCE_PX = 2.0
MAX_CER = 0.05
TEXT_SCORE = 0.5
"""RapidOCR drops lines read with a lower score; the comparison does the same."""

PAGES = {
    "one line, 32 px": (["Spillway routes requests to a GPU or a CPU."], 32, 0.0),
    "two lines, 24 px": (
        ["The quick brown fox jumps over", "the lazy dog at 10:45 today."],
        24,
        0.0,
    ),
    "three lines, 40 px": (["Invoice 2026-118", "Total due: 1,250.00 EUR", "Thank you!"], 40, 0.0),
    "tilted +2 degrees": (["Batching trades latency for throughput."], 32, 2.0),
    "tilted -3 degrees": (["Models load once per version."], 28, -3.0),
    "upside down": (["Canary releases roll back on errors."], 32, 180.0),
}


@dataclass(frozen=True)
class Models:
    root: Path
    det: OnnxModel
    cls: OnnxModel
    rec: OnnxModel


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    out = tmp_path_factory.mktemp("ocr-models")
    for build in (build_ocr_det, build_ocr_cls, build_ocr_rec):
        build(out)

    def load(model: OcrModel) -> OnnxModel:
        path = out / model.name / VERSION
        return OnnxModel(model.name, int(VERSION), model.config, path, EngineOptions())

    return Models(out, load(DET), load(CLS), load(REC))


@pytest.fixture(scope="module")
def reference() -> RapidOCR:
    return RapidOCR()


@dataclass(frozen=True)
class Line:
    box: np.ndarray
    text: str
    score: float


def spillway_ocr(models: Models, image: bytes) -> tuple[list[Line], list[int]]:
    """det → cls → rec, one request each; the lines RapidOCR would keep, and the angles."""
    found = models.det.infer({"image": np.array([image], dtype=np.object_)})
    if len(found["crops"]) == 0:
        return [], []
    turned = models.cls.infer({"crops": found["crops"]})
    read = models.rec.infer({"crops": turned["crops"]})
    lines = [
        Line(box, text.decode(), float(score))
        for box, text, score in zip(
            found["boxes"], read["text"][:, 0], read["text_score"][:, 0], strict=True
        )
    ]
    angles = turned["angle"][:, 0].tolist()
    return [line for line in lines if line.score >= TEXT_SCORE], angles


def rapidocr_lines(reference: RapidOCR, image: bytes) -> list[Line]:
    result, _ = reference(image)
    return [Line(np.array(box, np.float32), text, score) for box, text, score in result or []]


def edit_distance(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (ca != cb))
    return row[-1]


@pytest.mark.parametrize("page", PAGES, ids=list(PAGES))
def test_ocr_models_match_rapidocr(models: Models, reference: RapidOCR, page: str) -> None:
    # GIVEN a rendered page
    lines, size, angle = PAGES[page]
    image = render_lines(lines, size=size, angle=angle, min_side=720)
    # WHEN Spillway's three models and RapidOCR read it
    ours, angles = spillway_ocr(models, image)
    theirs = rapidocr_lines(reference, image)
    # THEN the same lines, boxes and texts
    assert [line.text for line in ours] == [line.text for line in theirs]
    for mine, its in zip(ours, theirs, strict=True):
        assert np.abs(mine.box - its.box).max() <= BOX_TOLERANCE_PX, (mine.box, its.box)
        assert mine.score == pytest.approx(its.score, abs=0.01)
    # AND a page read upside down was turned by the classifier
    if angle == 180.0:
        assert set(angles) == {180}
    # AND the text is the rendered one, give or take a character (spaces aside: the
    # model drops some between words in small print, as RapidOCR's run does)
    truth = "".join("".join(lines).split())
    read = "".join("".join(line.text for line in ours).split())
    cer = edit_distance(read, truth) / len(truth)
    assert cer <= MAX_CER, (read, truth, cer)


def test_positions_give_one_step_per_character(models: Models) -> None:
    # GIVEN one crop of a word
    crop = render_lines(["Spillway"], size=32, pad=4)
    # WHEN it is recognised
    read = models.rec.infer({"crops": np.array([[crop]], dtype=np.object_)})
    # THEN each character has a CTC step, increasing, inside the crop's width
    text = read["text"][0, 0].decode()
    positions = json.loads(read["char_positions"][0, 0])
    assert text == "Spillway"
    steps = positions["timesteps"]
    assert len(steps) == len(text)
    assert steps == sorted(steps)
    width = 32 * 8 + 8  # no more than the rendered word's pixels
    assert 0 < (steps[-1] + 0.5) * positions["step_width"] < width * 1.5


def test_classifier_keeps_an_upright_crop_unchanged(models: Models) -> None:
    # GIVEN an upright crop and the same crop upside down
    upright = render_lines(["Spillway reads lines"], size=32, pad=4)
    flipped = render_lines(["Spillway reads lines"], size=32, pad=4, angle=180)
    # WHEN they are classified
    out = models.cls.infer({"crops": np.array([[upright], [flipped]], dtype=np.object_)})
    # THEN the upright one passes as it came; the other is turned and both read alike
    assert out["angle"][:, 0].tolist() == [0, 180]
    assert out["angle_score"][1, 0] > CLS_THRESHOLD
    assert out["crops"][0, 0] == upright
    read = models.rec.infer({"crops": out["crops"]})
    assert [t.decode() for t in read["text"][:, 0]] == ["Spillway reads lines"] * 2


def test_a_photo_stored_turned_is_read_by_its_exif_orientation(models: Models) -> None:
    # GIVEN a two-line page as a camera held sideways stores it: a JPEG of the page
    # turned a quarter clockwise, whose EXIF Orientation (8) says to turn it back
    lines, size, _ = PAGES["two lines, 24 px"]
    page = Image.open(io.BytesIO(render_lines(lines, size=size, min_side=720)))
    exif = Image.Exif()
    exif[0x0112] = 8  # Orientation: rotate 90 degrees clockwise to show
    stored = io.BytesIO()
    page.transpose(Image.Transpose.ROTATE_270).save(stored, "JPEG", quality=95, exif=exif)
    # WHEN the models read the stored bytes
    ours, _ = spillway_ocr(models, stored.getvalue())
    # THEN both lines are read, in order, as on the upright page
    upright, _ = spillway_ocr(models, render_lines(lines, size=size, min_side=720))
    assert [line.text for line in ours] == [line.text for line in upright]
    assert len(ours) == len(lines)


def test_blank_page_has_no_lines(models: Models) -> None:
    # GIVEN a page with no text
    blank = render_lines([" "], size=32, min_side=320)
    # WHEN it is detected
    found = models.det.infer({"image": np.array([blank], dtype=np.object_)})
    # THEN no boxes, scores or crops, each with its shape
    assert found["boxes"].shape == (0, 4, 2)
    assert found["box_scores"].shape == (0,)
    assert found["crops"].shape == (0, 1)


def test_a_crop_that_is_not_an_image_is_refused(models: Models) -> None:
    # GIVEN a crop row that is not a JPEG or PNG
    crops = np.array([[b"not an image"]], dtype=np.object_)
    # WHEN it is prepared THEN it is the request's invalid_image error
    with pytest.raises(InvalidImageError):
        models.rec.infer({"crops": crops})


def test_models_serve_the_wheel_files_unchanged(models: Models) -> None:
    # GIVEN the built repository
    for model in (DET, CLS, REC):
        version_dir = models.root / model.name / VERSION
        # THEN each version's checksums list the wheel's file, its digest pinned
        lines = (version_dir / CHECKSUM_FILE).read_text().splitlines()
        sums = {name: digest for digest, name in (line.split("  ", 1) for line in lines)}
        assert sums["model.onnx"] == model.sha256
    # AND the recogniser's characters came from its metadata
    charset = (models.root / REC.name / VERSION / CHARSET_FILE).read_text(encoding="utf-8")
    assert len(charset.splitlines()) == 6623
