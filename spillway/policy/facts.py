"""What the router reads from a request: routing hints, sizes and the JSON header.

Hints come from the infer request's ``parameters`` first, then from headers
(``x-spillway-mode``, ``x-spillway-latency-budget-ms``, ``x-spillway-priority``,
``x-spillway-tenant``). For a binary body only the JSON header (the first
``Inference-Header-Content-Length`` bytes) is parsed, with the core's parsers; tensor
bytes are never touched. Sizes are estimates for the policy: elements from the shapes,
text tokens as UTF-8 bytes / 4. A session id (``x-spillway-session`` for canary
affinity, the session state API's path) is checked by ``check_session_id``. Nothing here
imports numpy.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pydantic_core

from spillway.protocol.errors import InvalidInputError
from spillway.protocol.framing import HEADER_LENGTH, parse_header_length, read_json_header
from spillway.protocol.wire import MAX_BUDGET_MS as MAX_BUDGET_MS  # the router's names for them
from spillway.protocol.wire import MIN_BUDGET_MS as MIN_BUDGET_MS
from spillway.protocol.wire import MODES as MODES
from spillway.protocol.wire import (
    InferParameters,
    Target,
    latency_budget_ms,
    priority_hint,
    routing_mode,
    tenant_hint,
)

_BYTES_PER_TOKEN = 4
_SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class Call:
    """One client request, transport-free; header names are lower-case."""

    method: str
    headers: Mapping[str, str]
    body: bytes
    request_id: str
    remaining_ms: float | None = None
    trusted_tenant: str | None = None


@dataclass(frozen=True)
class RequestFacts:
    """Everything the policy may look at, for one request."""

    method: str
    path: str
    operation: str
    """``infer``, ``metadata``, ``ready``, ``config``, ``stats`` or ``server``."""
    model: str | None = None
    version: str | None = None
    mode: str | None = None
    latency_budget_ms: float | None = None
    priority: int | None = None
    tenant: str | None = None
    payload_bytes: int = 0
    input_elements: int | None = None
    input_tokens: int | None = None
    rows: int = 1


@dataclass(frozen=True)
class Request:
    """A call as the router understands it: its target, the facts the policy sees, the
    parsed JSON header (infer only) with its length, and the client's ``Idempotency-Key``
    (only batch mode uses it, and checks it)."""

    call: Call
    target: Target
    facts: RequestFacts
    header: dict[str, Any] | None = None
    header_length: int | None = None
    idempotency_key: str | None = None


def read_request(call: Call, target: Target, *, trust_tenant_hints: bool = False) -> Request:
    """Read a call; a malformed one is the client's error (``InvalidInputError``).

    The tenant is the authorizer's; the one the request claims counts only when
    ``trust_tenant_hints`` (no authorizer in front to set it)."""
    header: dict[str, Any] | None = None
    length = parse_header_length(call.headers.get(HEADER_LENGTH))
    if target.operation == "infer":
        header = read_json_header(call.body, length)
        # The parameters every backend would refuse (a ``timeout`` or ``priority`` that is
        # negative, not an integer or past its bound; a routing parameter out of range) are
        # refused here alike, by the same core check, rather than forwarded or replaced.
        InferParameters.of(header.get("parameters"))
    hints = read_hints(header.get("parameters") if header else None, call.headers)
    elements, tokens, rows = input_size(header) if header else (None, None, 1)
    facts = RequestFacts(
        method=call.method,
        path=target.path,
        operation=target.operation,
        model=target.model,
        version=target.version,
        mode=hints.mode,
        latency_budget_ms=hints.latency_budget_ms,
        priority=hints.priority,
        tenant=call.trusted_tenant or (hints.tenant if trust_tenant_hints else None),
        payload_bytes=len(call.body),
        input_elements=elements,
        input_tokens=tokens,
        rows=rows,
    )
    return Request(call, target, facts, header, length, call.headers.get("idempotency-key"))


@dataclass(frozen=True)
class Hints:
    """The routing hints of one request, validated."""

    mode: str | None = None
    latency_budget_ms: float | None = None
    priority: int | None = None
    tenant: str | None = None


def read_hints(parameters: Mapping[str, Any] | None, headers: Mapping[str, str]) -> Hints:
    """Hints from request parameters, else headers; bad values are the client's error."""
    params = parameters or {}

    def pick(key: str) -> Any:
        value = params.get(key)
        if value is None:
            value = headers.get(f"x-spillway-{key.replace('_', '-')}")
        return value

    mode = routing_mode(pick("mode"))
    if mode is None and "respond-async" in headers.get("prefer", "").lower():
        mode = "async"  # RFC 7240
    return Hints(
        mode=mode,
        latency_budget_ms=latency_budget_ms(pick("latency_budget_ms")),
        priority=priority_hint(pick("priority")),
        tenant=tenant_hint(pick("tenant")),
    )


def check_session_id(value: str) -> str:
    """A session id: 1-128 letters, digits or ``._-``, starting with a letter or digit."""
    if not _SESSION_ID.fullmatch(value):
        raise InvalidInputError(
            "a session id must be 1-128 letters, digits or ._- starting with a letter or digit"
        )
    return value


def input_size(header: Mapping[str, Any]) -> tuple[int | None, int | None, int]:
    """Estimated (elements, text tokens, rows) of an infer request's inputs."""
    inputs = header.get("inputs")
    if not isinstance(inputs, list):
        return None, None, 1
    elements, tokens, rows = 0, 0, 1
    for index, tensor in enumerate(inputs):
        shape = tensor.get("shape") if isinstance(tensor, dict) else None
        if not isinstance(shape, list) or not all(_dim(d) for d in shape):
            return None, None, 1
        elements += math.prod(shape)
        if index == 0 and shape:
            rows = max(1, shape[0])
        if tensor.get("datatype") == "BYTES":
            tokens += _text_tokens(tensor)
    return elements, tokens, rows


def _dim(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**40


def _text_tokens(tensor: dict[str, Any]) -> int:
    size = (tensor.get("parameters") or {}).get("binary_data_size")
    if isinstance(size, int) and not isinstance(size, bool):
        return math.ceil(size / _BYTES_PER_TOKEN)
    data = tensor.get("data")
    stack, total = [data], 0
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            total += len(item.encode("utf-8", "surrogatepass"))  # counting, not sending
    return math.ceil(total / _BYTES_PER_TOKEN)


def with_timeout(
    body: bytes,
    header: dict[str, Any],
    header_length: int | None,
    timeout_us: int,
    priority: int | None = None,
) -> tuple[bytes, int | None]:
    """The body with ``parameters.timeout`` set to ``timeout_us`` (a lower value the client
    sent is kept) and a ``parameters.priority`` the client sent lowered to the priority it
    may use, and its new header length. Binary tensor bytes are carried over as-is."""
    parameters = dict(header.get("parameters") or {})
    if priority and parameters.get("priority"):  # the level the backend's batcher uses
        parameters["priority"] = priority
    current = parameters.get("timeout")
    if isinstance(current, int) and not isinstance(current, bool) and 0 < current <= timeout_us:
        timeout_us = current
    parameters["timeout"] = timeout_us
    # Once per attempt on the whole JSON header (all of a JSON body's data): pydantic-core
    # writes it several times faster than json.dumps, with the same numbers.
    try:
        head = pydantic_core.to_json({**header, "parameters": parameters}, inf_nan_mode="constants")
    except pydantic_core.PydanticSerializationError:  # e.g. a lone surrogate in a string
        raise InvalidInputError("the request holds text that is not valid Unicode") from None
    if header_length is None:
        return head, None
    return head + body[header_length:], len(head)
