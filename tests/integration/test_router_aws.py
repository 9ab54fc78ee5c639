"""The router's AWS paths on 127.0.0.1: ``lambda:Invoke`` of the CPU fallback through
boto3 (against the invoke API ``spillway serve cpu`` answers) and the policy in SSM
(a moto server), refreshed without a restart."""

from __future__ import annotations

import http.server
import json
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import boto3
import numpy as np
import pytest
from werkzeug.test import Client

from spillway.fallback.app import CpuApp
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.protocol.messages import (
    STAGED_SUFFIX,
    JobRequest,
    JobView,
    SubmitReceipt,
    read_staged_request,
)
from spillway.router.settings import RouterSettings
from spillway.router.wiring import Overrides, create_app
from spillway.state.table import scope
from spillway_cli.local.procs import free_port
from spillway_cli.local.wsgi_server import running
from tests.support import load_engine

ROOT = Path(__file__).resolve().parents[2]
BODY = json.loads((ROOT / "events" / "cpu_infer" / "infer-direct.json").read_text())["body"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def cpu_url(models_dir: Path) -> Iterator[str]:
    cpu = CpuService.load(CpuSettings(repository=str(models_dir), models=["digits"]))
    with running(CpuApp(cpu)) as url:
        yield url


def test_the_cpu_fallback_is_invoked_as_a_lambda_function(
    aws_env: str, cpu_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # GIVEN a router whose GPU cannot be reached and whose CPU fallback is a Lambda function,
    # invoked through boto3 at the endpoint AWS_ENDPOINT_URL_LAMBDA names
    monkeypatch.setenv("AWS_ENDPOINT_URL_LAMBDA", cpu_url)
    settings = RouterSettings(
        gpu_url=f"http://127.0.0.1:{free_port()}",
        cpu_function="spillway-cpu-infer",
        metrics_log=tmp_path / "metrics.log",
    )
    app = create_app(settings)
    # WHEN an infer request arrives
    response = Client(app).post("/v2/models/digits/infer", json=BODY)
    # THEN the Lambda function served it, and the response says it was a fallback
    assert response.status_code == 200, response.data
    assert response.headers["x-spillway-backend"] == "cpu"
    assert response.headers["x-spillway-fallback"] == "gpu:connect_error"
    answer = json.loads(response.data)
    assert answer["outputs"][0]["name"] == "label"
    assert answer["id"] == "post-1"
    # AND metadata and readiness travel as direct-invoke operations too
    meta = Client(app).get("/v2/models/digits", headers={"x-spillway-mode": "serverless"})
    assert meta.status_code == 200
    assert json.loads(meta.data)["name"] == "digits"
    assert (
        Client(app)
        .get("/v2/models/minilm/ready", headers={"x-spillway-mode": "serverless"})
        .status_code
        == 404
    )


def test_an_unknown_function_is_unavailable_not_a_crash(
    aws_env: str, cpu_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_LAMBDA", cpu_url)
    settings = RouterSettings(
        gpu_url=None, cpu_function="no-such-function", metrics_log=Path("/dev/null")
    )
    response = Client(create_app(settings)).post("/v2/models/digits/infer", json=BODY)
    assert response.status_code == 503
    assert response.headers["x-spillway-backend"] == "cpu"


def _policy(rule: str) -> str:
    return json.dumps(
        {
            "rules": [
                {"name": rule, "match": {"mode": ["serverless"]}, "route": "cpu"},
                {"name": "default", "route": "gpu"},
            ]
        }
    )


def test_the_policy_comes_from_ssm_and_a_bad_update_is_refused(
    aws_env: str, cpu_url: str, tmp_path: Path
) -> None:
    # GIVEN a policy in an SSM parameter and a router that reads it with a 60 s TTL
    ssm = boto3.client("ssm")
    name = f"/spillway/router/policy-{random.randrange(10**9)}"
    ssm.put_parameter(Name=name, Value=_policy("first"), Type="String")
    clock = Clock()
    metrics = tmp_path / "metrics.log"
    settings = RouterSettings(
        gpu_url=None, cpu_url=cpu_url, policy_parameter=name, policy_ttl_s=60, metrics_log=metrics
    )
    app = create_app(settings, Overrides(clock=clock, wall=lambda: datetime.now(UTC)))

    def rule() -> str:
        response = Client(app).post(
            "/v2/models/digits/infer", json=BODY, headers={"x-spillway-mode": "serverless"}
        )
        assert response.status_code == 200
        return str(response.headers["x-spillway-rule"])

    assert rule() == "first"
    # WHEN the parameter is overwritten with a policy that does not validate
    ssm.put_parameter(Name=name, Value='{"rules": [{"name": "x", "route": "tpu"}]}', Overwrite=True)
    clock.now += 60
    # THEN the last good policy keeps serving and the refusal is counted
    assert rule() == "first"
    rejected = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert sum(d.get("PolicyRejected", [0])[0] for d in rejected if "PolicyRejected" in d) == 1
    # WHEN a good policy is put, it serves once the TTL has passed, without a restart
    ssm.put_parameter(Name=name, Value=_policy("second"), Overwrite=True)
    assert rule() == "first"
    clock.now += 60
    assert rule() == "second"


def test_a_missing_parameter_leaves_the_built_in_policy_serving(aws_env: str) -> None:
    settings = RouterSettings(
        gpu_url=None, policy_parameter="/spillway/none", metrics_log=Path("/dev/null")
    )
    app = create_app(settings)
    store = app.router.policies
    assert store.loaded.source == "built-in"
    assert store.last_error is not None
    assert "ssm:/spillway/none" in store.last_error


class _JobsApi(http.server.BaseHTTPRequestHandler):
    """Stands in for the jobs API: records submissions, answers 202 like it does."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append({"headers": dict(self.headers.items()), "body": body})
        job = JobRequest.parse(body)
        view = JobView(
            job_id="job-7",
            state="SUBMITTED",
            model=job.model,
            input=job.input,
            output=job.output,
            created_at="2026-01-15T12:00:00Z",
        )
        answer = SubmitReceipt(job=view, replayed=False).model_dump_json().encode()
        self.send_response(202)
        self.send_header("Content-Type", "application/json")
        self.send_header("Location", "/v1/jobs/job-7")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        return None


@contextmanager
def _batch_router(bucket: str, tmp_path: Path) -> Iterator[Any]:
    """A router whose batch mode stages in ``s3://<bucket>/router`` (moto) and submits to
    the jobs API stand-in (submissions land in ``_JobsApi.seen``)."""
    boto3.client("s3").create_bucket(Bucket=bucket)
    _JobsApi.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _JobsApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = RouterSettings(
            gpu_url=None,
            jobs_url=f"http://127.0.0.1:{server.server_port}/v1/jobs",
            jobs_staging=f"s3://{bucket}/router",
            metrics_log=tmp_path / "metrics.log",
        )
        yield create_app(settings)
    finally:
        server.shutdown()
        server.server_close()


def test_batch_mode_stages_the_request_in_s3_and_submits_a_job(
    aws_env: str, tmp_path: Path
) -> None:
    # GIVEN a staging bucket (moto) and a jobs API, and a router configured for both
    from spillway.protocol.codec import decode_request

    s3 = boto3.client("s3")
    with _batch_router("staging", tmp_path) as app:
        images = [[float(i % 16)] * 64 for i in range(3)]
        body = {
            "inputs": [{"name": "image", "shape": [3, 8, 8], "datatype": "FP32", "data": images}]
        }
        # WHEN a batch-mode request arrives
        response = Client(app).post(
            "/v2/models/digits/infer",
            json=body,
            headers={"x-spillway-mode": "batch", "x-request-id": "nightly-42"},
        )
    # THEN it is accepted with the jobs API's job id
    assert response.status_code == 202
    assert json.loads(response.data) == {
        "job_id": "job-7",
        "status": "submitted",
        "status_url": "/v1/jobs/job-7",
    }
    assert response.headers["x-spillway-backend"] == "batch"
    # AND the submission is one the jobs API accepts, under a key the router made
    (seen,) = _JobsApi.seen
    key = seen["headers"]["idempotency-key"]
    assert len(key) == 32
    assert "nightly-42" not in key
    job = JobRequest.parse(seen["body"])
    assert job.model == "digits"
    assert job.input == f"s3://staging/router/-/{key}/in/"  # the anonymous caller's area
    # AND its input is the request as sent, which the core codec reads back: three rows
    bucket, _, prefix = job.input.removeprefix("s3://").partition("/")
    staged = s3.get_object(Bucket=bucket, Key=f"{prefix}request{STAGED_SUFFIX}")["Body"].read()
    _, tensors = decode_request(*read_staged_request(staged))
    assert tensors["image"].shape == (3, 8, 8)
    assert [float(row[0, 0]) for row in tensors["image"]] == [0.0, 1.0, 2.0]


def test_two_clients_with_one_request_id_each_get_their_own_rows(
    aws_env: str, tmp_path: Path, models_dir: Path
) -> None:
    # GIVEN the router's batch mode on moto S3 and two clients that send the same
    # x-request-id with different rows
    from batch_job.plan import RunSpec
    from batch_job.runner import run_job
    from batch_job.settings import JobsSettings

    s3 = boto3.client("s3")
    samples = np.load(models_dir / "digits" / "samples" / "images.npy").astype(np.float32)
    rows = {"alice": samples[:5], "bob": samples[5:12]}
    with _batch_router("staging2", tmp_path) as app:
        for images in rows.values():
            tensor = {
                "name": "image",
                "shape": list(images.shape),
                "datatype": "FP32",
                "data": images.ravel().tolist(),
            }
            # WHEN each submits in batch mode
            response = Client(app).post(
                "/v2/models/digits/infer",
                json={"inputs": [tensor]},
                headers={"x-spillway-mode": "batch", "x-request-id": "same-id"},
            )
            assert response.status_code == 202
    # AND the jobs run
    jobs = [JobRequest.parse(seen["body"]) for seen in _JobsApi.seen]
    assert len({job.input for job in jobs}) == 2
    engine = load_engine(models_dir, "digits")
    runner = JobsSettings(
        repository=str(models_dir),
        providers=("CPUExecutionProvider",),
        cache_dir=tmp_path / "cache",
        progress_bar=False,
    )
    for (client, images), job in zip(rows.items(), jobs, strict=True):
        run_job(RunSpec("digits", job.input, job.output), runner)
        # THEN each job's output holds exactly its own client's rows, computed right
        bucket, _, prefix = job.output.removeprefix("s3://").partition("/")
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
        keys = [o["Key"] for o in listed if o["Key"].endswith(".jsonl")]
        outputs = [k for k in keys if not k.endswith(".errors.jsonl") and "/_" not in k]
        lines = []
        for key in outputs:
            text = s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
            lines += [json.loads(line) for line in text.splitlines() if line]
        labels = [line["outputs"]["label"] for line in sorted(lines, key=lambda x: int(x["id"]))]
        expected = engine.infer({"image": images})["label"].tolist()
        assert labels == expected, client


def test_batch_mode_invokes_the_jobs_function_with_lambda_invoke(
    aws_env: str, tmp_path: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN the jobs API (its real event adapter, on moto's Batch, DynamoDB and S3) behind
    # Lambda's invoke API, and a router configured as the templates configure it on AWS:
    # ROUTER_JOBS_FUNCTION and ROUTER_JOBS_STAGING, no jobs URL
    from batch_job.api import answer
    from batch_job.service import JobService
    from batch_job.settings import JobsSettings
    from spillway_cli.local.lambda_http import wsgi_app
    from tests.integration.test_jobs_support import jobs_settings, new_bucket

    jobs = jobs_settings(aws_env, models_dir)
    for name in ("repository", "job_queue", "job_definition", "table"):
        monkeypatch.setenv(f"JOBS_{name.upper()}", str(getattr(jobs, name)))
    bucket = new_bucket()
    monkeypatch.setenv("JOBS_STAGING", f"s3://{bucket}/staging")
    api = JobService(JobsSettings())
    function = "arn:aws:lambda:us-east-1:123456789012:function:spillway-jobs"
    served = wsgi_app(lambda event, _context: answer(event, api), "/v1/health", "spillway-jobs")
    with running(served) as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL_LAMBDA", url)
        settings = RouterSettings(
            gpu_url=None,
            jobs_function=function,
            jobs_staging=f"s3://{bucket}/staging",
            metrics_log=tmp_path / "metrics.log",
            trust_tenant_hints=True,
        )
        app = create_app(settings)
        body = {"inputs": [{"name": "image", "shape": [1, 8, 8], "datatype": "FP32",
                            "data": [0.5] * 64}]}  # fmt: skip
        # WHEN a batch-mode request of tenant-r arrives, twice with one Idempotency-Key
        headers = {
            "x-spillway-mode": "batch",
            "idempotency-key": "retry-1",
            "x-spillway-tenant": "tenant-r",
        }
        first = Client(app).post("/v2/models/digits/infer", json=body, headers=headers)
        again = Client(app).post("/v2/models/digits/infer", json=body, headers=headers)
        # AND an unknown model is the client's 404, not a backend failure
        unknown = Client(app).post(
            "/v2/models/nope/infer",
            json=body,
            headers={"x-spillway-mode": "batch", "x-spillway-tenant": "tenant-r"},
        )
    # THEN the jobs function started one job over the staged request
    assert first.status_code == 202, first.data
    receipt = json.loads(first.data)
    assert json.loads(again.data)["job_id"] == receipt["job_id"]
    assert first.headers["location"] == f"/v1/jobs/{receipt['job_id']}"
    # AND the job is the router's caller's (the invoke event vouched for its tenant), over
    # what was staged in that tenant's own staging area
    status = JobService(jobs).status(receipt["job_id"], tenant="tenant-r")
    assert status.model == "digits"
    assert status.input.startswith(f"s3://{bucket}/staging/{scope('tenant-r')}/")
    key = status.input.removeprefix(f"s3://{bucket}/") + f"request{STAGED_SUFFIX}"
    staged = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    assert json.loads(read_staged_request(staged)[0]) == body
    assert unknown.status_code == 404
    assert json.loads(unknown.data)["code"] == "model_not_found"


class _SlowLambda(http.server.BaseHTTPRequestHandler):
    """A Lambda invoke endpoint that takes ``delay_s`` to answer (a cold, slow function)."""

    protocol_version = "HTTP/1.1"
    delay_s = 6.0
    release = threading.Event()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.release.wait(self.delay_s)
        answer = b'{"statusCode": 200, "headers": {}, "body": "{}"}'
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
        except OSError:  # the caller gave up, as it should
            pass

    def log_message(self, format: str, *args: Any) -> None:
        return None


def test_a_cpu_invoke_waits_no_longer_than_the_request_deadline(
    aws_env: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # GIVEN a CPU function that answers only after 6 s, and a router whose requests have a
    # 1 s deadline (the Lambda read timeout left at its 30 s default)
    import time

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowLambda)
    _SlowLambda.release.clear()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL_LAMBDA", f"http://127.0.0.1:{server.server_port}")
    try:
        settings = RouterSettings(
            gpu_url=None,
            cpu_function="spillway-cpu-infer",
            default_deadline_ms=1000,
            metrics_log=tmp_path / "metrics.log",
        )
        app = create_app(settings)
        # WHEN a request is routed to it
        started = time.monotonic()
        response = Client(app).post("/v2/models/digits/infer", json=BODY)
        waited = time.monotonic() - started
    finally:
        _SlowLambda.release.set()
        server.shutdown()
        server.server_close()
    # THEN the router gave up within its deadline (generous bound: well under the 6 s the
    # function takes, where a fixed 30 s read timeout would have waited for it)
    assert response.status_code == 504, response.data
    assert json.loads(response.data)["code"] == "deadline_exceeded"
    assert waited < 4.0
