"""The jobs API under the tenancy model, with two real tenants (two API key ids mapped to
two tenants), on the moto server: who may see a job, where a job may read and write."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from batch_job.api import authenticator
from batch_job.service import JobService
from batch_job.settings import JobsSettings
from functions.jobs import handler as jobs_handler
from spillway.aws.clients import aws_client
from spillway.state.table import scope
from tests.integration.test_jobs_support import (
    digits_images,
    jobs_settings,
    new_bucket,
    put_jsonl,
    record,
)
from tests.lambda_context import LambdaContext

EVENTS = Path(__file__).resolve().parents[2] / "events" / "jobs"
KEYS = {"a": "key-id-tenant-a", "b": "key-id-tenant-b"}
TENANTS = {KEYS["a"]: "tenant-a", KEYS["b"]: "tenant-b"}


class Deployment:
    """The jobs function over one data bucket and one models bucket."""

    def __init__(self, data: str, models: str) -> None:
        self.data = data
        self.models = models

    def area(self, tenant: str) -> str:
        return f"s3://{self.data}/tenants/{scope(tenant)}/"

    def staging(self, tenant: str) -> str:
        return f"s3://{self.data}/staging/router/{scope(tenant)}/"


def tenant_deployment(
    aws_env: str, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Deployment, JobsSettings]:
    """A jobs API over the models at ``repo`` whose callers are ``TENANTS``, each with its
    area under a new data bucket (``JOBS_*`` set for the test), and the job runner's
    settings."""
    settings: JobsSettings = jobs_settings(aws_env, repo)
    data, models = new_bucket(), new_bucket()
    env = {
        "JOBS_REPOSITORY": settings.repository,
        "JOBS_JOB_QUEUE": settings.job_queue,
        "JOBS_JOB_DEFINITION": settings.job_definition,
        "JOBS_TABLE": settings.table,
        "JOBS_TENANTS_ROOT": f"s3://{data}/tenants",
        "JOBS_STAGING": f"s3://{data}/staging/router",
        "JOBS_IDENTITY_TENANTS": json.dumps(TENANTS),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(jobs_handler, "jobs", JobService(JobsSettings()))
    # The handler's callers were built at its import, from that moment's settings.
    monkeypatch.setattr(jobs_handler, "callers", authenticator(JobsSettings()))
    return Deployment(data, models), settings


@pytest.fixture
def deployment(aws_env: str, models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Deployment:
    found, _ = tenant_deployment(aws_env, models_dir, monkeypatch)
    images = digits_images(models_dir)
    for tenant in ("tenant-a", "tenant-b"):
        for root in (found.area(tenant), found.staging(tenant)):
            key = f"{root.split('/', 3)[3]}in/0.jsonl"
            rows = [record(f"r{i}", image=images[i].tolist()) for i in range(3)]
            put_jsonl(found.data, key, rows)
    return found


def _call(
    who: str | None, method: str, path: str, body: Any = None, key: str | None = None
) -> tuple[int, dict[str, Any]]:
    """One API Gateway event from tenant ``who`` (its API key id), or from nobody."""
    name = "submit" if method == "POST" else "status"
    event: dict[str, Any] = json.loads((EVENTS / f"{name}.json").read_text())
    event["path"], event["httpMethod"] = path, method
    event["body"], event["isBase64Encoded"] = json.dumps(body) if body else None, False
    event["headers"] = {"Content-Type": "application/json"}
    if key is not None:
        event["headers"]["Idempotency-Key"] = key
    event["requestContext"]["identity"]["apiKeyId"] = KEYS[who] if who else None
    event["requestContext"]["identity"]["userArn"] = None
    answer = jobs_handler.handler(event, LambdaContext())
    return answer["statusCode"], json.loads(answer["body"])


def _job(input_url: str, output_url: str) -> dict[str, Any]:
    return {"model": "digits", "input": input_url, "output": output_url}


def _keys(bucket: str, prefix: str) -> list[str]:
    listed = aws_client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for o in listed.get("Contents", [])]


def test_another_tenants_job_is_not_found(deployment: Deployment) -> None:
    # GIVEN a job of tenant A
    a = deployment.area("tenant-a")
    status, receipt = _call("a", "POST", "/v1/jobs", _job(f"{a}in/", f"{a}out/"))
    assert status == 202, receipt
    job_id = receipt["job"]["job_id"]
    # WHEN tenant B asks for it
    status_b, answer_b = _call("b", "GET", f"/v1/jobs/{job_id}")
    # THEN B gets the same 404 as for a job that does not exist; A sees its job
    assert (status_b, answer_b["code"]) == (404, "job_not_found")
    status_a, answer_a = _call("a", "GET", f"/v1/jobs/{job_id}")
    assert (status_a, answer_a["job_id"]) == (200, job_id)


def test_a_call_nothing_authenticated_is_refused(deployment: Deployment) -> None:
    # GIVEN an event without API key id or IAM principal (nothing vouched for the caller)
    a = deployment.area("tenant-a")
    # WHEN it submits or asks for a job
    submit = _call(None, "POST", "/v1/jobs", _job(f"{a}in/", f"{a}out/"))
    status = _call(None, "GET", "/v1/jobs/00000000-0000-4000-8000-000000000000")
    # THEN both are 401 with a stable code, and nothing was written
    assert (submit[0], submit[1]["code"]) == (401, "unauthenticated")
    assert (status[0], status[1]["code"]) == (401, "unauthenticated")
    assert _keys(deployment.data, a.split("/", 3)[3] + "out/") == []


@pytest.mark.parametrize(
    ("what", "location"),
    [
        ("input from A's staging", lambda d: ("input", f"{d.staging('tenant-a')}in/")),
        ("input from A's area", lambda d: ("input", f"{d.area('tenant-a')}in/")),
        ("output into async/", lambda d: ("output", f"s3://{d.data}/async/b-owned/")),
        ("output into A's area", lambda d: ("output", f"{d.area('tenant-a')}out/")),
        (
            "output into the model repository",
            lambda d: ("output", f"s3://{d.models}/repository/zz-injected/"),
        ),
        ("output into A's staging", lambda d: ("output", f"{d.staging('tenant-a')}out/")),
    ],
)
def test_a_job_reads_and_writes_only_its_tenants_areas(
    deployment: Deployment, what: str, location: Any
) -> None:
    # GIVEN tenant B's own input and output, with one of them pointed elsewhere
    b = deployment.area("tenant-b")
    body = _job(f"{b}in/", f"{b}out/")
    field, url = location(deployment)
    body[field] = url
    # WHEN B submits the job
    status, answer = _call("b", "POST", "/v1/jobs", body)
    # THEN it is refused as outside B's area, naming B's own areas and no one else's
    assert (status, answer.get("code")) == (403, "outside_tenant_area"), (what, answer)
    assert deployment.area("tenant-b") in answer["error"]
    assert scope("tenant-a") not in answer["error"].replace(url, "")
    # AND nothing was written where it pointed (no plan in the repository or anywhere)
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    assert [k for k in _keys(bucket, prefix) if not k.endswith(".jsonl")] == []


def test_a_dot_dot_segment_is_refused_before_any_check(deployment: Deployment) -> None:
    # GIVEN an output that would read as A's area once a path resolver folded the '..'
    b = deployment.area("tenant-b")
    sneaky = f"{b}../{scope('tenant-a')}/out/"
    # WHEN B submits it THEN it is a 400: no location with '.', '..' or '//' is compared
    status, answer = _call("b", "POST", "/v1/jobs", _job(f"{b}in/", sneaky))
    assert (status, answer["code"]) == (400, "invalid_input")


def test_staging_the_router_wrote_for_a_tenant_is_that_tenants_input(
    deployment: Deployment,
) -> None:
    # GIVEN a request the router staged for tenant B (under B's staging scope)
    staged = f"{deployment.staging('tenant-b')}in/"
    out = f"{deployment.staging('tenant-b')}out/"
    # WHEN B's job names it
    status, receipt = _call("b", "POST", "/v1/jobs", _job(staged, out))
    # THEN it runs, writing into a folder of its own below the output it named
    assert status == 202, receipt
    assert receipt["job"]["output"] == f"{out}{receipt['job']['job_id']}/"


def test_outputs_go_to_a_folder_per_job(deployment: Deployment) -> None:
    # GIVEN two jobs of tenant A naming the same output prefix
    a = deployment.area("tenant-a")
    first = _call("a", "POST", "/v1/jobs", _job(f"{a}in/", f"{a}out/"))
    second = _call("a", "POST", "/v1/jobs", _job(f"{a}in/", f"{a}out/"))
    # THEN both run, each into <output>/<job id>/, and neither overwrites the other's plan
    assert (first[0], second[0]) == (202, 202), (first, second)
    outputs = [r[1]["job"]["output"] for r in (first, second)]
    assert outputs == [f"{a}out/{r[1]['job']['job_id']}/" for r in (first, second)]
    prefix = a.split("/", 3)[3]
    plans = sorted(k for k in _keys(deployment.data, f"{prefix}out/") if k.endswith("_plan.json"))
    assert plans == sorted(
        f"{prefix}out/{r[1]['job']['job_id']}/_plan.json" for r in (first, second)
    )


def test_idempotency_keys_are_scoped_per_tenant(deployment: Deployment) -> None:
    # GIVEN tenant A's job under an idempotency key
    a, b = deployment.area("tenant-a"), deployment.area("tenant-b")
    first = _call("a", "POST", "/v1/jobs", _job(f"{a}in/", f"{a}out/"), key="nightly-1")
    # WHEN tenant B uses the same key for its own job, and A replays its key
    other = _call("b", "POST", "/v1/jobs", _job(f"{b}in/", f"{b}out/"), key="nightly-1")
    again = _call("a", "POST", "/v1/jobs", _job(f"{a}in/", f"{a}out/"), key="nightly-1")
    # THEN B gets a job of its own (no conflict, no sight of A's), A its replay
    assert (first[0], other[0], again[0]) == (202, 202, 202), (first, other, again)
    assert other[1]["job"]["job_id"] != first[1]["job"]["job_id"]
    assert other[1]["replayed"] is False
    assert other[1]["job"]["input"] == f"{b}in/"
    assert (again[1]["job"]["job_id"], again[1]["replayed"]) == (first[1]["job"]["job_id"], True)


def test_the_router_vouches_for_its_callers_tenant(deployment: Deployment) -> None:
    # GIVEN the event the router invokes the jobs function with (lambda:Invoke, which only
    # the router's role may call): its caller's tenant in requestContext.authorizer
    staged = f"{deployment.staging('tenant-b')}in/"
    event = {
        "resource": "/v1/jobs",
        "path": "/v1/jobs",
        "httpMethod": "POST",
        "headers": {"content-type": "application/json", "idempotency-key": "r1"},
        "body": json.dumps(_job(staged, f"{deployment.staging('tenant-b')}out/")),
        "isBase64Encoded": False,
        "requestContext": {"requestId": "r1", "authorizer": {"tenant": "tenant-b"}},
    }
    # WHEN it arrives
    answer = jobs_handler.handler(event, LambdaContext())
    # THEN the job is tenant B's: B sees it, A does not
    assert answer["statusCode"] == 202, answer
    job_id = json.loads(answer["body"])["job"]["job_id"]
    assert _call("b", "GET", f"/v1/jobs/{job_id}")[0] == 200
    assert _call("a", "GET", f"/v1/jobs/{job_id}")[0] == 404


def test_the_local_jobs_server_maps_api_keys_as_api_gateway_does(
    deployment: Deployment,
) -> None:
    # GIVEN the jobs API behind the local HTTP server (as `spillway serve jobs` serves it),
    # which passes a request's x-api-key as API Gateway passes the key's id
    from batch_job import api
    from spillway_cli.local.lambda_http import wsgi_app
    from spillway_cli.local.wsgi_server import running

    a = deployment.area("tenant-a")
    body = json.dumps(_job(f"{a}in/", f"{a}out/")).encode()

    def call(method: str, path: str, key: str | None, data: bytes | None = None) -> int:
        headers = {"content-type": "application/json"} | ({"x-api-key": key} if key else {})
        request = urllib.request.Request(f"{url}{path}", data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as refused:
            return refused.code

    jobs = JobService(JobsSettings())
    with running(wsgi_app(lambda event, _context: api.answer(event, jobs), "/v1/health")) as url:
        # WHEN tenant A submits with its key, and B, then nobody, ask for the job
        request = urllib.request.Request(
            f"{url}/v1/jobs", body, {"x-api-key": KEYS["a"]}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            job_id = json.loads(answer.read())["job"]["job_id"]
        seen = [call("GET", f"/v1/jobs/{job_id}", key) for key in (KEYS["a"], KEYS["b"], None)]
    # THEN A sees it, B gets 404, a request without a key 401
    assert seen == [200, 404, 401]
