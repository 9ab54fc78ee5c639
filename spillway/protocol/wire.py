"""What every transport reads off and writes onto the wire, written once.

The GPU service (ASGI), the CPU fallback (WSGI and direct invoke), the router (WSGI on
API Gateway) and the jobs API all use these: the ``Inference-Header-Content-Length`` and
JSON-header parsers, the model path and what it targets, ``s3://`` locations, the API
Gateway stage prefix, the ``timeout``/``priority`` request parameters, and the one
mapping from a ``SpillwayError`` to a status, headers and body.

No numpy here: the router imports this module and must stay light.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from spillway.protocol.errors import (
    InvalidInputError,
    MethodNotAllowedError,
    PayloadTooLargeError,
    RouteNotFoundError,
    SpillwayError,
)
from spillway.protocol.names import validate_model_name, validate_version

HEADER_LENGTH = "inference-header-content-length"
FAULT_HEADER = "x-spillway-fault"
"""On an error answer: ``server`` when the server says the failure is its own (it failed
to compute, load or serve), so a router may count it against the server's health. An
answer without it (a client error, a busy 504, an unexpected exception) never does."""
TENANT_SCOPE_HEADER = "x-spillway-tenant-scope"
"""What the router sends a backend with every request: the caller's tenant scope
(``spillway.state.table.scope``: ``-`` when anonymous, else 32 hex digits of a digest)
with the router's proof, ``<scope>.<expiry>.<signature>`` (``spillway.tenancy.proof``:
an HMAC-SHA256 over the scope and an epoch-seconds expiry, keyed with a secret only the
router and the backends read). A scope is a digest anybody can compute from a tenant's
name, so the scope alone proves nothing: a backend keys a tenant's step cache entries by
it only when the signature verifies. A value without a valid proof (none, a bare scope,
a wrong or rotated-out key, an expired one) is served, but with no tenant's cache at all;
a value that is not even of this form is refused (400). The GPU service's HTTP and gRPC
doors and the CPU fallback's HTTP and direct-invoke doors read it alike; the router
never forwards a client's own."""
TENANT_SCOPE_PATTERN = r"^(-|[0-9a-f]{32})$"
"""A tenant scope as stored (async records, cache keys, jobs): no proof, never from a
client."""
_SCOPE_CLAIM = re.compile(
    r"^(?P<scope>-|[0-9a-f]{32})(?:\.(?P<expiry>[0-9]{1,12})\.(?P<signature>[0-9a-f]{64}))?$"
)
SCOPE_CLAIM_PATTERN = _SCOPE_CLAIM.pattern
"""What ``TENANT_SCOPE_HEADER`` (or a direct invoke's ``tenant_scope``) may hold: a
scope, with or without the router's ``.<expiry>.<signature>``."""
ANONYMOUS_SCOPE = "-"
"""The scope of a caller no tenant is known for (``state_table.scope(None)``): never the
scope of a named tenant."""
JSON_CONTENT_TYPE = "application/json"
BINARY_CONTENT_TYPE = "application/octet-stream"
# A JSON header longer than this many decimal digits would be larger than any body we take.
_MAX_LENGTH_DIGITS = 12
# One hour in microseconds: no caller waits longer for a synchronous answer.
MAX_TIMEOUT_US = 3_600_000_000
MAX_PRIORITY = 1_000_000

Headers = list[tuple[str, str]]

# --- synchronous payload limits -----------------------------------------------------------
# A synchronous Lambda invocation takes and returns at most 6 MB (6 MiB) of event JSON.
# API Gateway (REST with binary media types ``*/*``, and HTTP APIs for non-text bodies)
# puts the body into that event base64-encoded (4 bytes per 3), next to the headers and
# the request context; the router's ``lambda:Invoke`` of the CPU fallback does the same.
# So the largest body that reaches a function whole is about 4.4 MiB, not 6 or 10 MB.

LAMBDA_PAYLOAD_BYTES = 6 * 1024 * 1024
"""Lambda's limit on a synchronous invocation's request and response payloads."""
EVENT_ENVELOPE_BYTES = 128 * 1024
"""Kept for what surrounds the body in an event: headers (REST caps them at 10 KB),
query, request context, identity (a generous bound)."""
SYNC_BODY_BYTES = (LAMBDA_PAYLOAD_BYTES - EVENT_ENVELOPE_BYTES) * 3 // 4
"""The largest request or response body a synchronous call carries (base64 in an event)."""
LARGE_INPUT_HINT = (
    "run larger inputs or outputs as an offline job: POST /v1/jobs with an s3:// input "
    "and output (docs/deploy.md, payload limits)"
)


