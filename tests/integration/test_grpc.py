"""The GPU service's KServe V2 gRPC port with an unmodified ``tritonclient.grpc``: the
same answers as HTTP, sync, async and streaming, and errors as gRPC statuses."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpc_client
import tritonclient.http as http_client
from tritonclient.utils import InferenceServerException

from spillway_cli import procs
from tests.support import Service, gpu_service

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
