"""A binary input in an HTTP JSON body: a BYTES input with ``"parameters": {"content_type":
"base64"}`` carries each element's bytes as base64 (as a WebSocket text frame carries an
image, API Gateway's WebSocket APIs taking text frames only).

GIVEN an ``image`` model (an encoded PNG per row, at most ``max_bytes`` of it) served by
the GPU service (its own process) and by the CPU fallback (over HTTP), both on 127.0.0.1 —
WHEN a PNG travels in a JSON body as base64 — THEN the answer is the one the same PNG
gets as binary data; a string that is not base64 is a 400 ``invalid_input`` naming the
input; and the image's size limit counts the decoded bytes: a PNG of ``max_bytes`` passes
although its base64 is longer, one byte more is a 413 ``payload_too_large``.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spillway.fallback.app import CpuApp
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.protocol.codec import decode_response, encode_request
from spillway_cli.local.wsgi_server import running
from tests.integration.test_image_models import (
    HEIGHT,
    WIDTH,
    by_hand,
    pixel_means,
    png,
    write_version,
)
from tests.support import gpu_service

PAGE = png((10, 20, 30), 2, 6)
"""A 2x6 PNG (letterboxed into the model's 4x6)."""
MAX_BYTES = len(PAGE)
"""The model's ``max_bytes``: exactly this PNG; its base64 is a third longer."""


def write_model(root: Path) -> None:
    config = {
        "name": "pixels",
        "max_batch_size": 8,
        "input": [
            {"name": "image", "data_type": "TYPE_STRING", "dims": [1]},
            {"name": "offset", "data_type": "TYPE_FP32", "dims": [1]},
        ],
        "output": [{"name": "mean", "data_type": "TYPE_FP32", "dims": [3]}],
        "spillway": {
            "kind": "image",
            "image": {
                "input": "image",
                "size": [HEIGHT, WIDTH],
                "resize": "letterbox",
                "pad_value": 255,
                "mean": [0.5, 0.25, 0.0],
                "std": [0.25, 0.5, 2.0],
                "max_bytes": MAX_BYTES,
            },
        },
    }
    write_version(root, pixel_means(), config)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("base64-repo")
    write_model(root)
    return root


@pytest.fixture(scope="module", params=["gpu", "cpu"])
def server(
    request: pytest.FixtureRequest, repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The base URL of the GPU service or of the CPU fallback serving ``repo``."""
    if request.param == "gpu":
        with gpu_service(repo, tmp_path_factory.mktemp("base64-gpu")) as service:
            yield service.base
    else:
        cpu = CpuService.load(CpuSettings(repository=str(repo), models=["pixels"]))
        with running(CpuApp(cpu)) as url:
            yield url


def post(url: str, body: bytes, header_length: int | None = None) -> tuple[int, Any]:
    """POST an infer body; the status and the answer (its JSON, or its outputs)."""
    headers = {"Content-Type": "application/json"}
    if header_length is not None:
        headers["Content-Type"] = "application/octet-stream"
        headers["Inference-Header-Content-Length"] = str(header_length)
    request = urllib.request.Request(
        f"{url}/v2/models/pixels/infer", data=body, headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            length = response.headers.get("Inference-Header-Content-Length")
            raw = response.read()
            return response.status, decode_response(raw, int(length) if length else None)[1]
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def json_body(image: str) -> bytes:
    """A JSON infer body whose image is the base64 string ``image``."""
    inputs = [
        {
            "name": "image",
            "shape": [1, 1],
            "datatype": "BYTES",
            "parameters": {"content_type": "base64"},
            "data": [image],
        },
        {"name": "offset", "shape": [1, 1], "datatype": "FP32", "data": [0.5]},
    ]
    return json.dumps({"inputs": inputs}).encode()


def test_a_png_as_base64_in_json_is_answered_as_the_same_png_as_binary_data(server: str) -> None:
    # GIVEN the PNG as binary data, and the same PNG as base64 in a JSON body
    binary = encode_request(
        {
            "image": np.array([[PAGE]], dtype=np.object_),
            "offset": np.array([[0.5]], dtype=np.float32),
        },
        binary=True,
    )
    # WHEN both are served
    status, as_binary = post(server, *binary)
    json_status, as_json = post(server, json_body(base64.b64encode(PAGE).decode()))
    # THEN both are answered, alike, with the mean of the prepared tensor built by hand
    assert (status, json_status) == (200, 200), as_json
    np.testing.assert_array_equal(as_json["mean"], as_binary["mean"])
    expected = by_hand((10, 20, 30)).mean(axis=(1, 2)) + 0.5
    np.testing.assert_allclose(as_json["mean"][0], expected, atol=1e-5)


@pytest.mark.parametrize(
    "image",
    ["not base64!", base64.b64encode(PAGE).decode()[:-1], "iVBO Rw==", "ñ"],
    ids=["punctuation", "truncated", "whitespace", "not-ascii"],
)
def test_a_string_that_is_not_base64_is_a_400_naming_the_input(server: str, image: str) -> None:
    status, answer = post(server, json_body(image))
    assert (status, answer["code"]) == (400, "invalid_input"), answer
    assert answer["error"].startswith("input 'image': element 0 is not base64"), answer


def test_the_image_size_limit_counts_the_decoded_bytes(server: str) -> None:
    # GIVEN max_bytes of exactly the PNG's length, less than its base64's
    encoded = base64.b64encode(PAGE).decode()
    assert len(encoded) > MAX_BYTES
    # WHEN the PNG goes as base64, then the PNG and one byte more
    status, answer = post(server, json_body(encoded))
    over_status, over = post(server, json_body(base64.b64encode(PAGE + b"\0").decode()))
    # THEN the first is served (its decoded bytes are within the limit), the second
    # refused before it is opened
    assert status == 200, answer
    assert (over_status, over["code"]) == (413, "payload_too_large"), over