def body_over_limit(size: int, limit: int, what: str = "request body") -> PayloadTooLargeError:
    """The 413 of a body over a synchronous limit, naming the way to send a large input."""
    return PayloadTooLargeError(
        f"{what} of {size} bytes exceeds the synchronous limit of {limit} bytes; "
        + LARGE_INPUT_HINT
    )


# --- bodies -----------------------------------------------------------------------------


def read_wsgi_body(environ: Mapping[str, Any], limit: int) -> bytes:
    """A WSGI request's body, never more than ``limit`` bytes read: a declared length over
    it, or a chunked body that runs past it, is a 413 naming the large-input path."""
    declared = environ.get("CONTENT_LENGTH") or ""
    stream = environ["wsgi.input"]
    if declared.isdigit():
        if int(declared) > limit:
            raise body_over_limit(int(declared), limit)
        return bytes(stream.read(int(declared)))
    if environ.get("wsgi.input_terminated"):  # chunked: read to the end, within the cap
        body = bytes(stream.read(limit + 1))
        if len(body) > limit:
            raise body_over_limit(len(body), limit, "chunked request body (at least)")
        return body
    return b""


def parse_header_length(value: str | None) -> int | None:
    """The ``Inference-Header-Content-Length`` value (absent: ``None``): ASCII digits only,
    so ``+368``, ``1_0`` or ``٣`` are refused everywhere alike."""
    if value is None:
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= _MAX_LENGTH_DIGITS):
        raise InvalidInputError("Inference-Header-Content-Length must be a non-negative integer")
    return int(text)


def split_body(body: bytes, header_length: int | None) -> tuple[bytes, memoryview]:
    """The JSON header and the binary tensor data that follows it (empty for JSON)."""
    view = memoryview(body)
    if header_length is None:
        return body, view[len(view) :]
    if not 0 <= header_length <= len(body):
        raise InvalidInputError(
            f"Inference-Header-Content-Length {header_length} is outside the body "
            f"of {len(body)} bytes"
        )
    return bytes(view[:header_length]), view[header_length:]


NOT_UTF8 = "invalid JSON: not UTF-8"
"""The one message for JSON text that is not UTF-8, or that escapes a lone surrogate (a
string no UTF-8 can carry back): every server refuses both alike."""
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def utf8_text(raw: bytes) -> str:
    """JSON text as strict UTF-8 (RFC 8259): undecodable bytes, overlong forms and
    encoded surrogates (``\\xed\\xa0\\x80``) are refused alike, with ``NOT_UTF8``."""
    try:
        return raw.decode("ascii" if raw.isascii() else "utf-8")
    except UnicodeDecodeError:
        raise InvalidInputError(NOT_UTF8) from None


def has_surrogate_escape(raw: bytes) -> bool:
    """Whether JSON text escapes a UTF-16 surrogate (``\\ud83d``, paired or not): such
    text is read the long way, through ``load_json_object``, which refuses a lone one."""
    # A one-byte search first (memchr: a tenth of a millisecond for a 2.6 MB body of
    # numbers); only text with a backslash is searched for the escape itself.
    return b"\\" in raw and _SURROGATE_ESCAPE.search(raw) is not None


def _check_escapes(raw: bytes, value: Any) -> None:
    """Refuse a lone surrogate written as an escape (``\\ud800``): valid JSON, but text no
    answer (or forwarded body) can encode. Only text that has such an escape is walked."""
    if not has_surrogate_escape(raw):
        return
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInputError(NOT_UTF8) from None


def load_json_object(raw: bytes | str) -> dict[str, Any]:
    """A JSON object; anything else (bad JSON, a list, deep nesting, text that is not
    UTF-8 or holds a lone surrogate) is the client's error.

    The bare ``NaN`` and ``Infinity`` that Python's and tritonclient's encoders write are
    read (be tolerant in what you accept); Spillway itself writes them as strings."""
    try:
        data = raw.encode("utf-8") if isinstance(raw, str) else raw
    except UnicodeEncodeError:
        raise InvalidInputError(NOT_UTF8) from None
    try:
        value = json.loads(utf8_text(data))
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"invalid JSON: {exc.msg} at position {exc.pos}") from None
    except RecursionError:
        raise InvalidInputError("invalid JSON: nested too deeply") from None
    except ValueError:  # an integer past Python's digit limit
        raise InvalidInputError("invalid JSON: a number is too long") from None
    if not isinstance(value, dict):
        raise InvalidInputError("the JSON header must be an object")
    _check_escapes(data, value)
    return value


