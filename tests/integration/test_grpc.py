"""The GPU service's KServe V2 gRPC port with an unmodified ``tritonclient.grpc``: the
same answers as HTTP, sync, async and streaming, and errors as gRPC statuses; its health
service, its counts in ``/metrics``, and a drain under an open stream."""

from __future__ import annotations

import queue
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpc_client
import tritonclient.http as http_client
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from spillway_cli.local import procs
from tests.fakes import eventually
from tests.support import Service, gpu_service, write_slow_model

TOKEN = "grpc-test-token"  # noqa: S105 - a test's own token


@pytest.fixture(scope="module")
def served(
    serving_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Service, str]]:
    """A GPU service with a gRPC port (explicit model control behind a token): the HTTP
    service and the gRPC address."""
    port = procs.free_port()
    with gpu_service(
        serving_repo,
        tmp_path_factory.mktemp("grpc-logs"),
        grpc_port=str(port),
        model_control_mode="explicit",
        admin_token=TOKEN,
    ) as svc:
        yield svc, f"127.0.0.1:{port}"


@pytest.fixture
def client(served: tuple[Service, str]) -> grpc_client.InferenceServerClient:
    return grpc_client.InferenceServerClient(served[1])


def _images(repo: Path, count: int) -> np.ndarray[Any, Any]:
    images = np.load(repo / "digits" / "samples" / "images.npy")[:count]
    return np.asarray(images, dtype=np.float32)


def _digits_input(images: np.ndarray[Any, Any]) -> grpc_client.InferInput:
    tensor = grpc_client.InferInput("image", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images)
    return tensor


def test_health_metadata_and_config(client: grpc_client.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("digits")
    server = client.get_server_metadata(as_json=True)
    assert {"binary_tensor_data", "statistics", "model_repository"} <= set(server["extensions"])
    meta = client.get_model_metadata("minilm", as_json=True)
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": ["-1", "1"]}]
    config = client.get_model_config("digits", as_json=True)["config"]
    assert config["max_batch_size"] == 64
    assert config["input"][0]["data_type"] == "TYPE_FP32"


def test_fp32_and_bytes_answers_equal_http(
    served: tuple[Service, str], client: grpc_client.InferenceServerClient, serving_repo: Path
) -> None:
    # GIVEN the same inputs sent over HTTP and over gRPC
    http = http_client.InferenceServerClient(served[0].url)
    images = _images(serving_repo, 12)
    over_http = http.infer("digits", [_http_input("image", images, "FP32")])
    over_grpc = client.infer("digits", [_digits_input(images)], request_id="r-1")
    # THEN the answers are the same, with the request's id and the version that served it
    for name in ("label", "probabilities"):
        np.testing.assert_array_equal(over_grpc.as_numpy(name), over_http.as_numpy(name))
    assert over_grpc.get_response().id == "r-1"
    assert over_grpc.get_response().model_version == "1"
    texts = np.array([[b"Spillway routes requests."], [b"A second, longer text."]], np.object_)
    text = grpc_client.InferInput("text", [2, 1], "BYTES")
    text.set_data_from_numpy(texts)
    embedding = client.infer("minilm", [text]).as_numpy("embedding")
    expected = http.infer("minilm", [_http_input("text", texts, "BYTES")]).as_numpy("embedding")
    np.testing.assert_array_equal(embedding, expected)


def _http_input(name: str, array: np.ndarray[Any, Any], datatype: str) -> http_client.InferInput:
    tensor = http_client.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=True)
    return tensor


def _collect(answers: queue.Queue[Any]) -> Any:
    """A tritonclient callback (called with ``result`` and ``error``) into ``answers``."""

    def callback(result: Any, error: Any) -> None:
        answers.put((result, error))

    return callback


def test_async_infer(client: grpc_client.InferenceServerClient, serving_repo: Path) -> None:
    images = _images(serving_repo, 2)
    answers: queue.Queue[Any] = queue.Queue()
    answer = _collect(answers)
    client.async_infer("digits", [_digits_input(images)], answer)
    result, error = answers.get(timeout=30)
    assert error is None
    assert result.as_numpy("label").shape == (2, 1)


