"""The jobs API as one event adapter: ``POST /v1/jobs``, ``GET /v1/jobs/{id}`` and the
nightly scheduled event.

``answer`` takes what reaches the jobs function, an API Gateway event (REST v1 proxy or
HTTP API v2) or EventBridge's scheduled event, and returns what the function returns: the
proxy response, or the scheduled run's receipt. The Lambda (``functions.jobs.handler``)
and ``spillway serve jobs`` are its two transports.

A request's tenant is found with ``spillway.tenancy.identity`` (the router's rule: an
authorizer's ``tenant``, else the API key id or IAM principal through
``JOBS_IDENTITY_TENANTS``; 401 ``unauthenticated`` when nothing vouched for the caller);
``batch_job.service`` does the work for that tenant, and errors get the core's one
mapping (``spillway.protocol.replies.guarded``; ``INTERNAL_ERROR`` for anything unexpected).

The router's batch mode invokes the function directly (``lambda:Invoke``, granted to the
router's role alone) with a REST proxy event whose ``requestContext.authorizer`` carries
the router's caller's tenant: ``requestContext`` is written by API Gateway or by that
trusted invoker, never by a client.
A request's ``traceparent``/``tracestate`` (the router's attempt, or a client's) is
continued by a ``spillway.jobs`` span, and a job it submits carries it on to the Batch
job (``batch_job.service``). A tiny router instead of a web framework keeps the cold
start small; nothing here imports onnxruntime.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
from collections.abc import Mapping
from typing import Any, Protocol

from batch_job.service import JobService
from batch_job.settings import JobsSettings
from spillway import tracing
from spillway.protocol.errors import InvalidInputError, PayloadTooLargeError, RouteNotFoundError
from spillway.protocol.messages import DirectInvokeAnswer, JobRequest, JobStatus, SubmitReceipt
from spillway.protocol.replies import Reply, guarded, json_reply
from spillway.protocol.wire import allow, strip_stage
from spillway.state.table import open_state_store
from spillway.tenancy.directory import LiveConfigCache, TenantDirectory, apply_log_level
from spillway.tenancy.identity import Authenticator, event_header

log = logging.getLogger("spillway.jobs.api")

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


def authenticator(settings: JobsSettings, live: LiveConfigCache | None = None) -> Authenticator:
    """Who may call: the live configuration's identity map (``JOBS_CONFIG_TABLE``, over
    ``JOBS_IDENTITY_TENANTS``) and ``JOBS_TRUST_TENANT_HINTS``."""
    return Authenticator(
        TenantDirectory(live or live_config(settings)), settings.trust_tenant_hints
    )


def live_config(settings: JobsSettings) -> LiveConfigCache:
    """The live configuration the settings name; its log level is set on ``spillway``."""
    return LiveConfigCache(
        open_state_store(settings.config_table),
        ttl_s=settings.config_ttl_s,
        base=settings.identity_tenants,
        listeners=[apply_log_level],
    )


def is_scheduled(event: Mapping[str, Any]) -> bool:
    """Whether the event is EventBridge's scheduled event (the nightly re-scoring)."""
    return event.get("source") == "aws.events" and event.get("detail-type") == "Scheduled Event"


def answer(
    event: Mapping[str, Any], jobs: JobService, callers: Authenticator | None = None
) -> dict[str, Any]:
    """The answer to one event of the jobs function: the scheduled run's receipt, or the
    API Gateway proxy response (callers from ``jobs.settings``)."""
    if is_scheduled(event):
        # Errors propagate: the invocation fails and EventBridge retries; the day's
        # idempotency key makes a retry return the job a first attempt started.
        receipt = jobs.scheduled(event)
        log.info("scheduled run", extra={"event_id": event.get("id"), "job": receipt.job.job_id})
        return receipt.model_dump()
    return dispatch(event, jobs, callers or authenticator(jobs.settings))


def dispatch(
    event: Mapping[str, Any], jobs: Jobs, callers: Authenticator | None = None
) -> dict[str, Any]:
    """Route an API Gateway event for the caller ``callers`` finds (default: mapped
    identities none, hints refused); every error becomes ``{"error", "code"}``."""
    context = event.get("requestContext") or {}
    method = str(event.get("httpMethod") or context.get("http", {}).get("method", "")).upper()
    path = strip_stage(str(event.get("path") or event.get("rawPath") or ""), event)
    who = callers or Authenticator()
    trace = {name: event_header(event, name) for name in tracing.CARRIER_KEYS}
    attributes = {"http.request.method": method[:16], "spillway.operation": "jobs"}
    with (
        tracing.carry(trace),
        tracing.span("spillway.jobs", kind="server", attributes=attributes) as span,
    ):
        reply = guarded(
            log, lambda: _route(method, path, event, jobs, who), method=method, path=path[:100]
        )
        span.set("http.response.status_code", reply.status)
    # API Gateway's proxy-response shape (header names lower-case).
    return DirectInvokeAnswer.of(reply).dump()


def _route(
    method: str, path: str, event: Mapping[str, Any], jobs: Jobs, callers: Authenticator
) -> Reply:
    if path.rstrip("/") == "/v1/jobs":
        allow(method, "/v1/jobs", "POST")
        tenant = callers.tenant(event)
        request = JobRequest.parse(_body(event))
        receipt = jobs.submit(request, event_header(event, "idempotency-key"), tenant=tenant)
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
