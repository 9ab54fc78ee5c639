"""The CPU fallback reached with ``lambda:Invoke`` (the direct-invoke event of cpu_infer).

boto3 honours ``AWS_ENDPOINT_URL_LAMBDA`` / ``AWS_ENDPOINT_URL``, so locally the same code
targets any Lambda-invoke-compatible endpoint (``spillway serve cpu`` answers one,
as do ``sam local start-lambda`` and serverless-offline). botocore retries are off: the
router's own fallback and retry budget decide. boto3 is imported on the first call so a
router without a CPU function never pays for it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from functions.router.backends import (
    RESPONSE_HEADERS,
    BackendRequest,
    BackendResponse,
    CannotServe,
    ConnectFailed,
    TimedOut,
    forwardable,
)
from spillway.errors import InvalidInputError, OverloadedError, SpillwayError, UnavailableError
from spillway.messages import DirectInvokeAnswer, DirectInvokeEvent, parse_message
from spillway.wire import FAULT_HEADER, HEADER_LENGTH, Reply, error_reply, parse_header_length

# Lambda's limit on a synchronous invocation's request and response payloads.
LAMBDA_PAYLOAD_LIMIT = 6 * 1024 * 1024
_OPERATIONS = frozenset({"infer", "metadata", "ready", "config"})


def direct_event(request: BackendRequest) -> DirectInvokeEvent:
    """The cpu_infer direct-invoke event for a request (the schema cpu_infer reads)."""
    return DirectInvokeEvent.for_request(
        request.operation,
        request.model or "",
        request.version,
        request.body,
        parse_header_length(request.headers.get(HEADER_LENGTH)),
        request.request_id,
    )


def _response(reply: Reply, started: float, *, billed: bool = False) -> BackendResponse:
    elapsed = time.monotonic() - started
    headers = forwardable(dict(reply.headers), RESPONSE_HEADERS | {FAULT_HEADER})
    return BackendResponse(reply.status, headers, reply.body, elapsed, elapsed if billed else None)


def _failed(error: SpillwayError, started: float) -> BackendResponse:
    return _response(error_reply(error), started)


class LambdaBackend:
    """cpu_infer over ``lambda:Invoke`` (RequestResponse)."""

    def __init__(self, name: str, function: str, *, read_timeout_s: float = 30.0) -> None:
        self.name = name
        self.function = function
        self._read_timeout_s = read_timeout_s
        self._client: Any = None
        self._lock = threading.Lock()

    def _lambda(self) -> Any:
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                config = Config(
                    connect_timeout=2,
                    read_timeout=self._read_timeout_s,
                    retries={"mode": "standard", "max_attempts": 1},
                    tcp_keepalive=True,
                )
                self._client = boto3.client("lambda", config=config)
            return self._client

    def send(self, request: BackendRequest, timeout_s: float) -> BackendResponse:
        """Invoke the function; throttling reads as 429, other API errors as 503."""
        if request.operation not in _OPERATIONS or request.model is None:
            raise CannotServe(f"{self.name}: the CPU function does not serve {request.operation}")
        payload = direct_event(request).model_dump_json(exclude_none=True).encode()
        if len(payload) > LAMBDA_PAYLOAD_LIMIT:
            raise CannotServe(f"{self.name}: {len(payload)} bytes exceed Lambda's 6 MB payload")
        from botocore.exceptions import (
            ClientError,
            ConnectTimeoutError,
            EndpointConnectionError,
            ReadTimeoutError,
        )

        started = time.monotonic()
        try:
            result = self._lambda().invoke(
                FunctionName=self.function, InvocationType="RequestResponse", Payload=payload
            )
            raw = result["Payload"].read()
        except (EndpointConnectionError, ConnectTimeoutError) as exc:
            raise ConnectFailed(f"{self.name}: {exc}") from exc
        except ReadTimeoutError as exc:
            raise TimedOut(f"{self.name}: no answer from {self.function}") from exc
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            message = f"the CPU function answered {code}"
            if code in ("TooManyRequestsException", "ThrottlingException"):
                return _failed(OverloadedError(message), started)
            return _failed(UnavailableError(message), started)
        if result.get("FunctionError"):
            return _failed(UnavailableError("the CPU function failed"), started)
        try:
            reply = parse_message(DirectInvokeAnswer, raw, "CPU function answer").to_reply()
        except InvalidInputError:  # the function's fault, not the client's
            return _failed(UnavailableError("the CPU function sent a malformed answer"), started)
        return _response(reply, started, billed=True)
