"""Asynchronous inference: a request is accepted at once and answered later, once.

The router (``submit``) stages the request body in S3, writes its record to DynamoDB
(``queued``) and sends its id to an SQS queue. A consumer — the GPU service when its
batchers have room, the CPU fallback when the oldest request has waited too long —
``receive``\\ s ids, ``claim``\\ s the record (``running``, under a lease as long as the
message's visibility timeout), runs the request through the ordinary pipeline and
``settle``\\ s it: the result goes to S3 under a key only that attempt writes, and the
record flips to ``succeeded`` or ``failed`` with one conditional write, so whatever SQS
redelivers and whichever consumer crashes, exactly one result is ever visible. A
request that fails for a reason of the server's is retried until its ``max_attempts``-th
delivery; then its record says ``failed`` with the error and the message moves to the
queue's dead-letter queue (its redrive target: SQS's own redrive also catches a message
whose consumers crash before settling it). A client's error (400) fails at once.

One tenancy model: every place a request names lies in its caller's own *area*
(``spillway.tenancy.areas``: ``<root>/<scope>/``, one per root — ``<location>/inputs`` and each
of ``input_prefixes``), anything else is 403 ``outside_tenant_area``; an input that is not
there is a 400 ``input_not_found`` at once (and a client failure, recorded once, if it
vanishes later); results go to keys the server chooses (``<output>/<id>/result-<attempt>``),
never to a key a request names. An ``Idempotency-Key`` is scoped to the caller and bound
to a digest of (model, version, payload): another request under the same key is 409.
Admission (``submit``'s ``admit`` hook: the router's per-tenant quota) runs after a
replay is recognised and before anything is staged. Consumers take their deliveries in
``fair_order``: the tenant with the fewest requests running goes first.

Records and results expire: DynamoDB's TTL (``expires_at``) and an S3 lifecycle rule on
the results prefix remove them on AWS; readers treat an expired record as gone (TTL
deletes lazily) and ``purge_expired`` removes them where no TTL runs (the local stack).

No numpy here: the router imports this module.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

from spillway.envsettings import json_mapping, prefixed_values
from spillway.protocol.errors import (
    IdempotencyConflictError,
    InputNotFoundError,
    InvalidInputError,
    PayloadTooLargeError,
    RouteNotFoundError,
    SpillwayError,
    UnavailableError,
)
from spillway.protocol.messages import read_staged_request, stage_request
from spillway.protocol.names import validate_model_name, validate_version
from spillway.protocol.wire import (
    BINARY_CONTENT_TYPE,
    HEADER_LENGTH,
    JSON_CONTENT_TYPE,
    Reply,
    json_reply,
    parse_s3_url,
)
from spillway.state.table import scope
from spillway.tenancy.areas import area, folder, require_inside

ENV_PREFIX = "ASYNC_"
State = Literal["queued", "running", "succeeded", "failed"]
DONE: frozenset[str] = frozenset({"succeeded", "failed"})
MAX_INPUT_BYTES = 1024**3
"""The largest ``input_location`` object ``max_input_bytes`` may allow (1 GiB)."""
# S3's answers to a HEAD of a key that is not there: 404, or 403 for a caller without
# s3:ListBucket (the roles have none: they read keys they are told, never list).
_MISSING = frozenset({"404", "NoSuchKey", "NotFound", "403", "AccessDenied", "Forbidden"})
_ID_CHARS = frozenset("0123456789abcdef")
_PENDING = "1"  # the sparse index's one partition: only pending records carry it
_QUEUE_COUNTS = (
    "ApproximateNumberOfMessages",
    "ApproximateNumberOfMessagesNotVisible",
    "ApproximateNumberOfMessagesDelayed",
)
_PAGE = 25  # pending index entries read per query
ORPHAN_AFTER_S = 300.0
"""How long a pending record must have been untouched, with the queue empty, before the
drain check takes its message as lost (SQS's counts lag by about a minute)."""
# Attribute names that are DynamoDB reserved words.
_NAMES = {"#s": "state", "#st": "status", "#o": "owner"}


class AsyncSettings(BaseModel):
    """Where asynchronous requests live (``ASYNC_<FIELD>`` in the environment); the
    router, the GPU service and the CPU fallback read the same variables."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    table: str | None = None
    """DynamoDB table of request records (key ``id``, TTL attribute ``expires_at``, sparse
    index ``pending`` on ``pending``/``created_at``); unset: async mode is off."""
    queue_url: str | None = None
    """SQS queue of request ids (its redrive policy sends a message to the dead-letter
    queue after ``max_attempts`` deliveries)."""
    location: str | None = None
    """``s3://bucket/prefix`` where request bodies and results are kept."""
    input_prefixes: list[str] = Field(default_factory=list)
    """More roots of tenant areas (``s3://bucket/prefix``) besides ``<location>/inputs``:
    a request's ``input_location`` / ``output_location`` must lie in
    ``<root>/<tenant scope>/`` of one of them (the consumers read and write there with
    their own roles). A root may not overlap ``<location>`` outside its ``inputs/``."""
    ttl_s: int = Field(default=86_400, ge=60, le=30 * 86_400)
    """How long a request's record and result are kept after it is accepted."""
    max_attempts: int = Field(default=3, ge=1, le=20)
    """Deliveries before a request that keeps failing is given up (equal to the queue's
    ``maxReceiveCount``)."""
    lease_s: int = Field(default=60, ge=1, le=43_200)
    """How long a claimed request is held by one consumer (the queue's visibility
    timeout); after it, a redelivery may take it over."""
    topic_arn: str | None = None
    """SNS topic told of every finished request (``{"id", "state", "status"}``); unset:
    none."""
    drain_age_s: float = Field(default=120.0, ge=0)
    """Age of the oldest pending request past which the CPU fallback drains the queue."""
    max_input_bytes: int = Field(default=MAX_INPUT_BYTES, ge=1, le=MAX_INPUT_BYTES)
    """Largest object an ``input_location`` may name (checked with a HEAD when the
    request is submitted: 413 beyond it)."""
    tenant_max_inflight: int = Field(default=32, ge=1, le=2000)
    """Async requests one tenant may have queued or running at once (counted in the
    router's state table); past it a submission is 429 ``quota_exceeded`` with
    Retry-After. It bounds how far one tenant's burst can get ahead of another's request."""
    tenant_max_staged_bytes: int = Field(default=256 * 1024**2, ge=1024, le=64 * 1024**3)
    """Request bodies the router may hold staged in S3 for one tenant: those of its async
    requests in flight, and (a budget of its own) its batch-mode requests staged within
    ``staging_window_s``; past it 429 ``quota_exceeded``."""
    quota_recheck_s: float = Field(default=5.0, ge=0.1, le=3600)
    """How long a counted request is taken as still in flight before the quota, when
    full, reads its record again (a settled request frees its place within this)."""
    staging_window_s: float = Field(default=3600.0, ge=1, le=30 * 86_400)
    """The window of the batch-mode staging budget: bytes a tenant staged longer ago
    than this no longer count."""
    tenant_max_batch_staged: int = Field(default=1000, ge=1, le=2000)
    """Batch-mode requests one tenant may stage within ``staging_window_s``."""
    lookahead: int = Field(default=10, ge=0, le=100)
    """Deliveries a consumer holds beyond those it runs, to pick the next request from
    the tenant with the fewest running (0: first come, first served)."""
    state_machines: dict[str, str] = Field(default_factory=dict)
    """Pipelines that run as a Step Functions execution (JSON ``{"pipeline": "<state
    machine ARN>"}``): an async request for one of them is started as an execution of its
    state machine instead of being queued, and the execution's end settles its record.
    The templates name every pipeline with a definition in ``infra/statemachines``."""

    @field_validator("state_machines", mode="before")
    @classmethod
    def _mapping(cls, value: Any) -> Any:
        return json_mapping(value)

    @field_validator("input_prefixes", mode="before")
    @classmethod
    def _list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part for part in value.replace(",", " ").split() if part]
        return value

    @property
    def enabled(self) -> bool:
        """Whether the table, queue and location are all set."""
        return bool(self.table and self.queue_url and self.location)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AsyncSettings:
        """Settings from ``ASYNC_*`` variables (empty values count as unset)."""
        return cls.model_validate(prefixed_values(cls, ENV_PREFIX, environ))


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

    def view(self) -> dict[str, Any]:
        """What a client may see of a pending or failed request."""
        view: dict[str, Any] = {"id": self.id, "state": self.state, "model": self.model}
        if self.version:
            view["version"] = self.version
        view["attempts"] = self.attempts
        if self.state == "failed":
            view.update(status=self.status, code=self.code, error=self.error)
        return view


