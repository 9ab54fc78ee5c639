"""What AWS allows the router's synchronous calls, and how the router keeps within it.

GIVEN Lambda's 6 MB synchronous payload (API Gateway passes bodies base64 in the event)
THEN the router and the CPU fallback take bodies that fit whole, refuse larger ones with a
413 that names the offline path, replace a response too large to return, and bound each
``lambda:Invoke`` by what is left of the request's deadline; batch mode reaches the jobs
function with an event its handler reads.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest
from werkzeug.test import Client

from batch_job.api import dispatch
from spillway.policy.backend import BackendRequest, CannotServe
from spillway.protocol.errors import JobConflictError
from spillway.protocol.messages import JobRequest, JobView, SubmitReceipt
from spillway.protocol.wire import LAMBDA_PAYLOAD_BYTES, SYNC_BODY_BYTES
from spillway.router.lambda_backend import (
    MIN_READ_TIMEOUT_S,
    LambdaBackend,
    cpu_payload,
    direct_event,
    jobs_payload,
    read_timeout_step,
)
from spillway.router.settings import RouterSettings
from spillway.router.wiring import Overrides, create_app

ROOT = Path(__file__).resolve().parents[2]
REST_EVENT = json.loads((ROOT / "events" / "router" / "infer-rest-v1.json").read_text())


def _rest_event_with_body(size: int) -> bytes:
    """The REST (v1) proxy event API Gateway builds for a binary body of ``size`` bytes
    (binary media types ``*/*``: base64), with a full 10 KB of headers."""
    event = dict(REST_EVENT)
    event["headers"] = {**event["headers"], "x-padding": "h" * 10_000}
    event["body"] = base64.b64encode(b"\x00" * size).decode()
    event["isBase64Encoded"] = True
    return json.dumps(event).encode()


def test_the_synchronous_body_limit_is_what_fits_a_lambda_event() -> None:
    # THEN a body at the limit fits both events that carry it: API Gateway's to the
    # router, the router's direct invoke of the CPU fallback (binary, with its header)
    assert len(_rest_event_with_body(SYNC_BODY_BYTES)) <= LAMBDA_PAYLOAD_BYTES
    request = BackendRequest(
        "POST",
        "/v2/models/digits/infer",
        "infer",
        model="digits",
        headers={"inference-header-content-length": "999999"},
        body=b"\x00" * SYNC_BODY_BYTES,
        request_id="r" * 128,
    )
    assert len(cpu_payload(request)) <= LAMBDA_PAYLOAD_BYTES
    # AND the 6 MiB the router used to accept, or a 5 MB body, does not reach a function
    assert len(_rest_event_with_body(5_000_000)) > LAMBDA_PAYLOAD_BYTES
    assert 4_400_000 < SYNC_BODY_BYTES < 4_700_000


def _router(**settings: Any) -> Any:
    values: dict[str, Any] = {"gpu_url": None, "metrics_log": Path("/dev/null"), **settings}
    return create_app(RouterSettings(**values), Overrides(backends={}))


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_a_body_over_the_limit_is_a_413_naming_the_offline_path(chunked: bool) -> None:
    # GIVEN the router with its default limit
    app = _router()
    body = b"{" + b" " * SYNC_BODY_BYTES + b"}"
    # WHEN a body one byte over it arrives (with a length, or chunked)
    headers = {"content-type": "application/json"}
    environ: dict[str, Any] = {}
    if chunked:  # as a chunked request reaches WSGI: no length, the stream terminated
        environ = {"CONTENT_LENGTH": "", "wsgi.input_terminated": True}
    response = Client(app).post(
        "/v2/models/digits/infer",
        input_stream=io.BytesIO(body),
        headers=headers,
        environ_overrides=environ,
    )
    # THEN it is refused before any backend with a 413 that says what to do instead
    assert response.status_code == 413
    answer = json.loads(response.data)
    assert answer["code"] == "payload_too_large"
    assert str(SYNC_BODY_BYTES) in answer["error"]
    assert "POST /v1/jobs" in answer["error"]
    assert ("chunked" in answer["error"]) is chunked


def test_a_response_too_large_to_return_becomes_a_413() -> None:
    from functions.router.handler import RESPONSE_BODY_LIMIT, within_payload_limit

    small = {"statusCode": 200, "headers": {}, "body": "x" * 1000, "isBase64Encoded": False}
    assert within_payload_limit(small) is small
    big = {"statusCode": 200, "headers": {}, "body": "A" * (RESPONSE_BODY_LIMIT + 1),
           "isBase64Encoded": True}  # fmt: skip
    replaced = within_payload_limit(big)
    assert replaced["statusCode"] == 413
    assert json.loads(replaced["body"])["code"] == "payload_too_large"
    assert "response body" in json.loads(replaced["body"])["error"]


def test_read_timeouts_follow_the_deadline_on_a_short_ladder() -> None:
    budgets = [i / 100 for i in range(1, 4000)]
    steps = [read_timeout_step(budget, 30.0) for budget in budgets]
    # THEN no call may wait past its budget (beyond the smallest timeout) or the ceiling
    for budget, step in zip(budgets, steps, strict=True):
        assert step <= max(budget, MIN_READ_TIMEOUT_S)
        assert step <= 30.0
    # AND the timeouts rise with the budget and come in few steps (few clients)
    assert steps == sorted(steps)
    assert len(set(steps)) <= 50
    assert read_timeout_step(4.87, 30.0) == 4.5
    assert read_timeout_step(60.0, 30.0) == 30.0


def test_each_invoke_uses_a_client_whose_read_timeout_fits_its_budget() -> None:
    made: list[float] = []

    class Fake:
        def __init__(self, timeout: float) -> None:
            made.append(timeout)
            self.timeout = timeout

        def invoke(self, **kwargs: Any) -> dict[str, Any]:
            raise AssertionError("not called")

    backend = LambdaBackend("cpu", "f", new_client=Fake)
    first, timeout = backend.client_for(4.87)
    assert (first.timeout, timeout) == (4.5, 4.5)
    assert backend.client_for(4.6)[0] is first  # same step, same client
    assert backend.client_for(0.35)[0].timeout == pytest.approx(0.3)
    assert made == [4.5, pytest.approx(0.3)]


def test_real_boto3_clients_carry_the_step_as_their_read_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client, timeout = LambdaBackend("cpu", "f", connect_timeout_s=0.5).client_for(2.2)
    assert client.meta.config.read_timeout == timeout == 2.0
    assert client.meta.config.connect_timeout == 0.5


class _Jobs:
    """The jobs service seen by the handler: records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[JobRequest, str | None, str | None]] = []

    def submit(
        self, request: JobRequest, key: str | None = None, *, tenant: str | None
    ) -> SubmitReceipt:
        if self.calls and self.calls[0][1] == key and self.calls[0][0] != request:
            raise JobConflictError("the key was used for another job")
        self.calls.append((request, key, tenant))
        view = JobView(job_id="j-1", state="SUBMITTED", model=request.model,
                       input=request.input, output=request.output,
                       created_at="2026-11-30T00:00:00Z")  # fmt: skip
        return SubmitReceipt(job=view, replayed=len(self.calls) > 1)

    def status(self, job_id: str, *, tenant: str | None) -> Any:
        raise AssertionError("not called")


def test_the_jobs_invoke_event_is_what_the_jobs_handler_reads() -> None:
    # GIVEN the submission the router's batch mode makes for its caller, tenant-a
    job = JobRequest(model="digits", input="s3://bkt/s/k/in/", output="s3://bkt/s/k/out/")
    post = BackendRequest(
        "POST",
        "",
        "submit",
        headers={"content-type": "application/json", "idempotency-key": "k" * 64},
        body=job.model_dump_json().encode(),
        request_id="req-1",
        tenant="tenant-a",
    )
    # WHEN the jobs function's handler gets it as its invoke event
    jobs = _Jobs()
    answer = dispatch(json.loads(jobs_payload(post)), jobs)
    # THEN it submits that job for that tenant under the router's key, answering 202
    assert answer["statusCode"] == 202
    assert jobs.calls == [(job, "k" * 64, "tenant-a")]
    # AND the same event without the router's word for a tenant is refused
    anonymous = BackendRequest("POST", "", "submit", headers=post.headers, body=post.body)
    refused = dispatch(json.loads(jobs_payload(anonymous)), _Jobs())
    assert (refused["statusCode"], json.loads(refused["body"])["code"]) == (401, "unauthenticated")
    assert SubmitReceipt.model_validate_json(answer["body"]).job.job_id == "j-1"
    assert answer["headers"]["location"] == "/v1/jobs/j-1"
    # AND neither payload builder takes the other's operations
    with pytest.raises(CannotServe):
        jobs_payload(BackendRequest("POST", "", "infer", model="digits"))
    with pytest.raises(CannotServe):
        cpu_payload(post)
    assert direct_event(BackendRequest("GET", "", "ready", model="digits")).operation == "ready"
