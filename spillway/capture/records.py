"""One capture record: a request and its answer (or error) as one JSON line.

``Captured`` is what the watcher takes on the request's thread: references to the bodies
it keeps (no copy, no encoding) and the few facts of the reply's headers; its ``size`` is
what the buffer counts. ``record_of`` turns it into a ``CaptureRecord`` on the writer's
thread: a JSON body as its JSON value, any other body as UTF-8 text or base64, a binary
tensor body (``Inference-Header-Content-Length``) base64 with its header length, so that
a replay sends the very bytes. Bodies past the record's cap are left out (``omitted``)
and the record is ``truncated``: not replayable.

The same models read the records back (``spillway capture``), so writer and reader share
one schema: docs/capture.md lists every field.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from spillway.policy.facts import Call, Request
from spillway.policy.rules import CaptureRule, Keep
from spillway.protocol.framing import HEADER_LENGTH, has_surrogate_escape, parse_header_length
from spillway.protocol.replies import Reply
from spillway.protocol.wire import Target

SCHEMA = 1
RECORD_OVERHEAD_BYTES = 512
"""What the buffer counts for a record besides its bodies (its facts, the object)."""
_ERROR_BODY_BYTES = 4096
"""An error answer longer than this is not read for its code on the request's thread."""
Encoding = Literal["json", "text", "base64"]


class RoutedLike(Protocol):
    """What capture reads of the router's ``Routed`` (``spillway.router.routed``)."""

    @property
    def call(self) -> Call: ...
    @property
    def target(self) -> Target: ...
    @property
    def tenant(self) -> str | None: ...
    @property
    def reply(self) -> Reply: ...
    @property
    def backend(self) -> str | None: ...
    @property
    def version(self) -> str | None: ...
    @property
    def latency_s(self) -> float: ...
    @property
    def trace_id(self) -> str | None: ...
    @property
    def request(self) -> Request | None: ...


@dataclass(frozen=True)
class Body:
    """A body as sent: its bytes, the length of its JSON header when it is binary, and its
    content type; ``raw`` is ``None`` when the record leaves it out (past the cap)."""

    raw: bytes | None
    size: int
    header_length: int | None
    content_type: str | None


@dataclass(frozen=True)
class Captured:
    """One request as the watcher took it, until its batch is written."""

    record_id: str
    at: datetime
    tenant: str | None
    model: str
    requested_version: str | None
    version: str | None
    backend: str | None
    status: int
    latency_ms: float
    request_id: str
    trace_id: str | None
    rule: str | None
    fallback: str | None
    spilled: bool
    sample: float
    keep: Keep
    request: Body | None
    response: Body | None
    error: tuple[str, str] | None

    @property
    def truncated(self) -> bool:
        """Whether a body it keeps was left out."""
        return any(b is not None and b.raw is None for b in (self.request, self.response))

    @property
    def size(self) -> int:
        """The bytes it holds: its kept bodies and a fixed overhead."""
        held = sum(len(b.raw) for b in (self.request, self.response) if b and b.raw is not None)
        return RECORD_OVERHEAD_BYTES + held


def captured(
    routed: RoutedLike,
    rule: CaptureRule,
    *,
    at: datetime,
    record_id: str,
    max_body_bytes: int,
) -> Captured:
    """The record of ``routed`` under ``rule``: the bodies ``rule.keep`` names, each kept
    while the kept bodies add up to at most ``max_body_bytes`` (the request first)."""
    reply, call, target = routed.reply, routed.call, routed.target
    request = _request_body(routed) if rule.keep in ("both", "inputs") else None
    response = _reply_body(reply) if rule.keep in ("both", "outputs") else None
    room = max_body_bytes
    bodies: list[Body | None] = []
    for body in (request, response):
        if body is not None and body.raw is not None:
            if len(body.raw) <= room:
                room -= len(body.raw)
            else:
                body = Body(None, body.size, body.header_length, body.content_type)
        bodies.append(body)
    return Captured(
        record_id=record_id,
        at=at,
        tenant=routed.tenant,
        model=target.model or "-",
        requested_version=target.version,
        version=reply.header("x-spillway-model-version") or routed.version,
        backend=routed.backend,
        status=reply.status,
        latency_ms=round(routed.latency_s * 1000, 3),
        request_id=call.request_id,
        trace_id=routed.trace_id,
        rule=reply.header("x-spillway-rule"),
        fallback=reply.header("x-spillway-fallback"),
        spilled=reply.header("x-spillway-spilled") == "true",
        sample=rule.sample,
        keep=rule.keep,
        request=bodies[0],
        response=bodies[1],
        error=_error(reply),
    )


def _request_body(routed: RoutedLike) -> Body:
    call = routed.call
    if routed.request is not None:
        length = routed.request.header_length
    else:
        try:
            length = parse_header_length(call.headers.get(HEADER_LENGTH))
        except ValueError:  # InvalidInputError: the request was refused for it
            length = None
    return Body(call.body, len(call.body), length, call.headers.get("content-type"))


def _reply_body(reply: Reply) -> Body:
    try:
        length = parse_header_length(reply.header(HEADER_LENGTH))
    except ValueError:
        length = None
    return Body(reply.body, len(reply.body), length, reply.header("content-type"))


def _error(reply: Reply) -> tuple[str, str] | None:
    """The ``code`` and ``error`` of an error answer (``{"error", "code"}``)."""
    if reply.status < 400:
        return None
    code, message = f"status_{reply.status}", ""
    if len(reply.body) <= _ERROR_BODY_BYTES:
        try:
            document = json.loads(reply.body)
        except ValueError:
            document = None
        if isinstance(document, dict):
            code = str(document.get("code") or code)[:128]
            message = str(document.get("error") or "")[:1000]
    return code, message