def read_json_header(body: bytes, header_length: int | None) -> dict[str, Any]:
    """The parsed JSON header of an infer body; tensor bytes are never touched."""
    header = load_json_object(split_body(body, header_length)[0])
    parameters = header.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidInputError("parameters must be an object")
    return header


def read_tenant_scope(value: str | None) -> str:
    """A tenant scope a trusted tier stored (an async record, a job's settings); absent:
    anonymous. Never a client's header: that is a claim (``read_scope_claim``)."""
    if value is None:
        return ANONYMOUS_SCOPE
    if not re.fullmatch(TENANT_SCOPE_PATTERN, value):
        raise InvalidInputError(f"{TENANT_SCOPE_HEADER} must be - or 32 lower-case hex digits")
    return value


@dataclass(frozen=True)
class ScopeClaim:
    """A ``TENANT_SCOPE_HEADER`` value taken apart; proven only once its signature is
    checked (``spillway.tenancy.proof.ScopeProofs.verify``)."""

    scope: str
    expiry: int | None = None
    """Epoch seconds after which the proof is void (``None``: no proof)."""
    signature: str | None = None
    """HMAC-SHA256, lower-case hex (``None``: no proof)."""


def read_scope_claim(value: str | None) -> ScopeClaim | None:
    """The scope claim of a ``TENANT_SCOPE_HEADER`` value (absent: ``None``). A value that
    is not a scope, with or without a proof, is refused (400) rather than served as
    some other caller."""
    if value is None:
        return None
    match = _SCOPE_CLAIM.fullmatch(value)
    if match is None:
        raise InvalidInputError(
            f"{TENANT_SCOPE_HEADER} must be - or 32 lower-case hex digits, "
            "optionally followed by the router's .<expiry>.<signature>"
        )
    expiry = match["expiry"]
    return ScopeClaim(match["scope"], None if expiry is None else int(expiry), match["signature"])


# --- request parameters -----------------------------------------------------------------


def int_parameter(
    parameters: Mapping[str, Any] | None, key: str, maximum: int | None = None
) -> int | None:
    """A non-negative integer parameter (absent: ``None``), at most ``maximum``."""
    value = (parameters or {}).get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(f"parameter {key!r} must be a non-negative integer")
    if maximum is not None and value > maximum:
        raise InvalidInputError(f"parameter {key!r} must be at most {maximum}")
    return value


# The routing parameters: the router acts on them, every server checks them alike, so a
# value one server refuses is refused by all (a backend ignores what they ask for).
MODES = ("auto", "realtime", "serverless", "batch", "async")
# API Gateway and Lambda alone take tens of milliseconds: a smaller budget cannot be met.
MIN_BUDGET_MS = 100
MAX_BUDGET_MS = 3_600_000
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


def routing_mode(value: Any) -> str | None:
    """A ``mode`` hint: one of ``MODES`` (absent: ``None``)."""
    if value is None:
        return None
    if value not in MODES:
        raise InvalidInputError(f"mode must be one of {', '.join(MODES)}")
    return str(value)


