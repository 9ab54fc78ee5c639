"""The ``ocr`` and ``ocr-topics`` pipelines on the real PP-OCR models.

GIVEN the OCR models, ``ocr-lines`` and both pipelines built into a fresh repository
(with ``minilm`` and ``topics-head`` linked from the session's), and English sentences
rendered with Pillow's built-in font
WHEN a page goes through the CPU fallback and the GPU service's data plane in-process
THEN each answers one line per box in reading order with the spaces between words put
back (the word error rate well under the recogniser's own), ``ocr-topics`` labels the
page's text, and a bad image is a 400 with its stable code.
"""

from __future__ import annotations

import asyncio
import io
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from gpu_service.dataplane import DataPlane
from gpu_service.registry import ModelRegistry
from gpu_service.settings import GpuSettings
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.processing import Tensors
from spillway.models.repository import LocalRepository
from spillway.protocol.codec import decode_response, encode_request
from spillway.protocol.errors import SpillwayError
from spillway_cli.modelbuild import minilm, topics
from spillway_cli.modelbuild.build import build_repository
from spillway_cli.modelbuild.ocr import render_lines
from tests.support import link_model

SENTENCES = [
    "the old elephant walked slowly to the river at dawn",
    "Invoice 2026 total due is 1,250 EUR by Friday",
    "please review this message before it is posted",
    "our team shipped a new model to production today",
    "a small cat sat on the warm mat in the sun",
    "refund requests take up to five business days",
    "click here to claim your free prize now",
    "the weather will be cold and windy this weekend",
]
SIZES = (16, 20, 32)
MAX_WER = 0.15
"""Over the sizes; the recogniser alone (spaces as it reads them) is near 0.5."""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("ocr-pipelines")
    for name in (minilm.NAME, topics.HEAD):
        link_model(models_dir, root, name)
    build_repository(root, ["ocr-det", "ocr-cls", "ocr-rec", "ocr-lines", "ocr", "ocr-topics"])
    return root


@pytest.fixture(scope="module")
def cpu(repo: Path) -> CpuService:
    return CpuService.load(
        CpuSettings(
            repository=str(repo), models=["ocr-det", "ocr-cls", "ocr-rec", "ocr", "ocr-topics"]
        )
    )


def word_errors(truth: str, read: str) -> tuple[int, int]:
    a, b = truth.split(), read.split()
    row = list(range(len(b) + 1))
    for i, wa in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, wb in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (wa != wb))
    return row[-1], len(a)


def infer(cpu: CpuService, model: str, image: bytes) -> Tensors:
    body, length = encode_request(
        {"image": np.array([image], dtype=np.object_)}, binary=True, binary_outputs=True
    )
    encoded = cpu.infer(model, None, body, length)
    return decode_response(encoded.body, encoded.header_length)[1]


def texts(column: np.ndarray) -> list[str]:
    return [t.decode() for t in column.reshape(-1)]


def test_ocr_puts_back_the_spaces_between_words(cpu: CpuService) -> None:
    errors = {"ocr": [0, 0], "ocr-rec": [0, 0]}
    for size in SIZES:
        # GIVEN eight sentences on a page
        page = render_lines(SENTENCES, size=size, min_side=720)
        # WHEN the ocr pipeline reads it
        started = time.perf_counter()
        out = infer(cpu, "ocr", page)
        print(f"size {size}: {time.perf_counter() - started:.2f} s a page")
        # THEN one line a sentence, in order, with its box and score
        lines = texts(out["text"])
        assert out["counts"].tolist() == [len(SENTENCES)]
        assert out["boxes"].shape == (len(SENTENCES), 4, 2)
        assert out["scores"].shape == (len(SENTENCES), 1)
        order = out["boxes"][:, 0, 1]
        assert order.tolist() == sorted(order.tolist())
        # AND the words are the rendered ones, far more often than the recogniser's own
        raw = cpu_rec_texts(cpu, page)
        for truth, spaced, alone in zip(SENTENCES, lines, raw, strict=True):
            for key, read in (("ocr", spaced), ("ocr-rec", alone)):
                wrong, total = word_errors(truth, read)
                errors[key][0] += wrong
                errors[key][1] += total
    wer = {key: wrong / total for key, (wrong, total) in errors.items()}
    print(f"word error rate: {wer}")
    assert wer["ocr"] <= MAX_WER
    assert wer["ocr"] < wer["ocr-rec"] / 2