# --- the record as written and read --------------------------------------------------


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class CapturedBody(_Record):
    """A request or answer body in a record."""

    content_type: str | None = None
    """Its ``Content-Type`` as sent."""
    header_length: int | None = None
    """A binary body's ``Inference-Header-Content-Length`` (``None``: a JSON body)."""
    size: int = Field(ge=0)
    """Its size in bytes as sent."""
    encoding: Encoding | None = None
    """How ``data`` holds it: ``json`` (the JSON value), ``text`` (UTF-8 text that is not
    JSON) or ``base64`` (binary bodies and anything else); ``None`` when omitted."""
    data: Any = None
    """The body (``None`` when omitted)."""
    omitted: bool = False
    """Left out: the record's bodies would have passed ``ROUTER_CAPTURE_MAX_RECORD_BYTES``."""

    def raw(self) -> bytes | None:
        """The body's bytes as they were sent (a JSON body as compact JSON text), or
        ``None`` when it was left out or cannot be read."""
        if self.omitted or self.encoding is None:
            return None
        if self.encoding == "json":
            return json.dumps(self.data, separators=(",", ":"), ensure_ascii=False).encode()
        if not isinstance(self.data, str):
            return None
        if self.encoding == "text":
            return self.data.encode("utf-8", "surrogatepass")
        try:
            return base64.b64decode(self.data, validate=True)
        except (binascii.Error, ValueError):
            return None


class CapturedError(_Record):
    """What an error answer said."""

    code: str
    """Its stable code (docs/errors.md), or ``status_<status>`` when it named none."""
    message: str = ""


class CaptureRecord(_Record):
    """One captured request: the request and its answer (or error) in one record."""

    schema_version: int = Field(default=SCHEMA, alias="schema")
    id: str
    """The record's own id (a UUID)."""
    time: datetime
    """When the router answered (UTC)."""
    request_id: str
    trace_id: str | None = None
    tenant: str | None = None
    """The tenant the router served it as (``None``: anonymous)."""
    model: str
    requested_version: str | None = None
    """The version the client named in the path (``None``: none)."""
    version: str | None = None
    """The version that answered (the backend's ``x-spillway-model-version``), else the
    one the router chose."""
    backend: str | None = None
    """``gpu``, ``cpu`` or ``batch``; ``None``: no backend answered."""
    rule: str | None = None
    """The routing rule that fired (``x-spillway-rule``)."""
    fallback: str | None = None
    """``<first backend>:<why>`` when another backend served (``x-spillway-fallback``)."""
    spilled: bool = False
    status: int
    latency_ms: float
    """Router time from receipt to reply."""
    error: CapturedError | None = None
    sample: float
    """The capture entry's sample rate (weigh a record by ``1 / sample``)."""
    keep: Keep
    request: CapturedBody | None = None
    """The request (``None``: the entry keeps ``outputs`` only)."""
    response: CapturedBody | None = None
    """The answer (``None``: the entry keeps ``inputs`` only)."""
    truncated: bool = False
    """A body was left out: the record cannot be replayed."""
    replayable: bool = False
    """The request is kept and nothing was left out: ``spillway capture replay`` can
    send it."""

    def line(self) -> bytes:
        """The record as one JSON line."""
        text = self.model_dump_json(by_alias=True, exclude_none=False)
        return text.encode("utf-8", "surrogatepass") + b"\n"


def encode_body(body: Body) -> CapturedBody:
    """A body for the record: JSON as its value, text, or base64."""
    kept = CapturedBody(
        content_type=body.content_type, header_length=body.header_length, size=body.size
    )
    raw = body.raw
    if raw is None:
        return kept.model_copy(update={"omitted": True})
    encoding, data = _encoded(raw, body.header_length)
    return kept.model_copy(update={"encoding": encoding, "data": data})


def _encoded(raw: bytes, header_length: int | None) -> tuple[Encoding, Any]:
    if header_length is not None:
        return "base64", base64.b64encode(raw).decode("ascii")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "base64", base64.b64encode(raw).decode("ascii")
    if has_surrogate_escape(raw):  # a lone surrogate no JSON record can carry as a value
        return "text", text
    try:
        value = json.loads(text, parse_constant=_refuse)
    except ValueError:
        return "text", text
    return ("json", value) if isinstance(value, dict | list) else ("text", text)


def _refuse(constant: str) -> Any:
    """``NaN`` and ``Infinity`` are not JSON: such a body is kept as text."""
    raise ValueError(constant)


def record_of(item: Captured) -> CaptureRecord:
    """The record of a captured request, its bodies encoded."""
    request = encode_body(item.request) if item.request is not None else None
    response = encode_body(item.response) if item.response is not None else None
    replayable = request is not None and not item.truncated and item.model != "-"
    error = CapturedError(code=item.error[0], message=item.error[1]) if item.error else None
    return CaptureRecord.model_validate(
        {
            "schema": SCHEMA,
            "id": item.record_id,
            "time": item.at,
            "request_id": item.request_id,
            "trace_id": item.trace_id,
            "tenant": item.tenant,
            "model": item.model,
            "requested_version": item.requested_version,
            "version": item.version,
            "backend": item.backend,
            "rule": item.rule,
            "fallback": item.fallback,
            "spilled": item.spilled,
            "status": item.status,
            "latency_ms": item.latency_ms,
            "error": error,
            "sample": item.sample,
            "keep": item.keep,
            "request": request,
            "response": response,
            "truncated": item.truncated,
            "replayable": replayable,
        }
    )


def parse_record(line: bytes | str) -> CaptureRecord | None:
    """A record from one JSON line; ``None`` for a line that is not one."""
    text = line.strip()
    if not text:
        return None
    try:
        return CaptureRecord.model_validate_json(text)
    except ValueError:
        return None
