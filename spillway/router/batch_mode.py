"""Batch mode: hand an infer request to the offline jobs API and answer 202 with a job id.

Running jobs belongs to the batch job and the jobs function; the router only submits.
``BatchSubmitter`` is the seam. The default, ``JobsApiSubmitter``, speaks the jobs API
(``POST /v1/jobs``), which reads its input from S3: it stages the infer body as the client
sent it (JSON or binary; ``spillway.protocol.messages.stage_request``, which the batch job reads
back with the core codec) under ``ROUTER_JOBS_STAGING`` and submits::

    PUT  s3://<staging>/<scope>/<key>/in/request.v2req
    POST /v1/jobs            Idempotency-Key: <key>   (jobs function, or ROUTER_JOBS_URL)
         {"model": "digits", "version": null,
          "input": "s3://<staging>/<scope>/<key>/in/",
          "output": "s3://<staging>/<scope>/<key>/out/"}
    -> 202 {"job": {"job_id": "...", ...}, "replayed": false}, Location: /v1/jobs/<id>

``"version"`` is the one the request pinned or, for a model with a canary record, the one
the router chose from that record (as for a synchronous request): a job never runs on a
worker's default, which may be a version the record rolled back.

``<scope>`` is the caller's key segment (``spillway.state.table.scope``), so what is
staged for a tenant lies in its own area of the staging prefix (``staging_area``), as
every tenant's place does in every store (``spillway.tenancy.areas``); the job request carries
the caller's tenant. The router makes ``<key>``; no client names it. Without an
``Idempotency-Key`` header it is random, so two requests never share a staging place or
a job (whatever their ``x-request-id``). With one, it is a hash of the caller's scope,
the client's key and the body's hash: the same caller retrying the same payload replays
the same job, anyone else or any other payload gets a key of its own (and the jobs API
answers 409 to a key that comes back with a different job, e.g. another model). Without
a jobs function (or URL) and a staging prefix, batch-mode requests get 400
``mode_unavailable`` with a message that says so. With a state table, what a tenant
stages is counted (``staging_quota``): at most ``ASYNC_TENANT_MAX_BATCH_STAGED`` requests
and ``ASYNC_TENANT_MAX_STAGED_BYTES`` bytes within ``ASYNC_STAGING_WINDOW_S``; past
either, 429 ``quota_exceeded`` with Retry-After, before anything is staged. On AWS the
router invokes the jobs function (``ROUTER_JOBS_FUNCTION``, ``lambda:Invoke`` under its
own role) with the same ``POST /v1/jobs`` as a REST proxy event; no unsigned HTTP call
leaves the router. The ``POST`` carries the attempt's ``traceparent``/``tracestate``: the
jobs API passes them to the Batch job (``batch_job.service``), whose spans join the
request's trace.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from spillway import tracing
from spillway.async_inference.settings import AsyncSettings
from spillway.policy.backend import Backend, BackendError, BackendRequest, BackendResponse
from spillway.protocol.errors import (
    InvalidInputError,
    ModeUnavailableError,
    PayloadTooLargeError,
    UnavailableError,
)
from spillway.protocol.framing import HEADER_LENGTH, JSON_CONTENT_TYPE, parse_header_length
from spillway.protocol.messages import (
    STAGED_SUFFIX,
    JobRequest,
    SubmitReceipt,
    parse_message,
    stage_request,
)
from spillway.protocol.s3urls import parse_s3_url
from spillway.state.quotas import QuotaLedger, QuotaLimits
from spillway.state.table import StateStore, scope
from spillway.tenancy.areas import area

STAGED_NAME = f"request{STAGED_SUFFIX}"
# What the jobs API takes as an idempotency key, and so what a client may send.
_CLIENT_KEY = re.compile(r"^[!-~]{1,128}$")


@dataclass(frozen=True)
class BatchReceipt:
    """A submitted job: its id and, when the jobs API gives one, where to poll it."""

    job_id: str
    status_url: str | None = None


class BatchSubmitter(Protocol):
    """Submits one infer request as an offline job."""

    def submit(self, request: BackendRequest, timeout_s: float) -> BatchReceipt:
        """The job's receipt; raises ``SpillwayError`` or ``BackendError`` on failure."""
        ...


