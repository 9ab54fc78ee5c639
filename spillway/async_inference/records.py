"""An asynchronous request's record: its schema, its DynamoDB item and its id scheme.

A request's id is random, or (with an ``Idempotency-Key``) a hash of the caller's scope
and its key; either way 32 lower-case hex digits, and the record says whose it is
(``scope``) and what request a key is bound to (``digest``). The execution that runs a
request is named by its id *and* its attempt (``execution_name``): a Standard execution's
name stays taken for 90 days after it ends, far longer than a record lives.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from spillway import tracing
from spillway.aws.limits import SFN_EXECUTION_NAME_CHARS
from spillway.protocol.errors import IdempotencyConflictError, RouteNotFoundError
from spillway.state import dynamo
from spillway.state.table import scope

State = Literal["queued", "running", "succeeded", "failed"]
DONE: frozenset[str] = frozenset({"succeeded", "failed"})
EXECUTION_OWNER = "execution/"
"""An execution-run record's ``owner`` prefix: no queue consumer ever claims it."""
_ID_CHARS = frozenset("0123456789abcdef")


class AsyncRecord(BaseModel):
    """One asynchronous request, as its DynamoDB item holds it."""

    model_config = ConfigDict(extra="ignore")

    id: str
    tenant: str
    scope: str | None = None
    """The caller's key segment (``spillway.state.table.scope``): whose request it is."""
    digest: str | None = None
    """The digest of (model, version, payload) an ``Idempotency-Key`` is bound to."""
    model: str
    version: str | None = None
    state: State
    created_at: float
    updated_at: float
    expires_at: int
    input: str
    output: str
    attempts: int = 0
    lease_until: float = 0.0
    owner: str | None = None
    status: int | None = None
    code: str | None = None
    error: str | None = None
    result: str | None = None
    """The S3 URL of the visible result (set with ``succeeded``)."""
    content_type: str | None = None
    header_length: int | None = None
    result_version: str | None = None
    execution: str | None = None
    """The ARN of the Step Functions execution that runs the request (None: the queue's
    consumers run it)."""
    trace: dict[str, str] | None = None
    """The trace the request was accepted in (``{"traceparent", "tracestate"}``, the
    router's span): its worker's spans join it (``spillway.async_inference.traced``)."""

    @field_validator("trace", mode="before")
    @classmethod
    def _carrier(cls, value: Any) -> dict[str, str] | None:
        """Only a well-formed carrier (``spillway.tracing.carrier_of``); anything else in
        the item is ignored, never an error."""
        carrier = tracing.carrier_of(value) if isinstance(value, Mapping) else {}
        return carrier or None

    def view(self) -> dict[str, Any]:
        """What a client may see of a pending or failed request."""
        view: dict[str, Any] = {"id": self.id, "state": self.state, "model": self.model}
        if self.version:
            view["version"] = self.version
        view["attempts"] = self.attempts
        if self.state == "failed":
            view.update(status=self.status, code=self.code, error=self.error)
        return view


def to_item(record: AsyncRecord) -> dict[str, Any]:
    """The record's DynamoDB item (unset fields left out)."""
    return dynamo.item(record.model_dump(exclude_none=True))


def from_item(item: Mapping[str, Any]) -> AsyncRecord:
    """The record a DynamoDB item holds (attributes it does not know are ignored)."""
    return AsyncRecord.model_validate(dynamo.plain_item(item))


def request_id(tenant: str | None, client_key: str | None) -> str:
    """A new request's id: random, or (with an ``Idempotency-Key``) the hash of the
    caller's scope and its key, so a retried submission finds the request it already made
    (and no tenant name, ``anonymous`` included, can reach another caller's ids)."""
    if client_key is None:
        return uuid.uuid4().hex
    return hashlib.sha256(f"{scope(tenant)}\0{client_key}".encode()).hexdigest()[:32]


def request_digest(model: str, version: str | None, body: bytes, header_length: int | None) -> str:
    """What an ``Idempotency-Key`` is bound to: the model, the version and the payload
    (the body holds any ``input_location`` / ``output_location``)."""
    digest = hashlib.sha256(f"{model}\0{version or ''}\0{header_length}\0".encode())
    digest.update(body)
    return digest.hexdigest()


def check_id(value: str) -> str:
    """A request id as ``request_id`` makes them (32 lower-case hex digits), else 404."""
    if len(value) != 32 or not set(value) <= _ID_CHARS:
        raise RouteNotFoundError("no such asynchronous request")
    return value


def owner_scope(record: AsyncRecord) -> str:
    """Whose request a record is (a record written before scopes: from its tenant)."""
    if record.scope is not None:
        return record.scope
    return scope(None if record.tenant == "anonymous" else record.tenant)


def replayed(record: AsyncRecord, digest: str) -> AsyncRecord:
    """The request an ``Idempotency-Key`` already made, if it is this same request."""
    if record.digest is not None and record.digest != digest:
        raise IdempotencyConflictError(
            "this Idempotency-Key was used for another request (model, version or payload); "
            "use a new key for a new request"
        )
    return record


def execution_arn(machine: str, name: str) -> str:
    """The ARN of execution ``name`` of a standard state machine (Step Functions' form:
    ``arn:<partition>:states:<region>:<account>:execution:<machine name>:<name>``)."""
    parts = machine.split(":")
    if len(parts) != 7 or parts[2] != "states" or parts[5] != "stateMachine":
        raise ValueError(f"not a state machine ARN: {machine[:200]}")
    return ":".join([*parts[:5], "execution", parts[6], name])


def execution_name(rid: str, attempt: str) -> str:
    """The name of the Step Functions execution that runs attempt ``attempt`` (hex) of
    request ``rid``: ``<id>-<attempt>``, 45 characters of ``[0-9a-f-]``.

    Not the request id alone: a Standard execution's name stays taken for 90 days after
    the execution ends (``spillway.aws.limits.SFN_EXECUTION_NAME_REUSE_DAYS``) while a record
    expires after ``ttl_s`` (a day), so an ``Idempotency-Key`` used again after that would
    start no execution at all (``ExecutionAlreadyExists``). Idempotency is the record's
    (its conditional write); the name only has to be this attempt's own, so that a
    retried start of it finds the execution it already started."""
    name = f"{rid}-{attempt}"
    hexes = len(rid) == 32 and bool(attempt) and set(rid + attempt) <= _ID_CHARS
    if not hexes or len(name) > SFN_EXECUTION_NAME_CHARS:
        raise ValueError(f"not a request id and attempt: {name[:100]!r}")
    return name
