"""What one attempt sends a backend: the request as a ``BackendRequest``, and the
readiness probe a circuit asks.

An infer body carries the attempt's timeout (the Open Inference Protocol ``timeout``
parameter) and the request's priority; the headers carry only what the backend reads,
and the request's trace (``traceparent``/``tracestate`` of the attempt's span), so the
backend's spans join the router's trace.
"""

from __future__ import annotations

from collections.abc import Callable

from spillway import tracing
from spillway.policy.backend import Backend, BackendError, BackendRequest
from spillway.policy.facts import Request, with_timeout
from spillway.protocol.errors import SpillwayError
from spillway.protocol.framing import BINARY_CONTENT_TYPE, HEADER_LENGTH, JSON_CONTENT_TYPE

# The backend is told 90% of the attempt's time so that its own 504 arrives before ours.
BACKEND_TIMEOUT_SHARE = 0.9


READY_PATH = "/v2/health/ready"


def readiness_probe(backend: Backend, timeout_s: float) -> Callable[[], bool]:
    """``GET /v2/health/ready`` on the backend within ``timeout_s``: whether it answers 200
    (what a circuit opened by refused connections asks before its wait is over)."""
    request = BackendRequest(method="GET", path=READY_PATH, operation="ready")

    def probe() -> bool:
        try:
            return backend.send(request, timeout_s).status == 200
        except (BackendError, SpillwayError):
            return False

    return probe


def backend_request(request: Request, backend: str, timeout_s: float) -> BackendRequest:
    """What one attempt sends: the canonical path, the allowed headers, and an infer body
    carrying the attempt's timeout (a batch job gets the body as the client sent it, and
    the client's ``Idempotency-Key``)."""
    call, target = request.call, request.target
    body, length = call.body, request.header_length
    if request.header is None:
        body, length = b"", None
    elif backend != "batch":
        timeout_us = max(1, int(timeout_s * BACKEND_TIMEOUT_SHARE * 1e6))
        body, length = with_timeout(
            call.body, request.header, length, timeout_us, request.facts.priority
        )
    headers: dict[str, str] = {}
    if target.operation == "infer":
        headers["content-type"] = JSON_CONTENT_TYPE if length is None else BINARY_CONTENT_TYPE
    if length is not None:
        headers[HEADER_LENGTH] = str(length)
    if backend == "batch" and request.idempotency_key is not None:
        headers["idempotency-key"] = request.idempotency_key
    tracing.inject(headers)
    return BackendRequest(
        method=call.method,
        path=target.path,
        operation=target.operation,
        model=target.model,
        version=target.version,
        headers=headers,
        body=body,
        request_id=call.request_id,
        tenant=request.facts.tenant,
    )
