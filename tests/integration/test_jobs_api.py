"""Submission on the moto server: idempotency, the jobs Lambda's events, the schedule."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from batch_job.api import authenticator
from batch_job.plan import RunSpec
from batch_job.runner import run_job
from batch_job.service import JobService
from batch_job.settings import JobsSettings
from functions.jobs import handler as jobs_handler
from spillway.aws.clients import aws_client
from spillway.protocol.errors import JobConflictError, JobNotConfiguredError
from spillway.protocol.messages import JobRequest
from spillway.state.table import scope
from tests.integration.test_jobs_support import (
    EXAMPLE_API_KEY_ID,
    digits_images,
    jobs_settings,
    new_bucket,
    put_jsonl,
    record,
)
from tests.lambda_context import LambdaContext

EVENTS = Path(__file__).resolve().parents[2] / "events" / "jobs"


@pytest.fixture
def settings(aws_env: str, models_dir: Path) -> JobsSettings:
    return jobs_settings(aws_env, models_dir)


@pytest.fixture
def lambda_env(settings: JobsSettings, monkeypatch: pytest.MonkeyPatch) -> JobsSettings:
    """The jobs function's environment (``JOBS_*``), as its template would set it."""
    for name in ("repository", "job_queue", "job_definition", "table"):
        monkeypatch.setenv(f"JOBS_{name.upper()}", str(getattr(settings, name)))
    monkeypatch.setenv("JOBS_TENANTS_ROOT", "s3://spillway-data/tenants")
    monkeypatch.setattr(jobs_handler, "jobs", JobService(JobsSettings()))
    # The handler's callers were built at its import, from that moment's settings.
    monkeypatch.setattr(jobs_handler, "callers", authenticator(JobsSettings()))
    return settings


def _digits_input(bucket: str, prefix: str, models_dir: Path, files: int = 2) -> None:
    images = digits_images(models_dir)
    for f in range(files):
        put_jsonl(
            bucket,
            f"{prefix}{f}.jsonl",
            [record(f"{f}-{i}", image=images[i].tolist()) for i in range(5)],
        )


def _batch_jobs_named(settings: JobsSettings, name: str) -> list[dict[str, Any]]:
    batch = aws_client("batch")
    found = []
    for state in ("SUBMITTED", "PENDING", "RUNNABLE", "STARTING", "RUNNING", "SUCCEEDED", "FAILED"):
        listed = batch.list_jobs(jobQueue=settings.job_queue, jobStatus=state)["jobSummaryList"]
        # moto lists array children (``<id>:<index>``) beside their parent
        found += [j for j in listed if j["jobName"] == name and ":" not in j["jobId"]]
    return found


def _event(name: str) -> dict[str, Any]:
    event: dict[str, Any] = json.loads((EVENTS / f"{name}.json").read_text())
    return event


def test_concurrent_submissions_with_one_key_start_one_job(
    settings: JobsSettings, models_dir: Path
) -> None:
    # GIVEN an input prefix and one idempotency key
    bucket = new_bucket()
    _digits_input(bucket, "in/", models_dir)
    request = JobRequest(model="digits", input=f"s3://{bucket}/in/", output=f"s3://{bucket}/out/")
    service = JobService(settings)

    # WHEN four callers submit the same request with that key at once
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(
            pool.map(lambda _: service.submit_as_operator(request, f"key-{bucket}"), range(4))
        )

    # THEN they all get the same job, exactly one of them started it, Batch has one job
    assert len({r.job.job_id for r in results}) == 1
    started = [r for r in results if not r.replayed]
    assert len(started) == 1
    job = started[0].job
    assert (job.state, job.shards_total, job.array_size, job.model_version) == (
        "SUBMITTED",
        2,
        2,
        1,
    )
    batch_jobs = _batch_jobs_named(settings, f"spillway-digits-{job.job_id[:8]}")
    assert [j["jobId"] for j in batch_jobs] == [job.batch_job_id]
    # AND the replays carry the Batch job too (or, mid-submission, the same job id)
    assert {r.job.batch_job_id for r in results if r.job.state == "SUBMITTED"} == {job.batch_job_id}
    # AND the Batch job runs `spillway jobs run` with the plan's exact version
    described = aws_client("batch").describe_jobs(jobs=[job.batch_job_id])["jobs"][0]
    command = described["container"]["command"]
    assert command[:3] == ["spillway", "jobs", "run"]
    assert command[command.index("--version") + 1] == "1"
    assert described["arrayProperties"]["size"] == 2


def test_same_key_with_another_request_is_a_conflict(
    settings: JobsSettings, models_dir: Path
) -> None:
    # GIVEN a job submitted with a key
    bucket = new_bucket()
    _digits_input(bucket, "in/", models_dir)
    service = JobService(settings)
    first = JobRequest(model="digits", input=f"s3://{bucket}/in/", output=f"s3://{bucket}/o1/")
    service.submit_as_operator(first, f"k-{bucket}")
    # WHEN the key comes back with a different output prefix
    other = first.model_copy(update={"output": f"s3://{bucket}/o2/"})
    # THEN it is refused with 409 and no second plan is written
    with pytest.raises(JobConflictError) as caught:
        service.submit_as_operator(other, f"k-{bucket}")
    assert (caught.value.status, caught.value.code) == (409, "job_conflict")
    listed = aws_client("s3").list_objects_v2(Bucket=bucket, Prefix="o2/")
    assert listed.get("KeyCount", 0) == 0


