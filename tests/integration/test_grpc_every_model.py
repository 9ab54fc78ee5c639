"""Every model the repository serves answers the same over gRPC as over HTTP.

GIVEN the GPU service over the whole built repository (models and pipelines), with its
HTTP and gRPC ports
WHEN each served name gets one request built for it (OCR steps take what the step before
them answered for a rendered page) over HTTP, then with an unmodified
``tritonclient.grpc``: ``infer``, ``async_infer`` and a stream (``start_stream`` /
``async_stream_infer``)
THEN every output of every gRPC answer equals the HTTP answer's, and the test covers every
name in the repository index: a model added without a request here fails it.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpc_client
import tritonclient.http as http_client

from spillway_cli.local import procs
from spillway_cli.modelbuild.ocr import render_lines
from tests.support import gpu_service

Arrays = dict[str, np.ndarray[Any, Any]]

TEXTS = np.array([[b"Spillway routes requests."], [b"Invoices are due in thirty days."]])
PAGE = render_lines(["Spillway reads pages", "one line at a time"], size=24, min_side=480)


@pytest.fixture(scope="module")
def doors(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The HTTP URL and the gRPC address of one GPU service over the whole repository."""
    grpc_port = procs.free_port()
    with gpu_service(
        models_dir, tmp_path_factory.mktemp("grpc-every-model"), grpc_port=str(grpc_port)
    ) as svc:
        yield svc.url, f"127.0.0.1:{grpc_port}"


def _http_infer(url: str, model: str, inputs: Arrays) -> Arrays:
    client = http_client.InferenceServerClient(url.removeprefix("http://"))
    tensors = []
    for name, array in inputs.items():
        tensor = http_client.InferInput(name, list(array.shape), _datatype(array))
        tensor.set_data_from_numpy(array, binary_data=True)
        tensors.append(tensor)
    result = client.infer(model, tensors)
    return {out["name"]: result.as_numpy(out["name"]) for out in result.get_response()["outputs"]}


def _grpc_inputs(inputs: Arrays) -> list[grpc_client.InferInput]:
    tensors = []
    for name, array in inputs.items():
        tensor = grpc_client.InferInput(name, list(array.shape), _datatype(array))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _datatype(array: np.ndarray[Any, Any]) -> str:
    if array.dtype == np.object_:
        return "BYTES"
    return {"float32": "FP32", "int64": "INT64", "int32": "INT32"}[array.dtype.name]


def _outputs(result: Any) -> Arrays:
    return {out.name: result.as_numpy(out.name) for out in result.get_response().outputs}


def _requests(http: Callable[[str, Arrays], Arrays], models_dir: Path) -> dict[str, Arrays]:
    """One request per served name; the OCR steps' inputs are their producers' outputs."""
    images = np.load(models_dir / "digits" / "samples" / "images.npy")[:3].astype(np.float32)
    page = np.array([PAGE], dtype=np.object_)
    rng = np.random.default_rng(27)
    requests: dict[str, Arrays] = {
        "digits": {"image": images},
        "minilm": {"text": TEXTS.astype(np.object_)},
        "topics": {"text": TEXTS.astype(np.object_)},
        "mlp-bench": {"input": rng.standard_normal((2, 1024)).astype(np.float32)},
        "ocr-det": {"image": page},
        "ocr": {"image": page},
        "ocr-topics": {"image": page},
    }
    requests["topics-head"] = {"embedding": http("minilm", requests["minilm"])["embedding"]}
    crops = http("ocr-det", requests["ocr-det"])["crops"]
    assert len(crops) >= 2, "the rendered page must give the OCR steps at least two lines"
    requests["ocr-cls"] = {"crops": crops}
    upright = http("ocr-cls", requests["ocr-cls"])["crops"]
    requests["ocr-rec"] = {"crops": upright}
    read = http("ocr-rec", requests["ocr-rec"])
    requests["ocr-lines"] = {
        "text": read["text"],
        "char_positions": read["char_positions"],
        "crops": upright,
    }
    return requests


def test_every_served_model_answers_the_same_over_grpc(
    doors: tuple[str, str], models_dir: Path
) -> None:
    url, address = doors
    client = grpc_client.InferenceServerClient(address)
    served = {entry["name"] for entry in client.get_model_repository_index(as_json=True)["models"]}

    def http(model: str, inputs: Arrays) -> Arrays:
        return _http_infer(url, model, inputs)

    requests = _requests(http, models_dir)
    # THEN every served name has a request here (a new model must get one)
    assert served == set(requests), f"served without a request here: {served - set(requests)}"
    expected = {model: http(model, inputs) for model, inputs in requests.items()}

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()

    def callback(result: Any, error: Any) -> None:
        answers.put((result, error))

    for model, inputs in requests.items():
        over_sync = _outputs(client.infer(model, _grpc_inputs(inputs)))
        client.async_infer(model, _grpc_inputs(inputs), callback)
        result, error = answers.get(timeout=60)
        assert error is None, f"{model}: {error}"
        over_async = _outputs(result)
        for got in (over_sync, over_async):
            _assert_same(model, got, expected[model])

    client.start_stream(callback)
    try:
        for model, inputs in requests.items():
            client.async_stream_infer(model, _grpc_inputs(inputs), request_id=model)
        streamed = [answers.get(timeout=120) for _ in requests]
    finally:
        client.stop_stream()
    # THEN the stream answers in the order sent, each with its request's id
    assert [result.get_response().id for result, _ in streamed] == list(requests)
    for (result, error), model in zip(streamed, requests, strict=True):
        assert error is None, f"{model}: {error}"
        _assert_same(model, _outputs(result), expected[model])


def _assert_same(model: str, got: Arrays, expected: Arrays) -> None:
    assert set(got) == set(expected), model
    for name, array in expected.items():
        assert got[name].shape == array.shape, f"{model}.{name}"
        np.testing.assert_array_equal(got[name], array, err_msg=f"{model}.{name}")
