"""Backends reached with ``lambda:Invoke`` (RequestResponse): the CPU fallback and the jobs
function.

The CPU fallback gets its direct-invoke event (``spillway.protocol.messages.DirectInvokeEvent``);
the jobs function gets the API Gateway REST (v1) proxy event its handler already reads,
so a batch-mode submission needs no HTTP endpoint, no unsigned call and no second
schema. Both answer in API Gateway's proxy-response shape (``DirectInvokeAnswer``).

Each call waits no longer than what is left of its request's deadline: botocore takes a
read timeout per client, not per call, so clients are kept per step of a ladder of read
timeouts (``read_timeout_step``), and a call uses the largest step that fits its budget.

boto3 honours ``AWS_ENDPOINT_URL_LAMBDA`` / ``AWS_ENDPOINT_URL``, so locally the same code
targets any Lambda-invoke-compatible endpoint (``spillway serve cpu`` answers one, as do
``sam local start-lambda`` and serverless-offline). botocore retries are off: the
router's own fallback and retry budget decide. boto3 is imported on the first call so a
router without a Lambda backend never pays for it.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from spillway import tracing
from spillway.policy.backend import (
    BackendRequest,
    BackendResponse,
    CannotServe,
    ConnectFailed,
    TimedOut,
)
from spillway.protocol.errors import (
    InvalidInputError,
    OverloadedError,
    SpillwayError,
    UnavailableError,
)
from spillway.protocol.framing import HEADER_LENGTH, parse_header_length
from spillway.protocol.messages import DirectInvokeAnswer, DirectInvokeEvent, parse_message
from spillway.protocol.replies import FAULT_HEADER, Reply, error_reply
from spillway.protocol.wire import LAMBDA_PAYLOAD_BYTES
from spillway.router.backends import RESPONSE_HEADERS, TenantScopes, forwardable
from spillway.state.table import scope

_CPU_OPERATIONS = frozenset({"infer", "metadata", "ready", "config"})
# The shortest read timeout a call is given: below it, the call is not worth starting.
MIN_READ_TIMEOUT_S = 0.1
# Clients kept (one per read-timeout step in use); the least recently used is dropped.
_MAX_CLIENTS = 8

Payload = Callable[[BackendRequest], bytes]


def read_timeout_step(budget_s: float, ceiling_s: float) -> float:
    """The read timeout of a call with ``budget_s`` left: the largest step of the ladder
    (0.1 s steps below 1 s, 0.5 s below 10 s, 2.5 s above) not over the budget or the
    ceiling, and never below ``MIN_READ_TIMEOUT_S``. Few steps, so few clients."""
    limit = min(budget_s, ceiling_s)
    step = 0.1 if limit < 1 else 0.5 if limit < 10 else 2.5
    return max(MIN_READ_TIMEOUT_S, round(math.floor(limit / step + 1e-9) * step, 3))


def direct_event(request: BackendRequest, scopes: TenantScopes = scope) -> DirectInvokeEvent:
    """The cpu_infer direct-invoke event for a request (the schema cpu_infer reads), with
    the caller's tenant scope as ``scopes`` gives it (signed: its pipeline step cache
    entries are the tenant's)."""
    return DirectInvokeEvent.for_request(
        request.operation,
        request.model or "",
        request.version,
        request.body,
        parse_header_length(request.headers.get(HEADER_LENGTH)),
        request.request_id,
        scopes(request.tenant),
        trace=tracing.carrier_of(request.headers),
    )


def cpu_payload(request: BackendRequest, scopes: TenantScopes = scope) -> bytes:
    """The CPU fallback's invoke payload; ``CannotServe`` for what it does not serve."""
    if request.operation not in _CPU_OPERATIONS or request.model is None:
        raise CannotServe(f"the CPU function does not serve {request.operation}")
    return direct_event(request, scopes).model_dump_json(exclude_none=True).encode()


def jobs_payload(request: BackendRequest) -> bytes:
    """The jobs function's invoke payload: ``POST /v1/jobs`` as a REST (v1) proxy event.

    The body is the router's own ``JobRequest`` JSON (small, never the client's input: that
    is staged in S3 first). The router vouches for its caller's tenant as an API Gateway
    authorizer would, in ``requestContext.authorizer``: only callers allowed
    ``lambda:InvokeFunction`` on the jobs function (the router's role) can write it."""
    if request.operation != "submit":
        raise CannotServe(f"the jobs function is not invoked for {request.operation}")
    context: dict[str, object] = {"requestId": request.request_id or ""}
    if request.tenant is not None:
        context["authorizer"] = {"tenant": request.tenant}
    event = {
        "resource": "/v1/jobs",
        "path": "/v1/jobs",
        "httpMethod": request.method,
        "headers": dict(request.headers),
        "body": request.body.decode(),
        "isBase64Encoded": False,
        "requestContext": context,
    }
    return json.dumps(event).encode()


