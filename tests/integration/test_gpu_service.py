"""The GPU service over real HTTP on 127.0.0.1, with tritonclient and raw requests."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton

from tests.fakes import eventually
from tests.support import Service, gpu_service, load_engine, write_slow_model


def _http(
    method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def _infer_slow(base: str, value: float, **parameters: Any) -> tuple[int, dict[str, str], bytes]:
    body: dict[str, Any] = {
        "inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [value]}]
    }
    if parameters:
        body["parameters"] = parameters
    return _http("POST", f"{base}/v2/models/slow/infer", json.dumps(body).encode())


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_digits_through_tritonclient_equals_engine(
    service: Service, serving_repo: Path, binary: bool
) -> None:
    images = np.load(serving_repo / "digits" / "samples" / "images.npy")[:12].astype(np.float32)
    client = triton.InferenceServerClient(service.url)
    tensor = triton.InferInput("image", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images, binary_data=binary)
    outputs = [
        triton.InferRequestedOutput(n, binary_data=binary) for n in ("label", "probabilities")
    ]
    result = client.infer("digits", [tensor], outputs=outputs)
    direct = load_engine(serving_repo, "digits").infer({"image": images})
    np.testing.assert_array_equal(result.as_numpy("label"), direct["label"])
    np.testing.assert_allclose(result.as_numpy("probabilities"), direct["probabilities"], atol=1e-6)
    assert result.get_response()["model_version"] == "1"


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_minilm_through_tritonclient_equals_engine(
    service: Service, serving_repo: Path, binary: bool
) -> None:
    texts = np.array(
        [
            [b"Spillway routes requests."],
            [b"A much longer sentence, with more tokens in it than the first one has."],
        ],
        dtype=np.object_,
    )
    client = triton.InferenceServerClient(service.url)
    tensor = triton.InferInput("text", [2, 1], "BYTES")
    tensor.set_data_from_numpy(texts, binary_data=binary)
    result = client.infer(
        "minilm", [tensor], outputs=[triton.InferRequestedOutput("embedding", binary_data=binary)]
    )
    direct = load_engine(serving_repo, "minilm").infer({"text": texts})["embedding"]
    np.testing.assert_allclose(result.as_numpy("embedding"), direct, atol=1e-5)


def test_metadata_config_and_server_are_readable(service: Service) -> None:
    client = triton.InferenceServerClient(service.url)
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("digits")
    server = client.get_server_metadata()
    assert {"binary_tensor_data", "statistics"} <= set(server["extensions"])
    meta = client.get_model_metadata("minilm")
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1, 1]}]
    config = client.get_model_config("digits")
    assert config["max_batch_size"] == 64
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    versioned = client.get_model_metadata("digits", model_version="1")
    assert versioned["versions"] == ["1"]


def test_concurrent_requests_form_batches(service: Service, serving_repo: Path) -> None:
    # GIVEN 48 single-image requests sent at once
    images = np.load(serving_repo / "digits" / "samples" / "images.npy")[:48].astype(np.float32)
    before = triton.InferenceServerClient(service.url).get_inference_statistics("digits")

    def one(i: int) -> int:
        client = triton.InferenceServerClient(service.url)
        tensor = triton.InferInput("image", [1, 8, 8], "FP32")
        tensor.set_data_from_numpy(images[i : i + 1])
        return int(client.infer("digits", [tensor]).as_numpy("label")[0, 0])

    with ThreadPoolExecutor(16) as pool:
        labels = list(pool.map(one, range(48)))
    after = triton.InferenceServerClient(service.url).get_inference_statistics("digits")
    # THEN every answer is its own, and fewer executions than requests ran
    direct = load_engine(serving_repo, "digits").infer({"image": images})["label"][:, 0]
    assert labels == direct.tolist()
    b, a = before["model_stats"][0], after["model_stats"][0]
    assert a["inference_count"] - b["inference_count"] == 48
    assert a["execution_count"] - b["execution_count"] < 48
    assert a["inference_stats"]["success"]["count"] - b["inference_stats"]["success"]["count"] == 48


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_input"),
        (
            b'{"inputs": [{"name": "image", "shape": [1, 8, 8], "datatype": "FP64",'
            b' "data": [' + b",".join([b"0.5"] * 64) + b"]}]}",
            400,
            "invalid_input",
        ),
        (
            b'{"inputs": [{"name": "image", "shape": [1, 64], "datatype": "FP32",'
            b' "data": [' + b",".join([b"0.5"] * 64) + b"]}]}",
            400,
            "invalid_input",
        ),
        (
            b'{"inputs": [{"name": "pixels", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}',
            400,
            "invalid_input",
        ),
        (
            b'{"inputs": [{"name": "image", "shape": [1], "datatype": "FP99", "data": [1]}]}',
            400,
            "unsupported_datatype",
        ),
    ],
    ids=["malformed", "wrong-dtype", "wrong-shape", "unknown-input", "unknown-datatype"],
)
def test_bad_input_is_a_clear_4xx(service: Service, body: bytes, status: int, code: str) -> None:
    got, _, raw = _http("POST", f"{service.base}/v2/models/digits/infer", body)
    assert got == status
    assert json.loads(raw)["code"] == code
    assert "Traceback" not in raw.decode()


def test_unknown_model_traversal_and_routes(service: Service) -> None:
    assert _http("GET", f"{service.base}/v2/models/nope")[0] == 404
    status, _, raw = _http("GET", f"{service.base}/v2/models/..%2Fetc/config")
    assert status in (400, 404)
    status, _, raw = _http("GET", f"{service.base}/v2/models/Bad%20Name")
    assert (status, json.loads(raw)["code"]) == (400, "invalid_model_name")
    assert _http("GET", f"{service.base}/v2/models/digits/infer")[0] == 405
    assert _http("GET", f"{service.base}/nowhere")[0] == 404


def test_metrics_expose_batching_and_queue(service: Service) -> None:
    status, _, raw = _http("GET", f"{service.base}/metrics")
    text = raw.decode()
    assert status == 200
    for name in (
        "nv_inference_request_success",
        "nv_inference_exec_count",
        "nv_inference_pending_request_count",
        "spillway_batch_size_bucket",
        "spillway_queue_depth",
        "nv_inference_queue_duration_us",
        "spillway_model_memory_bytes",
    ):
        assert f'{name}{{model="digits",version="1"' in text


def test_load_headers_on_every_infer(service: Service) -> None:
    status, headers, _ = _infer_slow(service.base, 0.5)
    assert status == 200
    lowered = {k.lower(): v for k, v in headers.items()}
    assert int(lowered["x-spillway-queue-depth"]) >= 0
    assert 0.0 <= float(lowered["x-spillway-busy"]) <= 1.0
    assert lowered["x-spillway-model-version"] == "1"


def _gauges(base: str, model: str = "slow") -> tuple[float, float]:
    """Requests of a model's version 1 in the service now: (queued or computing, queued)."""
    _, _, raw = _http("GET", f"{base}/metrics")
    values = {}
    for line in raw.decode().splitlines():
        name, _, value = line.partition(f'{{model="{model}",version="1"}} ')
        if value:
            values[name] = float(value)
    return values["nv_inference_pending_request_count"], values["spillway_queue_depth"]


