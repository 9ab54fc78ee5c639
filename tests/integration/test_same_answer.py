# ruff: noqa: E501 - the table of cases reads best one case a line
"""Every server gives the same answer to the same doubtful request: one rule, in the core.

The router (with the GPU service behind it, and with the CPU fallback behind it as a
Lambda function), the GPU service and the CPU fallback (over HTTP and as a direct
invoke) get the same body: text that is not valid UTF-8 inside the JSON, parameters out
of range for the model (``priority`` past its levels), routing parameters no server
accepts (``mode``, ``latency_budget_ms``, ``tenant``), a version or model name no server
serves. Each must answer with the same status, the same stable code and the same message.
"""

from __future__ import annotations

import base64
import json
import math
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from spillway.fallback.app import CpuApp
from spillway.fallback.direct import handle_direct
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.protocol.codec import encode_request
from spillway.protocol.framing import HEADER_LENGTH
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway_cli.local import procs
from spillway_cli.local.wsgi_server import running
from tests.support import Service, gpu_service, link_model

IMAGE = {"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": [0.5] * 64}
_IMAGE = json.dumps(IMAGE).encode()


def _with(parameters: dict[str, object]) -> bytes:
    return json.dumps({"parameters": parameters, "inputs": [IMAGE]}).encode()


def _data(values: str) -> bytes:
    """A body whose FP32 image holds ``values`` (JSON text, written as it is) then 0.5s."""
    count = values.count(",") + 1
    rest = ", 0.5" * (64 - count)
    return (
        b'{"inputs": [{"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": ['
        + (values + rest).encode()
        + b"]}]}"
    )


def _binary(first: float) -> tuple[bytes, int]:
    """A binary-extension body whose FP32 image starts with ``first`` (then 0.5s)."""
    pixels = np.full((1, 8, 8), 0.5, dtype=np.float32)
    with np.errstate(over="ignore"):  # 1e39: infinite, as a float32 client sends it
        pixels[0, 0, 0] = first
    body, length = encode_request({"image": pixels}, binary=True)
    assert length is not None
    return body, length


_BINARY_INF, _BINARY_LENGTH = _binary(math.inf)
_BINARY_NAN, _ = _binary(math.nan)
_BINARY_FINITE, _ = _binary(0.25)


@dataclass(frozen=True)
class Case:
    name: str
    body: bytes
    status: int
    path: str = "/v2/models/digits/infer"
    code: str | None = None
    """The code every server answers with (checked when given)."""
    header_length: int | None = None


CASES = [
    Case("invalid UTF-8 byte in the id", b'{"id": "\xff", "inputs": [' + _IMAGE + b"]}", 400),
    Case("UTF-8-encoded surrogate in the id", b'{"id": "\xed\xa0\x80", "inputs": [' + _IMAGE + b"]}", 400),
    Case("UTF-8-encoded surrogate in a parameter", b'{"parameters": {"note": "\xed\xa0\x80"}, "inputs": [' + _IMAGE + b"]}", 400),
    Case("UTF-8-encoded surrogate in an input name", b'{"inputs": [{"name": "image\xed\xa0\x80", "shape": [1, 8, 8], "datatype": "FP32", "data": [0.5]}]}', 400),
    Case("overlong UTF-8 in a parameter", b'{"parameters": {"note": "\xc0\xaf"}, "inputs": [' + _IMAGE + b"]}", 400),
    Case("escaped lone surrogate in the id", b'{"id": "\\ud800", "inputs": [' + _IMAGE + b"]}", 400),
    Case("escaped lone surrogate in a parameter", b'{"parameters": {"note": "x\\udfff"}, "inputs": [' + _IMAGE + b"]}", 400),
    Case("escaped surrogate pair (valid)", b'{"id": "\\ud83d\\ude00", "inputs": [' + _IMAGE + b"]}", 200),
    Case("priority past the model's levels", _with({"priority": 99}), 400),
    Case("priority one past the levels", _with({"priority": 3}), 400),
    Case("priority at the lowest level", _with({"priority": 2}), 200),
    Case("priority past the protocol's bound", _with({"priority": 2_000_000}), 400),
    Case("priority as a string", _with({"priority": "1"}), 400),
    Case("timeout as a float", _with({"timeout": 1.5}), 400),
    Case("timeout past an hour", _with({"timeout": 3_600_000_001}), 400),
    Case("mode no server knows", _with({"mode": "bogus"}), 400),
    Case("latency budget below the floor", _with({"latency_budget_ms": 5}), 400),
    Case("latency budget not finite", b'{"parameters": {"latency_budget_ms": NaN}, "inputs": [' + _IMAGE + b"]}", 400),
    Case("tenant with a space", _with({"tenant": "a b"}), 400),
    Case("NaN literal in FP32 data", _data("NaN"), 400, code="non_finite_input"),
    Case("Infinity literal in FP32 data", _data("0.5, -Infinity"), 400, code="non_finite_input"),
    Case("NaN as a string in FP32 data", _data('"NaN"'), 400, code="non_finite_input"),
    Case("a number past float32 in FP32 data", _data("1e39"), 400, code="non_finite_input"),
    Case("the largest float32 in FP32 data", _data("3.4028235e38"), 200),
    Case("binary +inf in FP32 data", _BINARY_INF, 400, code="non_finite_input", header_length=_BINARY_LENGTH),
    Case("binary NaN in FP32 data", _BINARY_NAN, 400, code="non_finite_input", header_length=_BINARY_LENGTH),
    Case("binary finite FP32 data", _BINARY_FINITE, 200, header_length=_BINARY_LENGTH),
    Case("valid routing parameters", _with({"mode": "auto", "latency_budget_ms": 5000, "timeout": 0}), 200),
    Case("version that is no number", _with({}), 400, "/v2/models/digits/versions/one/infer"),
    Case("version with ten digits", _with({}), 400, "/v2/models/digits/versions/1234567890/infer"),
    Case("version with a leading zero", _with({}), 200, "/v2/models/digits/versions/01/infer"),
    Case("version not served", _with({}), 404, "/v2/models/digits/versions/7/infer"),
    Case("unknown model", _with({}), 404, "/v2/models/nosuch/infer"),
    Case("model name of 65 characters", _with({}), 400, "/v2/models/" + "a" * 65 + "/infer"),
]  # fmt: skip


