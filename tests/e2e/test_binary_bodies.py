"""Binary bodies reach the local router whole, on every router runtime, as API Gateway
delivers them (serverless.yml's ``binaryMediaTypes: ["*/*"]``: the body base64-encoded
in the event, ``isBase64Encoded: true``).

GIVEN the local stack's router behind the REST API's door (the API key checked), under
serverless-offline and as the WSGI app (``spillway serve router --api-key``)
WHEN a Triton binary-extension request for ``digits`` is sent with each content type a
client may give it (none, ``application/octet-stream``, Triton's
``application/vnd.sagemaker-triton.binary+json``) and a rendered page as binary data for
``ocr``
THEN each answer holds ONNX Runtime's labels for the images and the page's text lines.
serverless-offline's own HTTP server decoded every body but an ``octet-stream`` one as
UTF-8 text: the 1,126-byte digits body reached the router as 1,258 bytes, a 400.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient

from spillway.protocol.codec import decode_response, encode_request
from spillway_cli.local import procs
from spillway_cli.local.names import LOCAL_API_KEY
from spillway_cli.local.stack import LocalStack
from spillway_cli.modelbuild.ocr import render_lines
from tests.integration.test_ocr_pipelines import SENTENCES

LINES = SENTENCES[0:2]
CONTENT_TYPES = [None, "application/octet-stream", "application/vnd.sagemaker-triton.binary+json"]
KEY = {"x-api-key": LOCAL_API_KEY}


def _images(models_dir: Path) -> np.ndarray:
    images: np.ndarray = np.load(models_dir / "digits/samples/images.npy")[:8]
    return images.astype(np.float32)


def _labels(models_dir: Path, images: np.ndarray) -> list[int]:
    """ONNX Runtime's labels on the model file itself (the graph takes 64 values)."""
    session = ort.InferenceSession(
        str(models_dir / "digits/1/model.onnx"), providers=["CPUExecutionProvider"]
    )
    feed = {session.get_inputs()[0].name: images.reshape(len(images), 64)}
    label = session.run(["label"], feed)[0]
    return [int(x) for x in np.asarray(label).ravel()]


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, int | None]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            length = answer.headers.get("inference-header-content-length")
            return answer.status, answer.read(), int(length) if length else None
    except urllib.error.HTTPError as error:
        return error.code, error.read(), None


def _check_router(router: str, models_dir: Path) -> None:
    images = _images(models_dir)
    expected = _labels(models_dir, images)
    body, length = encode_request({"image": images}, binary=True)
    assert length is not None
    for content_type in CONTENT_TYPES:
        headers = {**KEY, "inference-header-content-length": str(length)}
        if content_type is not None:
            headers["content-type"] = content_type
        # WHEN a binary-extension digits request is sent with this content type
        status, raw, header = _post(f"{router}/v2/models/digits/infer", body, headers)
        # THEN its answer holds ONNX Runtime's labels
        assert status == 200, (content_type, raw[:300])
        labels = decode_response(raw, header)[1]["label"]
        assert [int(x) for x in labels.ravel()] == expected, content_type
    # WHEN tritonclient sends the images as binary data (its own headers)
    client = httpclient.InferenceServerClient(router.removeprefix("http://"))
    image = httpclient.InferInput("image", list(images.shape), "FP32")
    image.set_data_from_numpy(images, binary_data=True)
    result = client.infer("digits", [image], headers=KEY)
    got = result.as_numpy("label")
    assert got is not None
    assert [int(x) for x in got.ravel()] == expected
    # WHEN a rendered page is sent as binary data for OCR
    page = render_lines(LINES, size=24, min_side=720)
    body, length = encode_request(
        {"image": np.array([page], dtype=np.object_)}, binary=True, outputs=["text"]
    )
    headers = {**KEY, "inference-header-content-length": str(length)}
    status, raw, _ = _post(f"{router}/v2/models/ocr/infer", body, headers)
    # THEN its text is the page's lines
    assert status == 200, raw[:300]
    text = json.loads(raw)["outputs"][0]
    assert text["name"] == "text"
    assert text["data"] == LINES


def test_under_serverless_offline(offline_stack: LocalStack, models_dir: Path) -> None:
    # GIVEN the router under serverless-offline, behind the REST API's door
    _check_router(offline_stack.url("router"), models_dir)


@pytest.fixture
def keyed_wsgi_router(stack: LocalStack, tmp_path: Path) -> Iterator[str]:
    """The WSGI router as ``spillway up`` runs it (``--api-key``), beside the session
    stack's router, on the same GPU service and CPU fallback; stopped by PID."""
    port = procs.free_port()
    argv = [*_spillway(), "serve", "router", "--port", str(port), "--api-key", LOCAL_API_KEY]
    env = {**stack.aws_env(), **stack.router_env()}
    env["ROUTER_METRICS_LOG"] = str(tmp_path / "metrics.jsonl")
    child = procs.start("router-keyed", argv, tmp_path, env)
    try:
        url = f"http://127.0.0.1:{port}"
        procs.wait_http(f"{url}/v2/health/live", 120, child.proc, headers=KEY)
        yield url
    finally:
        child.stop()


def _spillway() -> list[str]:
    return [sys.executable, "-m", "spillway_cli.main"]


def test_under_wsgi(keyed_wsgi_router: str, models_dir: Path) -> None:
    # GIVEN the WSGI router behind the REST API's door
    _check_router(keyed_wsgi_router, models_dir)
    # AND a request without the key never reaches it
    status, raw, _ = _post(f"{keyed_wsgi_router}/v2/models/digits/infer", b"{}", {})
    assert (status, raw) == (403, b'{"message":"Forbidden"}')