def test_api_events_submit_then_report_status(lambda_env: JobsSettings, models_dir: Path) -> None:
    # GIVEN the bucket the POST event's body names, with input files in the area of the
    # event's caller (its API key id, its own tenant)
    s3 = aws_client("s3")
    s3.create_bucket(Bucket="spillway-data")
    area = f"tenants/{scope(EXAMPLE_API_KEY_ID)}/"
    _digits_input("spillway-data", f"{area}digits/in/", models_dir, files=3)

    # WHEN API Gateway delivers POST /v1/jobs (events/jobs/submit.json) twice
    post = _event("submit")
    first = jobs_handler.handler(post, LambdaContext())
    again = jobs_handler.handler(post, LambdaContext())

    # THEN one job is accepted and the retry replays it
    assert first["statusCode"] == 202, first
    job = json.loads(first["body"])["job"]
    assert first["headers"]["location"] == f"/v1/jobs/{job['job_id']}"
    assert (again["statusCode"], again["headers"].get("idempotent-replayed")) == (202, "true")
    assert json.loads(again["body"])["job"]["job_id"] == job["job_id"]
    assert (job["shards_total"], job["array_size"]) == (3, 2)
    assert job["output"] == f"s3://spillway-data/{area}digits/out/{job['job_id']}/"

    # AND once the shards run, GET /v1/jobs/{id} (events/jobs/status.json) adds them up
    run_job(RunSpec("digits", job["input"], job["output"], batch_size=32), lambda_env)
    get = _event("status")
    get["path"] = f"/v1/jobs/{job['job_id']}"
    get["pathParameters"] = {"id": job["job_id"]}
    response = jobs_handler.handler(get, LambdaContext())
    assert response["statusCode"] == 200, response
    status = json.loads(response["body"])
    assert (status["state"], status["batch_status"]) == ("SUCCEEDED", "SUCCEEDED")
    assert (status["shards_done"], status["records"], status["errors"]) == (3, 15, 0)


def test_api_errors_are_mapped_once(lambda_env: JobsSettings) -> None:
    # GIVEN the status event for a job that does not exist
    missing = jobs_handler.handler(_event("status"), LambdaContext())
    # THEN 404 with a stable code and no internals
    assert missing["statusCode"] == 404
    assert json.loads(missing["body"])["code"] == "job_not_found"
    # AND a POST with an unknown model name is a 400 naming the field
    post = _event("submit")
    post["body"] = json.dumps({"model": "../etc", "input": "s3://a-b/x/", "output": "s3://a-b/y/"})
    post["isBase64Encoded"] = False
    bad = jobs_handler.handler(post, LambdaContext())
    assert bad["statusCode"] == 400
    assert json.loads(bad["body"])["code"] == "invalid_input"
    assert json.loads(bad["body"])["error"].startswith("invalid job request: model:")


def test_a_scheduled_event_without_its_settings_fails_as_the_deployment_s_fault(
    lambda_env: JobsSettings,
) -> None:
    # GIVEN the function without JOBS_SCHEDULE_MODEL, _INPUT and _OUTPUT
    assert lambda_env.schedule_model is None
    # WHEN EventBridge delivers the scheduled event
    with pytest.raises(JobNotConfiguredError) as caught:
        jobs_handler.handler(_event("nightly"), LambdaContext())
    # THEN the invocation fails with the deployment's 500 and its own code, never the
    # caller's 400 ``not_configured``
    assert (caught.value.status, caught.value.code) == (500, "job_not_configured")
    assert caught.value.message == "JOBS_SCHEDULE_MODEL, _INPUT and _OUTPUT must be set"


def test_scheduled_event_starts_the_configured_job_once(
    lambda_env: JobsSettings, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN the function configured to re-score a prefix nightly
    bucket = new_bucket()
    _digits_input(bucket, "content/", models_dir)
    monkeypatch.setenv("JOBS_SCHEDULE_MODEL", "digits")
    monkeypatch.setenv("JOBS_SCHEDULE_INPUT", f"s3://{bucket}/content/")
    monkeypatch.setenv("JOBS_SCHEDULE_OUTPUT", f"s3://{bucket}/rescored")
    monkeypatch.setattr(jobs_handler, "jobs", JobService(JobsSettings()))
    # The handler's callers were built at its import, from that moment's settings.
    monkeypatch.setattr(jobs_handler, "callers", authenticator(JobsSettings()))

    # WHEN EventBridge delivers the scheduled event (events/jobs/nightly.json), twice
    event = _event("nightly")
    first = jobs_handler.handler(event, LambdaContext())
    second = jobs_handler.handler(event, LambdaContext())

    # THEN one job re-scores the prefix into that day's output prefix
    job = first["job"]
    assert (first["replayed"], second["replayed"]) == (False, True)
    assert second["job"]["job_id"] == job["job_id"]
    assert job["input"] == f"s3://{bucket}/content/"
    assert job["output"] == f"s3://{bucket}/rescored/2024-06-02/"
    assert (job["model"], job["model_version"], job["shards_total"]) == ("digits", 1, 2)
    described = aws_client("batch").describe_jobs(jobs=[job["batch_job_id"]])["jobs"][0]
    command = described["container"]["command"]
    assert command[command.index("--output") + 1] == f"s3://{bucket}/rescored/2024-06-02/"
    # AND its plan is frozen at the output prefix for the array children
    plan = aws_client("s3").get_object(Bucket=bucket, Key="rescored/2024-06-02/_plan.json")
    assert [s["key"] for s in json.loads(plan["Body"].read())["shards"]] == [
        "content/0.jsonl",
        "content/1.jsonl",
    ]
