"""Batch mode through the jobs API: the request staged as-is, under a key the router makes.

An in-memory S3 and an in-memory jobs API that behaves like the real one about
idempotency keys (same key and same job: the first job, replayed; same key and another
job: 409).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any

from spillway.policy.backend import BackendRequest, BackendResponse
from spillway.protocol.messages import JobRequest, JobView, SubmitReceipt, read_staged_request
from spillway.router.batch_mode import STAGED_NAME, JobsApiSubmitter, staging_key
from spillway.state.table import scope
from tests.unit.test_router import BODY, Stack, make_stack

STAGING = "s3://staging/router"


@dataclass
class MemoryS3:
    """``put_object`` into a dict, keeping every write."""

    objects: dict[tuple[str, str], bytes] = field(default_factory=dict)
    writes: list[str] = field(default_factory=list)

    def put_object(self, *, Bucket: str, Key: str, Body: bytes) -> dict[str, Any]:
        self.objects[(Bucket, Key)] = Body
        self.writes.append(Key)
        return {}


@dataclass
class JobsApi:
    """``POST /v1/jobs`` as the jobs function answers it."""

    name: str = "jobs"
    jobs: dict[str, tuple[JobRequest, str]] = field(default_factory=dict)
    posts: list[BackendRequest] = field(default_factory=list)

    def send(self, request: BackendRequest, timeout_s: float) -> BackendResponse:
        self.posts.append(request)
        job = JobRequest.parse(request.body)
        key = request.headers["idempotency-key"]
        known = self.jobs.get(key)
        if known is not None and known[0] != job:
            conflict = b'{"error":"key reused","code":"conflict"}'
            return BackendResponse(409, {"content-type": "application/json"}, conflict, 0.0)
        if known is None:
            self.jobs[key] = (job, f"job-{len(self.jobs) + 1}")
        job_id = self.jobs[key][1]
        view = JobView(
            job_id=job_id,
            state="SUBMITTED",
            model=job.model,
            input=job.input,
            output=job.output,
            created_at="2026-01-15T12:00:00Z",
        )
        answer = SubmitReceipt(job=view, replayed=known is not None).model_dump_json()
        headers = {"content-type": "application/json", "location": f"/v1/jobs/{job_id}"}
        return BackendResponse(202, headers, answer.encode(), 0.0)


def batch_stack() -> tuple[Stack, MemoryS3, JobsApi]:
    s3, api = MemoryS3(), JobsApi()
    # Tenant hints stand in for the identity API Gateway would vouch for.
    stack = make_stack(submitter=JobsApiSubmitter(api, STAGING, s3=s3), trust_tenant_hints=True)
    return stack, s3, api


def submit(stack: Stack, body: bytes = BODY, /, **headers: str) -> Any:
    return stack.post(body=body, headers={"x-spillway-mode": "batch", **headers})


def other_body() -> bytes:
    document = json.loads(BODY)
    document["inputs"][0]["data"][0] = 99.0
    return json.dumps(document).encode()


def test_the_request_is_staged_as_sent_and_the_job_reads_it() -> None:
    # GIVEN a router with a staging bucket and a jobs API
    stack, s3, api = batch_stack()
    # WHEN a batch-mode request arrives
    response = submit(stack)
    # THEN it is accepted with the job's id and where to poll it
    assert response.status_code == 202
    assert response.json == {
        "job_id": "job-1",
        "status": "submitted",
        "status_url": "/v1/jobs/job-1",
    }
    # AND the job's input is the staged request, byte for byte, under the job's key
    (post,) = api.posts
    job = JobRequest.parse(post.body)
    key = post.headers["idempotency-key"]
    assert (job.model, job.version) == ("digits", None)
    # (in the caller's own area of the staging prefix: here the anonymous one)
    assert job.input == f"{STAGING}/-/{key}/in/"
    assert job.output == f"{STAGING}/-/{key}/out/"
    staged = s3.objects[("staging", f"router/-/{key}/in/{STAGED_NAME}")]
    assert read_staged_request(staged) == (BODY, None)


def test_a_binary_request_is_staged_with_its_header_length() -> None:
    stack, s3, _ = batch_stack()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": [1, 4],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 16},
                }
            ]
        }
    ).encode()
    body = header + struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    response = stack.post(
        body=body,
        headers={"x-spillway-mode": "batch", "Inference-Header-Content-Length": str(len(header))},
        content_type="application/octet-stream",
    )
    assert response.status_code == 202
    ((_, key),) = s3.objects
    assert key.endswith(".v2req")
    assert read_staged_request(s3.objects[("staging", key)]) == (body, len(header))


def test_two_clients_with_the_same_request_id_get_their_own_staging_and_job() -> None:
    # GIVEN two clients that happen to send the same x-request-id, with different payloads
    stack, s3, api = batch_stack()
    first = submit(stack, BODY, **{"x-request-id": "nightly-42", "x-spillway-tenant": "acme"})
    second = submit(
        stack, other_body(), **{"x-request-id": "nightly-42", "x-spillway-tenant": "globex"}
    )
    # THEN each got its own job, staged in its own place: nobody overwrote the other
    assert (first.status_code, second.status_code) == (202, 202)
    assert first.json["job_id"] != second.json["job_id"]
    keys = [post.headers["idempotency-key"] for post in api.posts]
    assert keys[0] != keys[1]
    assert "nightly-42" not in keys[0] + keys[1]
    assert len(set(s3.writes)) == 2
    assert read_staged_request(s3.objects[("staging", s3.writes[0])])[0] == BODY


def test_the_same_request_twice_without_a_key_makes_two_jobs() -> None:
    stack, _, api = batch_stack()
    ids = {submit(stack, **{"x-request-id": "r-1"}).json["job_id"] for _ in range(2)}
    assert len(ids) == 2
    assert len({post.headers["idempotency-key"] for post in api.posts}) == 2


def test_a_retry_with_the_same_idempotency_key_replays_the_job() -> None:
    # GIVEN a caller that sends the same payload twice with its Idempotency-Key
    stack, s3, api = batch_stack()
    headers = {"Idempotency-Key": "order-7", "x-spillway-tenant": "acme"}
    first, retry = submit(stack, **headers), submit(stack, **headers)
    # THEN the retry gets the first job, staged in the same place
    assert first.json["job_id"] == retry.json["job_id"] == "job-1"
    assert len({post.headers["idempotency-key"] for post in api.posts}) == 1
    assert len(set(s3.writes)) == 1


def test_the_same_idempotency_key_with_another_payload_is_409_and_another_caller_another_job() -> (
    None
):
    # GIVEN a first batch request under a client key
    stack, s3, api = batch_stack()
    first = submit(stack, **{"Idempotency-Key": "order-7", "x-spillway-tenant": "acme"})
    first_staged = dict(s3.objects)
    # WHEN the same caller reuses the key with another payload, and another caller uses it
    other_payload = submit(
        stack, other_body(), **{"Idempotency-Key": "order-7", "x-spillway-tenant": "acme"}
    )
    other_caller = submit(stack, **{"Idempotency-Key": "order-7", "x-spillway-tenant": "globex"})
    # THEN the reuse is the jobs API's 409, staged elsewhere (the first rows are intact)
    assert first.status_code == 202
    assert other_payload.status_code == 409
    assert all(s3.objects[k] == v for k, v in first_staged.items())
    # AND the other caller gets its own job under its own key
    assert other_caller.status_code == 202
    assert other_caller.json["job_id"] != first.json["job_id"]
    assert len({post.headers["idempotency-key"] for post in api.posts}) == 2


def test_the_same_key_and_payload_for_another_model_is_the_jobs_apis_409() -> None:
    stack, _, _ = batch_stack()
    assert submit(stack, **{"Idempotency-Key": "order-7"}).status_code == 202
    response = stack.post(
        "/v2/models/minilm/infer",
        headers={"x-spillway-mode": "batch", "Idempotency-Key": "order-7"},
    )
    assert response.status_code == 409
    assert response.json["code"] == "conflict"
    assert response.headers["x-spillway-backend"] == "batch"


def test_the_key_is_scoped_to_the_caller_and_the_place_to_the_payload() -> None:
    key, place = staging_key("acme", "order-7", b"body")
    assert key == hashlib.sha256(f"{scope('acme')}\0order-7".encode()).hexdigest()
    assert place == f"{key}/{hashlib.sha256(b'body').hexdigest()[:32]}"
    other_key, other_place = staging_key("acme", "order-7", b"body2")
    assert (other_key, other_place != place) == (key, True)
    assert staging_key("globex", "order-7", b"body")[0] != key
    assert staging_key(None, "order-7", b"body") != staging_key("anonymous", "order-7", b"body")
    randoms = [staging_key("acme", None, b"body") for _ in range(3)]
    assert len({k for k, _ in randoms}) == 3
    assert all(k == p and len(k) == 32 for k, p in randoms)
