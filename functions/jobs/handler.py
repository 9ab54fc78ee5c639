"""The jobs Lambda: ``POST /v1/jobs``, ``GET /v1/jobs/{id}`` and the scheduled event.

A thin adapter: it parses the API Gateway (REST v1 proxy, or HTTP API v2) or EventBridge
event, finds the caller's tenant (``spillway.tenancy.identity``, the router's rule: an
authorizer's ``tenant``, else the API key id or IAM principal through
``JOBS_IDENTITY_TENANTS``; 401 ``unauthenticated`` when nothing vouched for the caller),
calls ``batch_job.service`` for that tenant and maps errors with the core's one mapping
(``spillway.protocol.wire.error_reply``; ``INTERNAL_ERROR`` for anything unexpected).

The router's batch mode invokes this function directly (``lambda:Invoke``, granted to
the router's role alone) with a REST proxy event whose ``requestContext.authorizer``
carries the router's caller's tenant: ``requestContext`` is written by API Gateway or by
that trusted invoker, never by a client.
A tiny router instead of a web framework keeps the cold start small; nothing here
imports onnxruntime.
"""

from __future__ import annotations

import base64
import binascii
import functools
import logging
import re
from collections.abc import Mapping
from typing import Any, Protocol

from batch_job.service import JobService
from batch_job.settings import JobsSettings
from spillway.protocol.errors import (
    InvalidInputError,
    PayloadTooLargeError,
    RouteNotFoundError,
    SpillwayError,
)
from spillway.protocol.messages import DirectInvokeAnswer, JobRequest, JobStatus, SubmitReceipt
from spillway.protocol.wire import (
    INTERNAL_ERROR,
    Reply,
    allow,
    error_reply,
    json_reply,
    strip_stage,
)
from spillway.tenancy.identity import Authenticator

log = logging.getLogger("spillway.jobs.api")
logging.getLogger("spillway").setLevel(logging.INFO)

MAX_BODY_BYTES = 64 * 1024
_JOB_PATH = re.compile(r"^/v1/jobs/([^/]{1,64})/?$")


class Jobs(Protocol):
    """What the routes need: ``JobService``, or a fake in unit tests."""

    def submit(
        self, request: JobRequest, key: str | None = None, *, tenant: str | None
    ) -> SubmitReceipt:
        """Start (or replay) the tenant's job."""

    def status(self, job_id: str, *, tenant: str | None) -> JobStatus:
        """The tenant's job's combined status."""


@functools.cache
def service() -> JobService:
    """The service, built once per execution environment (on the first event)."""
    return JobService(JobsSettings())


def authenticator(settings: JobsSettings) -> Authenticator:
    """Who may call, from the settings (``JOBS_IDENTITY_TENANTS``, ``_TRUST_TENANT_HINTS``)."""
    return Authenticator(settings.identity_tenants, settings.trust_tenant_hints)


def handler(event: Mapping[str, Any], context: object) -> dict[str, Any]:
    """Lambda entry point."""
    if event.get("source") == "aws.events" and event.get("detail-type") == "Scheduled Event":
        # Errors propagate: the invocation fails and EventBridge retries; the day's
        # idempotency key makes a retry return the job a first attempt started.
        result = service().scheduled(event)
        log.info("scheduled run %s: job %s", event.get("id"), result.job.job_id)
        return result.model_dump()
    jobs = service()
    return dispatch(event, jobs, authenticator(jobs.settings))


def dispatch(
    event: Mapping[str, Any], jobs: Jobs, callers: Authenticator | None = None
) -> dict[str, Any]:
    """Route an API Gateway event for the caller ``callers`` finds (default: mapped
    identities none, hints refused); every error becomes ``{"error", "code"}``."""
    context = event.get("requestContext") or {}
    method = str(event.get("httpMethod") or context.get("http", {}).get("method", "")).upper()
    path = strip_stage(str(event.get("path") or event.get("rawPath") or ""), event)
    try:
        reply = _route(method, path, event, jobs, callers or Authenticator())
    except SpillwayError as exc:
        log.warning("%s %s -> %d %s: %s", method, path[:100], exc.status, exc.code, exc.message)
        reply = error_reply(exc)
    except Exception:
        log.exception("unhandled error in %s %s", method, path[:100])
        reply = INTERNAL_ERROR
    # API Gateway's proxy-response shape (header names lower-case).
    return DirectInvokeAnswer.of(reply).dump()


def _route(
    method: str, path: str, event: Mapping[str, Any], jobs: Jobs, callers: Authenticator
) -> Reply:
    if path.rstrip("/") == "/v1/jobs":
        allow(method, "/v1/jobs", "POST")
        tenant = callers.tenant(event)
        request = JobRequest.parse(_body(event))
        receipt = jobs.submit(request, _header(event, "idempotency-key"), tenant=tenant)
        headers = [("location", f"/v1/jobs/{receipt.job.job_id}")]
        if receipt.replayed:
            headers.append(("idempotent-replayed", "true"))
        return json_reply(202, receipt.model_dump(), headers)
    match = _JOB_PATH.match(path)
    if match:
        allow(method, "/v1/jobs/{id}", "GET")
        tenant = callers.tenant(event)
        return json_reply(200, jobs.status(match.group(1), tenant=tenant).model_dump())
    raise RouteNotFoundError(f"no route for {path[:100]!r}")


def _body(event: Mapping[str, Any]) -> bytes:
    raw = event.get("body") or ""
    if len(raw) > MAX_BODY_BYTES * 4 // 3 + 4:
        raise PayloadTooLargeError(f"the body exceeds {MAX_BODY_BYTES} bytes")
    if event.get("isBase64Encoded"):
        try:
            data = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidInputError("the body is not valid base64") from None
    else:
        data = str(raw).encode()
    if len(data) > MAX_BODY_BYTES:
        raise PayloadTooLargeError(f"the body exceeds {MAX_BODY_BYTES} bytes")
    return data


def _header(event: Mapping[str, Any], name: str) -> str | None:
    for key, value in (event.get("headers") or {}).items():
        if key.lower() == name and value:
            return str(value)
    return None