def test_stream_answers_in_order_with_ids(
    client: grpc_client.InferenceServerClient, serving_repo: Path
) -> None:
    # GIVEN 20 requests on one stream, one image each, the 8th for an unknown model
    images = _images(serving_repo, 20)
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(_collect(answers))
    try:
        for i in range(20):
            model = "nope" if i == 7 else "digits"
            inputs = [_digits_input(images[i : i + 1])]
            client.async_stream_infer(model, inputs, request_id=f"frame-{i}")
        got = [answers.get(timeout=30) for _ in range(20)]
    finally:
        client.stop_stream()
    # THEN each is answered in order, its id kept; the unknown model's answer is an error
    assert "model_not_found" in str(got[7][1])
    labels = [r.as_numpy("label")[0, 0] for i, (r, _) in enumerate(got) if i != 7]
    assert [r.get_response().id for i, (r, _) in enumerate(got) if i != 7] == [
        f"frame-{i}" for i in range(20) if i != 7
    ]
    single = client.infer("digits", [_digits_input(images)]).as_numpy("label")[:, 0]
    assert labels == [single[i] for i in range(20) if i != 7]


def test_statistics_count_grpc_requests(
    client: grpc_client.InferenceServerClient, serving_repo: Path
) -> None:
    before = client.get_inference_statistics("digits", as_json=True)["model_stats"][0]
    client.infer("digits", [_digits_input(_images(serving_repo, 3))])
    after = client.get_inference_statistics("digits", as_json=True)["model_stats"][0]
    assert int(after["inference_count"]) - int(before.get("inference_count", 0)) == 3


