"""What a request carries besides its body's framing, read alike by every transport.

The GPU service (ASGI), the CPU fallback (WSGI and direct invoke), the router (WSGI on
API Gateway) and the jobs API all use these: the synchronous payload limits and a WSGI
body read within them, the tenant scope header and its claims, the ``timeout``/``priority``
and routing request parameters, the model path and what it targets, and the API Gateway
stage prefix. A body's framing and JSON are ``spillway.protocol.framing``'s, the replies
and the one mapping from a ``SpillwayError`` to a response ``spillway.protocol.replies``'s,
``s3://`` locations ``spillway.protocol.s3urls``'s.

No numpy here: the router imports this module and must stay light.
"""

from __future__ import annotations

import math
import re
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any

from spillway.protocol.errors import (
    InvalidInputError,
    MethodNotAllowedError,
    PayloadTooLargeError,
    RouteNotFoundError,
)
from spillway.protocol.names import validate_model_name, validate_version

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


# --- the tenant scope header ----------------------------------------------------------

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

# One hour in microseconds: no caller waits longer for a synchronous answer.
MAX_TIMEOUT_US = 3_600_000_000
MAX_PRIORITY = 1_000_000


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


TOKEN_COUNT = "token_count"  # noqa: S105 - a parameter name, not a secret
"""The answer parameter of a text request (``parameters.token_count`` of an infer
response): the tokens the model read for it, every row's after truncation, special tokens
included. Written by the one request path every server runs (``spillway.inference``),
read by the router's OpenAI-compatible door as the request's usage."""


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
