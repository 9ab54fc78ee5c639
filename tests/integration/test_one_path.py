# ruff: noqa: E501 - the table of cases reads best one case a line
"""One request path: every transport answers the same malformed request the same way.

The GPU service (its own process), the CPU fallback (HTTP and direct invoke) and the
router in front of the GPU service all parse, validate and map errors with the core, so
the same bad header or body gets the same status and stable code from each of them; so
does a bad image sent to ``ocr`` (truncated, a header declaring 20000 x 20000, a text file).
"""

from __future__ import annotations

import base64
import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from spillway.fallback.app import CpuApp
from spillway.fallback.direct import handle_direct
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.repository import LocalRepository
from spillway.protocol.codec import decode_response, encode_request
from spillway.protocol.errors import OverloadedError, UnavailableError
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway_cli.local.wsgi_server import running
from spillway_cli.modelbuild.build import build_repository
from tests.integration.test_ocr_pipelines import _png_header
from tests.support import Service, gpu_service, link_model

IMAGE = {"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": [0.5] * 64}


@dataclass(frozen=True)
class Case:
    """A request: path below the model, headers, body; and the expected status and code."""

    name: str
    body: bytes
    status: int
    code: str
    path: str = "/v2/models/digits/infer"
    method: str = "POST"
    header_length: str | None = None


def _json(value: object) -> bytes:
    return json.dumps(value).encode()


CASES = [
    Case("header length with a sign", _json({"inputs": [IMAGE]}), 400, "invalid_input", header_length="+2"),
    Case("header length with an underscore", _json({"inputs": [IMAGE]}), 400, "invalid_input", header_length="1_0"),
    Case("header length past the body", _json({"inputs": [IMAGE]}), 400, "invalid_input", header_length="99999"),
    Case("body not JSON", b"{nope", 400, "invalid_input"),
    Case("body a JSON list", b"[1, 2]", 400, "invalid_input"),
    Case("no inputs", _json({"inputs": []}), 400, "invalid_input"),
    Case("wrong datatype", _json({"inputs": [{**IMAGE, "datatype": "INT32", "data": [1] * 64}]}), 400, "invalid_input"),
    Case("data short of the shape", _json({"inputs": [{**IMAGE, "data": [0.5] * 3}]}), 400, "invalid_input"),
    Case("binary size past the end", _json({"inputs": [{**IMAGE, "data": None, "parameters": {"binary_data_size": 256}}]}), 400, "invalid_input"),
    Case("huge timeout", b'{"parameters": {"timeout": 1' + b"0" * 400 + b'}, "inputs": [' + _json(IMAGE) + b"]}", 400, "invalid_input"),
    Case("65 dimensions", _json({"inputs": [{**IMAGE, "shape": [1] * 65, "data": [0.5]}]}), 400, "invalid_input"),
    Case("zero beside a huge dimension", _json({"inputs": [{**IMAGE, "shape": [0, 2**62], "data": []}]}), 400, "invalid_input"),
    Case("zero beside two big dimensions", _json({"inputs": [{**IMAGE, "shape": [0, 2**31 - 1, 2**31 - 1], "data": []}]}), 400, "invalid_input"),
    Case("huge priority", b'{"parameters": {"priority": 1' + b"0" * 400 + b'}, "inputs": [' + _json(IMAGE) + b"]}", 400, "invalid_input"),
    Case("lone surrogate in text", b'{"inputs": [{"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": ["\\ud800"]}]}', 400, "invalid_input"),
    Case("negative priority", _json({"parameters": {"priority": -1}, "inputs": [IMAGE]}), 400, "invalid_input"),
    Case("unknown output", _json({"inputs": [IMAGE], "outputs": [{"name": "nope"}]}), 400, "invalid_input"),
    Case("unknown model", _json({"inputs": [IMAGE]}), 404, "model_not_found", path="/v2/models/nosuch/infer"),
    Case("unsafe model name", _json({"inputs": [IMAGE]}), 400, "invalid_model_name", path="/v2/models/Bad!/infer"),
    Case("version zero", _json({"inputs": [IMAGE]}), 400, "invalid_model_name", path="/v2/models/digits/versions/0/infer"),
    Case("GET on infer", b"", 405, "method_not_allowed", method="GET"),
    Case("unknown input", _json({"inputs": [{**IMAGE, "name": "img"}]}), 400, "invalid_input"),
    Case("typo in the path", _json({"inputs": [IMAGE]}), 404, "not_found", path="/v2/model/digits/infer"),
    Case("GET on a typo in the path", b"", 404, "not_found", path="/v2/model/digits/infer", method="GET"),
    Case("POST on no path at all", _json({"inputs": [IMAGE]}), 404, "not_found", path="/v2/nothing"),
    Case("POST on a repository path that is none", b"", 404, "not_found", path="/v2/repository/typo"),
]  # fmt: skip