def test_load_and_unload_need_the_token(client: grpc_client.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as refused:
        client.unload_model("mlp-bench")
    assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
    assert "unauthorized" in str(refused.value.message())
    headers = {"authorization": f"Bearer {TOKEN}"}
    client.unload_model("mlp-bench", headers=headers)
    assert not client.is_model_ready("mlp-bench")
    client.load_model("mlp-bench", headers=headers)
    assert client.is_model_ready("mlp-bench")
    index = client.get_model_repository_index(headers=headers, as_json=True)["models"]
    assert {"digits", "minilm", "mlp-bench"} <= {m["name"] for m in index}


def test_unknown_model_and_bad_shape_are_grpc_statuses(
    client: grpc_client.InferenceServerClient, serving_repo: Path
) -> None:
    images = _images(serving_repo, 2)
    with pytest.raises(InferenceServerException) as unknown:
        client.infer("nope", [_digits_input(images)])
    assert unknown.value.status() == "StatusCode.NOT_FOUND"
    assert str(unknown.value.message()).startswith("model_not_found: ")
    with pytest.raises(InferenceServerException) as bad:
        client.infer("digits", [_digits_input(images.reshape(2, 64))])
    assert bad.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert str(bad.value.message()).startswith("invalid_input: ")


def test_the_grpc_server_takes_the_http_sides_time_limits() -> None:
    from gpu_service.grpc_server import time_limits
    from gpu_service.settings import GpuSettings

    # GIVEN settings with their own keep-alive, header and write limits
    settings = GpuSettings.model_validate(
        {"keep_alive_s": 7.5, "header_timeout_s": 2.0, "write_timeout_s": 4.0}
    )
    # THEN an idle connection closes after the keep-alive, a silent peer is dropped after
    # the write limit, and a connection carries a bounded number of RPCs
    assert dict(time_limits(settings)) == {
        "grpc.max_connection_idle_ms": 7500,
        "grpc.keepalive_time_ms": 2000,
        "grpc.keepalive_timeout_ms": 4000,
        "grpc.max_concurrent_streams": 100,
    }


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _health(address: str) -> Any:
    return health_pb2_grpc.HealthStub(grpc.insecure_channel(address))


def test_health_service_says_serving_for_the_server_and_the_inference_service(
    served: tuple[Service, str],
) -> None:
    health = _health(served[1])
    for service in ("", "inference.GRPCInferenceService"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert answer.status == SERVING
    with pytest.raises(grpc.RpcError) as unknown:
        health.Check(health_pb2.HealthCheckRequest(service="other.Service"), timeout=10)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def _samples(base: str, prefix: str = "spillway_grpc_") -> dict[str, float]:
    """The samples of ``/metrics`` whose names start with ``prefix``, by name and labels."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {
        key: float(value)
        for key, _, value in (line.rpartition(" ") for line in lines)
        if key.startswith(prefix)
    }


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_metrics_count_calls_by_method_and_code_and_stream_messages(
    served: tuple[Service, str], client: grpc_client.InferenceServerClient, serving_repo: Path
) -> None:
    images = _images(serving_repo, 4)
    before = _samples(served[0].base)
    # GIVEN three answered ModelInfer calls and one for an unknown model
    for i in range(3):
        client.infer("digits", [_digits_input(images[i : i + 1])])
    with pytest.raises(InferenceServerException):
        client.infer("nope", [_digits_input(images[:1])])
    # AND a stream of four requests, the third for an unknown model
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(_collect(answers))
    for i in range(4):
        client.async_stream_infer(
            "nope" if i == 2 else "digits", [_digits_input(images[i : i + 1])]
        )
    got = [answers.get(timeout=30) for _ in range(4)]
    client.stop_stream()
    assert [error is None for _, error in got] == [True, True, False, True]
    # THEN /metrics counts each call by method and status, and each stream message
    calls = "spillway_grpc_requests_total"
    messages = "spillway_grpc_stream_messages_total"
    expected = {
        f'{calls}{{method="ModelInfer",code="OK"}}': 3,
        f'{calls}{{method="ModelInfer",code="NOT_FOUND"}}': 1,
        f'{calls}{{method="ModelStreamInfer",code="OK"}}': 1,
        f'{messages}{{direction="received",code=""}}': 4,
        f'{messages}{{direction="sent",code="OK"}}': 3,
        f'{messages}{{direction="sent",code="NOT_FOUND"}}': 1,
    }
    eventually(
        lambda: _delta(before, _samples(served[0].base)) == expected,
        f"the counts {expected}",
        timeout_s=20,
    )


def _slow_input(value: float) -> grpc_client.InferInput:
    tensor = grpc_client.InferInput("x", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[value]], np.float32))
    return tensor


def test_drain_answers_a_streams_requests_in_order_and_refuses_new_rpcs(
    models_dir: Path, tmp_path: Path
) -> None:
    # GIVEN a service with a slow model (one request a run) and a gRPC port
    write_slow_model(tmp_path / "repo", max_batch_size=1, max_queue_size=8, steps=6)
    port = procs.free_port()
    address = f"127.0.0.1:{port}"
    with gpu_service(
        tmp_path / "repo",
        tmp_path / "logs",
        grpc_port=str(port),
        drain_timeout_s="60",
        instance_count="1",
    ) as svc:
        client = grpc_client.InferenceServerClient(address)
        watch = _health(address).Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
        assert next(watch).status == SERVING
        # AND a stream whose five requests the service has taken in (running or queued)
        answers: queue.Queue[Any] = queue.Queue()
        client.start_stream(_collect(answers))
        for i in range(5):
            client.async_stream_infer("slow", [_slow_input(float(i))], request_id=f"s-{i}")
        pending = 'nv_inference_pending_request_count{model="slow"'
        eventually(
            lambda: sum(_samples(svc.base, pending).values()) == 5,
            "five stream requests in the service",
        )
        # WHEN the service is told to stop (an ECS stop) and has taken it in
        svc.child.signal(signal.SIGTERM)
        eventually(
            lambda: "readiness false" in svc.child.log_path.read_text(errors="replace"),
            "the service logs that it drains",
        )
        # THEN health says NOT_SERVING to its watcher
        assert next(watch).status == NOT_SERVING
        watch.cancel()
        # AND a new RPC is refused with UNAVAILABLE
        with pytest.raises(InferenceServerException) as refused:
            client.infer("slow", [_slow_input(9.0)])
        assert refused.value.status() == "StatusCode.UNAVAILABLE"
        # AND a request sent on the open stream after the drain began is refused in it
        client.async_stream_infer("slow", [_slow_input(5.0)], request_id="s-5")
        got = [answers.get(timeout=120) for _ in range(6)]
        # AND the stream ends cleanly when the client closes it: no more answers, no error
        client.stop_stream()
        code = svc.child.proc.wait(90)
    # THEN every request sent before the drain was answered, in order, with its own value
    assert [(r.get_response().id, r.as_numpy("y")[0, 0]) for r, _ in got[:5]] == [
        (f"s-{i}", float(i)) for i in range(5)
    ]
    assert all(error is None for _, error in got[:5])
    assert got[5][0] is None
    assert str(got[5][1].message()).startswith("unavailable: ")
    assert answers.empty()
    assert code == 0
