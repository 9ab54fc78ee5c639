"""The CPU fallback reached with ``lambda:Invoke`` (the direct-invoke event of cpu_infer).

boto3 honours ``AWS_ENDPOINT_URL_LAMBDA`` / ``AWS_ENDPOINT_URL``, so locally the same code
targets any Lambda-invoke-compatible endpoint (``spillway serve cpu`` answers one,
as do ``sam local start-lambda`` and serverless-offline). botocore retries are off: the
router's own fallback and retry budget decide. boto3 is imported on the first call so a
router without a CPU function never pays for it.
"""

from __future__ import annotations

import base64
import binascii
import json
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

# Lambda's limit on a synchronous invocation's request and response payloads.
LAMBDA_PAYLOAD_LIMIT = 6 * 1024 * 1024
_OPERATIONS = frozenset({"infer", "metadata", "ready", "config"})


def direct_event(request: BackendRequest) -> dict[str, Any]:
    """The cpu_infer direct-invoke event for a request (see functions.cpu_infer.handler)."""
    event: dict[str, Any] = {"operation": request.operation, "model": request.model}
    if request.version is not None:
        event["version"] = request.version
    length = request.headers.get("inference-header-content-length")
    if length is not None:
        event["headers"] = {"inference-header-content-length": length}
    if request.body:
        event["body_b64"] = base64.b64encode(request.body).decode()
    if request.request_id:
        event["request_id"] = request.request_id
    return event


def _unavailable(status: int, message: str, started: float) -> BackendResponse:
    body = json.dumps({"error": message, "code": "overloaded" if status == 429 else "unavailable"})
    headers = {"content-type": "application/json"}
    return BackendResponse(status, headers, body.encode(), time.monotonic() - started)


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
        payload = json.dumps(direct_event(request), separators=(",", ":")).encode()
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
            status = 429 if code in ("TooManyRequestsException", "ThrottlingException") else 503
            return _unavailable(status, f"the CPU function answered {code}", started)
        if result.get("FunctionError"):
            return _unavailable(503, "the CPU function failed", started)
        return _parse(raw, started)


def _parse(raw: bytes, started: float) -> BackendResponse:
    elapsed = time.monotonic() - started
    try:
        answer = json.loads(raw)
        status = int(answer["statusCode"])
        body = answer.get("body") or ""
        data = base64.b64decode(body) if answer.get("isBase64Encoded") else body.encode()
        headers = forwardable(answer.get("headers") or {}, RESPONSE_HEADERS)
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error):
        return _unavailable(503, "the CPU function sent a malformed answer", started)
    return BackendResponse(status, headers, data, elapsed, billed_s=elapsed)