def _number(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise InvalidInputError(f"{what} must be a number") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInputError(f"{what} must be a finite number")
    try:
        number = float(value)  # an integer like 10**400 overflows here
    except OverflowError:
        raise InvalidInputError(f"{what} is out of range") from None
    if not math.isfinite(number):
        raise InvalidInputError(f"{what} must be a finite number")
    return number


def latency_budget_ms(value: Any) -> float | None:
    """A ``latency_budget_ms`` hint (a number, or its text in a header)."""
    number = _number(value, "latency_budget_ms")
    if number is not None and not MIN_BUDGET_MS <= number <= MAX_BUDGET_MS:
        raise InvalidInputError(
            f"latency_budget_ms must be between {MIN_BUDGET_MS} and {MAX_BUDGET_MS}"
        )
    return number


def priority_hint(value: Any) -> int | None:
    """A ``priority`` hint as a header gives it (text of a whole number)."""
    number = _number(value, "priority")
    if number is None:
        return None
    if number != int(number) or not 0 <= number <= MAX_PRIORITY:
        raise InvalidInputError("priority must be a non-negative integer")
    return int(number)


def tenant_hint(value: Any) -> str | None:
    """A ``tenant`` a request claims (it counts only where the router trusts claims)."""
    if value is None:
        return None
    if not isinstance(value, str) or not _TENANT.fullmatch(value):
        raise InvalidInputError("tenant must be 1-128 letters, digits or ._:@-")
    return value


@dataclass(frozen=True)
class InferParameters:
    """The request parameters a server acts on: deadline and priority."""

    timeout_us: int | None = None
    priority: int | None = None

    @property
    def timeout_s(self) -> float | None:
        """The timeout in seconds (``None``: none given)."""
        return None if self.timeout_us is None else self.timeout_us / 1e6

    @classmethod
    def of(cls, parameters: Mapping[str, Any] | None) -> InferParameters:
        """Validated ``timeout`` (microseconds, at most an hour; 0 means none, as in
        Triton) and ``priority`` (0: the model's default level; whether the model has
        that level is ``spillway.inference.check_priority``'s to say). The routing
        parameters (``mode``, ``latency_budget_ms``, ``tenant``) are checked too, so
        every server refuses the same values the router does."""
        timeout = int_parameter(parameters, "timeout", MAX_TIMEOUT_US)
        priority = int_parameter(parameters, "priority", MAX_PRIORITY)
        if parameters:
            routing_mode(parameters.get("mode"))
            latency_budget_ms(parameters.get("latency_budget_ms"))
            tenant_hint(parameters.get("tenant"))
        return cls(timeout_us=timeout or None, priority=priority)


# --- paths ------------------------------------------------------------------------------

MODEL_PATH = re.compile(
    r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?"
    r"(?:/(?P<op>ready|config|stats|infer))?$"
)


@dataclass(frozen=True)
class Target:
    """What a request asks for: an operation, maybe on a model (and version)."""

    operation: str
    """``infer``, ``metadata``, ``ready``, ``config``, ``stats`` or ``server``."""
    model: str | None = None
    version: str | None = None

    @property
    def path(self) -> str:
        """The canonical path (never a client's raw path)."""
        if self.model is None:
            return "/v2/models/stats" if self.operation == "stats" else "/v2"
        path = f"/v2/models/{self.model}"
        if self.version is not None:
            path += f"/versions/{self.version}"
        return path if self.operation == "metadata" else f"{path}/{self.operation}"

    @property
    def method(self) -> str:
        """The one HTTP method the operation takes."""
        return "POST" if self.operation == "infer" else "GET"


def model_target(path: str) -> Target | None:
    """The target of a ``/v2/models/...`` path, names validated; ``None`` if it is none.

    ``/v2/models/stats`` (every model's statistics) is the ``stats`` target with no model.
    """
    match = MODEL_PATH.match(path)
    if match is None:
        return None
    model, version, op = match["model"], match["version"], match["op"]
    if model == "stats" and version is None and op is None:
        return Target("stats")
    if version is not None:
        validate_version(version)
    return Target(op or "metadata", validate_model_name(model), version)


def require_model_target(path: str) -> Target:
    """Like ``model_target``, but a path that names no model is 404."""
    target = model_target(path)
    if target is None:
        raise no_route(path)
    return target


def allow(method: str, path: str, allowed: str) -> None:
    """405 with ``Allow`` unless ``method`` is the one allowed (call it only for a path
    that exists: a 405 says the path is there)."""
    if method != allowed:
        raise MethodNotAllowedError(f"{method[:16]} is not allowed on {path[:200]}", allow=allowed)


def no_route(path: str) -> RouteNotFoundError:
    """The 404 of a path no route has, whatever its method."""
    return RouteNotFoundError(f"no route for {path[:200]}")


def allow_get(method: str, path: str, routes: Container[str]) -> None:
    """One of a server's fixed ``GET`` paths (``routes``) with any other method is 405;
    a path that is not among them is 404 whatever the method (``POST /v2/model/m/infer``,
    a typo, is no route rather than a wrong method)."""
    if path not in routes:
        raise no_route(path)
    allow(method, path, "GET")


def strip_stage(path: str, event: object) -> str:
    """``path`` without an HTTP API stage name: an HTTP API (v2 event) with a named stage
    keeps the stage in ``rawPath``; REST APIs and ``$default`` do not."""
    if isinstance(event, dict) and event.get("version") == "2.0":
        stage = (event.get("requestContext") or {}).get("stage")
        if stage and stage != "$default" and path.startswith(f"/{stage}/"):
            return path[len(stage) + 1 :]
    return path


# --- s3:// locations --------------------------------------------------------------------

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3Location:
    """``s3://bucket/prefix``: the prefix has no leading ``/`` and keeps a trailing one."""

    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        """The location as ``s3://bucket/prefix``."""
        return f"s3://{self.bucket}/{self.prefix}"

    def key(self, *parts: str) -> str:
        """A key below the prefix, joined with ``/``."""
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p.strip("/"))


