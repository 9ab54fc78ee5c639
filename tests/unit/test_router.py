"""The router application with in-memory backends and an injected clock (no network)."""

from __future__ import annotations

import base64
import io
import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import serverless_wsgi
from hypothesis import given
from hypothesis import strategies as st
from werkzeug.test import Client

from spillway.policy.backend import (
    BackendError,
    BackendRequest,
    BackendResponse,
    ConnectFailed,
    TimedOut,
)
from spillway.router.app import RouterApp
from spillway.router.batch_mode import BatchReceipt, JobRefused
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from tests.unit.router_support import fake_overrides

ROOT = Path(__file__).resolve().parents[2]
IMAGE = [float(i % 17) for i in range(64)]
BODY = json.dumps(
    {"inputs": [{"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": IMAGE}]}
).encode()
RESULT = b'{"model_name":"digits","outputs":[]}'
Item = BackendResponse | BackendError | Callable[[BackendRequest, float], BackendResponse]


class Clock:
    """A monotonic clock that only moves when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


SERVER_FAULT = {"x-spillway-fault": "server"}


def ok(
    status: int = 200, body: bytes = RESULT, headers: dict[str, str] | None = None
) -> BackendResponse:
    return BackendResponse(
        status, {"content-type": "application/json", **(headers or {})}, body, 0.01
    )


@dataclass
class FakeBackend:
    """Answers from a script (the last item repeats) and records every request."""

    name: str
    script: list[Item] = field(default_factory=lambda: [ok()])
    requests: list[BackendRequest] = field(default_factory=list)
    timeouts: list[float] = field(default_factory=list)

    def send(self, request: BackendRequest, timeout_s: float) -> BackendResponse:
        self.requests.append(request)
        self.timeouts.append(timeout_s)
        item = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(item, BackendError):
            raise item
        if callable(item):
            return item(request, timeout_s)
        return item


@dataclass
class Stack:
    app: RouterApp
    clock: Clock
    gpu: FakeBackend
    cpu: FakeBackend
    metrics: io.StringIO

    def post(self, path: str = "/v2/models/digits/infer", body: bytes = BODY, **kw: Any) -> Any:
        return Client(self.app).post(path, data=body, **kw)

    def get(self, path: str, **kw: Any) -> Any:
        return Client(self.app).get(path, **kw)


def make_stack(
    gpu: list[Item] | None = None,
    cpu: list[Item] | None = None,
    *,
    without: tuple[str, ...] = (),
    submitter: Any = None,
    **settings: Any,
) -> Stack:
    clock = Clock()
    backends: dict[str, Any] = {
        "gpu": FakeBackend("gpu", gpu or [ok(headers={"x-spillway-busy": "0.2"})]),
        "cpu": FakeBackend("cpu", cpu or [ok()]),
    }
    from spillway.router.batch_mode import BatchBackend

    backends["batch"] = BatchBackend(submitter)
    for name in without:
        backends.pop(name)
    metrics = io.StringIO()
    app = create_app(RouterSettings(**settings), fake_overrides(backends, clock, metrics))
    return Stack(app, clock, backends.get("gpu"), backends.get("cpu"), metrics)  # type: ignore[arg-type]


def with_parameters(**parameters: Any) -> bytes:
    return json.dumps({**json.loads(BODY), "parameters": parameters}).encode()


def sent_json(request: BackendRequest) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(request.body)
    return document


# --- routing and the headers that explain it -------------------------------------------------


def test_infer_goes_to_the_gpu_with_the_deadline_as_timeout_parameter() -> None:
    # GIVEN the built-in policy and a 5 s default deadline
    stack = make_stack()
    # WHEN a JSON infer request arrives
    response = stack.post()
    # THEN the GPU served it and the response says how
    assert response.status_code == 200
    assert response.data == RESULT
    assert response.headers["x-spillway-backend"] == "gpu"
    assert response.headers["x-spillway-rule"] == "default"
    assert "x-spillway-fallback" not in response.headers
    assert float(response.headers["x-spillway-cost-usd"]) > 0
    # AND the GPU got 70% of the deadline (30% kept for the fallback), told as 90% of that
    (request,) = stack.gpu.requests
    assert stack.gpu.timeouts == [pytest.approx(3.5)]
    assert sent_json(request)["parameters"]["timeout"] == 3_150_000
    assert sent_json(request)["inputs"][0]["data"] == IMAGE
    assert request.path == "/v2/models/digits/infer"


def test_a_binary_body_keeps_its_tensor_bytes_and_gets_a_fixed_header_length() -> None:
    stack = make_stack()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": [1, 8, 8],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 256},
                }
            ]
        }
    ).encode()
    tensor = struct.pack("<64f", *IMAGE)
    response = stack.post(
        body=header + tensor,
        headers={"Inference-Header-Content-Length": str(len(header))},
        content_type="application/octet-stream",
    )
    assert response.status_code == 200
    (request,) = stack.gpu.requests
    length = int(request.headers["inference-header-content-length"])
    assert request.body[length:] == tensor
    assert json.loads(request.body[:length])["parameters"]["timeout"] == 3_150_000
    assert request.headers["content-type"] == "application/octet-stream"


def test_a_lower_timeout_sent_by_the_client_is_kept() -> None:
    stack = make_stack()
    body = json.loads(BODY)
    body["parameters"] = {"timeout": 1000}
    stack.post(body=json.dumps(body).encode())
    assert sent_json(stack.gpu.requests[0])["parameters"]["timeout"] == 1000


def test_hints_from_headers_and_parameters_pick_the_rule() -> None:
    stack = make_stack()
    by_header = stack.post(headers={"x-spillway-mode": "serverless"})
    body = json.loads(BODY)
    body["parameters"] = {"mode": "serverless"}
    by_parameter = stack.post(body=json.dumps(body).encode(), headers={"x-spillway-mode": "auto"})
    for response in (by_header, by_parameter):
        assert response.headers["x-spillway-rule"] == "serverless-requested"
        assert response.headers["x-spillway-backend"] == "cpu"
    assert len(stack.gpu.requests) == 0


# --- fallback ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        (ok(429, b'{"error":"full","code":"overloaded"}', {"retry-after": "1"}), "overloaded"),
        (ok(503, b'{"error":"draining","code":"unavailable"}'), "unavailable"),
        (ok(504, b'{"error":"late","code":"deadline_exceeded"}'), "deadline"),
        (TimedOut("slow"), "timeout"),
    ],
    ids=["429", "503", "504", "timeout"],
)
def test_a_failing_gpu_falls_back_to_the_cpu(failure: Item, reason: str) -> None:
    stack = make_stack(gpu=[failure])
    response = stack.post()
    assert response.status_code == 200
    assert response.headers["x-spillway-backend"] == "cpu"
    assert response.headers["x-spillway-fallback"] == f"gpu:{reason}"
    assert "retry-after" not in response.headers
    assert len(stack.gpu.requests) == 1
    assert len(stack.cpu.requests) == 1


def test_a_connect_error_is_retried_once_within_the_budget_then_falls_back() -> None:
    stack = make_stack(gpu=[ConnectFailed("refused")])
    first = stack.post()
    assert first.headers["x-spillway-fallback"] == "gpu:connect_error"
    assert len(stack.gpu.requests) == 2  # one retry (the budget's first token)
    second = stack.post()
    assert second.headers["x-spillway-backend"] == "cpu"
    assert len(stack.gpu.requests) == 3  # no token left: no retry


@pytest.mark.parametrize("status", [400, 404, 413, 500])
def test_an_answer_caused_by_the_request_is_returned_as_is(status: int) -> None:
    body = json.dumps({"error": "nope", "code": "x"}).encode()
    stack = make_stack(gpu=[ok(status, body)])
    response = stack.post()
    assert response.status_code == status
    assert response.data == body
    assert response.headers["x-spillway-backend"] == "gpu"
    assert len(stack.gpu.requests) == 1
    assert stack.cpu.requests == []


def test_with_no_fallback_left_the_backends_own_answer_is_returned() -> None:
    stack = make_stack(
        gpu=[ok(429, b'{"error":"full","code":"overloaded"}', {"retry-after": "2"})],
        without=("cpu",),
    )
    response = stack.post()
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    assert response.headers["x-spillway-backend"] == "gpu"


def test_when_nothing_can_be_reached_the_answer_is_503_with_every_attempt() -> None:
    stack = make_stack(gpu=[ConnectFailed("refused")], cpu=[ConnectFailed("refused")])
    response = stack.post()
    assert response.status_code == 503
    assert response.json["code"] == "unavailable"
    assert "gpu: connect_error" in response.json["error"]
    assert "cpu: connect_error" in response.json["error"]
    assert response.headers["x-spillway-backend"] == "none"


# --- circuit breaker --------------------------------------------------------------------------


def test_the_circuit_opens_after_five_failures_and_half_opens_after_the_wait() -> None:
    # GIVEN a GPU that fails with 503 and no retry budget in play
    stack = make_stack(gpu=[ok(503, b'{"error":"down","code":"unavailable"}', SERVER_FAULT)])
    for _ in range(5):
        assert stack.post().headers["x-spillway-fallback"] == "gpu:unavailable"
    assert len(stack.gpu.requests) == 5
    # WHEN more requests come while the circuit is open
    responses = [stack.post() for _ in range(3)]
    # THEN they go straight to the CPU without touching the GPU
    assert {r.headers["x-spillway-fallback"] for r in responses} == {"gpu:circuit_open"}
    assert len(stack.gpu.requests) == 5
    # WHEN the wait (5 s) passes and the GPU has recovered
    stack.gpu.script = [ok()]
    stack.clock.now += 5
    trial = stack.post()
    # THEN one trial goes to the GPU, succeeds, and the circuit closes
    assert trial.headers["x-spillway-backend"] == "gpu"
    assert stack.app.router.breakers["gpu"].state == "closed"
    assert stack.post().headers["x-spillway-backend"] == "gpu"


def test_a_busy_gpu_does_not_open_its_circuit() -> None:
    # GIVEN a GPU that keeps answering 429 and 504 (busy, not broken)
    pair: list[Item] = [ok(429, b"{}"), ok(504, b"{}")]
    busy = pair * 5 + [ok(429, b"{}")]
    stack = make_stack(gpu=busy)
    for _ in range(10):
        assert stack.post().headers["x-spillway-backend"] == "cpu"
    # THEN every request still tried the GPU first, and its circuit is closed
    assert len(stack.gpu.requests) == 10
    assert stack.app.router.breakers["gpu"].state == "closed"


def test_answers_the_request_caused_do_not_open_the_circuit() -> None:
    # GIVEN a GPU that refuses every request as malformed (4xx: the client's fault)
    stack = make_stack(gpu=[ok(400, b'{"error":"bad","code":"invalid_input"}')])
    # WHEN more requests than the failure threshold get that answer
    statuses = [stack.post().status_code for _ in range(8)]
    # THEN each is the client's answer, and the GPU's circuit stays closed
    assert statuses == [400] * 8
    assert len(stack.gpu.requests) == 8
    assert stack.app.router.breakers["gpu"].state == "closed"


def test_readiness_follows_the_circuits() -> None:
    stack = make_stack(gpu=[ok(503, b"{}", SERVER_FAULT)], without=("cpu",))
    assert stack.get("/v2/health/ready").status_code == 200
    for _ in range(5):
        stack.post()
    response = stack.get("/v2/health/ready")
    assert response.status_code == 400
    assert response.json["code"] == "not_ready"
    blocked = stack.post()
    assert blocked.status_code == 503
    assert blocked.headers["retry-after"] == "5"


# --- deadlines --------------------------------------------------------------------------------


def test_a_latency_budget_bounds_every_attempt() -> None:
    stack = make_stack()

    def slow(request: BackendRequest, timeout_s: float) -> BackendResponse:
        stack.clock.now += timeout_s  # uses all of its time, then times out
        raise TimedOut("slow")

    stack.gpu.script = [slow]
    response = stack.post(headers={"x-spillway-latency-budget-ms": "200"})
    # THEN the GPU had 70% of 200 ms and the CPU the 60 ms left, told as timeout parameters
    assert stack.gpu.timeouts == [pytest.approx(0.14)]
    assert stack.cpu.timeouts == [pytest.approx(0.06)]
    assert sent_json(stack.cpu.requests[0])["parameters"]["timeout"] == 54_000
    assert response.headers["x-spillway-backend"] == "cpu"


def test_no_attempt_starts_after_the_deadline() -> None:
    stack = make_stack()

    def hang(request: BackendRequest, timeout_s: float) -> BackendResponse:
        stack.clock.now += 10
        raise TimedOut("hung")

    stack.gpu.script = [hang]
    response = stack.post(headers={"x-spillway-latency-budget-ms": "100"})
    assert response.status_code == 504
    assert response.json["code"] == "deadline_exceeded"
    assert stack.cpu.requests == []


def test_the_lambda_remaining_time_caps_the_deadline() -> None:
    stack = make_stack(deadline_margin_ms=150)

    class Context:
        def get_remaining_time_in_millis(self) -> int:
            return 1000

    Client(stack.app).post(
        "/v2/models/digits/infer", data=BODY, environ_overrides={"serverless.context": Context()}
    )
    assert stack.gpu.timeouts == [pytest.approx(0.85 * 0.7)]


# --- batch ------------------------------------------------------------------------------------


def test_batch_mode_without_a_jobs_api_is_a_clear_4xx() -> None:
    # GIVEN a router with no jobs API WHEN a client asks for batch mode
    stack = make_stack()
    response = stack.post(headers={"x-spillway-mode": "batch"})
    # THEN a client error saying the mode is not offered (never a 5xx), breaker untouched
    assert (response.status_code, response.json["code"]) == (400, "mode_unavailable")
    assert "ROUTER_JOBS_URL" in response.json["error"]
    assert stack.app.router.breakers["batch"].state == "closed"
    assert response.headers["x-spillway-rule"] == "batch-requested"


def test_batch_mode_submits_and_answers_202_with_the_job_id() -> None:
    submitted: list[BackendRequest] = []

    class Submitter:
        def submit(self, request: BackendRequest, timeout_s: float) -> BatchReceipt:
            submitted.append(request)
            return BatchReceipt("job-42", "/v1/jobs/job-42")

    stack = make_stack(submitter=Submitter(), trust_tenant_hints=True)
    response = stack.post(headers={"x-spillway-mode": "batch", "x-spillway-tenant": "acme"})
    assert response.status_code == 202
    assert response.json == {
        "job_id": "job-42",
        "status": "submitted",
        "status_url": "/v1/jobs/job-42",
    }
    assert response.headers["location"] == "/v1/jobs/job-42"
    assert response.headers["x-spillway-backend"] == "batch"
    (request,) = submitted
    assert request.body == BODY  # no deadline is imposed on an offline job
    assert request.tenant == "acme"


def test_a_job_the_jobs_api_refuses_is_the_clients_error() -> None:
    class Refusing:
        def submit(self, request: BackendRequest, timeout_s: float) -> BatchReceipt:
            body = b'{"error":"unknown model","code":"model_not_found"}'
            raise JobRefused(BackendResponse(404, {"content-type": "application/json"}, body, 0.0))

    stack = make_stack(submitter=Refusing())
    response = stack.post(headers={"x-spillway-mode": "batch"})
    assert response.status_code == 404
    assert response.json["code"] == "model_not_found"
    assert response.headers["x-spillway-backend"] == "batch"


# --- security ---------------------------------------------------------------------------------


def test_only_allowlisted_headers_reach_a_backend() -> None:
    stack = make_stack()
    stack.post(
        headers={
            "Authorization": "Bearer secret",
            "Cookie": "session=1",
            "X-Api-Key": "k",
            "Proxy-Authorization": "Basic x",
            "Connection": "keep-alive, X-Hop",
            "X-Hop": "1",
            "Keep-Alive": "timeout=5",
            "TE": "trailers",
            "Upgrade": "h2c",
            "X-Forwarded-For": "1.2.3.4",
            "X-Amz-Security-Token": "t",
            "X-Request-Id": "req-1",
        },
    )
    (request,) = stack.gpu.requests
    assert set(request.headers) == {"content-type"}
    assert request.request_id == "req-1"


def test_a_request_cannot_choose_a_backend_url() -> None:
    stack = make_stack()
    body = json.loads(BODY)
    body["parameters"] = {"backend": "http://evil.example", "gpu_url": "http://evil.example"}
    response = stack.post(
        "/v2/models/digits/infer?gpu_url=http://evil.example&backend=http://evil.example",
        body=json.dumps(body).encode(),
        headers={
            "Host": "evil.example",
            "x-spillway-backend": "http://evil.example",
            "x-spillway-gpu-url": "http://evil.example",
        },
    )
    assert response.status_code == 200
    assert len(stack.gpu.requests) == 1
    assert stack.gpu.requests[0].path == "/v2/models/digits/infer"
    with pytest.raises(ValueError, match="not an http"):
        RouterSettings(gpu_url="file:///etc/passwd")
    with pytest.raises(ValueError, match="credentials"):
        RouterSettings(cpu_url="http://user:pw@cpu.internal")


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/Digits/infer",
        "/v2/models/.hidden/infer",
        "/v2/models/%2E%2E/infer",
        f"/v2/models/{'a' * 65}/infer",
        "/v2/models/digits/versions/0/infer",
        "/v2/models/digits/versions/one/infer",
        "/v2/models/digits/versions/1234567890/infer",
    ],
)
def test_model_names_and_versions_are_validated_before_routing(path: str) -> None:
    stack = make_stack()
    response = stack.post(path)
    assert response.status_code == 400
    assert response.json["code"] == "invalid_model_name"
    assert stack.gpu.requests == []


def test_a_traversal_in_the_path_finds_no_route() -> None:
    stack = make_stack()
    response = stack.post("/v2/models/..%2F..%2Fetc/infer")
    assert response.status_code == 404
    assert stack.gpu.requests == []


def test_a_body_over_the_cap_is_refused_before_it_is_read() -> None:
    stack = make_stack(max_body_bytes=4096)
    response = stack.post(body=b"x" * 5000)
    assert response.status_code == 413
    assert response.json["code"] == "payload_too_large"
    assert stack.gpu.requests == []


@pytest.mark.parametrize(
    ("body", "headers", "message"),
    [
        (b"{not json", {}, "invalid JSON"),
        (b"[1, 2]", {}, "must be an object"),
        (BODY, {"x-spillway-mode": "turbo"}, "mode must be one of"),
        (BODY, {"x-spillway-latency-budget-ms": "-5"}, "latency_budget_ms"),
        (BODY, {"x-spillway-latency-budget-ms": "50"}, "between 100 and 3600000"),
        (BODY, {"x-spillway-priority": "high"}, "priority must be a number"),
        (BODY, {"x-spillway-tenant": "a b"}, "tenant must be"),
        (BODY, {"Inference-Header-Content-Length": "99999"}, "outside the body"),
        (BODY, {"Inference-Header-Content-Length": "-1"}, "non-negative integer"),
        (BODY, {"Inference-Header-Content-Length": "+5"}, "non-negative integer"),
        (with_parameters(timeout=10**400), {}, "'timeout' must be at most"),
        (with_parameters(timeout=-1), {}, "'timeout' must be a non-negative integer"),
        (with_parameters(priority=1.5), {}, "'priority' must be a non-negative integer"),
        (BODY, {"Inference-Header-Content-Length": "1_0"}, "non-negative integer"),
    ],
)
def test_bad_requests_get_400_and_reach_no_backend(
    body: bytes, headers: dict[str, str], message: str
) -> None:
    stack = make_stack()
    response = stack.post(body=body, headers=headers)
    assert response.status_code == 400
    assert response.json["code"] == "invalid_input"
    assert message in response.json["error"]
    assert stack.gpu.requests == []


def test_unknown_paths_and_methods() -> None:
    stack = make_stack()
    assert stack.get("/v3/anything").status_code == 404
    wrong = stack.get("/v2/models/digits/infer")
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "POST"
    assert stack.post("/v2/health/live").headers["allow"] == "GET"


# --- other routes -----------------------------------------------------------------------------


def test_model_metadata_is_proxied_and_readiness_is_json() -> None:
    stack = make_stack(gpu=[ok(200, b"", {"content-type": "application/json"})])
    ready = stack.get("/v2/models/digits/versions/1/ready")
    assert ready.status_code == 200
    assert ready.json == {"ready": True}
    assert stack.gpu.requests[0].path == "/v2/models/digits/versions/1/ready"
    assert stack.gpu.requests[0].body == b""
    stack.get("/v2/models/stats")
    assert stack.gpu.requests[1].path == "/v2/models/stats"


def test_router_health_and_metadata() -> None:
    stack = make_stack()
    assert stack.get("/v2/health/live").json == {"live": True}
    meta = stack.get("/v2").json
    assert meta["name"] == "spillway-router"
    assert "binary_tensor_data" in meta["extensions"]


def test_openapi_document_is_valid_and_every_path_is_routed() -> None:
    from openapi_spec_validator import validate

    stack = make_stack()
    document = stack.get("/openapi.json").json
    validate(document)
    for path, operations in document["paths"].items():
        concrete = path.replace("{model}", "digits").replace("{version}", "1")
        for method in operations:
            response = Client(stack.app).open(concrete, method=method.upper(), data=BODY)
            assert response.status_code != 404, path
            assert str(response.status_code) in operations[method]["responses"], path


def test_each_request_emits_one_emf_line_with_its_route() -> None:
    stack = make_stack(gpu=[ok(503, b"{}", SERVER_FAULT)])
    stack.post()
    (line,) = stack.metrics.getvalue().splitlines()
    document = json.loads(line)
    assert (document["rule"], document["backend"], document["model"]) == (
        "default",
        "cpu",
        "digits",
    )
    assert document["Fallbacks"] == [1.0]
    assert document["attempts"] == 2


# --- API Gateway events without a network -----------------------------------------------------


def test_an_http_api_stage_prefix_is_removed() -> None:
    stack = make_stack(policy_file=Path(__file__).resolve().parents[2] / "policies/example.yaml")
    event = json.loads(
        (Path(__file__).resolve().parents[2] / "events/router/infer-http-v2-stage.json").read_text()
    )
    assert event["rawPath"].startswith("/prod/")
    response = serverless_wsgi.handle_request(stack.app, event, None)
    assert response["statusCode"] == 200
    assert response["headers"]["x-spillway-rule"] == "realtime"
    assert stack.gpu.requests[0].path == "/v2/models/digits/infer"
    assert "cookie" not in stack.gpu.requests[0].headers


def test_an_authorizer_tenant_wins_over_the_claimed_one() -> None:
    stack = make_stack(
        policy_file=Path(__file__).resolve().parents[2] / "policies/example.yaml",
        trust_tenant_hints=True,
    )
    event = json.loads(
        (Path(__file__).resolve().parents[2] / "events/router/infer-rest-v1.json").read_text()
    )
    event["multiValueHeaders"]["x-spillway-tenant"] = ["moderation-live"]
    event["requestContext"]["authorizer"] = {"principalId": "u", "tenant": "appeals"}
    response = serverless_wsgi.handle_request(stack.app, event, None)
    assert response["multiValueHeaders"]["x-spillway-rule"] == ["default"]
    del event["requestContext"]["authorizer"]
    response = serverless_wsgi.handle_request(stack.app, event, None)
    assert response["multiValueHeaders"]["x-spillway-rule"] == ["premium-tenants"]


def test_claimed_tenants_are_ignored_by_default() -> None:
    # GIVEN the default settings WHEN a caller claims the premium tenant
    example = Path(__file__).resolve().parents[2] / "policies/example.yaml"
    stack = make_stack(policy_file=example)
    response = stack.post(headers={"x-spillway-tenant": "moderation-live"})
    # THEN the claim is ignored: it gets the default rule, not the premium one
    assert response.headers["x-spillway-rule"] == "default"


@pytest.mark.parametrize("shape", ["rest-api-key", "rest-iam", "http-iam"])
def test_the_tenant_comes_from_the_authenticated_identity(shape: str) -> None:
    # GIVEN identities mapped to tenants, and an event API Gateway authenticated
    example = Path(__file__).resolve().parents[2] / "policies/example.yaml"
    key_id, arn = "k3y1d", "arn:aws:iam::123456789012:role/moderation"
    mapping = {key_id: "moderation-live", arn: "moderation-live"}
    stack = make_stack(policy_file=example, identity_tenants=json.dumps(mapping))
    events = Path(__file__).resolve().parents[2] / "events/router"
    name = "infer-http-v2.json" if shape == "http-iam" else "infer-rest-v1.json"
    event = json.loads((events / name).read_text())
    context = event["requestContext"]
    if shape == "rest-api-key":
        context.setdefault("identity", {})["apiKeyId"] = key_id
    elif shape == "rest-iam":
        context.setdefault("identity", {})["userArn"] = arn
    else:
        context["authorizer"] = {"iam": {"userArn": arn}}
    # WHEN routed
    response = serverless_wsgi.handle_request(stack.app, event, None)
    headers = response.get("multiValueHeaders") or {k: [v] for k, v in response["headers"].items()}
    # THEN the mapped tenant's tier decides (premium never spills)
    assert headers["x-spillway-rule"] == ["premium-tenants"], response


def test_binary_responses_travel_base64_through_api_gateway() -> None:
    payload = b'{"model_name":"digits","outputs":[]}' + b"\x00\x01"
    binary = BackendResponse(
        200,
        {"content-type": "application/octet-stream", "inference-header-content-length": "37"},
        payload,
        0.01,
    )
    stack = make_stack(gpu=[binary])
    event = json.loads(
        (Path(__file__).resolve().parents[2] / "events/router/infer-http-v2.json").read_text()
    )
    response = serverless_wsgi.handle_request(stack.app, event, None)
    assert response["isBase64Encoded"] is True
    assert base64.b64decode(response["body"]) == payload
    assert response["headers"]["inference-header-content-length"] == "37"


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(
    body=st.one_of(
        st.binary(max_size=300),
        _JSONISH.map(lambda v: json.dumps(v).encode()),
        st.builds(
            lambda p: json.dumps({"parameters": p, "inputs": []}).encode(),
            st.dictionaries(
                st.sampled_from(["mode", "latency_budget_ms", "priority", "tenant", "timeout"]),
                _JSONISH,
            ),
        ),
    ),
    hints=st.dictionaries(
        st.sampled_from(
            [
                "x-spillway-mode",
                "x-spillway-latency-budget-ms",
                "x-spillway-priority",
                "x-spillway-tenant",
                "Inference-Header-Content-Length",
            ]
        ),
        st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=12),
    ),
)
def test_any_body_and_hints_get_a_documented_answer(body: bytes, hints: dict[str, str]) -> None:
    # GIVEN arbitrary bytes, JSON and hint headers (what a fuzzer would send)
    stack = make_stack()
    response = stack.post(body=body, headers=hints)
    # THEN the router answers 200 (forwarded) or a clear 400, never a crash
    assert response.status_code in (200, 400)
    if response.status_code == 400:
        assert set(response.json) == {"error", "code"}
        assert response.json["code"] == "invalid_input"
        assert stack.gpu.requests == []


def test_the_router_never_imports_numpy() -> None:
    # GIVEN a fresh interpreter that loads the handler (the application is built at import)
    # and every module a request can reach: the Lambda and batch backends included
    script = (
        "import sys\n"
        "import functions.router.handler\n"
        "from spillway.router.batch_mode import JobsApiSubmitter, staging_key\n"
        "from spillway.policy.facts import Call, read_request\n"
        "from spillway.router.lambda_backend import direct_event\n"
        "from spillway.router.dispatch import backend_request\n"
        "from spillway.protocol.messages import stage_request\n"
        "from spillway.protocol.wire import require_model_target\n"
        'body = b\'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32",'
        '"parameters":{"binary_data_size":4}}]}\'\n'
        "call = Call('POST', {'inference-header-content-length': str(len(body))},"
        " body + bytes(4), 'r')\n"
        "request = read_request(call, require_model_target('/v2/models/digits/infer'))\n"
        "direct_event(backend_request(request, 'cpu', 1.0))\n"
        "stage_request(call.body, request.header_length)\n"
        "print('numpy:', sorted(m for m in sys.modules if m.split('.')[0] == 'numpy'))\n"
    )
    env = {**os.environ, "AWS_DEFAULT_REGION": "us-east-1", "ROUTER_METRICS_LOG": os.devnull}
    env.pop("ROUTER_POLICY_PARAMETER", None)
    # WHEN it runs a request's reading, its Lambda event and its staging
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    # THEN numpy was never imported
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "numpy: []"


# --- the CPU fallback over lambda:Invoke ------------------------------------------------------


class FakeLambda:
    """``invoke`` answering a fixed payload (or raising), recording what it was sent."""

    def __init__(self, answer: bytes | Exception, function_error: bool = False) -> None:
        self.answer, self.function_error = answer, function_error
        self.payloads: list[bytes] = []

    def invoke(self, **kwargs: Any) -> dict[str, Any]:
        self.payloads.append(kwargs["Payload"])
        if isinstance(self.answer, Exception):
            raise self.answer
        result: dict[str, Any] = {"Payload": io.BytesIO(self.answer)}
        if self.function_error:
            result["FunctionError"] = "Unhandled"
        return result


def lambda_backend(client: FakeLambda) -> Any:
    from spillway.router.lambda_backend import LambdaBackend

    return LambdaBackend("cpu", "spillway-cpu-infer", new_client=lambda _timeout: client)


def test_the_lambda_backend_speaks_the_shared_direct_invoke_schemas() -> None:
    from spillway.protocol.messages import DirectInvokeAnswer, DirectInvokeEvent, parse_message
    from spillway.protocol.replies import infer_reply

    # GIVEN a CPU function that answers a binary infer result
    result = b'{"outputs":[]}' + b"\x00\x01"
    answer = DirectInvokeAnswer.of(infer_reply(result, 14, 3)).dump()
    client = FakeLambda(json.dumps(answer).encode())
    request = BackendRequest(
        "POST",
        "/v2/models/digits/versions/3/infer",
        "infer",
        model="digits",
        version="3",
        headers={"inference-header-content-length": "14"},
        body=b'{"inputs":[]}!' + b"\x07",
        request_id="req-9",
    )
    # WHEN the router sends it a request
    response = lambda_backend(client).send(request, 1.0)
    # THEN the event is the one cpu_infer parses, carrying the body and its header length
    event = parse_message(DirectInvokeEvent, json.loads(client.payloads[0]), "event")
    assert (event.operation, event.model, event.version, event.request_id) == (
        "infer",
        "digits",
        "3",
        "req-9",
    )
    assert (event.raw_body(), event.header_length()) == (request.body, 14)
    # AND the answer comes back as sent, binary body and headers included, billed
    assert (response.status, response.body) == (200, result)
    assert response.headers["inference-header-content-length"] == "14"
    assert response.headers["x-spillway-model-version"] == "3"
    assert response.billed_s == response.elapsed_s


@pytest.mark.parametrize(
    "client",
    [
        FakeLambda(b'{"statusCode": "soon"}'),
        FakeLambda(b'{"statusCode": 200, "body": "!!", "isBase64Encoded": true}'),
        FakeLambda(b"{}", function_error=True),
    ],
    ids=["malformed", "bad-base64", "function-error"],
)
def test_a_cpu_function_that_fails_reads_as_unavailable(client: FakeLambda) -> None:
    request = BackendRequest("GET", "/v2/models/digits", "metadata", model="digits")
    response = lambda_backend(client).send(request, 1.0)
    assert response.status == 503
    assert json.loads(response.body)["code"] == "unavailable"


def test_a_throttled_cpu_function_reads_as_overloaded() -> None:
    from botocore.exceptions import ClientError

    throttled = ClientError({"Error": {"Code": "TooManyRequestsException"}}, "Invoke")
    request = BackendRequest("GET", "/v2/models/digits", "metadata", model="digits")
    response = lambda_backend(FakeLambda(throttled)).send(request, 1.0)
    assert response.status == 429
    assert json.loads(response.body)["code"] == "overloaded"


@pytest.mark.parametrize(
    ("headers", "state"), [({}, "closed"), (SERVER_FAULT, "open")], ids=["unmarked", "marked"]
)
def test_only_a_5xx_the_backend_calls_its_own_counts_against_it(
    headers: dict[str, str], state: str
) -> None:
    # GIVEN a GPU answering 500 ten times, with or without the server-fault mark
    stack = make_stack(gpu=[ok(500, b'{"error":"x","code":"internal"}', headers)])
    # WHEN ten requests are routed
    for _ in range(10):
        stack.post()
    # THEN an unmarked 500 (maybe the request's doing) leaves the circuit closed; a marked
    # one opens it after the configured five failures
    assert stack.app.router.breakers["gpu"].state == state


def test_a_request_whose_run_fails_everywhere_opens_no_circuit() -> None:
    # GIVEN both backends failing every run of a (poisoned) request with their own 500
    failed = ok(500, b'{"error":"x","code":"inference_failed"}', SERVER_FAULT)
    stack = make_stack(gpu=[failed], cpu=[failed])
    # WHEN it is sent ten times
    replies = [stack.post() for _ in range(10)]
    # THEN each falls back, the client gets the last backend's 500, and neither circuit
    # counts it: the request is what the failures had in common
    assert {r.status_code for r in replies} == {500}
    assert {r.headers["x-spillway-fallback"] for r in replies} == {"gpu:server_fault"}
    assert len(stack.gpu.requests) == len(stack.cpu.requests) == 10
    assert stack.app.router.breakers["gpu"].state == "closed"
    assert stack.app.router.breakers["cpu"].state == "closed"


@pytest.mark.parametrize(
    "parameters",
    [
        b'{"latency_budget_ms": 1' + b"0" * 400 + b"}",
        b'{"priority": 1' + b"0" * 400 + b"}",
    ],
    ids=["budget", "priority"],
)
def test_numbers_past_float_range_are_the_clients_error(parameters: bytes) -> None:
    # GIVEN a routing hint with an integer too big for a float
    stack = make_stack(gpu=[ok()])
    body = b'{"parameters": ' + parameters + b', "inputs": []}'
    # WHEN routed THEN 400 invalid_input, never a 500
    reply = stack.post(body=body)
    assert (reply.status_code, reply.json["code"]) == (400, "invalid_input")


def test_a_lone_surrogate_in_text_is_the_clients_error() -> None:
    # GIVEN BYTES data holding an unpaired surrogate escape
    stack = make_stack(gpu=[ok()])
    body = b'{"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": ["\\ud800"]}]}'
    # WHEN routed THEN 400 invalid_input, and the backend never saw it
    reply = stack.post(body=body)
    assert (reply.status_code, reply.json["code"]) == (400, "invalid_input")
    assert stack.gpu.requests == []


@pytest.mark.parametrize(("status", "model"), [(200, "digits"), (400, "digits"), (404, "-")])
def test_only_known_models_become_a_metric_dimension(status: int, model: str) -> None:
    # GIVEN a GPU that knows the model (200, or 400 for a bad body) or does not (404)
    stack = make_stack(gpu=[ok(status, RESULT if status == 200 else b'{"code":"x"}')])
    # WHEN a request is routed
    stack.post()
    # THEN its EMF line names the model only when the backend knew it
    line = json.loads(stack.metrics.getvalue().splitlines()[-1])
    assert line["model"] == model


def test_the_priority_a_caller_may_use_comes_from_its_tier(tmp_path: Path) -> None:
    # GIVEN a policy where standard callers may use priority 2 at best, premium ones 1
    import yaml

    example = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "policies/example.yaml").read_text()
    )
    example["tier_priorities"] = {"standard": 2, "premium": 1}
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(example))
    stack = make_stack(policy_file=policy, trust_tenant_hints=True)
    # WHEN a standard and a premium caller both ask for priority 1
    for tenant in ("appeals", "moderation-live"):
        stack.post(body=with_parameters(priority=1), headers={"x-spillway-tenant": tenant})
    # THEN the standard caller's request reaches the GPU at level 2, the premium one at 1
    sent = [json.loads(r.body)["parameters"]["priority"] for r in stack.gpu.requests]
    assert sent == [2, 1]