@dataclass(frozen=True)
class Message:
    """A delivery of one request id from the queue."""

    id: str
    receipt: str
    receive_count: int
    scope: str = ""
    """The requesting tenant's key segment (for ``fair_order``; never its name)."""


@dataclass(frozen=True)
class Job:
    """A claimed request: its record and the delivery it came with."""

    record: AsyncRecord
    message: Message
    token: str
    """This attempt's own token: its result key is its own."""


def _item(record: AsyncRecord) -> dict[str, Any]:
    values = record.model_dump(exclude_none=True)
    item: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, bool):
            item[key] = {"BOOL": value}
        elif isinstance(value, int | float):
            item[key] = {"N": repr(value)}
        else:
            item[key] = {"S": str(value)}
    return item


def _record(item: Mapping[str, Any]) -> AsyncRecord:
    values: dict[str, Any] = {}
    for key, typed in item.items():
        if "N" in typed:
            number = float(typed["N"])
            values[key] = int(number) if number.is_integer() and key != "created_at" else number
        elif "S" in typed:
            values[key] = typed["S"]
    return AsyncRecord.model_validate(values)


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


def fair_order(messages: Iterable[Message], running: Mapping[str, int]) -> list[Message]:
    """The deliveries in the order to run them: each next one from the tenant with the
    fewest requests running (``running``, by scope) plus those picked before it, first
    come first served among equals. One tenant's burst so waits its turn behind
    another's single request instead of ahead of it."""
    load = Counter(running)
    left = list(messages)
    order: list[Message] = []
    while left:
        best = min(range(len(left)), key=lambda i: (load[left[i].scope], i))
        message = left.pop(best)
        load[message.scope] += 1
        order.append(message)
    return order


