"""OTLP/HTTP trace export requests in, span records out, and the answers the OTLP
specification prescribes (https://opentelemetry.io/docs/specs/otlp/#otlphttp).

A body is binary Protobuf (``application/x-protobuf``) or the OTLP JSON encoding
(``application/json``: proto3 JSON with trace and span ids as hex strings, not base64),
optionally gzip-compressed; both end as one ``ExportTraceServiceRequest`` message, read
once into ``SpanRecord`` values. A body is checked against its size limit before it is
read and again once decompressed. The answer uses the request's encoding: an
``ExportTraceServiceResponse`` (with ``partial_success`` naming the spans refused, e.g.
an invalid id), or a ``google.rpc.Status`` whose ``ErrorInfo`` detail carries Spillway's
stable error code.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from spillway.protocol.errors import (
    InvalidInputError,
    PayloadTooLargeError,
    SpillwayError,
    UnsupportedMediaTypeError,
)
from spillway_cli.dashboard.traces import SpanRecord

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
MAX_BODY_BYTES = 8 * 1024 * 1024
"""The largest export body, compressed or not (the SDKs' batches are far smaller)."""
MAX_STRING = 4096
"""Longer attribute strings are cut to this many characters."""
MAX_ITEMS = 128
"""The most attributes, events or links kept per span (the SDKs' own default limit)."""
_ID_FIELDS = ("traceId", "spanId", "parentSpanId")
_GRPC_CODES = {400: code_pb2.INVALID_ARGUMENT, 413: code_pb2.RESOURCE_EXHAUSTED}


@dataclass(frozen=True)
class Export:
    """One decoded export: the spans kept and what was refused."""

    spans: list[SpanRecord]
    rejected: int = 0
    reason: str = ""


def media_type(content_type: str | None) -> str:
    """The ``Content-Type``'s media type, lowercase, without parameters."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def check_headers(content_type: str | None, content_encoding: str | None) -> str:
    """The request's media type, when the receiver takes it and its encoding."""
    kind = media_type(content_type)
    if kind not in (PROTOBUF, JSON):
        raise UnsupportedMediaTypeError(
            f"content type {kind or '(none)'!r} is not taken: send {PROTOBUF} or {JSON}"
        )
    encoding = (content_encoding or "identity").strip().lower()
    if encoding not in ("identity", "gzip"):
        raise UnsupportedMediaTypeError(
            f"content encoding {encoding!r} is not taken: send gzip or none"
        )
    return kind


def decode(
    body: bytes, kind: str, content_encoding: str | None, limit: int = MAX_BODY_BYTES
) -> Export:
    """The spans of one export body (``check_headers`` passed), at most ``limit`` bytes
    once decompressed."""
    if (content_encoding or "").strip().lower() == "gzip":
        body = _gunzip(body, limit)
    return spans_of(_request(body, kind))


def _gunzip(body: bytes, limit: int) -> bytes:
    """``body`` decompressed, refused past ``limit`` bytes (a small body may inflate)."""
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflate.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidInputError(f"the gzip body does not decompress: {exc}") from None
    if len(out) > limit:
        raise PayloadTooLargeError(f"the body decompresses to over {limit} bytes")
    if not inflate.eof:
        raise InvalidInputError("the gzip body is truncated")
    return out


def _request(body: bytes, kind: str) -> ExportTraceServiceRequest:
    """The export request message from its binary or JSON encoding."""
    if kind == PROTOBUF:
        message = ExportTraceServiceRequest()
        try:
            message.ParseFromString(body)
        except DecodeError as exc:
            raise InvalidInputError(f"the body is not an OTLP trace export: {exc}") from None
        return message
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise InvalidInputError(f"the body is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidInputError("the body is not an OTLP trace export: not a JSON object")
    message = ExportTraceServiceRequest()
    try:
        json_format.ParseDict(_ids_as_base64(document), message, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        raise InvalidInputError(f"the body is not an OTLP trace export: {exc}") from None
    return message


def _ids_as_base64(node: Any) -> Any:
    """OTLP JSON writes trace and span ids as hex; proto3 JSON reads bytes as base64."""
    if isinstance(node, list):
        return [_ids_as_base64(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _ID_FIELDS and isinstance(value, str):
            try:
                value = base64.b64encode(bytes.fromhex(value)).decode()
            except ValueError:
                raise InvalidInputError(f"{key} {value[:40]!r} is not hex") from None
        out[key] = _ids_as_base64(value)
    return out


def spans_of(request: ExportTraceServiceRequest) -> Export:
    """Every span of ``request`` with a valid trace and span id; the others counted."""
    kept: list[SpanRecord] = []
    rejected = 0
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        service = str(resource.get("service.name") or "unknown_service")
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope.name
            for span in scope_spans.spans:
                record = _record(span, service, scope)
                if record is None:
                    rejected += 1
                else:
                    kept.append(record)
    reason = f"{rejected} span(s) without a valid trace or span id" if rejected else ""
    return Export(kept, rejected, reason)


def _record(span: Span, service: str, scope: str) -> SpanRecord | None:
    """The span as the store keeps it; ``None`` when its ids are not valid."""
    trace_id, span_id = _hex_id(span.trace_id, 16), _hex_id(span.span_id, 8)
    parent = _hex_id(span.parent_span_id, 8) if span.parent_span_id else None
    if trace_id is None or span_id is None or (span.parent_span_id and parent is None):
        return None
    events = [
        {"name": e.name, "time_ns": e.time_unix_nano, "attributes": _attributes(e.attributes)}
        for e in span.events[:MAX_ITEMS]
    ]
    links = [
        {"trace_id": lt, "span_id": ls, "attributes": _attributes(link.attributes)}
        for link in span.links[:MAX_ITEMS]
        if (lt := _hex_id(link.trace_id, 16)) is not None
        and (ls := _hex_id(link.span_id, 8)) is not None
    ]
    kind = Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_").lower()
    status = Status.StatusCode.Name(span.status.code).removeprefix("STATUS_CODE_").lower()
    return SpanRecord(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent,
        name=span.name[:MAX_STRING],
        service=service[:MAX_STRING],
        kind="internal" if kind == "unspecified" else kind,
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        attributes=_attributes(span.attributes),
        events=events,
        links=links,
        status=status,
        status_message=span.status.message[:MAX_STRING],
        scope=scope[:MAX_STRING],
    )


def _hex_id(raw: bytes, size: int) -> str | None:
    """A trace (16 bytes) or span (8 bytes) id as hex; ``None`` unless it has that size
    and is not all zeros (the W3C invalid id)."""
    if len(raw) != size or not any(raw):
        return None
    return binascii.hexlify(raw).decode()


def _attributes(pairs: Any) -> dict[str, Any]:
    """OTLP key-value pairs as a plain dict, at most ``MAX_ITEMS`` of them."""
    return {kv.key[:MAX_STRING]: _value(kv.value) for kv in pairs[:MAX_ITEMS]}


def _value(value: AnyValue, depth: int = 0) -> Any:
    """An ``AnyValue`` as a JSON value (bytes as base64; nesting cut at depth 8)."""
    which = value.WhichOneof("value")
    if which is None or depth > 8:
        return None
    if which == "string_value":
        return value.string_value[:MAX_STRING]
    if which == "bytes_value":
        return base64.b64encode(value.bytes_value[:MAX_STRING]).decode()
    if which == "array_value":
        return [_value(v, depth + 1) for v in value.array_value.values[:MAX_ITEMS]]
    if which == "kvlist_value":
        return {
            kv.key[:MAX_STRING]: _value(kv.value, depth + 1)
            for kv in value.kvlist_value.values[:MAX_ITEMS]
        }
    return getattr(value, which)


def success(kind: str, export: Export) -> bytes:
    """The ``ExportTraceServiceResponse`` in the request's encoding; ``partial_success``
    set only when spans were refused, as the specification asks."""
    answer = ExportTraceServiceResponse()
    if export.rejected:
        answer.partial_success.rejected_spans = export.rejected
        answer.partial_success.error_message = export.reason
    return _encode(answer, kind)


def failure(kind: str, error: SpillwayError) -> bytes:
    """The ``google.rpc.Status`` of a refused export, in the request's encoding (JSON
    when it had none the receiver takes), its ``ErrorInfo`` reason the stable code."""
    status = status_pb2.Status(
        code=_GRPC_CODES.get(error.status, code_pb2.INVALID_ARGUMENT), message=error.message
    )
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=error.code, domain="spillway"))
    return _encode(status, kind if kind == PROTOBUF else JSON)


def _encode(message: Any, kind: str) -> bytes:
    if kind == PROTOBUF:
        return bytes(message.SerializeToString())
    return json.dumps(json_format.MessageToDict(message), separators=(",", ":")).encode()
