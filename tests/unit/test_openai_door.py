# ruff: noqa: E501 - the tables of cases read best one case a line
"""The OpenAI-compatible door in the router application, with in-memory backends and a
model repository in a folder (no network): what reaches a backend, what the client gets,
and that routing, fallback, tenants and errors are the ``/v2`` path's."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from werkzeug.test import Client, TestResponse

from spillway.policy.backend import BackendError, BackendRequest, BackendResponse, ConnectFailed
from spillway.router.batch_mode import BatchBackend
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from tests.unit.openai_support import DIMENSIONS, repository, v2_answer, vector
from tests.unit.router_support import fake_overrides

JSON = {"content-type": "application/json"}
Script = BackendResponse | BackendError | Callable[[BackendRequest], BackendResponse]


def answered(request: BackendRequest) -> BackendResponse:
    """A backend that embeds every text it is sent (7 tokens each) with its model version."""
    rows = json.loads(request.body)["inputs"][0]["shape"][0]
    headers = {**JSON, "x-spillway-model-version": "1"}
    return BackendResponse(200, headers, v2_answer(rows, tokens=7 * rows), 0.01)


def failing(status: int, code: str, message: str, **headers: str) -> BackendResponse:
    body = json.dumps({"error": message, "code": code}).encode()
    return BackendResponse(status, {**JSON, **headers}, body, 0.01)


@dataclass
class Recording:
    """A backend that answers from a script (the last item repeats) and keeps requests."""

    name: str
    script: list[Script] = field(default_factory=lambda: [answered])
    requests: list[BackendRequest] = field(default_factory=list)

    def send(self, request: BackendRequest, timeout_s: float) -> BackendResponse:
        self.requests.append(request)
        item = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(item, BackendError):
            raise item
        return item(request) if callable(item) else item


@dataclass
class Door:
    client: Client
    gpu: Recording
    cpu: Recording
    metrics: io.StringIO

    def embed(self, body: Any, **headers: str) -> TestResponse:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.client.post("/v1/embeddings", data=data, headers={**JSON, **headers})


def make_door(
    tmp_path: Path,
    gpu: list[Script] | None = None,
    cpu: list[Script] | None = None,
    **settings: Any,
) -> Door:
    backends: dict[str, Any] = {
        "gpu": Recording("gpu", gpu or [answered]),
        "cpu": Recording("cpu", cpu or [answered]),
        "batch": BatchBackend(None),
    }
    metrics = io.StringIO()
    settings.setdefault("model_repository", str(repository(tmp_path / "repo")))
    app = create_app(RouterSettings(**settings), fake_overrides(backends, lambda: 100.0, metrics))
    return Door(Client(app), backends["gpu"], backends["cpu"], metrics)


def _error(response: TestResponse) -> dict[str, Any]:
    error: dict[str, Any] = response.get_json()["error"]
    return error


def test_texts_become_the_v2_infer_request_on_the_model_and_vectors_come_back(
    tmp_path: Path,
) -> None:
    # GIVEN the built-in policy and a GPU backend that embeds
    door = make_door(tmp_path)
    # WHEN three texts are embedded
    response = door.embed({"model": "minilm", "input": ["a", "b", "c"]})
    # THEN the GPU service got the V2 infer request on the model, as /v2 would send it
    (sent,) = door.gpu.requests
    assert (sent.method, sent.path, sent.operation, sent.model) == (
        "POST",
        "/v2/models/minilm/infer",
        "infer",
        "minilm",
    )
    document = json.loads(sent.body)
    assert document["inputs"] == [
        {"name": "text", "shape": [3, 1], "datatype": "BYTES", "data": ["a", "b", "c"]}
    ]
    assert document["outputs"] == [{"name": "embedding"}]
    assert document["parameters"]["timeout"] == 3_150_000  # the deadline, as for /v2
    # AND the client got OpenAI's list, the backend's vectors and count, the routing
    assert response.status_code == 200
    body = response.get_json()
    assert [d["embedding"] for d in body["data"]] == [vector(0), vector(1), vector(2)]
    assert body["usage"] == {"prompt_tokens": 21, "total_tokens": 21}
    assert response.headers["x-spillway-backend"] == "gpu"
    assert response.headers["x-spillway-rule"] == "default"
    assert response.headers["x-spillway-model-version"] == "1"
    assert float(response.headers["x-spillway-cost-usd"]) > 0


def test_a_failing_gpu_falls_back_to_the_cpu_as_on_v2(tmp_path: Path) -> None:
    door = make_door(tmp_path, gpu=[ConnectFailed("refused")])
    response = door.embed({"model": "minilm", "input": "a", "encoding_format": "base64"})
    assert response.status_code == 200
    assert response.headers["x-spillway-backend"] == "cpu"
    assert response.headers["x-spillway-fallback"] == "gpu:connect_error"
    assert isinstance(response.get_json()["data"][0]["embedding"], str)


def test_the_tenant_api_gateway_vouched_for_reaches_the_backend(tmp_path: Path) -> None:
    # GIVEN a router that maps an API key id to a tenant
    door = make_door(tmp_path, identity_tenants={"key-1": "acme"})
    event = {"requestContext": {"identity": {"apiKeyId": "key-1"}}}
    # WHEN the key's caller embeds (a tenant it claims for itself does not count)
    response = door.client.post(
        "/v1/embeddings",
        data=json.dumps({"model": "minilm", "input": "a"}),
        headers={**JSON, "x-spillway-tenant": "mallory"},
        environ_overrides={"serverless.event": event},
    )
    # THEN the request went on as acme's
    assert response.status_code == 200
    assert door.gpu.requests[0].tenant == "acme"


@pytest.mark.parametrize(
    "headers",
    [{"x-spillway-mode": "batch"}, {"prefer": "respond-async"}],
    ids=["batch", "async"],
)
def test_modes_that_answer_with_a_job_are_refused(tmp_path: Path, headers: dict[str, str]) -> None:
    door = make_door(tmp_path)
    response = door.embed({"model": "minilm", "input": "a"}, **headers)
    assert response.status_code == 400
    assert _error(response)["code"] == "mode_unavailable"
    assert door.gpu.requests == []


def test_a_rule_routing_to_batch_walks_its_chain_without_it(tmp_path: Path) -> None:
    # GIVEN a policy whose rule sends every infer request to batch, the CPU after it
    policy = tmp_path / "policy.json"
    rules = [
        {"name": "all-batch", "match": {"path": ["/v2/models/*/infer"]}, "route": "batch"},
        {"name": "default", "route": "gpu"},
    ]
    fallbacks = {"batch": ["cpu"], "gpu": ["cpu"]}
    policy.write_text(json.dumps({"version": 1, "fallbacks": fallbacks, "rules": rules}))
    door = make_door(tmp_path, policy_file=policy)
    # WHEN texts are embedded
    response = door.embed({"model": "minilm", "input": "a"})
    # THEN the rule fired, no job was made, and the chain's next backend answered
    assert response.status_code == 200
    assert response.headers["x-spillway-rule"] == "all-batch"
    assert response.headers["x-spillway-backend"] == "cpu"


@pytest.mark.parametrize(
    ("answer", "status", "kind", "code"),
    [
        (failing(400, "invalid_input", "text must be valid UTF-8"), 400, "invalid_request_error", "invalid_input"),
        (failing(500, "inference_failed", "the run failed", **{"x-spillway-fault": "server"}), 500, "server_error", "inference_failed"),
        (failing(504, "deadline_exceeded", "too late"), 504, "server_error", "deadline_exceeded"),
    ],
    ids=["the request's fault", "the server's fault", "busy"],
)  # fmt: skip
def test_a_backends_error_reaches_the_client_in_openais_shape(
    tmp_path: Path, answer: BackendResponse, status: int, kind: str, code: str
) -> None:
    door = make_door(tmp_path, gpu=[answer], cpu=[answer])
    response = door.embed({"model": "minilm", "input": "a"})
    assert response.status_code == status
    assert _error(response)["type"] == kind
    assert _error(response)["code"] == code
    assert "x-spillway-rule" in response.headers


def test_a_full_queue_everywhere_is_a_429_with_retry_after(tmp_path: Path) -> None:
    full = failing(429, "overloaded", "queue full", **{"retry-after": "1"})
    door = make_door(tmp_path, gpu=[full], cpu=[full])
    response = door.embed({"model": "minilm", "input": "a"})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert (_error(response)["type"], _error(response)["code"]) == (
        "rate_limit_error",
        "overloaded",
    )


def test_an_answer_without_a_token_count_is_a_500_not_a_made_up_count(tmp_path: Path) -> None:
    uncounted = BackendResponse(200, JSON, v2_answer(1, tokens=None), 0.01)
    door = make_door(tmp_path, gpu=[uncounted])
    response = door.embed({"model": "minilm", "input": "a"})
    assert response.status_code == 500
    assert (_error(response)["type"], _error(response)["code"]) == (
        "server_error",
        "inference_failed",
    )


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"model": "digits", "input": "a"}, 404, "model_not_found", "model"),
        ({"model": "nosuch", "input": "a"}, 404, "model_not_found", "model"),
        ({"model": "Bad/Name", "input": "a"}, 400, "invalid_model_name", "model"),
        ({"model": "minilm", "input": ["a"] * 9}, 400, "batch_too_large", "input"),
        ({"model": "minilm", "input": "a", "dimensions": DIMENSIONS - 1}, 400, "invalid_input", "dimensions"),
        ({"model": "minilm", "input": [1, 2]}, 400, "invalid_input", "input"),
        (b"{", 400, "invalid_input", None),
    ],
    ids=["other kind", "unknown", "bad name", "over max_batch_size", "dimensions", "token ids", "bad JSON"],
)  # fmt: skip
def test_a_refused_request_never_reaches_a_backend(
    tmp_path: Path, body: Any, status: int, code: str, param: str | None
) -> None:
    door = make_door(tmp_path)
    response = door.embed(body)
    assert response.status_code == status
    assert (_error(response)["code"], _error(response)["param"]) == (code, param)
    assert door.gpu.requests == door.cpu.requests == []


def test_its_own_size_as_dimensions_is_served(tmp_path: Path) -> None:
    door = make_door(tmp_path)
    response = door.embed({"model": "minilm", "input": "a", "dimensions": DIMENSIONS})
    assert response.status_code == 200


def test_a_body_over_the_limit_is_a_413_in_openais_shape(tmp_path: Path) -> None:
    door = make_door(tmp_path, max_body_bytes=1024)
    response = door.embed({"model": "minilm", "input": "x" * 2000})
    assert response.status_code == 413
    assert _error(response)["code"] == "payload_too_large"


def test_a_wrong_method_is_a_405_with_allow(tmp_path: Path) -> None:
    door = make_door(tmp_path)
    response = door.client.get("/v1/embeddings")
    assert (response.status_code, response.headers["allow"]) == (405, "POST")
    assert _error(response)["code"] == "method_not_allowed"
    assert door.client.post("/v1/models").status_code == 405


def test_the_models_listed_are_the_text_embedding_ones(tmp_path: Path) -> None:
    door = make_door(tmp_path)
    listed = door.client.get("/v1/models").get_json()
    assert [(m["id"], m["object"], m["owned_by"]) for m in listed["data"]] == [
        ("minilm", "model", "spillway")
    ]
    assert listed["object"] == "list"
    one = door.client.get("/v1/models/minilm").get_json()
    assert one == listed["data"][0]
    other = door.client.get("/v1/models/digits")
    assert (other.status_code, _error(other)["code"]) == (404, "model_not_found")


def test_without_a_repository_the_door_says_it_is_not_configured(tmp_path: Path) -> None:
    door = make_door(tmp_path, model_repository=None)
    for response in (door.client.get("/v1/models"), door.embed({"model": "minilm", "input": "a"})):
        assert response.status_code == 400
        assert _error(response)["code"] == "not_configured"
        assert "ROUTER_MODEL_REPOSITORY" in _error(response)["message"]


def test_each_request_is_accounted_once_as_its_model(tmp_path: Path) -> None:
    door = make_door(tmp_path)
    door.embed({"model": "minilm", "input": "a"})
    (line,) = door.metrics.getvalue().splitlines()
    document = json.loads(line)
    assert (document["rule"], document["backend"], document["model"]) == (
        "default",
        "gpu",
        "minilm",
    )


def test_the_other_v1_paths_keep_their_own_answers(tmp_path: Path) -> None:
    # GIVEN the door on /v1/embeddings and /v1/models
    door = make_door(tmp_path)
    # WHEN session state (no state table here) is asked for
    response = door.client.get("/v1/sessions/abc")
    # THEN the sessions API answered, in its own (V2) error shape
    assert response.get_json()["code"] == "not_configured"
    assert "ROUTER_STATE_TABLE" in response.get_json()["error"]
