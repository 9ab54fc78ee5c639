"""The CPU-fallback function: direct-invoke events, API Gateway events, HTTP, limits."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
import serverless_wsgi
import tritonclient.http as triton

from spillway.fallback.app import CpuApp
from spillway.fallback.direct import handle_direct
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.engine import EngineOptions, OnnxModel
from spillway.models.repository import LocalRepository
from spillway_cli.local.wsgi_server import running

ROOT = Path(__file__).resolve().parents[2]
EVENTS = ROOT / "events" / "cpu_infer"


def event(name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((EVENTS / name).read_text())
    return document


@pytest.fixture(scope="module")
def cpu(models_dir: Path) -> CpuService:
    return CpuService.load(CpuSettings(repository=str(models_dir), models=["digits"]))


@pytest.fixture(scope="module")
def cpu_url(cpu: CpuService) -> Iterator[str]:
    with running(CpuApp(cpu)) as url:
        yield url


@pytest.fixture(scope="module")
def first_label(models_dir: Path) -> int:
    return int(np.load(models_dir / "digits" / "samples" / "labels.npy")[0])


def outputs(answer: dict[str, Any]) -> dict[str, Any]:
    assert answer["isBase64Encoded"] is False
    body = json.loads(answer["body"])
    return {o["name"]: o["data"] for o in body["outputs"]}


def test_direct_json_event_is_answered_with_the_label(cpu: CpuService, first_label: int) -> None:
    # GIVEN the direct-invoke event the router sends (JSON body)
    answer = handle_direct(cpu, event("infer-direct.json"))
    # THEN the answer has the API Gateway shape and the right digit
    assert answer["statusCode"] == 200
    assert answer["headers"]["x-spillway-model-version"] == "1"
    assert outputs(answer) == {"label": [first_label]}


def test_direct_binary_event_gives_the_same_label(cpu: CpuService, first_label: int) -> None:
    answer = handle_direct(cpu, event("infer-direct-binary.json"))
    assert answer["statusCode"] == 200
    assert outputs(answer) == {"label": [first_label]}


def test_direct_metadata_event(cpu: CpuService) -> None:
    answer = handle_direct(cpu, event("metadata-direct.json"))
    assert answer["statusCode"] == 200
    meta = json.loads(answer["body"])
    assert meta["name"] == "digits"
    assert meta["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 8, 8]}]
    assert meta["parameters"]["execution_provider"] == "CPUExecutionProvider"


def test_a_body_over_the_synchronous_limit_is_refused_clearly(cpu: CpuService) -> None:
    # GIVEN a body one byte over what fits base64 in Lambda's 6 MB invoke payload
    from spillway.protocol.wire import SYNC_BODY_BYTES

    over = b" " * (SYNC_BODY_BYTES + 1)
    answer = handle_direct(cpu, {"model": "digits", "body_b64": base64.b64encode(over).decode()})
    # THEN it is a 413 that names the limit and the offline path for large inputs
    assert answer["statusCode"] == 413
    body = json.loads(answer["body"])
    assert body["code"] == "payload_too_large"
    assert f"limit of {SYNC_BODY_BYTES} bytes" in body["error"]
    assert "/v1/jobs" in body["error"]


@pytest.mark.parametrize(
    ("bad", "status", "code"),
    [
        ({"model": "Digits"}, 400, "invalid_model_name"),
        ({"model": "minilm"}, 404, "model_not_found"),
        ({"model": "digits", "version": "7"}, 404, "model_not_found"),
        ({"model": "digits", "body": "{not json"}, 400, "invalid_input"),
        ({"model": "digits", "body_b64": "***"}, 400, "invalid_input"),
        ({"operation": "explode", "model": "digits"}, 400, "invalid_input"),
        ({}, 400, "invalid_input"),
    ],
)
def test_bad_events_are_answered_not_raised(
    cpu: CpuService, bad: dict[str, Any], status: int, code: str
) -> None:
    answer = handle_direct(cpu, bad)
    assert answer["statusCode"] == status
    assert json.loads(answer["body"])["code"] == code


def test_an_expired_timeout_is_not_computed(cpu: CpuService) -> None:
    request = event("infer-direct.json")
    request["body"]["parameters"] = {"timeout": 1}
    answer = handle_direct(cpu, request)
    assert answer["statusCode"] == 504
    assert json.loads(answer["body"])["code"] == "deadline_exceeded"


def test_api_gateway_event_goes_through_the_wsgi_app(cpu: CpuService, first_label: int) -> None:
    answer = serverless_wsgi.handle_request(CpuApp(cpu), event("infer-http-v2.json"), None)
    assert answer["statusCode"] == 200
    assert {o["name"]: o["data"] for o in json.loads(answer["body"])["outputs"]} == {
        "label": [first_label]
    }


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_over_http_equals_the_engine(
    cpu_url: str, models_dir: Path, binary: bool
) -> None:
    images = np.load(models_dir / "digits" / "samples" / "images.npy")[:5].astype(np.float32)
    client = triton.InferenceServerClient(cpu_url.removeprefix("http://"))
    tensor = triton.InferInput("image", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images, binary_data=binary)
    wanted = [
        triton.InferRequestedOutput(n, binary_data=binary) for n in ("label", "probabilities")
    ]
    result = client.infer("digits", [tensor], outputs=wanted)
    local = LocalRepository(models_dir)
    engine = OnnxModel(
        "digits",
        1,
        local.read_config("digits"),
        local.fetch_version("digits", 1, models_dir),
        EngineOptions(),
    )
    direct = engine.infer({"image": images})
    np.testing.assert_array_equal(result.as_numpy("label"), direct["label"])
    np.testing.assert_allclose(result.as_numpy("probabilities"), direct["probabilities"], atol=1e-6)
    assert client.is_model_ready("digits")
    assert not client.is_model_ready("minilm")


def test_the_handler_in_a_fresh_process_like_sam_local_invoke(
    models_dir: Path, tmp_path: Path, first_label: int
) -> None:
    # GIVEN the handler module loaded in a new interpreter, models from CPU_REPOSITORY
    script = (
        "import json, sys\n"
        "from functions.cpu_infer.handler import handler\n"
        "from tests.lambda_context import LambdaContext\n"
        "for path in sys.argv[1:]:\n"
        "    print(json.dumps(handler(json.load(open(path)), LambdaContext())))\n"
    )
    env = {
        **os.environ,
        "CPU_REPOSITORY": str(models_dir),
        "CPU_MODELS": '["digits"]',
        "CPU_CACHE_DIR": str(tmp_path),
        "POWERTOOLS_LOG_LEVEL": "WARNING",
    }
    files = [str(EVENTS / n) for n in ("infer-direct.json", "infer-http-v2.json")]
    done = subprocess.run(
        [sys.executable, "-c", script, *files],
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    answers = [
        json.loads(line) for line in done.stdout.decode().splitlines() if line.startswith("{")
    ]
    answers = [a for a in answers if "statusCode" in a]
    assert [a["statusCode"] for a in answers] == [200, 200]
    for answer in answers:
        labels = {o["name"]: o["data"] for o in json.loads(answer["body"])["outputs"]}
        assert labels == {"label": [first_label]}


def test_models_load_at_init_from_s3_into_the_cache(
    aws_env: str, models_dir: Path, tmp_path: Path, first_label: int
) -> None:
    # GIVEN the digits model published under an S3 prefix (moto server)
    s3 = boto3.client("s3")
    bucket = f"models-{tmp_path.name.lower().replace('_', '-')[:40]}"
    s3.create_bucket(Bucket=bucket)
    for path in (models_dir / "digits").rglob("*"):
        if path.is_file() and "samples" not in path.parts:
            key = f"repo/digits/{path.relative_to(models_dir / 'digits').as_posix()}"
            s3.upload_file(str(path), bucket, key)
    # WHEN the function initialises with CPU_REPOSITORY=s3://bucket/repo
    settings = CpuSettings(repository=f"s3://{bucket}/repo", cache_dir=tmp_path / "cache")
    service = CpuService.load(settings)
    # THEN the version was fetched into the cache, verified, and serves
    assert sorted(service.models) == ["digits"]
    assert (tmp_path / "cache" / "digits" / "1" / "model.onnx").is_file()
    answer = handle_direct(service, event("infer-direct.json"))
    assert outputs(answer) == {"label": [first_label]}
