"""The jobs Lambda's routing and error mapping, with an in-memory fake service."""

from __future__ import annotations

import base64
import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from batch_job.api import dispatch
from batch_job.service import combined_state
from spillway.protocol.errors import JobNotFoundError
from spillway.protocol.messages import JobRequest, JobStatus, JobView, SubmitReceipt
from spillway.tenancy.identity import Authenticator

EVENTS = Path(__file__).resolve().parents[2] / "events" / "jobs"
BODY = {"model": "digits", "input": "s3://data-in/x/", "output": "s3://data-out/y/"}
EXAMPLE_TENANT = "abcde12345"  # the API key id in events/jobs/*.json, its own tenant


def _view(job_id: str = "00000000-0000-4000-8000-000000000001") -> JobView:
    return JobView(
        job_id=job_id,
        state="SUBMITTED",
        model="digits",
        input=BODY["input"],
        output=BODY["output"],
        created_at="2024-06-02T01:00:00+00:00",
    )


@dataclass
class FakeJobs:
    """Remembers submissions; knows one job; can blow up like a bug would."""

    calls: list[tuple[JobRequest, str | None]] = field(default_factory=list)
    tenants: list[str | None] = field(default_factory=list)
    crash: bool = False

    def submit(
        self, request: JobRequest, key: str | None = None, *, tenant: str | None
    ) -> SubmitReceipt:
        if self.crash:
            raise RuntimeError("secret internals")
        self.calls.append((request, key))
        self.tenants.append(tenant)
        return SubmitReceipt(job=_view(), replayed=len(self.calls) > 1)

    def status(self, job_id: str, *, tenant: str | None) -> JobStatus:
        self.tenants.append(tenant)
        if job_id != _view().job_id or tenant != EXAMPLE_TENANT:
            raise JobNotFoundError(f"no job {job_id}")
        return JobStatus(**_view().model_dump(), shards_done=2, records=10)


def _post(body: Any, **changes: Any) -> dict[str, Any]:
    event: dict[str, Any] = json.loads((EVENTS / "submit.json").read_text())
    event["body"] = body if isinstance(body, str) else json.dumps(body)
    event["isBase64Encoded"] = False
    event.update(changes)
    return event


def _body(response: dict[str, Any]) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(response["body"])
    return parsed


def test_post_submits_with_the_idempotency_key_header() -> None:
    jobs = FakeJobs()
    # GIVEN the submit event (header Idempotency-Key) WHEN it arrives twice
    first = dispatch(_post(BODY), jobs)
    second = dispatch(_post(BODY), jobs)
    # THEN 202 with a Location, the key reached the service, the second is a replay
    assert first["statusCode"] == 202
    assert first["headers"]["location"] == f"/v1/jobs/{_view().job_id}"
    assert jobs.calls[0] == (JobRequest(**BODY), "digits-api-example-0001")
    assert "idempotent-replayed" not in first["headers"]
    assert second["headers"]["idempotent-replayed"] == "true"


def test_a_base64_body_is_decoded() -> None:
    jobs = FakeJobs()
    encoded = base64.b64encode(json.dumps(BODY).encode()).decode()
    response = dispatch(_post(encoded, isBase64Encoded=True), jobs)
    assert response["statusCode"] == 202
    assert jobs.calls[0][0].model == "digits"


def test_get_reports_status_and_unknown_jobs_are_404() -> None:
    event = json.loads((EVENTS / "status.json").read_text())
    missing = dispatch(event, FakeJobs())
    assert (missing["statusCode"], _body(missing)["code"]) == (404, "job_not_found")
    event["path"] = f"/v1/jobs/{_view().job_id}"
    found = dispatch(event, FakeJobs())
    assert found["statusCode"] == 200
    assert (_body(found)["shards_done"], _body(found)["records"]) == (2, 10)


@pytest.mark.parametrize(
    ("change", "status", "code"),
    [
        ({"body": "{not json"}, 400, "invalid_input"),
        ({"body": json.dumps({**BODY, "extra": 1})}, 400, "invalid_input"),
        ({"body": json.dumps({**BODY, "input": "file:///etc/"})}, 400, "invalid_input"),
        ({"body": json.dumps({**BODY, "shards": 0})}, 400, "invalid_input"),
        ({"body": "!!", "isBase64Encoded": True}, 400, "invalid_input"),
        ({"body": "x" * 200_000}, 413, "payload_too_large"),
        ({"httpMethod": "DELETE"}, 405, "method_not_allowed"),
        ({"path": "/v1/other"}, 404, "not_found"),
    ],
)
def test_bad_requests_get_a_clear_error_and_code(
    change: dict[str, Any], status: int, code: str
) -> None:
    event = copy.deepcopy(_post(BODY))
    event.update(change)
    response = dispatch(event, FakeJobs())
    assert (response["statusCode"], _body(response)["code"]) == (status, code)
    assert "Traceback" not in response["body"]