def check_id(value: str) -> str:
    """A request id as ``request_id`` makes them (32 lower-case hex digits), else 404."""
    if len(value) != 32 or not set(value) <= _ID_CHARS:
        raise RouteNotFoundError("no such asynchronous request")
    return value


Admit = Callable[[str, int, float], None]
"""The router's admission of a new request (its id, the bytes staged for it, now):
returns, or raises (``QuotaExceededError``)."""
EXECUTION_OWNER = "execution/"
"""An execution-run record's ``owner`` prefix: no queue consumer ever claims it."""


class Starter(Protocol):
    """Starts the Step Functions execution that runs a request, instead of queueing it:
    an execution of ``machine`` named by the request id."""

    machine: str

    def __call__(self, record: AsyncRecord) -> None: ...


def execution_arn(machine: str, name: str) -> str:
    """The ARN of execution ``name`` of a standard state machine (Step Functions' form:
    ``arn:<partition>:states:<region>:<account>:execution:<machine name>:<name>``)."""
    parts = machine.split(":")
    if len(parts) != 7 or parts[2] != "states" or parts[5] != "stateMachine":
        raise ValueError(f"not a state machine ARN: {machine[:200]}")
    return ":".join([*parts[:5], "execution", parts[6], name])


class AsyncStore:
    """The records (DynamoDB), bodies and results (S3) and the queue (SQS)."""

    def __init__(
        self,
        settings: AsyncSettings,
        *,
        clients: Callable[[str], Any] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not settings.enabled:
            raise ValueError("async inference needs ASYNC_TABLE, ASYNC_QUEUE_URL, ASYNC_LOCATION")
        self.settings = settings
        self.table = str(settings.table)
        self.queue_url = str(settings.queue_url)
        self.location = parse_s3_url(str(settings.location))
        own = folder(self.location.url)
        self._roots = [f"{own}inputs/", *(folder(p) for p in settings.input_prefixes)]
        for root in self._roots[1:]:
            # The server's own keys (<location>/<id>/...) are never in a tenant's area.
            if (own.startswith(root) or root.startswith(own)) and not root.startswith(
                self._roots[0]
            ):
                raise ValueError(f"ASYNC_INPUT_PREFIXES {root} overlaps ASYNC_LOCATION {own}")
        self._make = clients
        self._clients: dict[str, Any] = {}
        self.clock = clock

    def client(self, service: str) -> Any:
        """The boto3 client of a service (made on first use)."""
        if service not in self._clients:
            if self._make is not None:
                self._clients[service] = self._make(service)
            else:
                from spillway.models.repository import aws_client

                self._clients[service] = aws_client(service)
        return self._clients[service]

    # --- the router's side ------------------------------------------------------------

    def areas(self, tenant: str | None) -> list[str]:
        """The caller's own areas: where its ``input_location`` / ``output_location`` may
        point (``<root>/<scope>/`` of each root)."""
        return [area(root, tenant) for root in self._roots]

    def staged_url(self, rid: str) -> str:
        """Where the router stages a request's body (the server's own key)."""
        return f"s3://{self.location.bucket}/{self.location.key(rid, 'request.v2req')}"

    def submit(
        self,
        *,
        tenant: str | None,
        model: str,
        version: str | None,
        body: bytes,
        header_length: int | None,
        client_key: str | None = None,
        input_location: str | None = None,
        output_location: str | None = None,
        admit: Admit | None = None,
        start: Starter | None = None,
    ) -> tuple[AsyncRecord, bool]:
        """Accept a request: the record (``queued``) and whether it already existed (an
        ``Idempotency-Key`` replay of the same request; another one is 409). With
        ``start`` the request runs as the execution it starts (the record ``running``,
        outside the pending index and the queue) until ``settle_execution``."""
        validate_model_name(model)
        if version is not None:
            validate_version(version)
        own = self.areas(tenant)
        source = self._input_place(input_location, own) if input_location is not None else None
        rid = request_id(tenant, client_key)
        output = (
            f"{require_inside(output_location, own, 'output')}{rid}/"
            if output_location is not None
            else f"s3://{self.location.bucket}/{self.location.key(rid)}/"
        )
        digest = request_digest(model, version, body, header_length)
        existing = self.find(rid)
        if existing is not None:
            return _replayed(existing, digest), True
        staged = b"" if source is not None else stage_request(body, header_length)
        if source is not None:
            self._check_input(source)
        now = self.clock()
        if admit is not None:
            admit(rid, len(staged), now)
        if source is None:
            self.client("s3").put_object(
                Bucket=self.location.bucket,
                Key=self.location.key(rid, "request.v2req"),
                Body=staged,
            )
        record = AsyncRecord(
            id=rid,
            tenant=tenant or "anonymous",
            scope=scope(tenant),
            digest=digest,
            model=model,
            version=version,
            state="queued",
            created_at=now,
            updated_at=now,
            expires_at=int(now + self.settings.ttl_s),
            input=source or self.staged_url(rid),
            output=output,
        )
        if start is not None:
            token = uuid.uuid4().hex[:12]
            record = record.model_copy(
                update={
                    "state": "running",
                    "owner": EXECUTION_OWNER + token,
                    "attempts": 1,
                    "execution": execution_arn(start.machine, rid),
                }
            )
        item = {**_item(record), **({} if start else {"pending": {"S": _PENDING}})}
        from botocore.exceptions import ClientError

        try:
            # An expired record DynamoDB's TTL has not deleted yet may be replaced.
            self.client("dynamodb").put_item(
                TableName=self.table,
                Item=item,
                ConditionExpression="attribute_not_exists(id) OR expires_at < :now",
                ExpressionAttributeValues={":now": {"N": repr(now)}},
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ConditionalCheckFailedException":
                raise
            found = self.find(rid)
            if found is None:
                raise UnavailableError("the request record could not be written") from exc
            return _replayed(found, digest), True
        if start is not None:
            return self._started(record, start), False
        message = {"id": rid, "scope": record.scope}
        self.client("sqs").send_message(QueueUrl=self.queue_url, MessageBody=json.dumps(message))
        return record, False

    def _input_place(self, url: str, own: list[str]) -> str:
        """An ``input_location``: an object strictly inside one of the caller's areas."""
        inside = require_inside(url, own, "input")
        if url.endswith("/") or inside in own:
            raise InvalidInputError(
                f"input_location must name an object inside your area ({', '.join(own)})"
            )
        return inside.rstrip("/")

    def _check_input(self, source: str) -> dict[str, Any]:
        """The named input's HEAD: it is there (else 400 ``input_not_found``) and not
        too large (else 413)."""
        head = self._client_object(source, "head_object")
        if int(head["ContentLength"]) > self.settings.max_input_bytes:
            raise PayloadTooLargeError(
                f"input_location holds {head['ContentLength']} bytes; the limit is "
                f"{self.settings.max_input_bytes}"
            )
        return head

    def _client_object(self, source: str, operation: str) -> dict[str, Any]:
        """``head_object`` / ``get_object`` of a client's object; a missing (or unreadable)
        one is the client's ``InputNotFoundError``."""
        from botocore.exceptions import ClientError

        place = parse_s3_url(source)
        try:
            answer: dict[str, Any] = getattr(self.client("s3"), operation)(
                Bucket=place.bucket, Key=place.prefix
            )
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code", "")) not in _MISSING:
                raise
            raise InputNotFoundError(
                f"input_location {source[:200]!r} does not exist (or cannot be read)"
            ) from None
        return answer

    def still_pending(self, rid: str) -> bool:
        """Whether a request is queued or running (not settled, expired or unknown)."""
        record = self.find(rid)
        return record is not None and record.state not in DONE

    def find(self, rid: str) -> AsyncRecord | None:
        """The record of a request id, or None (also when it has expired)."""
        answer = self.client("dynamodb").get_item(
            TableName=self.table, Key={"id": {"S": rid}}, ConsistentRead=True
        )
        item = answer.get("Item")
        if not item:
            return None
        record = _record(item)
        return None if record.expires_at < self.clock() else record

    def lookup(self, rid: str, tenant: str | None) -> AsyncRecord:
        """A caller's own request; another caller's, an expired or unknown one is 404."""
        record = self.find(check_id(rid))
        if record is None or _owner_scope(record) != scope(tenant):
            raise RouteNotFoundError("no such asynchronous request (or it has expired)")
        return record

    def result_reply(self, rid: str, tenant: str | None) -> Reply:
        """``GET /v1/results/{id}``: 202 with the state while pending, the V2 response when
        it succeeded, its error (status and code) when it failed."""
        record = self.lookup(rid, tenant)
        if record.state in ("queued", "running"):
            return json_reply(202, record.view(), [("retry-after", "1")])
        if record.state == "failed":
            body = {"error": record.error or "failed", "code": record.code or "failed"}
            return json_reply(record.status or 500, {**body, "id": record.id})
        place = parse_s3_url(str(record.result))
        data = self.client("s3").get_object(Bucket=place.bucket, Key=place.prefix)["Body"].read()
        headers = [("content-type", record.content_type or JSON_CONTENT_TYPE)]
        if record.header_length is not None:
            headers.append((HEADER_LENGTH, str(record.header_length)))
        if record.result_version:
            headers.append(("x-spillway-model-version", record.result_version))
        return Reply(200, headers, data)

    # --- the consumers' side ----------------------------------------------------------

    def receive(self, count: int, wait_s: float) -> list[Message]:
        """Up to ``count`` (≤ 10) deliveries, long-polling up to ``wait_s`` seconds."""
        answer = self.client("sqs").receive_message(
            QueueUrl=self.queue_url,
            MaxNumberOfMessages=max(1, min(count, 10)),
            WaitTimeSeconds=int(max(0, min(wait_s, 20))),
            VisibilityTimeout=self.settings.lease_s,
            AttributeNames=["ApproximateReceiveCount"],
        )
        return [message_of(m) for m in answer.get("Messages", [])]

    def claim(self, message: Message, owner: str) -> Job | None:
        """Take the request for this delivery: a ``Job``, or None when there is nothing to
        run (it is done, expired or unknown: the delivery is deleted; or another consumer
        holds a live lease: the delivery comes back later)."""
        now = self.clock()
        record = self.find(message.id) if len(message.id) == 32 else None
        if record is None or record.state in DONE:
            self.delete(message)
            return None
        token = uuid.uuid4().hex[:12]
        from botocore.exceptions import ClientError

        try:
            answer = self.client("dynamodb").update_item(
                TableName=self.table,
                Key={"id": {"S": message.id}},
                UpdateExpression=(
                    "SET #s = :running, lease_until = :lease, #o = :owner, updated_at = :now "
                    "ADD attempts :one"
                ),
                ConditionExpression="#s = :queued OR (#s = :running AND lease_until < :now)",
                ExpressionAttributeNames={"#s": "state", "#o": "owner"},
                ExpressionAttributeValues={
                    ":running": {"S": "running"},
                    ":queued": {"S": "queued"},
                    ":lease": {"N": repr(now + self.settings.lease_s)},
                    ":owner": {"S": f"{owner}/{token}"},
                    ":now": {"N": repr(now)},
                    ":one": {"N": "1"},
                },
                ReturnValues="ALL_NEW",
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ConditionalCheckFailedException":
                raise
            # Held by a live lease (or finished meanwhile): come back when the lease ends,
            # not sooner, so a long run costs one extra delivery per lease, no more.
            left = int(record.lease_until - now) + 1
            if record.state == "running" and left > 0:
                self.client("sqs").change_message_visibility(
                    QueueUrl=self.queue_url,
                    ReceiptHandle=message.receipt,
                    VisibilityTimeout=min(left, 43_200),
                )
            return None
        return Job(_record(answer["Attributes"]), message, token)

    def read_input(self, job: Job) -> tuple[bytes, int | None]:
        """The request body and its header length (a staged ``.v2req``, else a V2 body:
        binary when the object's metadata names a header length)."""
        return self.read_record_input(job.record)

    def read_record_input(self, record: AsyncRecord) -> tuple[bytes, int | None]:
        """``read_input`` of a record (an execution's steps have no delivery)."""
        place = parse_s3_url(record.input)
        if record.input == self.staged_url(record.id):
            # The body the router staged: its absence is the server's fault (retried).
            s3 = self.client("s3")
            head = s3.head_object(Bucket=place.bucket, Key=place.prefix)
            data = s3.get_object(Bucket=place.bucket, Key=place.prefix)["Body"].read()
        else:
            # The client's own object: gone since it was submitted, that is the client's
            # failure (recorded once: no retry, no dead letter).
            head = self._check_input(record.input)
            data = self._client_object(record.input, "get_object")["Body"].read()
        if place.prefix.endswith(".v2req"):
            return read_staged_request(data)
        length = (head.get("Metadata") or {}).get(HEADER_LENGTH)
        from spillway.protocol.wire import parse_header_length

        return data, parse_header_length(length)

    def settle(self, job: Job, reply: Reply) -> State | None:
        """Record the outcome of a run: success, a client error (final), or a server
        error (retried until the last delivery, then final). The state it reached, or
        None when it will be retried (or another attempt had already finished it)."""
        if reply.status < 300:
            return self._finish(job, "succeeded", reply)
        server_fault = reply.status >= 500 or reply.status == 429
        if not server_fault or job.message.receive_count >= self.settings.max_attempts:
            state = self._finish(job, "failed", reply)
            if server_fault and state is not None:  # the last delivery: to the DLQ
                self._dead_letter(job.message, reply)
            return state
        self._release(job, reply)
        return None

    def _started(self, record: AsyncRecord, start: Starter) -> AsyncRecord:
        """Start the execution of a recorded request; a start that fails settles the
        record (503, the platform's fault) so it never waits for a run that never was,
        with a write the router may make (``PutItem``, on its own record only)."""
        try:
            start(record)
        except Exception as exc:  # every failure to start is the platform's, never the client's
            reason = UnavailableError(f"the request could not be started ({type(exc).__name__})")
            code, message = _error_of(failure_reply(reason))
            failed = record.model_copy(
                update={"state": "failed", "status": reason.status, "code": code,
                        "error": message, "updated_at": self.clock()}
            )  # fmt: skip
            self.client("dynamodb").put_item(
                TableName=self.table,
                Item=_item(failed),
                ConditionExpression="#o = :owner",
                ExpressionAttributeNames={"#o": "owner"},
                ExpressionAttributeValues={":owner": {"S": str(record.owner)}},
            )
            raise reason from exc
        return record

    @staticmethod
    def _execution_job(record: AsyncRecord) -> Job:
        """An execution-run request as a ``Job`` (no delivery: nothing to delete)."""
        token = str(record.owner).removeprefix(EXECUTION_OWNER)
        return Job(record, Message(record.id, "", 1, str(record.scope or "")), token)

    def settle_execution(self, rid: str, reply: Reply) -> State | None:
        """The end of the execution that ran request ``rid``: its result (or error) and
        its record, settled once (the state it reached; None when it was already
        settled). Step Functions has done the retries: every outcome is final."""
        record = self.find(check_id(rid))
        if record is None or not str(record.owner or "").startswith(EXECUTION_OWNER):
            raise InvalidInputError(f"request {rid} is not run by an execution")
        if record.state in DONE:
            return None
        state: State = "succeeded" if reply.status < 300 else "failed"
        return self._finish(self._execution_job(record), state, reply)

    def result_url(self, rid: str) -> str | None:
        """The S3 URL of a request's visible result (None: none yet)."""
        record = self.find(check_id(rid))
        return None if record is None else record.result

    def _finish(self, job: Job, state: State, reply: Reply) -> State | None:
        values: dict[str, Any] = {
            ":done": {"S": state},
            ":status": {"N": str(reply.status)},
            ":now": {"N": repr(self.clock())},
            ":owner": {"S": str(job.record.owner)},
            ":running": {"S": "running"},
        }
        sets = ["#s = :done", "#st = :status", "updated_at = :now"]
        headers = dict(reply.headers)
        if state == "succeeded":
            key = self._write_result(job, reply)
            names = {"#r": "result"}
            sets += ["#r = :result", "content_type = :ctype"]
            values[":result"] = {"S": key}
            values[":ctype"] = {"S": headers.get("content-type", JSON_CONTENT_TYPE)}
            if HEADER_LENGTH in headers:
                sets.append("header_length = :hl")
                values[":hl"] = {"N": headers[HEADER_LENGTH]}
            if "x-spillway-model-version" in headers:
                sets.append("result_version = :rv")
                values[":rv"] = {"S": headers["x-spillway-model-version"]}
        else:
            error = _error_of(reply)
            names = {"#e": "error"}
            sets += ["code = :code", "#e = :error"]
            values[":code"] = {"S": error[0]}
            values[":error"] = {"S": error[1]}
        from botocore.exceptions import ClientError

        try:
            self.client("dynamodb").update_item(
                TableName=self.table,
                Key={"id": {"S": job.record.id}},
                UpdateExpression="SET " + ", ".join(sets) + " REMOVE pending, lease_until",
                ConditionExpression="#s = :running AND #o = :owner",
                ExpressionAttributeNames={**_NAMES, **names},
                ExpressionAttributeValues=values,
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ConditionalCheckFailedException":
                raise
            self.delete(job.message)  # another attempt owns it now, or finished it
            return None
        if state == "succeeded" or reply.status < 500:
            self.delete(job.message)
        self._notify(job.record.id, state, reply.status)
        return state

    def _write_result(self, job: Job, reply: Reply) -> str:
        """The result object of this attempt (its own key: a late attempt never overwrites
        what the record points at); its S3 URL."""
        place = parse_s3_url(folder(job.record.output))
        key = f"{place.prefix}result-{job.token}"
        headers = dict(reply.headers)
        metadata = {}
        if HEADER_LENGTH in headers:
            metadata[HEADER_LENGTH] = headers[HEADER_LENGTH]
        self.client("s3").put_object(
            Bucket=place.bucket,
            Key=key,
            Body=reply.body,
            ContentType=headers.get("content-type", BINARY_CONTENT_TYPE),
            Metadata=metadata,
        )
        return f"s3://{place.bucket}/{key}"

    def _release(self, job: Job, reply: Reply) -> None:
        """A failed attempt that will be retried: back to ``queued`` with its error, and
        the delivery visible again after a short backoff."""
        code, message = _error_of(reply)
        from botocore.exceptions import ClientError

        try:
            self.client("dynamodb").update_item(
                TableName=self.table,
                Key={"id": {"S": job.record.id}},
                UpdateExpression="SET #s = :queued, code = :code, #e = :error, updated_at = :now",
                ConditionExpression="#s = :running AND #o = :owner",
                ExpressionAttributeNames={"#s": "state", "#o": "owner", "#e": "error"},
                ExpressionAttributeValues={
                    ":queued": {"S": "queued"},
                    ":running": {"S": "running"},
                    ":owner": {"S": str(job.record.owner)},
                    ":code": {"S": code},
                    ":error": {"S": message},
                    ":now": {"N": repr(self.clock())},
                },
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ConditionalCheckFailedException":
                raise
        backoff = min(2**job.message.receive_count, self.settings.lease_s)
        self.client("sqs").change_message_visibility(
            QueueUrl=self.queue_url,
            ReceiptHandle=job.message.receipt,
            VisibilityTimeout=int(backoff),
        )

    def _dead_letter(self, message: Message, reply: Reply) -> None:
        """Move a request given up on to the queue's dead-letter queue (its redrive
        policy's target) with its error, at once: it does not wait for another receive
        that may never come (a drained backlog stops the CPU consumer's polling)."""
        sqs = self.client("sqs")
        attributes = sqs.get_queue_attributes(
            QueueUrl=self.queue_url, AttributeNames=["RedrivePolicy"]
        ).get("Attributes", {})
        policy = json.loads(attributes.get("RedrivePolicy") or "{}")
        target = str(policy.get("deadLetterTargetArn", ""))
        if target:
            name = target.rsplit(":", 1)[-1]
            code, error = _error_of(reply)
            body = json.dumps({"id": message.id, "status": reply.status, "code": code,
                               "error": error, "deliveries": message.receive_count})  # fmt: skip
            dlq = sqs.get_queue_url(QueueName=name)["QueueUrl"]
            sqs.send_message(QueueUrl=dlq, MessageBody=body)
        self.delete(message)

    def delete(self, message: Message) -> None:
        """Remove a delivery from the queue (its request needs no more attempts); a
        receipt that is no longer valid (the message was redelivered) is left alone."""
        if not message.receipt:  # an execution-run request: it was never queued
            return
        from botocore.exceptions import ClientError

        try:
            self.client("sqs").delete_message(
                QueueUrl=self.queue_url, ReceiptHandle=message.receipt
            )
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if "ReceiptHandleIsInvalid" not in code and code != "InvalidParameterValue":
                raise

    def _notify(self, rid: str, state: str, status: int) -> None:
        if self.settings.topic_arn:
            message = json.dumps({"id": rid, "state": state, "status": status})
            self.client("sns").publish(TopicArn=self.settings.topic_arn, Message=message)

    # --- queue age and expiry ---------------------------------------------------------

    def pending(self, limit: int = 100) -> Iterator[AsyncRecord]:
        """Live queued or running requests, oldest first, at most ``limit`` of them.

        The sparse ``pending`` index (only pending records carry its key; it projects
        keys only) is read from ``now - ttl_s`` on, so the records DynamoDB's TTL has not
        deleted yet (it takes up to days) cost nothing; each candidate is then read from
        the table, which also skips one that expired or settled meanwhile. An expired
        record is nobody's backlog: nobody can read its result."""
        since = self.clock() - self.settings.ttl_s
        query: dict[str, Any] = {
            "TableName": self.table,
            "IndexName": "pending",
            "KeyConditionExpression": "pending = :p AND created_at >= :since",
            "ExpressionAttributeValues": {":p": {"S": _PENDING}, ":since": {"N": repr(since)}},
            "ScanIndexForward": True,
            "Limit": _PAGE,
        }
        seen = 0
        while True:
            answer = self.client("dynamodb").query(**query)
            for item in answer.get("Items") or []:
                record = self.find(str(item["id"]["S"]))
                if record is None or record.state in DONE:
                    continue
                yield record
                seen += 1
                if seen >= limit:
                    return
            if "LastEvaluatedKey" not in answer:
                return
            query["ExclusiveStartKey"] = answer["LastEvaluatedKey"]

    def oldest_pending_age(self) -> float | None:
        """Seconds the oldest live queued or running request has waited (None: none)."""
        oldest = next(self.pending(1), None)
        return None if oldest is None else max(0.0, self.clock() - oldest.created_at)

    def queue_is_empty(self) -> bool:
        """Whether the queue holds no message at all: none waiting, in flight or delayed
        (SQS's approximate counts, about a minute behind)."""
        counts = (
            self.client("sqs")
            .get_queue_attributes(QueueUrl=self.queue_url, AttributeNames=list(_QUEUE_COUNTS))
            .get("Attributes", {})
        )
        return all(int(counts.get(name, 0)) == 0 for name in _QUEUE_COUNTS)

    def reconcile_pending(self, *, queue_empty: bool, limit: int = 100) -> int:
        """Fail the pending requests whose message is gone; how many were failed.

        A record not held by a live lease has lost its message when its deliveries are
        used up (the queue's redrive moved the message to the dead-letter queue after a
        consumer crashed on the last one), or when the queue holds no message at all and
        it has waited more than ``orphan_after_s`` (a send that failed after the record
        was written, a purge). Such a record is failed as the server's fault (500
        ``delivery_lost``), once: the write is conditional on the attempt count read, so
        a consumer that claims it meanwhile wins. A failed record leaves the pending index,
        and a tenant's in-flight quota frees its place at the next read of it. Failing
        rather than sending again keeps the drain function off the queue's send side and
        never runs a request twice; the client sees the failure and may submit again."""
        now = self.clock()
        orphan_after = max(float(self.settings.lease_s), ORPHAN_AFTER_S)
        failed = 0
        for record in list(self.pending(limit)):
            if record.state == "running" and record.lease_until >= now:
                continue
            exhausted = record.attempts >= self.settings.max_attempts
            lost = queue_empty and now - record.updated_at > orphan_after
            if (exhausted or lost) and self._fail_lost(record, now):
                failed += 1
        return failed

    def _fail_lost(self, record: AsyncRecord, now: float) -> bool:
        """Record a lost request as failed unless a consumer touched it since it was read."""
        from botocore.exceptions import ClientError

        message = (
            "the request's message was lost after "
            f"{record.attempts} of {self.settings.max_attempts} deliveries; submit it again"
        )
        try:
            self.client("dynamodb").update_item(
                TableName=self.table,
                Key={"id": {"S": record.id}},
                UpdateExpression=(
                    "SET #s = :failed, #st = :status, code = :code, #e = :error, "
                    "updated_at = :now REMOVE pending, lease_until"
                ),
                ConditionExpression=(
                    "attribute_exists(pending) AND attempts = :attempts AND "
                    "(#s = :queued OR lease_until < :now)"
                ),
                ExpressionAttributeNames={"#s": "state", "#st": "status", "#e": "error"},
                ExpressionAttributeValues={
                    ":failed": {"S": "failed"},
                    ":queued": {"S": "queued"},
                    ":status": {"N": "500"},
                    ":code": {"S": "delivery_lost"},
                    ":error": {"S": message},
                    ":now": {"N": repr(now)},
                    ":attempts": {"N": str(record.attempts)},
                },
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ConditionalCheckFailedException":
                raise
            return False
        self._notify(record.id, "failed", 500)
        return True

    def purge_expired(self, limit: int = 100) -> int:
        """Delete expired records and their objects (what DynamoDB's TTL and the S3
        lifecycle rule do on AWS); how many were removed."""
        now = self.clock()
        answer = self.client("dynamodb").scan(
            TableName=self.table,
            FilterExpression="expires_at < :now",
            ExpressionAttributeValues={":now": {"N": repr(now)}},
            Limit=max(limit, 1) * 10,
        )
        removed = 0
        for item in answer.get("Items", [])[:limit]:
            record = _record(item)
            own = f"s3://{self.location.bucket}/{self.location.key(record.id)}/"
            for url in {record.input, record.result or ""} - {""}:
                if url.startswith(own):  # the server's own keys, never a client's object
                    place = parse_s3_url(url)
                    self.client("s3").delete_object(Bucket=place.bucket, Key=place.prefix)
            self.client("dynamodb").delete_item(TableName=self.table, Key={"id": {"S": record.id}})
            removed += 1
        return removed


def message_of(raw: Mapping[str, Any]) -> Message:
    """A delivery from SQS's ``ReceiveMessage`` or a Lambda SQS event record."""
    try:
        body = json.loads(raw.get("Body") or raw.get("body") or "{}")
        rid, owner = str(body.get("id", "")), str(body.get("scope", ""))[:64]
    except (ValueError, AttributeError):
        rid, owner = "", ""
    attributes = raw.get("Attributes") or raw.get("attributes") or {}
    return Message(
        id=rid,
        receipt=str(raw.get("ReceiptHandle") or raw.get("receiptHandle") or ""),
        receive_count=int(attributes.get("ApproximateReceiveCount", 1)),
        scope=owner,
    )


def _owner_scope(record: AsyncRecord) -> str:
    """Whose request a record is (a record written before scopes: from its tenant)."""
    if record.scope is not None:
        return record.scope
    return scope(None if record.tenant == "anonymous" else record.tenant)


def _replayed(record: AsyncRecord, digest: str) -> AsyncRecord:
    """The request an ``Idempotency-Key`` already made, if it is this same request."""
    if record.digest is not None and record.digest != digest:
        raise IdempotencyConflictError(
            "this Idempotency-Key was used for another request (model, version or payload); "
            "use a new key for a new request"
        )
    return record


def _error_of(reply: Reply) -> tuple[str, str]:
    try:
        body = json.loads(reply.body)
        return str(body.get("code", "failed"))[:64], str(body.get("error", ""))[:1000]
    except (ValueError, AttributeError):
        return "failed", f"status {reply.status}"


def failure_reply(error: BaseException) -> Reply:
    """The reply recorded for a run that raised: its own mapping, or 500 for anything
    unexpected (retried like any server fault)."""
    from spillway.protocol.wire import INTERNAL_ERROR, error_reply

    if isinstance(error, SpillwayError):
        return error_reply(error)
    return INTERNAL_ERROR
