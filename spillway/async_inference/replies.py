"""Replies and records, both ways: what a run's reply leaves in a request's record, and
the HTTP reply ``GET /v1/results/{id}`` renders from a record."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from spillway.async_inference.records import AsyncRecord
from spillway.protocol.errors import SpillwayError
from spillway.protocol.framing import HEADER_LENGTH, JSON_CONTENT_TYPE
from spillway.protocol.replies import Reply, json_reply

VERSION_HEADER = "x-spillway-model-version"


def error_of(reply: Reply) -> tuple[str, str]:
    """A failed reply's code and message (bounded), as its record keeps them."""
    try:
        body = json.loads(reply.body)
        return str(body.get("code", "failed"))[:64], str(body.get("error", ""))[:1000]
    except (ValueError, AttributeError):
        return "failed", f"status {reply.status}"


def failure_reply(error: BaseException) -> Reply:
    """The reply recorded for a run that raised: its own mapping, or 500 for anything
    unexpected (retried like any server fault)."""
    from spillway.protocol.replies import INTERNAL_ERROR, error_reply

    if isinstance(error, SpillwayError):
        return error_reply(error)
    return INTERNAL_ERROR


def result_fields(reply: Reply) -> dict[str, Any]:
    """What a successful reply's record keeps to render it again: its content type, header
    length and model version."""
    headers = dict(reply.headers)
    fields: dict[str, Any] = {"content_type": headers.get("content-type", JSON_CONTENT_TYPE)}
    if HEADER_LENGTH in headers:
        fields["header_length"] = int(headers[HEADER_LENGTH])
    if VERSION_HEADER in headers:
        fields["result_version"] = headers[VERSION_HEADER]
    return fields


def result_reply(record: AsyncRecord, read: Callable[[str], bytes]) -> Reply:
    """``GET /v1/results/{id}`` of a caller's own record: 202 with the state while
    pending, the V2 response when it succeeded (its body ``read`` from the result's S3
    URL), its error (status and code) when it failed."""
    if record.state in ("queued", "running"):
        return json_reply(202, record.view(), [("retry-after", "1")])
    if record.state == "failed":
        body = {"error": record.error or "failed", "code": record.code or "failed"}
        return json_reply(record.status or 500, {**body, "id": record.id})
    headers = [("content-type", record.content_type or JSON_CONTENT_TYPE)]
    if record.header_length is not None:
        headers.append((HEADER_LENGTH, str(record.header_length)))
    if record.result_version:
        headers.append((VERSION_HEADER, record.result_version))
    return Reply(200, headers, read(str(record.result)))
