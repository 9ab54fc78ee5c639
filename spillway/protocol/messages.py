"""Every message that crosses a process boundary, with one schema for writer and reader.

* ``DirectInvokeEvent`` / ``DirectInvokeAnswer``: what the router's ``lambda:Invoke``
  sends to the CPU fallback and what comes back (API Gateway's proxy-response shape).
* ``JobRequest``, ``JobView``, ``JobStatus``, ``SubmitReceipt``: the jobs API
  (``POST /v1/jobs``, ``GET /v1/jobs/{id}``), written by the jobs function, read by the
  router's batch mode and the CLI.
* ``StagedRequest``: an infer request the router stages in S3 for an offline job; the
  batch job reads it back with the same functions.

No numpy here (the router imports it).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from spillway.protocol.errors import InvalidInputError
from spillway.protocol.framing import HEADER_LENGTH, JSON_CONTENT_TYPE, parse_header_length
from spillway.protocol.names import MODEL_NAME_PATTERN
from spillway.protocol.replies import Reply, json_bytes
from spillway.protocol.s3urls import parse_s3_url
from spillway.protocol.wire import SCOPE_CLAIM_PATTERN

M = TypeVar("M", bound=BaseModel)


def parse_message(model: type[M], raw: str | bytes | dict[str, Any], what: str) -> M:
    """A message from JSON text or a decoded object; a clear 400 naming the first bad field,
    never the validator's internals or the input."""
    try:
        if isinstance(raw, dict):
            return model.model_validate(raw)
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        first = errors[0]
        where = ".".join(map(str, first["loc"])) or what
        raise InvalidInputError(f"invalid {what}: {where}: {first['msg']}") from None


# --- the CPU fallback's direct-invoke event ----------------------------------------------

Operation = Literal["infer", "metadata", "ready", "config"]


