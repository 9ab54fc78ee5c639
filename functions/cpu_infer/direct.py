"""The direct-invoke event of the CPU fallback (what the router's ``lambda:Invoke`` sends).

Event::

    {
      "operation": "infer",          # infer (default) | metadata | ready | config
      "model": "digits",
      "version": "1",                # optional; the loaded version otherwise
      "headers": {"inference-header-content-length": "123"},   # binary bodies only
      "body": {...} | "<JSON text>", # a JSON infer request, or
      "body_b64": "<base64>",        # the raw body (JSON or Triton binary extension)
      "request_id": "..."            # optional, for the logs
    }

Answer (the API Gateway proxy response shape, so the same parser reads both)::

    {"statusCode": 200, "headers": {"content-type": "...",
     "inference-header-content-length"?: "..."}, "body": "<text or base64>",
     "isBase64Encoded": false}

A body over the 6 MB payload limit is answered with 413 ``payload_too_large``; every
error is an answer with its status and ``{"error", "code"}`` body, never an exception.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from functions.cpu_infer.service import CpuService
from spillway.codec import header_length_from
from spillway.errors import InvalidInputError, SpillwayError

log = logging.getLogger("spillway.cpu_infer")


class DirectEvent(BaseModel):
    """The direct-invoke event (see the module docstring)."""

    model_config = ConfigDict(extra="ignore")

    operation: Literal["infer", "metadata", "ready", "config"] = "infer"
    model: str = Field(min_length=1, max_length=64)
    version: str | None = Field(default=None, max_length=9)
    headers: dict[str, str] = Field(default_factory=dict)
    body: dict[str, Any] | str | None = None
    body_b64: str | None = None
    request_id: str | None = Field(default=None, max_length=128)

    def raw_body(self) -> bytes:
        """The request body as bytes."""
        if self.body_b64 is not None:
            try:
                return base64.b64decode(self.body_b64, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidInputError("body_b64 is not valid base64") from None
        if isinstance(self.body, dict):
            return json.dumps(self.body).encode()
        return (self.body or "").encode()

    def header_length(self) -> int | None:
        """The ``Inference-Header-Content-Length`` of a binary body (any header case)."""
        name = "inference-header-content-length"
        lengths = [v for k, v in self.headers.items() if k.lower() == name]
        return header_length_from(lengths[0]) if lengths else None


def answer(status: int, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
    """An API Gateway-shaped answer; binary bodies are base64."""
    text = headers.get("content-type", "application/json") == "application/json"
    return {
        "statusCode": status,
        "headers": headers,
        "body": body.decode() if text else base64.b64encode(body).decode(),
        "isBase64Encoded": not text,
    }


def error_answer(error: SpillwayError) -> dict[str, Any]:
    """The answer of a failed request."""
    headers = {"content-type": "application/json"}
    if error.retry_after_s is not None:
        headers["retry-after"] = str(max(1, round(error.retry_after_s)))
    return answer(error.status, json.dumps(error.to_body()).encode(), headers)


def handle_direct(service: CpuService, event: dict[str, Any]) -> dict[str, Any]:
    """Serve one direct-invoke event; errors become answers, not exceptions."""
    arrived = time.monotonic()
    try:
        return _serve(service, _parse(event), arrived)
    except SpillwayError as error:
        operation = event.get("operation", "infer")
        log.info("direct %s -> %d %s: %s", operation, error.status, error.code, error.message)
        return error_answer(error)


def _parse(event: dict[str, Any]) -> DirectEvent:
    try:
        return DirectEvent.model_validate(event)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        first = errors[0]
        where = ".".join(map(str, first["loc"])) or "event"
        raise InvalidInputError(f"invalid event: {where}: {first['msg']}") from None


def _serve(service: CpuService, event: DirectEvent, arrived: float) -> dict[str, Any]:
    json_headers = {"content-type": "application/json"}
    if event.operation == "metadata":
        document = service.metadata(event.model, event.version)
        return answer(200, json.dumps(document).encode(), json_headers)
    if event.operation == "config":
        document = service.config(event.model, event.version)
        return answer(200, json.dumps(document).encode(), json_headers)
    if event.operation == "ready":
        service.get(event.model, event.version)
        return answer(200, b'{"ready":true}', json_headers)
    body, length = event.raw_body(), event.header_length()
    result = service.infer(event.model, event.version, body, length, arrived=arrived)
    headers = {"x-spillway-model-version": str(result.version)}
    if result.header_length is None:
        headers["content-type"] = "application/json"
    else:
        headers["content-type"] = "application/octet-stream"
        headers["inference-header-content-length"] = str(result.header_length)
    return answer(200, result.body, headers)