def staging_key(tenant: str | None, client_key: str | None, body: bytes) -> tuple[str, str]:
    """The jobs API idempotency key and the staging place of one batch request (hex).

    Without a client ``Idempotency-Key`` both are random. With one, the key is scoped to
    the caller (its tenant) and the place to the key and a hash of the payload: a replay
    of the same payload finds the same job, and the same key with another payload stages
    elsewhere (never over the first) and gets the jobs API's 409."""
    if client_key is None:
        key = uuid.uuid4().hex
        return key, key
    caller = "\0".join((scope(tenant), client_key))
    key = hashlib.sha256(caller.encode()).hexdigest()
    return key, f"{key}/{hashlib.sha256(body).hexdigest()[:32]}"


def staging_area(staging: str, tenant: str | None) -> str:
    """The caller's own area of the staging prefix (``<staging>/<scope>/``): everything
    the router stages for it lies there, and only there."""
    return area(staging, tenant)


@dataclass(frozen=True)
class StagingQuota:
    """What one tenant may stage for batch mode: a ledger of its staged requests, each
    counted for ``window_s`` after it was staged."""

    ledger: QuotaLedger
    window_s: float
    clock: Callable[[], float] = time.time

    def admit(self, tenant: str | None, place: str, size: int) -> None:
        """Count a request about to be staged (429 past the quota, 413 if it never fits)."""
        if size > self.ledger.limits.bytes:
            raise PayloadTooLargeError(
                f"the request ({size} bytes staged) exceeds a tenant's staging quota "
                f"({self.ledger.limits.bytes} bytes)"
            )
        now = self.clock()
        # Nothing tells the router when a job is done with its input: an entry counts for
        # the window, then it is gone for the quota.
        self.ledger.charge(scope(tenant), place, size, now, now + self.window_s, _gone)


def staging_quota(settings: AsyncSettings, state: StateStore) -> StagingQuota:
    """The per-tenant batch staging quota ``ASYNC_*`` sets, counted in ``state``."""
    limits = QuotaLimits(settings.tenant_max_batch_staged, settings.tenant_max_staged_bytes)
    ledger = QuotaLedger(state, "staging", limits, "batch requests staged")
    return StagingQuota(ledger, settings.staging_window_s)


def _gone(name: str, now: float) -> float | None:
    return None