@pytest.mark.parametrize(
    ("path", "method", "allowed"),
    [("/v1/jobs", "GET", "POST"), (f"/v1/jobs/{_view().job_id}", "POST", "GET")],
)
def test_a_wrong_method_is_405_naming_the_allowed_one(path: str, method: str, allowed: str) -> None:
    # GIVEN a route called with the method it does not take
    event = {**_post(BODY), "path": path, "httpMethod": method}
    # WHEN dispatched
    response = dispatch(event, FakeJobs())
    # THEN 405 with the core's error body and an Allow header
    assert response["statusCode"] == 405
    assert response["headers"]["allow"] == allowed
    assert _body(response)["code"] == "method_not_allowed"


def test_an_unexpected_failure_is_a_generic_500(caplog: pytest.LogCaptureFixture) -> None:
    response = dispatch(_post(BODY), FakeJobs(crash=True))
    assert response["statusCode"] == 500
    assert _body(response) == {"error": "internal error", "code": "internal"}
    # AND the traceback is in the log, not in the response
    assert "secret internals" in caplog.text
    assert "secret internals" not in response["body"]


def test_http_api_v2_events_route_too() -> None:
    # GIVEN an HTTP API event on a named stage (rawPath keeps the stage)
    event = {
        "version": "2.0",
        "rawPath": "/prod/v1/jobs",
        "requestContext": {
            "http": {"method": "POST"},
            "stage": "prod",
            "authorizer": {"iam": {"userArn": "arn:aws:iam::123456789012:user/ci"}},
        },
        "headers": {"idempotency-key": "k1"},
        "body": json.dumps(BODY),
    }
    jobs = FakeJobs()
    assert dispatch(event, jobs)["statusCode"] == 202
    assert jobs.calls[0][1] == "k1"
    # AND the IAM principal is the caller (unmapped: its own tenant)
    assert jobs.tenants == ["arn:aws:iam::123456789012:user/ci"]


def _anonymous(event: dict[str, Any]) -> dict[str, Any]:
    event = copy.deepcopy(event)
    event["requestContext"]["identity"]["apiKeyId"] = None
    return event


@pytest.mark.parametrize("name", ["submit", "status"])
def test_a_call_nothing_vouched_for_is_401_before_anything_runs(name: str) -> None:
    # GIVEN an event without an API key id, IAM principal or authorizer tenant
    event = _anonymous(json.loads((EVENTS / f"{name}.json").read_text()))
    jobs = FakeJobs()
    # WHEN dispatched with the default authenticator
    response = dispatch(event, jobs)
    # THEN 401 unauthenticated, and the service was never asked
    assert (response["statusCode"], _body(response)["code"]) == (401, "unauthenticated")
    assert jobs.tenants == []


def test_identities_map_to_tenants_and_an_authorizer_tenant_wins() -> None:
    # GIVEN the API key id mapped to a tenant
    callers = Authenticator({EXAMPLE_TENANT: "team-a"})
    jobs = FakeJobs()
    # WHEN the submit event arrives, then the same with an authorizer's tenant
    dispatch(_post(BODY), jobs, callers)
    vouched = _post(BODY)
    vouched["requestContext"]["authorizer"] = {"tenant": "team-b"}
    dispatch(vouched, jobs, callers)
    # THEN the first is the mapped tenant's, the second the authorizer's
    assert jobs.tenants == ["team-a", "team-b"]


def test_hints_count_only_where_the_deployment_trusts_them() -> None:
    # GIVEN an unauthenticated event naming a tenant in x-spillway-tenant
    event = _anonymous(_post(BODY))
    event["headers"]["X-Spillway-Tenant"] = "claimed"
    strict, local = FakeJobs(), FakeJobs()
    # WHEN dispatched strictly, and where hints are trusted (local runs)
    refused = dispatch(event, strict)
    dispatch(event, local, Authenticator(trust_tenant_hints=True))
    no_hint = _anonymous(_post(BODY))
    dispatch(no_hint, local, Authenticator(trust_tenant_hints=True))
    # THEN strict refuses; trusting, the hint is the tenant, and no hint is anonymous
    assert refused["statusCode"] == 401
    assert local.tenants == ["claimed", None]


@pytest.mark.parametrize(
    ("record_state", "batch", "done", "expected"),
    [
        ("SUBMITTING", None, 0, "SUBMITTING"),
        ("SUBMITTED", "RUNNING", 1, "RUNNING"),
        ("SUBMITTED", "RUNNING", 3, "SUCCEEDED"),
        ("SUBMITTED", "FAILED", 2, "FAILED"),
        ("SUBMITTED", "SUCCEEDED", 2, "INCOMPLETE"),
    ],
)
def test_status_state_combines_batch_and_markers(
    record_state: str, batch: str | None, done: int, expected: str
) -> None:
    record = {"state": record_state, "shards_total": 3}
    assert combined_state(record, batch, done) == expected
