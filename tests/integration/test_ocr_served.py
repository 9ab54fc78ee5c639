"""``ocr`` and ``ocr-topics`` through the router, with tritonclient, and async.

GIVEN the OCR models and pipelines built into a fresh repository (``minilm`` and
``topics-head`` linked), served by the GPU service (its own process) and the CPU fallback
(over HTTP), with the router in front of both
WHEN tritonclient sends a rendered page as binary data, asking for the outputs as binary
data and as JSON
THEN both pipelines answer as the CPU fallback does directly; an image cannot travel as a
plain JSON string (V2 JSON BYTES are UTF-8 strings: tritonclient refuses it, and a page's
bytes base64-encoded into the string without ``"content_type": "base64"`` are an
``invalid_image`` 400); and an async ``ocr``
request with a binary body gets the same answer once the CPU fallback drains it.
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException
from werkzeug.test import Client, TestResponse

from spillway.async_inference.store import AsyncStore
from spillway.fallback.app import CpuApp
from spillway.fallback.async_drain import drain_forever
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.processing import Tensors
from spillway.protocol.codec import decode_response, encode_request
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway_cli.local.async_resources import async_env, create_async_resources
from spillway_cli.local.wsgi_server import running
from spillway_cli.modelbuild import minilm, topics
from spillway_cli.modelbuild.build import build_repository
from spillway_cli.modelbuild.ocr import render_lines
from tests.fakes import eventually
from tests.integration.test_ocr_pipelines import SENTENCES
from tests.support import gpu_service, link_model

OCR = ["ocr-det", "ocr-cls", "ocr-rec", "ocr-lines", "ocr", "ocr-topics"]
PAGE = render_lines(SENTENCES[0:2], size=24, min_side=720)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("ocr-served")
    for name in (minilm.NAME, topics.HEAD):
        link_model(models_dir, root, name)
    build_repository(root, OCR)
    return root


@pytest.fixture(scope="module")
def cpu(repo: Path) -> CpuService:
    return CpuService.load(CpuSettings(repository=str(repo), models=OCR[:3] + OCR[4:]))


@pytest.fixture(scope="module")
def router(repo: Path, cpu: CpuService, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with (
        gpu_service(repo, tmp_path_factory.mktemp("ocr-served-logs")) as gpu,
        running(CpuApp(cpu)) as cpu_url,
    ):
        settings = RouterSettings(gpu_url=gpu.base, cpu_url=cpu_url, metrics_log=Path("/dev/null"))
        with running(create_app(settings)) as url:
            yield url


def direct(cpu: CpuService, model: str, image: bytes) -> Tensors:
    """The CPU fallback's own answer, without HTTP."""
    body, length = encode_request(
        {"image": np.array([image], dtype=np.object_)}, binary=True, binary_outputs=True
    )
    encoded = cpu.infer(model, None, body, length)
    return decode_response(encoded.body, encoded.header_length)[1]


OUTPUTS = {"ocr": ("text", "boxes", "scores", "counts"), "ocr-topics": ("label", "scores", "text")}


@pytest.mark.parametrize("binary_outputs", [True, False], ids=["binary outputs", "JSON outputs"])
@pytest.mark.parametrize("model", list(OUTPUTS))
def test_the_router_answers_as_the_cpu_fallback(
    router: str, cpu: CpuService, model: str, binary_outputs: bool
) -> None:
    # GIVEN a page sent as binary data through the router, outputs as binary data or JSON
    client = httpclient.InferenceServerClient(router.removeprefix("http://"))
    image = httpclient.InferInput("image", [1], "BYTES")
    image.set_data_from_numpy(np.array([PAGE], dtype=np.object_), binary_data=True)
    wanted = [
        httpclient.InferRequestedOutput(name, binary_data=binary_outputs) for name in OUTPUTS[model]
    ]
    # WHEN the router serves it
    result = client.infer(model, [image], outputs=wanted)
    # THEN every output equals the CPU fallback's direct answer
    expected = direct(cpu, model, PAGE)
    for name in OUTPUTS[model]:
        got = result.as_numpy(name)
        assert got is not None, name
        if expected[name].dtype == np.object_:  # JSON outputs come back as str
            assert _texts(got) == _texts(expected[name]), name
        else:
            np.testing.assert_allclose(got, expected[name], atol=1e-4, err_msg=name)
    if model == "ocr":
        assert _texts(result.as_numpy("text")) == [[line] for line in SENTENCES[0:2]]


def _texts(array: np.ndarray | None) -> list[object]:
    assert array is not None
    flat = [x.decode() if isinstance(x, bytes) else x for x in array.ravel()]
    listed: list[object] = np.array(flat, dtype=object).reshape(array.shape).tolist()
    return listed


def test_an_image_cannot_travel_as_json(router: str) -> None:
    # GIVEN a page; WHEN tritonclient is asked to send it as JSON
    image = httpclient.InferInput("image", [1], "BYTES")
    # THEN it refuses before sending: JSON BYTES are UTF-8 strings, a PNG is not UTF-8
    with pytest.raises(InferenceServerException, match="binary_data=True"):
        image.set_data_from_numpy(np.array([PAGE], dtype=np.object_), binary_data=False)
    # AND the page base64-encoded into the string is not an image: a 400 with its code
    client = httpclient.InferenceServerClient(router.removeprefix("http://"))
    encoded = np.array([base64.b64encode(PAGE)], dtype=np.object_)
    image.set_data_from_numpy(encoded, binary_data=False)
    with pytest.raises(InferenceServerException) as raised:
        client.infer("ocr", [image])
    assert raised.value.status() == "400"
    assert "is not a JPEG or PNG image" in str(raised.value.message())


def test_an_async_ocr_request_with_a_binary_body(
    aws_env: str, repo: Path, cpu: CpuService, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN the async resources, a router with no GPU service, and the CPU fallback draining
    suffix = uuid.uuid4().hex[:8]
    settings = create_async_resources(
        f"ocr-async-{suffix}", drain_age_s=0.0, names=(f"t-{suffix}", f"q-{suffix}", f"d-{suffix}")
    )
    for key, value in async_env(settings).items():
        monkeypatch.setenv(key, value)
    router = Client(create_app(RouterSettings(gpu_url=None, metrics_log=tmp_path / "m.log")))
    body, length = encode_request(
        {"image": np.array([PAGE], dtype=np.object_)}, binary=True, binary_outputs=True
    )
    # WHEN an ocr request is sent async, its image as binary data
    answer = router.post(
        "/v2/models/ocr/infer",
        data=body,
        headers={"prefer": "respond-async", "inference-header-content-length": str(length)},
    )
    assert answer.status_code == 202, answer.data
    status_url = json.loads(answer.data)["status_url"]
    stop = threading.Event()
    drain = threading.Thread(target=drain_forever, args=(cpu, AsyncStore(settings), stop, 0.2))

    def finished() -> TestResponse | None:
        result = router.get(status_url)
        return result if result.status_code == 200 else None

    drain.start()
    try:
        reply = eventually(finished, "the result")
    finally:
        stop.set()
        drain.join(30)
    # THEN its result is the synchronous answer
    header = reply.headers.get("inference-header-content-length")
    outputs = decode_response(reply.data, int(header) if header else None)[1]
    expected = direct(cpu, "ocr", PAGE)
    assert outputs["text"].tolist() == expected["text"].tolist()
    np.testing.assert_allclose(outputs["boxes"], expected["boxes"], atol=1e-4)