@dataclass(frozen=True)
class Answer:
    status: int
    code: str | None
    error: str | None


def _call(base: str, case: Case) -> Answer:
    headers = {"content-type": "application/json"}
    if case.header_length is not None:
        headers = {
            "content-type": "application/octet-stream",
            HEADER_LENGTH: str(case.header_length),
        }
    request = urllib.request.Request(base + case.path, case.body, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return Answer(response.status, None, None)
    except urllib.error.HTTPError as error:
        body = json.loads(error.read() or b"{}")
        return Answer(error.code, body.get("code"), body.get("error"))


def _direct(cpu: CpuService, case: Case) -> Answer:
    parts = case.path.split("/")  # /v2/models/<model>[/versions/<v>]/infer
    event: dict[str, object] = {"model": parts[3], "body_b64": base64.b64encode(case.body).decode()}
    if "versions" in parts:
        event["version"] = parts[5]
    if case.header_length is not None:
        event["headers"] = {HEADER_LENGTH: str(case.header_length)}
    answer = handle_direct(cpu, event)
    body = json.loads(answer["body"])
    if answer["statusCode"] == 200:
        return Answer(200, None, None)
    return Answer(answer["statusCode"], body.get("code"), body.get("error"))


@pytest.fixture(scope="module")
def repo(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("same-answer-repo")
    link_model(models_dir, root, "digits")
    return root


@pytest.fixture(scope="module")
def cpu(repo: Path) -> CpuService:
    return CpuService.load(CpuSettings(repository=str(repo)))


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return procs.free_port()


@pytest.fixture(scope="module")
def gpu(repo: Path, tmp_path_factory: pytest.TempPathFactory, grpc_port: int) -> Iterator[Service]:
    logs = tmp_path_factory.mktemp("same-answer-logs")
    with gpu_service(repo, logs, grpc_port=str(grpc_port)) as svc:
        yield svc


@pytest.fixture(scope="module")
def bases(gpu: Service, cpu: CpuService, moto_endpoint: str) -> Iterator[dict[str, str]]:
    with running(CpuApp(cpu)) as cpu_url, pytest.MonkeyPatch.context() as env:
        # The second router reaches the CPU fallback as a Lambda function (its invoke API).
        env.setenv("AWS_ENDPOINT_URL_LAMBDA", cpu_url)
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.setenv(name, "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        to_gpu = RouterSettings(gpu_url=gpu.base, metrics_log=Path("/dev/null"))
        to_cpu = RouterSettings(
            gpu_url=None, cpu_function="spillway-cpu-infer", metrics_log=Path("/dev/null")
        )
        with running(create_app(to_gpu)) as router_gpu, running(create_app(to_cpu)) as router_cpu:
            yield {
                "gpu": gpu.base,
                "cpu": cpu_url,
                "router->gpu": router_gpu,
                "router->cpu": router_cpu,
            }


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_server_gives_the_same_answer(
    case: Case, bases: dict[str, str], cpu: CpuService
) -> None:
    # GIVEN the GPU service, the CPU fallback and the router in front of either
    # WHEN each gets the same request
    answers = {name: _call(base, case) for name, base in bases.items()}
    answers["cpu-direct"] = _direct(cpu, case)
    # THEN every one answers with the expected status, and the same code and message
    assert {name: a.status for name, a in answers.items()} == dict.fromkeys(answers, case.status)
    assert len({(a.code, a.error) for a in answers.values()}) == 1, answers
    if case.code is not None:
        assert next(iter(answers.values())).code == case.code
    elif case.status == 400:
        assert next(iter(answers.values())).code in ("invalid_input", "invalid_model_name")
    if case.status == 404:
        assert next(iter(answers.values())).code == "model_not_found"


GRPC_VALUES = [("nan", math.nan, "raw"), ("inf", math.inf, "typed"), ("1e39", 1e39, "typed"), ("-inf", -math.inf, "raw")]  # fmt: skip


@pytest.mark.parametrize(("label", "value", "how"), GRPC_VALUES, ids=[v[0] for v in GRPC_VALUES])
def test_the_grpc_door_refuses_non_finite_numbers_as_http_does(
    label: str, value: float, how: str, gpu: Service, grpc_port: int
) -> None:
    # GIVEN the GPU service's gRPC door, and its HTTP door's answer to a binary body
    # whose first pixel is the same value
    body, length = _binary(value)
    http = _call(gpu.base, Case(label, body, 400, header_length=length))
    request = service_pb2.ModelInferRequest(model_name="digits")
    tensor = request.inputs.add(name="image", datatype="FP32", shape=[1, 8, 8])
    pixels = [value] + [0.5] * 63
    if how == "raw":
        request.raw_input_contents.append(np.array(pixels, dtype="<f4").tobytes())
    else:  # typed contents: a float field, so 1e39 is infinite before it leaves the client
        tensor.contents.fp32_contents.extend(pixels)
    # WHEN the gRPC door gets it
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request, timeout=30)
    # THEN it is INVALID_ARGUMENT with the same code and message as HTTP's 400
    error = refused.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(error.trailing_metadata() or ())["spillway-code"] == "non_finite_input"
    assert http == Answer(400, "non_finite_input", error.details().partition(": ")[2])