class DirectInvokeEvent(BaseModel):
    """The event the router sends with ``lambda:Invoke`` (``RequestResponse``)."""

    model_config = ConfigDict(extra="ignore")

    operation: Operation = "infer"
    # Bounded here; checked by the fallback with the core's name and version rules, so a
    # bad one gets the answer every server gives (invalid_model_name).
    model: str = Field(min_length=1, max_length=256)
    version: str | None = Field(default=None, max_length=64)
    headers: dict[str, str] = Field(default_factory=dict)
    body: dict[str, Any] | str | None = None
    """A JSON infer request (object or text); or use ``body_b64``."""
    body_b64: str | None = None
    """The raw body, base64 (JSON, or Triton's binary extension)."""
    request_id: str | None = Field(default=None, max_length=128)
    tenant_scope: str | None = Field(default=None, pattern=SCOPE_CLAIM_PATTERN)
    """The caller's tenant scope (``spillway.state.table.scope``) with the router's proof
    (``<scope>.<expiry>.<signature>``, ``spillway.tenancy.proof``), set by the router. It
    keys the caller's pipeline step cache entries only when the proof verifies; absent or
    unproven, the request uses no tenant's entries."""

    @classmethod
    def for_request(
        cls,
        operation: str,
        model: str,
        version: str | None,
        body: bytes,
        header_length: int | None,
        request_id: str | None,
        tenant_scope: str | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> DirectInvokeEvent:
        """The event for one request (what the router builds); ``trace`` is the
        request's W3C trace context (``traceparent``, ``tracestate``), carried in
        ``headers`` as on HTTP."""
        headers = {} if header_length is None else {HEADER_LENGTH: str(header_length)}
        headers.update(trace or {})
        return cls(
            operation=operation,
            model=model,
            version=version,
            headers=headers,
            body_b64=base64.b64encode(body).decode() if body else None,
            request_id=request_id or None,
            tenant_scope=tenant_scope,
        )

    def raw_body(self) -> bytes:
        """The request body as bytes."""
        if self.body_b64 is not None:
            try:
                return base64.b64decode(self.body_b64, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidInputError("body_b64 is not valid base64") from None
        if isinstance(self.body, dict):
            return json_bytes(self.body)
        return (self.body or "").encode()

    def header_length(self) -> int | None:
        """The ``Inference-Header-Content-Length`` of a binary body (any header case)."""
        lengths = [v for k, v in self.headers.items() if k.lower() == HEADER_LENGTH]
        return parse_header_length(lengths[0]) if lengths else None


class DirectInvokeAnswer(BaseModel):
    """The answer: API Gateway's proxy-response shape, so one parser reads both."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    status_code: int = Field(alias="statusCode", ge=100, le=599)
    headers: dict[str, str] = Field(default_factory=dict)
    body: str = ""
    is_base64_encoded: bool = Field(default=False, alias="isBase64Encoded")

    @classmethod
    def of(cls, reply: Reply) -> DirectInvokeAnswer:
        """The answer carrying a reply; a body that is not JSON travels as base64."""
        headers = dict(reply.headers)
        text = headers.get("content-type", JSON_CONTENT_TYPE) == JSON_CONTENT_TYPE
        body = reply.body.decode() if text else base64.b64encode(reply.body).decode()
        return cls(status_code=reply.status, headers=headers, body=body, is_base64_encoded=not text)

    def to_reply(self) -> Reply:
        """The reply it carries (header names lower-cased)."""
        if self.is_base64_encoded:
            try:
                data = base64.b64decode(self.body, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidInputError("the answer's body is not valid base64") from None
        else:
            data = self.body.encode()
        headers = [(k.lower(), v) for k, v in self.headers.items()]
        return Reply(self.status_code, headers, data)

    def dump(self) -> dict[str, Any]:
        """The answer as Lambda returns it."""
        return self.model_dump(by_alias=True)


# --- the jobs API -------------------------------------------------------------------------


class JobRequest(BaseModel):
    """``POST /v1/jobs``: what to run over which data."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(pattern=MODEL_NAME_PATTERN.pattern)
    version: int | None = Field(default=None, ge=1, le=999_999_999)
    input: str = Field(max_length=1024)
    output: str = Field(max_length=1024)
    shards: int | None = Field(default=None, ge=1, le=10_000)
    batch_size: int | None = Field(default=None, ge=1, le=65_536)

    @field_validator("input", "output")
    @classmethod
    def _s3(cls, value: str) -> str:
        try:
            parse_s3_url(value)
        except InvalidInputError:
            raise ValueError("must be an s3://bucket/prefix location") from None
        return value

    @classmethod
    def parse(cls, raw: str | bytes) -> JobRequest:
        """A request from a JSON body; a clear 400 naming the field."""
        return parse_message(cls, raw, "job request")


class JobView(BaseModel):
    """A job as the API shows it."""

    job_id: str
    state: str
    model: str
    model_version: int | None = None
    input: str
    output: str
    shards_total: int | None = None
    array_size: int | None = None
    batch_job_id: str | None = None
    created_at: str


class JobStatus(JobView):
    """A job's record, Batch's state and what its shard markers add up to."""

    batch_status: str | None = None
    array_status: dict[str, int] = Field(default_factory=dict)
    shards_done: int = 0
    records: int = 0
    outputs: int = 0
    errors: int = 0


class SubmitReceipt(BaseModel):
    """``POST /v1/jobs``'s answer: the job, and whether an earlier submission with the
    same key already made it."""

    job: JobView
    replayed: bool


# --- requests staged for an offline job ---------------------------------------------------

STAGED_SUFFIX = ".v2req"
"""Shards in this format hold one staged infer request each."""
_STAGED_MAGIC = b"SPILLWAY-V2 "


def stage_request(body: bytes, header_length: int | None) -> bytes:
    """A staged request file: one ASCII line with the header length (``-`` for a JSON
    body), then the infer body as the client sent it (JSON or binary)."""
    length = b"-" if header_length is None else str(header_length).encode()
    return _STAGED_MAGIC + length + b"\n" + body


def read_staged_request(data: bytes) -> tuple[bytes, int | None]:
    """The infer body and header length of a staged request file."""
    line, newline, body = data.partition(b"\n")
    if not newline or not line.startswith(_STAGED_MAGIC):
        raise InvalidInputError("not a staged infer request")
    length = line[len(_STAGED_MAGIC) :].decode("ascii", "replace")
    return body, None if length == "-" else parse_header_length(length)