@dataclass(frozen=True)
class Answer:
    status: int
    code: str | None
    headers: dict[str, str]
    error: str | None = None


def _call(base: str, case: Case) -> Answer:
    headers = {"content-type": "application/json"}
    if case.header_length is not None:
        headers["inference-header-content-length"] = case.header_length
    data = case.body if case.method == "POST" else None
    request = urllib.request.Request(base + case.path, data, headers, method=case.method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return Answer(
                response.status, None, {k.lower(): v for k, v in response.headers.items()}
            )
    except urllib.error.HTTPError as error:
        body = json.loads(error.read() or b"{}")
        return Answer(
            error.code,
            body.get("code"),
            {k.lower(): v for k, v in error.headers.items()},
            body.get("error"),
        )


def _direct(cpu: CpuService, case: Case) -> Answer | None:
    parts = case.path.split("/")  # /v2/models/<model>[/versions/<v>]/infer
    if case.method != "POST" or parts[-1] != "infer" or parts[2] != "models":
        return None  # the direct-invoke event has no method or path to get wrong
    event: dict[str, object] = {"model": parts[3], "body_b64": base64.b64encode(case.body).decode()}
    if "versions" in parts:
        event["version"] = parts[5]
    if case.header_length is not None:
        event["headers"] = {"Inference-Header-Content-Length": case.header_length}
    answer = handle_direct(cpu, event)
    body = json.loads(answer["body"])
    return Answer(answer["statusCode"], body.get("code"), answer["headers"], body.get("error"))


@pytest.fixture(scope="module")
def repo(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("one-path-repo")
    for name in ("digits", "topics-head"):  # two models: an unknown name lists both
        link_model(models_dir, root, name)
    return root


@pytest.fixture(scope="module")
def cpu(repo: Path) -> CpuService:
    return CpuService.load(CpuSettings(repository=str(repo)))


@pytest.fixture(scope="module")
def gpu(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with gpu_service(repo, tmp_path_factory.mktemp("one-path-logs")) as svc:
        yield svc


@pytest.fixture(scope="module")
def bases(gpu: Service, cpu: CpuService) -> Iterator[dict[str, str]]:
    settings = RouterSettings(gpu_url=gpu.base, metrics_log=Path("/dev/null"))
    with running(CpuApp(cpu)) as cpu_url, running(create_app(settings)) as router_url:
        yield {"gpu": gpu.base, "cpu": cpu_url, "router": router_url}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_transport_answers_a_bad_request_alike(
    case: Case, bases: dict[str, str], cpu: CpuService
) -> None:
    # GIVEN the GPU service, the CPU fallback and the router (GPU behind it)
    # WHEN each gets the same malformed request
    answers = {name: _call(base, case) for name, base in bases.items()}
    direct = _direct(cpu, case)
    if direct is not None:
        answers["cpu-direct"] = direct
    # THEN every one answers with the same status and stable code
    seen = {name: (a.status, a.code) for name, a in answers.items()}
    assert set(seen.values()) == {(case.status, case.code)}, seen
    if case.status == 405:
        assert {a.headers.get("allow") for a in answers.values()} == {"POST"}


NAMING = [
    (Case("unknown model", _json({"inputs": [IMAGE]}), 404, "model_not_found", path="/v2/models/nosuch/infer"),
     "unknown model 'nosuch'; models served here: 'digits', 'topics-head'"),
    (Case("unknown input", _json({"inputs": [{**IMAGE, "name": "img"}]}), 400, "invalid_input"),
     "unknown input 'img' for model digits; its inputs: 'image'"),
    (Case("unknown output", _json({"inputs": [IMAGE], "outputs": [{"name": "nope"}]}), 400, "invalid_input"),
     "unknown output 'nope'; the model has ['label', 'probabilities']"),
]  # fmt: skip
"""Refusals whose message names what is valid, and that message."""


@pytest.mark.parametrize(("case", "message"), NAMING, ids=[c.name for c, _ in NAMING])
def test_every_transport_names_what_is_valid(
    case: Case, message: str, bases: dict[str, str], cpu: CpuService
) -> None:
    # GIVEN the GPU service, the CPU fallback and the router, serving digits and topics-head
    # WHEN each gets a request naming a model, input or output that is not there
    answers = {name: _call(base, case) for name, base in bases.items()}
    direct = _direct(cpu, case)
    assert direct is not None
    answers["cpu-direct"] = direct
    # THEN every one keeps the stable code and says which names are valid, in the same words
    seen = {name: (a.status, a.code, a.error) for name, a in answers.items()}
    assert set(seen.values()) == {(case.status, case.code, message)}, seen


def test_a_path_that_exists_answers_405_to_another_method(bases: dict[str, str]) -> None:
    # GIVEN the three servers; WHEN each gets a POST on a path that takes GET alone
    case = Case("POST on a GET path", b"", 405, "method_not_allowed", path="/v2/health/live")
    answers = {name: _call(base, case) for name, base in bases.items()}
    # THEN it is a 405 naming GET, not a 404: the path is there
    assert {(a.status, a.code) for a in answers.values()} == {(405, "method_not_allowed")}
    assert all("GET" in a.headers["allow"] for a in answers.values()), answers


def test_a_good_request_gets_the_same_answer_everywhere(
    bases: dict[str, str], cpu: CpuService, repo: Path
) -> None:
    # GIVEN a binary request for a real image
    images = np.load(repo / "digits" / "samples" / "images.npy")[:3].astype(np.float32)
    body, length = encode_request({"image": images}, binary=True, binary_outputs=True)
    labels = {}
    for name, base in bases.items():
        request = urllib.request.Request(
            base + "/v2/models/digits/infer",
            body,
            {"inference-header-content-length": str(length)},
        )
        # WHEN each transport serves it
        with urllib.request.urlopen(request, timeout=30) as response:
            out_length = int(response.headers["inference-header-content-length"])
            _, outputs = decode_response(response.read(), out_length)
        labels[name] = outputs["label"].ravel().tolist()
    # THEN all agree, and agree with the engine run directly
    expected = cpu.get("digits", None).infer({"image": images})["label"].ravel().tolist()
    assert labels == dict.fromkeys(bases, expected)


@pytest.mark.parametrize(
    "error",
    [OverloadedError("busy", retry_after_s=2.4), UnavailableError("gone", retry_after_s=0.2)],
)
def test_the_cpu_fallback_keeps_retry_after(
    cpu: CpuService, error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a CPU fallback whose engine step reports a busy or unavailable state
    def refuse(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(cpu, "infer", refuse)
    # WHEN a direct invoke and an HTTP request reach it
    answer = handle_direct(cpu, {"model": "digits", "body": {"inputs": [IMAGE]}})
    with running(CpuApp(cpu)) as url:
        http = _call(url, Case("busy", _json({"inputs": [IMAGE]}), 0, ""))
    # THEN both carry Retry-After in whole seconds (at least 1), like the GPU service
    expected = str(max(1, round(error.retry_after_s)))  # type: ignore[attr-defined]
    assert answer["headers"]["retry-after"] == expected
    assert http.headers["retry-after"] == expected
    assert answer["statusCode"] == http.status == error.status  # type: ignore[attr-defined]


def test_the_cpu_fallback_serves_the_versions_the_policy_names(
    models_dir: Path, tmp_path: Path
) -> None:
    # GIVEN digits with versions 1 and 2, and a policy that serves only version 1
    link_model(models_dir, tmp_path, "digits")
    repo = LocalRepository(tmp_path)
    source = repo.fetch_version("digits", 1, tmp_path)
    files = {p.name: p for p in source.iterdir() if p.is_file() and p.name != "SHA256SUMS"}
    assert repo.publish_version("digits", files) == 2
    config = json.loads((tmp_path / "digits" / "config.json").read_text())
    config["version_policy"] = {"specific": {"versions": [1]}}
    (tmp_path / "digits" / "config.json").unlink()  # a hard link: do not write through it
    (tmp_path / "digits" / "config.json").write_text(json.dumps(config))
    # WHEN the CPU fallback loads
    cpu = CpuService.load(CpuSettings(repository=str(tmp_path)))
    # THEN it serves version 1 (not the newest), and refuses version 2
    assert sorted(cpu.models["digits"]) == [1]
    answer = handle_direct(cpu, {"model": "digits", "body": {"inputs": [IMAGE]}})
    assert answer["statusCode"] == 200
    assert answer["headers"]["x-spillway-model-version"] == "1"
    refused = handle_direct(cpu, {"model": "digits", "version": "2", "body": {"inputs": [IMAGE]}})
    assert refused["statusCode"] == 404


def test_a_chunked_body_reaches_the_cpu_fallback(cpu: CpuService) -> None:
    # GIVEN a JSON infer request sent with chunked transfer encoding (no Content-Length)
    body = _json({"inputs": [IMAGE]})
    chunks = iter([body[:50], body[50:]])
    with running(CpuApp(cpu)) as url:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        # WHEN posted
        conn.request("POST", "/v2/models/digits/infer", chunks, encode_chunked=True)
        response = conn.getresponse()
        answer = json.loads(response.read())
        conn.close()
    # THEN it is read whole and served (not read as an empty body)
    assert response.status == 200, answer
    assert answer["outputs"][0]["name"] == "label"


def test_malformed_requests_never_trip_the_router_breaker(gpu: Service, cpu: CpuService) -> None:
    # GIVEN the router in front of the GPU service, with the CPU fallback behind it
    with running(CpuApp(cpu)) as cpu_url:
        settings = RouterSettings(gpu_url=gpu.base, cpu_url=cpu_url, metrics_log=Path("/dev/null"))
        app = create_app(settings)
        with running(app) as url:
            # WHEN 100 malformed requests (every kind in the table, round robin) go through
            bad = [c for c in CASES if c.method == "POST"]
            statuses = [_call(url, bad[i % len(bad)]).status for i in range(100)]
            # AND then 10 valid ones
            body = _json({"inputs": [IMAGE]})
            served = []
            for _ in range(10):
                request = urllib.request.Request(url + "/v2/models/digits/infer", body)
                with urllib.request.urlopen(request, timeout=30) as response:
                    served.append(
                        (
                            response.headers["x-spillway-backend"],
                            response.headers["x-spillway-fallback"],
                        )
                    )
        # THEN every malformed one was a 4xx, and every valid one was served by the GPU
        # service with no fallback: the breaker stayed closed
        assert all(400 <= s < 500 for s in statuses), statuses
        assert served == [("gpu", None)] * 10
        assert app.router.breakers["gpu"].state == "closed"


def _image_case(name: str, image: bytes, code: str) -> Case:
    body, length = encode_request({"image": np.array([image], dtype=np.object_)}, binary=True)
    return Case(name, body, 400, code, path="/v2/models/ocr/infer", header_length=str(length))


BAD_IMAGES = [
    _image_case("truncated JPEG", b"\xff\xd8\xff\xe0" + b"\x00" * 64, "invalid_image"),
    _image_case("PNG whose header says 20000 x 20000", _png_header(20_000, 20_000), "image_too_large"),
    _image_case("a text file", b"hello, this is not an image\n", "invalid_image"),
]  # fmt: skip


@pytest.fixture(scope="module")
def ocr_cpu(tmp_path_factory: pytest.TempPathFactory) -> CpuService:
    root = tmp_path_factory.mktemp("one-path-ocr")
    build_repository(root, ["ocr-det", "ocr-cls", "ocr-rec", "ocr-lines", "ocr"])
    return CpuService.load(CpuSettings(repository=str(root)))


@pytest.fixture(scope="module")
def ocr_bases(
    ocr_cpu: CpuService, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    logs = tmp_path_factory.mktemp("one-path-ocr-logs")
    with gpu_service(ocr_cpu.settings.repository, logs) as gpu:
        settings = RouterSettings(gpu_url=gpu.base, metrics_log=Path("/dev/null"))
        with running(CpuApp(ocr_cpu)) as cpu_url, running(create_app(settings)) as router_url:
            yield {"gpu": gpu.base, "cpu": cpu_url, "router": router_url}


@pytest.mark.parametrize("case", BAD_IMAGES, ids=[c.name for c in BAD_IMAGES])
def test_every_transport_refuses_a_bad_image_alike(
    case: Case, ocr_bases: dict[str, str], ocr_cpu: CpuService
) -> None:
    # GIVEN the GPU service, the CPU fallback and the router serving ocr
    # WHEN each gets the same bad image as binary data
    answers = {name: _call(base, case) for name, base in ocr_bases.items()}
    direct = _direct(ocr_cpu, case)
    assert direct is not None
    answers["cpu-direct"] = direct
    # THEN every one answers 400 with the image's stable code
    seen = {name: (a.status, a.code) for name, a in answers.items()}
    assert set(seen.values()) == {(case.status, case.code)}, seen