def cpu_rec_texts(cpu: CpuService, page: bytes) -> list[str]:
    """The recogniser's texts of the page's lines, as ocr-rec gives them."""
    det = cpu.get("ocr-det", None).infer({"image": np.array([page], dtype=np.object_)})
    upright = cpu.get("ocr-cls", None).infer({"crops": det["crops"]})["crops"]
    return texts(cpu.get("ocr-rec", None).infer({"crops": upright})["text"])


def test_ocr_topics_labels_the_page(cpu: CpuService) -> None:
    # GIVEN a page about animals
    page = render_lines(
        ["the old elephant walked slowly", "to the river with her calf"], size=20, min_side=720
    )
    # WHEN ocr-topics reads it
    out = infer(cpu, "ocr-topics", page)
    # THEN the page's text, its lines joined, and the label of that text
    assert texts(out["text"]) == ["the old elephant walked slowly\nto the river with her calf"]
    assert out["label"].shape == (1, 1)
    assert out["scores"].shape == (1, 6)
    assert texts(out["label"]) == ["animals"]


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (width, height), 255).save(buffer, format="PNG")
    return buffer.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A PNG that says it is ``width`` x ``height`` (one grey row of pixels follows)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    pixels = zlib.compress(b"\x00" + b"\xff" * width)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


BAD_IMAGES = {
    "truncated JPEG": (b"\xff\xd8\xff\xe0" + b"\x00" * 64, "invalid_image"),
    "a text file": (b"hello, this is not an image\n", "invalid_image"),
    "20k x 20k PNG header": (_png_header(20_000, 20_000), "image_too_large"),
    "20k x 20k PNG (a whole file, under max_bytes)": (_png(20_000, 20_000), "image_too_large"),
}


@pytest.mark.parametrize("case", BAD_IMAGES, ids=list(BAD_IMAGES))
def test_a_bad_image_is_refused_with_its_code(cpu: CpuService, case: str) -> None:
    data, code = BAD_IMAGES[case]
    with pytest.raises(SpillwayError) as raised:
        infer(cpu, "ocr", data)
    status = 413 if code == "payload_too_large" else 400
    assert (raised.value.status, raised.value.code) == (status, code)


def test_the_gpu_service_runs_each_step_on_its_batcher(repo: Path) -> None:
    pages = [render_lines(SENTENCES[i : i + 2], size=24, min_side=720) for i in (0, 2)]

    async def main() -> tuple[list[Tensors], int]:
        settings = GpuSettings(providers=("CPUExecutionProvider",))
        registry = ModelRegistry(LocalRepository(repo), settings)
        await registry.start()
        plane = DataPlane(registry, settings)
        try:
            requests = [
                encode_request(
                    {"image": np.array([p], dtype=np.object_)}, binary=True, binary_outputs=True
                )
                for p in pages
            ]
            answers = await asyncio.gather(*(plane.infer("ocr", None, *r) for r in requests))
            rows = registry.get("ocr-rec").stats.inference_count
            return [decode_response(a.body, a.header_length)[1] for a in answers], rows
        finally:
            await registry.stop(5)
            plane.close()

    (first, second), rows = asyncio.run(main())
    # THEN each page got its own two lines, spaces and all
    assert texts(first["text"]) == SENTENCES[0:2]
    assert texts(second["text"]) == SENTENCES[2:4]
    # AND the recogniser read the four lines through its batcher
    assert rows == 4