def is_s3_url(value: str) -> bool:
    """Whether ``value`` is meant as an ``s3://`` location (it may still be invalid)."""
    return value.startswith("s3://")


def parse_s3_url(value: str) -> S3Location:
    """The bucket and prefix of ``s3://bucket[/prefix]``; a bad one is ``InvalidInputError``."""
    if not is_s3_url(value) or "\\" in value or len(value) > 1024:
        raise InvalidInputError(f"{value[:200]!r} is not an s3://bucket/prefix location")
    bucket, _, prefix = value.removeprefix("s3://").partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise InvalidInputError(f"{value[:200]!r} does not name a valid bucket")
    return S3Location(bucket, prefix.lstrip("/"))


# --- errors to responses ----------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """Status, headers (names lower-case) and body of a response."""

    status: int
    headers: Headers
    body: bytes

    def header(self, name: str) -> str | None:
        """The first value of a header."""
        return next((v for k, v in self.headers if k == name), None)


def json_bytes(value: Any) -> bytes:
    """Compact JSON."""
    return json.dumps(value, separators=(",", ":")).encode()


def json_reply(status: int, value: Any, headers: Headers | None = None) -> Reply:
    """A JSON response."""
    return Reply(status, [("content-type", JSON_CONTENT_TYPE), *(headers or [])], json_bytes(value))


def infer_reply(
    body: bytes, header_length: int | None, version: int, extra: Headers | None = None
) -> Reply:
    """The 200 of an infer request, on every server: the model version that answered,
    ``extra`` (a server's load report), and JSON or binary with its header length."""
    headers: Headers = [("x-spillway-model-version", str(version)), *(extra or [])]
    if header_length is None:
        headers.append(("content-type", JSON_CONTENT_TYPE))
    else:
        headers += [
            ("content-type", BINARY_CONTENT_TYPE),
            (HEADER_LENGTH, str(header_length)),
        ]
    return Reply(200, headers, body)


def error_reply(error: SpillwayError) -> Reply:
    """The one response of an error, on every transport: its status, ``{"error", "code"}``,
    ``Retry-After`` (whole seconds, at least 1) when it carries one, ``Allow`` on 405, and
    the server-fault mark on a 5xx the server knows is its own (504 means busy)."""
    headers: Headers = []
    if error.status >= 500 and error.status != 504:
        headers.append((FAULT_HEADER, "server"))
    if error.retry_after_s is not None:
        headers.append(("retry-after", str(max(1, round(error.retry_after_s)))))
    if isinstance(error, MethodNotAllowedError) and error.allow:
        headers.append(("allow", error.allow))
    return json_reply(error.status, error.to_body(), headers)


_PHRASES = {status.value: status.phrase for status in HTTPStatus}


def status_phrase(status: int) -> str:
    """The reason phrase every transport writes after a status (``Unknown`` for a status
    HTTP does not name)."""
    return _PHRASES.get(status, "Unknown")


INTERNAL_ERROR = json_reply(500, {"error": "internal error", "code": "internal"})
"""The last-resort answer to an unexpected exception (logged with its traceback)."""


def refused(log: logging.Logger, error: SpillwayError, **where: object) -> Reply:
    """The reply to a refused request, logged once at INFO on every transport: ``refused``
    with where it happened (``where``: method, path, request id…) and the error's status,
    code and reason."""
    fields = {**where, "status": error.status, "code": error.code, "reason": error.message}
    log.info("refused", extra=fields)
    return error_reply(error)


def unhandled(log: logging.Logger, **where: object) -> Reply:
    """The reply to an unexpected exception (call it from its ``except``): logged with its
    traceback as ``unhandled error`` and where it happened; answered ``INTERNAL_ERROR``."""
    log.exception("unhandled error", extra=where)
    return INTERNAL_ERROR


def guarded(log: logging.Logger, answer: Callable[[], Reply], **where: object) -> Reply:
    """``answer()``, or the reply to what it raised: a ``SpillwayError`` as ``refused``,
    anything else as ``unhandled``. Never raises."""
    try:
        return answer()
    except SpillwayError as error:
        return refused(log, error, **where)
    except Exception:  # noqa: BLE001 - logged with its traceback by unhandled()
        return unhandled(log, **where)
