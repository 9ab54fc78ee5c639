"""Submitting and tracking jobs: one code path for the jobs Lambda, the CLI and the tests.

``submit`` validates the request, claims the job record (idempotent on the key), freezes
the shard plan at the output prefix, submits the AWS Batch array job (queue, definition,
retry strategy and timeout from settings; the current trace as its ``TRACEPARENT`` and
``TRACESTATE``) and records it. ``status`` combines Batch's
state with the shard markers. Nothing here imports onnxruntime.

Every job belongs to a tenant (its record's ``owner``: the tenant's scope). A tenant's
job reads and writes only inside the tenant's areas (``spillway.tenancy.areas``: its folder
under ``JOBS_TENANTS_ROOT`` and under the router's staging) and writes to a folder the
server names, ``<output>/<job id>/``; its idempotency keys are its own; another tenant
asking for it gets the 404 of a job that does not exist. Jobs the operator configures
(the nightly schedule, ``spillway jobs submit`` without ``--tenant``) belong to
``JOBS_OPERATOR_TENANT`` and write where the operator said.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import time
import uuid
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Any

from batch_job.errors import EXIT_NO_RETRY
from batch_job.jobstore import SUBMITTED, SUBMITTING, JobStore
from batch_job.manifest import read_markers, totals
from batch_job.plan import (
    Locations,
    OutputLayout,
    Plan,
    RunSpec,
    check_output_keys,
    ensure_plan,
)
from batch_job.settings import JobsSettings
from batch_job.storage import open_location
from spillway import tracing
from spillway.aws.clients import aws_client
from spillway.models.repository import open_repository
from spillway.protocol.errors import (
    InvalidInputError,
    JobConflictError,
    JobNotConfiguredError,
    JobNotFoundError,
)
from spillway.protocol.messages import JobRequest, JobStatus, JobView, SubmitReceipt
from spillway.protocol.names import validate_model_name
from spillway.state.table import scope
from spillway.tenancy.areas import area, require_inside

JOB_ID_NAMESPACE = uuid.UUID("6f1d7c1e-3b0a-5c4e-9a57-5b1f0e2d8c41")
"""Job ids of keyed submissions are ``uuid5(f"{owner scope}\\0{key}")`` in this namespace:
one key, one job id, per tenant."""
_KEY = re.compile(r"^[\x21-\x7e]{1,128}$")


class JobService:
    """Submission and status over AWS Batch, DynamoDB and S3."""

    def __init__(self, settings: JobsSettings, client: Callable[[str], Any] | None = None) -> None:
        self.settings = settings
        self._client = client or (lambda service: aws_client(service, settings.region))

    @cached_property
    def batch(self) -> Any:
        return self._client("batch")

    @cached_property
    def s3(self) -> Any:
        return self._client("s3")

    @cached_property
    def store(self) -> JobStore:
        return JobStore(self.settings.table, self._client("dynamodb"))

    def areas(self, tenant: str | None) -> list[str]:
        """The folders a tenant's jobs may read and write: its area under the tenants'
        root and under the router's staging (those configured)."""
        roots = (self.settings.tenants_root, self.settings.staging)
        return [area(root, tenant) for root in roots if root]

    def submit(
        self, request: JobRequest, key: str | None = None, *, tenant: str | None
    ) -> SubmitReceipt:
        """Start ``tenant``'s job once per idempotency key (the tenant's own keys); later
        calls with it return that job. Its input and output must lie in the tenant's
        areas (``OutsideTenantAreaError``); it writes to ``<output>/<job id>/``."""
        validate_model_name(request.model)
        mine = self.areas(tenant)
        where = request.model_copy(
            update={
                "input": require_inside(request.input, mine, "input"),
                "output": require_inside(request.output, mine, "output"),
            }
        )
        return self._submit(where, key, scope(tenant), per_job_output=True)

    def submit_as_operator(self, request: JobRequest, key: str | None = None) -> SubmitReceipt:
        """A job the operator configured (the schedule, the CLI): owned by the operator
        tenant, its locations as given (the operator's, not a request's)."""
        validate_model_name(request.model)
        return self._submit(request, key, scope(self.settings.operator_tenant))

    def _submit(
        self, request: JobRequest, key: str | None, owner: str, *, per_job_output: bool = False
    ) -> SubmitReceipt:
        if key is not None and not _KEY.fullmatch(key):
            raise InvalidInputError("the idempotency key must be 1-128 printable characters")
        # One key, one job id, per owner: another tenant's key names another job.
        job_id = str(uuid.uuid5(JOB_ID_NAMESPACE, f"{owner}\0{key}") if key else uuid.uuid4())
        digest = hashlib.sha256(request.model_dump_json().encode()).hexdigest()
        if per_job_output:
            request = request.model_copy(update={"output": f"{request.output}{job_id}/"})
        check_output_keys(request.output)
        now = time.time()
        record = {
            **request.model_dump(exclude={"version"}),
            "job_id": job_id,
            "owner": owner,
            "idempotency_key": key,
            "request_hash": digest,
            "requested_version": request.version,
            "state": SUBMITTING,
            "created_at": dt.datetime.fromtimestamp(now, dt.UTC).isoformat(timespec="seconds"),
            "lease_until": now + self.settings.submit_lease_s,
            "expires_at": int(now) + self.settings.record_ttl_days * 86_400,
        }
        if not self.store.create(record):
            existing = self._claim_existing(job_id, digest, now)
            if existing is not None:
                return SubmitReceipt(job=_view(existing), replayed=True)
        try:
            plan = self._plan(request)
            array_size = min(request.shards or len(plan.shards), len(plan.shards))
            array_size = min(array_size, self.settings.max_array_size)
            submitted = self._submit_batch(job_id, owner, request, plan, array_size)
        except BaseException:
            self.store.release(job_id)
            raise
        fields = {
            "batch_job_id": submitted["jobId"],
            "batch_job_name": submitted["jobName"],
            "model_version": plan.model_version,
            "shards_total": len(plan.shards),
            "array_size": array_size,
        }
        return SubmitReceipt(job=_view(self.store.mark_submitted(job_id, fields)), replayed=False)

    def _claim_existing(self, job_id: str, digest: str, now: float) -> dict[str, Any] | None:
        """The existing record to replay, or ``None`` when we took over a stalled one."""
        existing = self.store.get(job_id)
        if existing is None:
            raise JobConflictError("a submission with this key is being cancelled; retry")
        if existing["request_hash"] != digest:
            raise JobConflictError("this idempotency key was used for a different request")
        stalled = existing["state"] == SUBMITTING and existing["lease_until"] < now
        lease = now + self.settings.submit_lease_s
        if stalled and self.store.take_over(job_id, existing["lease_until"], lease):
            return None
        return existing

    def _plan(self, request: JobRequest) -> Plan:
        spec = RunSpec(request.model, request.input, request.output, request.version)
        repo_client = self.s3 if self.settings.repository.startswith("s3://") else None
        repository = open_repository(self.settings.repository, client=repo_client)
        return ensure_plan(spec, repository, Locations.of(spec, client=self.s3))

    def _submit_batch(
        self, job_id: str, owner: str, request: JobRequest, plan: Plan, array_size: int
    ) -> dict[str, Any]:
        s = self.settings
        command = ["spillway", "jobs", "run", "--repository", s.repository]
        command += ["--model", plan.model, "--version", str(plan.model_version)]
        command += ["--input", request.input, "--output", request.output]
        if request.batch_size:
            command += ["--batch-size", str(request.batch_size)]
        environment = [
            {"name": "JOBS_ARRAY_SIZE", "value": str(array_size)},
            {"name": "JOBS_TENANT_SCOPE", "value": owner},
        ]
        # The submitting request's trace, as the job's TRACEPARENT/TRACESTATE (container
        # overrides' environment: https://docs.aws.amazon.com/batch/latest/APIReference/API_ContainerOverrides.html).
        environment += [
            {"name": name.upper(), "value": value} for name, value in tracing.outgoing().items()
        ]
        kwargs: dict[str, Any] = {
            "jobName": f"spillway-{re.sub(r'[^A-Za-z0-9_-]', '-', plan.model)}-{job_id[:8]}",
            "jobQueue": s.job_queue,
            "jobDefinition": s.job_definition,
            "containerOverrides": {"command": command, "environment": environment},
            "retryStrategy": {
                "attempts": s.retry_attempts,
                "evaluateOnExit": [{"onExitCode": str(EXIT_NO_RETRY), "action": "EXIT"}],
            },
            "timeout": {"attemptDurationSeconds": s.attempt_timeout_s},
            "tags": {"spillway:job-id": job_id},
            "propagateTags": True,
        }
        if array_size > 1:  # Batch arrays have 2 to 10,000 children
            kwargs["arrayProperties"] = {"size": array_size}
        result: dict[str, Any] = self.batch.submit_job(**kwargs)
        return result

    def status(self, job_id: str, *, tenant: str | None) -> JobStatus:
        """``tenant``'s job: its record, Batch's view of it and its committed shards; a
        job of another tenant is ``JobNotFoundError`` like one that does not exist."""
        return self._status(job_id, scope(tenant))

    def status_as_operator(self, job_id: str) -> JobStatus:
        """Any tenant's job (``spillway jobs status`` with the operator's credentials)."""
        return self._status(job_id, None)

    def _status(self, job_id: str, owner: str | None) -> JobStatus:
        try:
            uuid.UUID(job_id)
        except ValueError:
            raise InvalidInputError("a job id is a UUID") from None
        record = self.store.get(job_id)
        if record is None or (owner is not None and record.get("owner") != owner):
            raise JobNotFoundError(f"no job {job_id}")
        view = _view(record).model_dump()
        batch_status, summary = None, {}
        if record.get("batch_job_id"):
            jobs = self.batch.describe_jobs(jobs=[record["batch_job_id"]])["jobs"]
            if jobs:
                batch_status = jobs[0]["status"]
                summary = jobs[0].get("arrayProperties", {}).get("statusSummary", {})
        store, prefix = open_location(record["output"], client=self.s3)
        layout = OutputLayout(prefix)
        manifests = read_markers(store, layout, self.settings.status_read_concurrency)
        done = totals(manifests)
        view["state"] = combined_state(record, batch_status, done.shards_done)
        return JobStatus(
            **view, batch_status=batch_status, array_status=summary, **done.model_dump()
        )

    def scheduled(self, event: Mapping[str, Any]) -> SubmitReceipt:
        """The nightly re-scoring for an EventBridge scheduled event: one job per rule and
        day, however often the event is delivered."""
        s = self.settings
        if not (s.schedule_model and s.schedule_input and s.schedule_output):
            raise JobNotConfiguredError("JOBS_SCHEDULE_MODEL, _INPUT and _OUTPUT must be set")
        try:
            when = dt.datetime.fromisoformat(str(event.get("time", "")).replace("Z", "+00:00"))
        except ValueError:
            raise InvalidInputError("the scheduled event has no valid 'time'") from None
        resources = event.get("resources") or ["rule/manual"]
        rule = str(resources[0]).rsplit("/", 1)[-1][:64]
        day = when.date().isoformat()
        request = JobRequest(
            model=s.schedule_model,
            version=s.schedule_version,
            input=s.schedule_input,
            output=f"{s.schedule_output.rstrip('/')}/{day}/",
            shards=s.schedule_shards,
        )
        return self.submit_as_operator(request, key=f"schedule:{rule}:{day}")


def _view(record: Mapping[str, Any]) -> JobView:
    return JobView(
        job_id=record["job_id"],
        state=record["state"],
        model=record["model"],
        model_version=record.get("model_version") or record.get("requested_version"),
        input=record["input"],
        output=record["output"],
        shards_total=record.get("shards_total"),
        array_size=record.get("array_size"),
        batch_job_id=record.get("batch_job_id"),
        created_at=record["created_at"],
    )


def combined_state(record: Mapping[str, Any], batch_status: str | None, shards_done: int) -> str:
    """One state for users: the shards decide success, Batch decides failure."""
    total = record.get("shards_total")
    if record["state"] != SUBMITTED:
        return str(record["state"])
    if total is not None and shards_done >= int(total):
        return "SUCCEEDED"
    if batch_status == "FAILED":
        return "FAILED"
    if batch_status == "SUCCEEDED":
        return "INCOMPLETE"  # Batch says done but markers are missing (e.g. deleted)
    return batch_status or SUBMITTED