def _response(reply: Reply, started: float, *, billed: bool = False) -> BackendResponse:
    elapsed = time.monotonic() - started
    headers = forwardable(dict(reply.headers), RESPONSE_HEADERS | {FAULT_HEADER})
    return BackendResponse(reply.status, headers, reply.body, elapsed, elapsed if billed else None)


def _failed(error: SpillwayError, started: float) -> BackendResponse:
    return _response(error_reply(error), started)


class LambdaBackend:
    """A function called with ``lambda:Invoke``; ``payload`` builds its event."""

    def __init__(
        self,
        name: str,
        function: str,
        *,
        payload: Payload = cpu_payload,
        read_timeout_s: float = 30.0,
        connect_timeout_s: float = 2.0,
        new_client: Callable[[float], Any] | None = None,
    ) -> None:
        """``new_client(read_timeout_s)`` makes a Lambda client (tests pass a fake)."""
        self.name = name
        self.function = function
        self._payload = payload
        self._new_client = new_client or self._boto_client
        self._max_read_timeout_s = read_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._clients: OrderedDict[float, Any] = OrderedDict()
        self._lock = threading.Lock()

    def client_for(self, budget_s: float) -> tuple[Any, float]:
        """The client whose read timeout is the largest step within ``budget_s``, and that
        timeout."""
        timeout = read_timeout_step(budget_s, self._max_read_timeout_s)
        with self._lock:
            client = self._clients.get(timeout)
            if client is None:
                client = self._new_client(timeout)
                self._clients[timeout] = client
                while len(self._clients) > _MAX_CLIENTS:
                    self._clients.popitem(last=False)
            self._clients.move_to_end(timeout)
            return client, timeout

    def _boto_client(self, read_timeout_s: float) -> Any:
        from spillway.aws.clients import client

        return client(
            "lambda",
            connect_timeout=min(self._connect_timeout_s, read_timeout_s),
            read_timeout=read_timeout_s,
            max_attempts=1,
            tcp_keepalive=True,
        )

    def send(self, request: BackendRequest, timeout_s: float) -> BackendResponse:
        """Invoke the function within ``timeout_s``; throttling reads as 429, other API
        errors as 503, a function error or malformed answer as the function's fault."""
        try:
            payload = self._payload(request)
        except CannotServe as exc:
            raise CannotServe(f"{self.name}: {exc}") from None
        if len(payload) > LAMBDA_PAYLOAD_BYTES:
            raise CannotServe(f"{self.name}: {len(payload)} bytes exceed Lambda's 6 MB payload")
        if timeout_s < MIN_READ_TIMEOUT_S:
            raise TimedOut(f"{self.name}: {timeout_s * 1000:.0f} ms left, too little to invoke")
        from spillway.aws.errors import (
            ClientError,
            ConnectTimeoutError,
            EndpointConnectionError,
            ReadTimeoutError,
            error_code,
        )

        client, read_timeout = self.client_for(timeout_s)
        started = time.monotonic()
        try:
            result = client.invoke(
                FunctionName=self.function, InvocationType="RequestResponse", Payload=payload
            )
            raw = result["Payload"].read()
        except (EndpointConnectionError, ConnectTimeoutError) as exc:
            raise ConnectFailed(f"{self.name}: {exc}") from exc
        except ReadTimeoutError as exc:
            raise TimedOut(f"{self.name}: no answer within {read_timeout:g} s") from exc
        except ClientError as exc:
            code = error_code(exc)
            message = f"the {self.name} function answered {code}"
            if code in ("TooManyRequestsException", "ThrottlingException"):
                return _failed(OverloadedError(message), started)
            return _failed(UnavailableError(message), started)
        if result.get("FunctionError"):
            return _failed(UnavailableError(f"the {self.name} function failed"), started)
        try:
            answer = parse_message(DirectInvokeAnswer, raw, f"{self.name} function answer")
            reply = answer.to_reply()
        except InvalidInputError:  # the function's fault, not the client's
            error = UnavailableError(f"the {self.name} function sent a malformed answer")
            return _failed(error, started)
        return _response(reply, started, billed=True)
