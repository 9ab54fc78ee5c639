"""OCR pages as frame streams: rendered text pages (PNG) to the OCR detector through each
door, two tenants' WebSocket connections among them. Through the WebSocket API a page is
base64 in a text frame (``content_type`` ``base64``: API Gateway closes the connection on
a binary frame), one frame of at most 32 KiB; through HTTP binary data, through gRPC raw
contents. Every page is answered once, in seq order on the streaming doors, with a box for
each of its lines where the detector's own code, run in this process on the model file,
finds them."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from spillway.aws.limits import WS_FRAME_BYTES
from spillway_cli.frame_streams import DOORS, OcrPages, Scenario, StreamLog
from spillway_cli.local.stack import LocalStack
from spillway_cli.stream_drivers import Endpoints, run_door, websocket_message

SCENARIO = Scenario(streams=4, frames=3, window=2)


@pytest.fixture(scope="module")
def pages(models_dir: Path) -> OcrPages:
    loaded = OcrPages.load(models_dir)
    assert loaded is not None, "make models builds the OCR detector"
    return loaded


def test_the_pages_differ_and_their_reference_finds_each_line(pages: OcrPages) -> None:
    # the pages' line counts vary, and the reference finds one box per line on each
    assert sorted(set(pages.lines)) == [1, 2, 3, 4]
    assert [len(boxes) for boxes in pages.boxes] == list(pages.lines)
    # AND an answer with another page's boxes, or one box short, is wrong
    four = pages.lines.index(4)
    tensors = {"counts": np.array([4]), "boxes": pages.boxes[four]}
    frame = next(
        seq for seq in range(8) if pages.tensors(0, seq, 8)["image"][0] == pages.pages[four]
    )
    assert pages.right(0, frame, 8, tensors)
    assert not pages.right(0, frame, 8, {**tensors, "boxes": pages.boxes[four] + 5.0})
    assert not pages.right(0, frame, 8, {"counts": np.array([3]), "boxes": pages.boxes[four][:3]})


def test_a_page_is_one_text_frame_with_the_png_as_base64(pages: OcrPages) -> None:
    # WHEN each page is made a WebSocket message
    log = StreamLog(0, len(pages.pages))
    for seq in range(len(pages.pages)):
        message = websocket_message(pages, log, seq)
        # THEN it is text within one API Gateway frame, the page as base64 BYTES
        assert isinstance(message, str)
        assert len(message.encode()) <= WS_FRAME_BYTES
        (image,) = json.loads(message)["inputs"]
        assert image["parameters"] == {"content_type": "base64"}
        assert base64.b64decode(image["data"][0]) == pages.tensors(0, seq, log.frames)["image"][0]


@pytest.mark.parametrize("door", DOORS)
def test_ocr_pages_stream_through_every_door(stack: LocalStack, pages: OcrPages, door: str) -> None:
    # WHEN 4 streams of 3 pages go through the door, 2 in flight a stream
    run = run_door(door, Endpoints.of_stack(stack), SCENARIO, pages)
    got = run.summary()
    # THEN every page was answered once, rightly, and nothing failed
    assert (got["model"], got["frames"], got["answered_ok"]) == ("ocr-det", 12, 12), got
    assert (got["wrong_answers"], got["missing"], got["duplicated"]) == (0, 0, 0), got
    assert got["errors"] == {}, got
    # AND the streaming doors kept each stream's order; every page was served by a backend
    # of the platform (through the router: the GPU service or the CPU fallback, the
    # router's choice; gRPC streams: the GPU service itself)
    if door != "http":
        assert got["order_kept"], got
    assert sum(got["backends"].values()) == 12, got
    assert set(got["backends"]) <= {"gpu", "cpu"}, got
    if door == "grpc":
        assert got["gpu_inferences"] >= 12, got