class JobsApiSubmitter:
    """Stages the request in S3 and submits a job over it to the jobs API (``api``: the
    jobs function through ``lambda:Invoke`` on AWS, or an ``HttpBackend`` on
    ``ROUTER_JOBS_URL`` locally)."""

    def __init__(
        self,
        api: Backend,
        staging: str,
        *,
        s3: Any = None,
        quota: StagingQuota | None = None,
    ) -> None:
        self._api = api
        self._staging = parse_s3_url(staging)
        self._s3 = s3
        self._lock = threading.Lock()
        self.quota = quota

    def _client(self) -> Any:
        with self._lock:
            if self._s3 is None:
                from spillway.aws.clients import client

                # No retry mode named: botocore's default (or AWS_RETRY_MODE), as before.
                self._s3 = client(
                    "s3", connect_timeout=2, read_timeout=10, max_attempts=2, retry_mode=None
                )
            return self._s3

    def submit(self, request: BackendRequest, timeout_s: float) -> BatchReceipt:
        """Stage the request, then POST the job; its receipt, or ``UnavailableError``."""
        if request.model is None:
            raise InvalidInputError("batch mode needs a model")
        client_key = request.headers.get("idempotency-key")
        if client_key is not None and not _CLIENT_KEY.fullmatch(client_key):
            raise InvalidInputError("Idempotency-Key must be 1-128 visible ASCII characters")
        key, place = staging_key(request.tenant, client_key, request.body)
        length = parse_header_length(request.headers.get(HEADER_LENGTH))
        staged = stage_request(request.body, length)
        if self.quota is not None:
            self.quota.admit(request.tenant, place, len(staged))
        own = parse_s3_url(staging_area(self._staging.url, request.tenant))
        self._stage(own.key(place, "in", STAGED_NAME), staged)
        job = JobRequest(
            model=request.model,
            version=int(request.version) if request.version else None,
            input=f"s3://{own.bucket}/{own.key(place, 'in')}/",
            output=f"s3://{own.bucket}/{own.key(place, 'out')}/",
        )
        headers = {"content-type": JSON_CONTENT_TYPE, "idempotency-key": key}
        # The attempt's trace goes on to the jobs API, and from it into the Batch job.
        headers.update(tracing.carrier_of(request.headers))
        post = BackendRequest(
            "POST",
            "",
            "submit",
            headers=headers,
            body=job.model_dump_json().encode(),
            request_id=request.request_id,
            tenant=request.tenant,
        )
        return _receipt(self._api.send(post, timeout_s))

    def _stage(self, key: str, data: bytes) -> None:
        from spillway.aws.errors import aws_errors

        try:
            self._client().put_object(Bucket=self._staging.bucket, Key=key, Body=data)
        except aws_errors() as exc:
            raise UnavailableError(
                f"the batch request could not be staged ({type(exc).__name__})"
            ) from exc


class JobRefused(Exception):
    """The jobs API refused the submission for a reason of the request's own (4xx)."""

    def __init__(self, answer: BackendResponse) -> None:
        super().__init__(f"the jobs API answered {answer.status}")
        self.answer = answer


def _receipt(answer: BackendResponse) -> BatchReceipt:
    if 400 <= answer.status < 500 and answer.status != 429:
        raise JobRefused(answer)
    if answer.status not in (200, 201, 202):
        raise UnavailableError(f"the jobs API answered {answer.status}")
    try:
        receipt = parse_message(SubmitReceipt, answer.body, "jobs API answer")
    except InvalidInputError:  # the jobs API's fault, not the client's
        raise UnavailableError("the jobs API sent an answer without a job") from None
    return BatchReceipt(receipt.job.job_id, answer.headers.get("location"))


class BatchBackend:
    """The ``batch`` backend: submit, then answer 202 with the job id."""

    def __init__(self, submitter: BatchSubmitter | None) -> None:
        self.name = "batch"
        self._submitter = submitter

    def send(self, request: BackendRequest, timeout_s: float) -> BackendResponse:
        """Submit the request as a job; only infer requests can become jobs."""
        if self._submitter is None:
            # The deployment does not offer the mode the request asked for: a 4xx the
            # client can act on, not a server failure.
            raise ModeUnavailableError(
                "batch mode is not offered by this deployment (the operator sets "
                "ROUTER_JOBS_STAGING and ROUTER_JOBS_FUNCTION or ROUTER_JOBS_URL)"
            )
        if request.operation != "infer":
            raise ModeUnavailableError("only infer requests can run in batch mode")
        started = time.monotonic()
        try:
            receipt = self._submitter.submit(request, timeout_s)
        except JobRefused as refused:  # e.g. an unknown model: the client's to fix
            return refused.answer
        except BackendError as exc:
            raise UnavailableError(f"the jobs API could not be reached ({exc.kind})") from exc
        body: dict[str, str] = {"job_id": receipt.job_id, "status": "submitted"}
        headers = {"content-type": "application/json"}
        if receipt.status_url:
            body["status_url"] = receipt.status_url
            headers["location"] = receipt.status_url
        return BackendResponse(202, headers, json.dumps(body).encode(), time.monotonic() - started)