def _wait_queue(base: str, *, running: int, queued: int) -> None:
    """Until the slow model has ``running`` requests computing and ``queued`` waiting."""
    eventually(
        lambda: _gauges(base) == (running + queued, queued),
        f"{running} request(s) computing and {queued} queued",
    )


@pytest.fixture
def slow_repo(models_dir: Path, tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    write_slow_model(root, max_batch_size=1, max_queue_size=3, steps=6)
    return root


def test_full_queue_gives_exactly_k_429s(slow_repo: Path, tmp_path: Path) -> None:
    # GIVEN a busy model with max_queue_size 3
    with (
        gpu_service(slow_repo, tmp_path / "logs", instance_count="1") as svc,
        ThreadPoolExecutor(8) as pool,
    ):
        first = pool.submit(_infer_slow, svc.base, 1.0)
        _wait_queue(svc.base, running=1, queued=0)
        # WHEN 3 + 2 more requests arrive
        statuses = list(pool.map(lambda i: _infer_slow(svc.base, float(i)), range(5)))
        first.result()
    # THEN exactly 2 are refused with 429 and Retry-After; the 3 queued ones succeed
    codes = sorted(s for s, _, _ in statuses)
    assert codes == [200, 200, 200, 429, 429]
    for status, headers, raw in statuses:
        if status == 429:
            assert json.loads(raw)["code"] == "overloaded"
            assert int({k.lower(): v for k, v in headers.items()}["retry-after"]) >= 1


def test_deadline_passes_in_queue_gives_504(slow_repo: Path, tmp_path: Path) -> None:
    with (
        gpu_service(slow_repo, tmp_path / "logs", instance_count="1") as svc,
        ThreadPoolExecutor(2) as pool,
    ):
        first = pool.submit(_infer_slow, svc.base, 1.0)
        _wait_queue(svc.base, running=1, queued=0)
        status, _, raw = _infer_slow(svc.base, 2.0, timeout=50_000)  # 50 ms, in microseconds
        still_running = not first.done()
        assert first.result()[0] == 200
        _, _, stats = _http("GET", f"{svc.base}/v2/models/slow/stats")
    assert (status, json.loads(raw)["code"]) == (504, "deadline_exceeded")
    assert still_running, "the 504 must not wait for the running batch"
    model_stats = json.loads(stats)["model_stats"][0]
    assert model_stats["inference_count"] == 1  # the expired request never ran
    assert model_stats["spillway"]["expired"] == 1


@pytest.mark.parametrize("early", [False, True], ids=["wait-for-company", "early-dispatch"])
def test_lone_request_latency_is_bounded_by_the_delay(
    models_dir: Path, tmp_path: Path, early: bool
) -> None:
    # GIVEN a fast model whose queue delay is 300 ms, with early dispatch off or on
    root = tmp_path / "repo"
    write_slow_model(root, max_batch_size=8, delay_us=300_000, steps=0)
    with gpu_service(root, tmp_path / "logs", early_dispatch=str(early).lower()) as svc:
        _infer_slow(svc.base, 1.0)  # warm the connection path
        started = time.monotonic()
        status, _, _ = _infer_slow(svc.base, 1.0)
        elapsed = time.monotonic() - started
    assert status == 200
    if early:
        # alone, it could gain no company by waiting: it ran at once
        assert elapsed < 0.3
    else:
        # it waited for company for the delay, measured from its arrival, and not much more
        assert 0.3 <= elapsed < 0.3 + 1.5


def test_sigterm_drains_in_flight_and_refuses_new(slow_repo: Path, tmp_path: Path) -> None:
    results: list[int] = []
    with gpu_service(slow_repo, tmp_path / "logs", drain_timeout_s="60", instance_count="1") as svc:
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(_infer_slow, svc.base, 1.0)
            _wait_queue(svc.base, running=1, queued=0)
            queued = [pool.submit(_infer_slow, svc.base, float(i)) for i in (2, 3)]
            _wait_queue(svc.base, running=1, queued=2)
            # WHEN the service is told to stop (an ECS stop), and has taken it in
            svc.child.signal(signal.SIGTERM)
            eventually(
                lambda: "readiness false" in svc.child.log_path.read_text(errors="replace"),
                "the service logs that it drains",
            )
            # THEN new requests are refused
            try:
                late = _infer_slow(svc.base, 4.0)[0]
            except (urllib.error.URLError, ConnectionError):
                late = -1
            results = [f.result()[0] for f in [first, *queued]]
        code = svc.child.proc.wait(90)
    # AND everything in flight or queued completed, and the process exited cleanly
    assert results == [200, 200, 200]
    assert late in (-1, 503)
    assert code == 0


def test_statistics_of_every_model(service: Service) -> None:
    status, _, raw = _http("GET", f"{service.base}/v2/models/stats")
    assert status == 200
    names = {entry["name"] for entry in json.loads(raw)["model_stats"]}
    assert {"digits", "minilm", "mlp-bench", "slow"} <= names


def test_openapi_document_is_valid(service: Service) -> None:
    from openapi_spec_validator import validate

    status, _, raw = _http("GET", f"{service.base}/openapi.json")
    assert status == 200
    document = json.loads(raw)
    validate(document)
    assert "/v2/models/{model}/infer" in document["paths"]
