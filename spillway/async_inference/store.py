"""``AsyncStore``: asynchronous requests' records in DynamoDB, with their bodies and
results (``objects``) and their queue (``queue``), and every transition of a record.

Each transition of a record (``states``) is one conditional write: a claim, a settle, a
release or the failure of a lost request happens only if the record is still as the
transition's guard requires, so of two consumers (or a consumer and the drain check)
exactly one wins and the other learns it from the failed condition. The reads of the
records (one, a caller's own, the pending ones, the expired ones) are ``RecordTable``'s
(``spillway.async_inference.table``), which this class extends.

Records expire: DynamoDB's TTL (``expires_at``) and an S3 lifecycle rule on the results
prefix remove them on AWS; readers treat an expired record as gone (TTL deletes lazily)
and ``purge_expired`` removes them where no TTL runs (the local stack).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from spillway.async_inference import replies
from spillway.async_inference.queue import Message
from spillway.async_inference.records import (
    DONE,
    EXECUTION_OWNER,
    AsyncRecord,
    State,
    check_id,
    execution_arn,
    execution_name,
    from_item,
    replayed,
    request_digest,
    request_id,
    to_item,
)
from spillway.async_inference.states import final_state
from spillway.async_inference.table import PENDING_PARTITION, RecordTable, attribute_names
from spillway.protocol.errors import InvalidInputError, UnavailableError
from spillway.protocol.messages import stage_request
from spillway.protocol.names import validate_model_name, validate_version
from spillway.protocol.replies import Reply
from spillway.state import dynamo
from spillway.state.table import scope

_CLAIMABLE = "#s = :queued OR (#s = :running AND lease_until < :now)"  # Lifecycle.is_claimable
_OWNED = "#s = :running AND #o = :owner"  # Lifecycle.may_settle

Admit = Callable[[str, int, float], None]
"""The router's admission of a new request (its id, the bytes staged for it, now):
returns, or raises (``QuotaExceededError``)."""


class Starter(Protocol):
    """The state machine whose execution runs a request instead of the queue: the store
    starts an execution of ``machine`` per attempt (``AsyncStore.start_execution``)."""

    machine: str


@dataclass(frozen=True)
class Job:
    """A claimed request: its record and the delivery it came with."""

    record: AsyncRecord
    message: Message
    token: str
    """This attempt's own token: its result key is its own."""


class AsyncStore(RecordTable):
    """The records (DynamoDB), bodies and results (S3) and the queue (SQS)."""

    # --- the router's side ------------------------------------------------------------

    def areas(self, tenant: str | None) -> list[str]:
        """The caller's own areas (``AsyncObjects.areas``)."""
        return self.objects.areas(tenant)

    def staged_url(self, rid: str) -> str:
        """Where the router stages a request's body (the server's own key)."""
        return self.objects.staged_url(rid)

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
        trace: Mapping[str, str] | None = None,
    ) -> tuple[AsyncRecord, bool]:
        """Accept a request: the record (``queued``) and whether it already existed (an
        ``Idempotency-Key`` replay of the same request; another one is 409). With
        ``start`` the request runs as the execution it starts (the record ``running``,
        outside the pending index and the queue) until ``settle_execution``.

        Admission (``admit``: the router's per-tenant quota) runs after a replay is
        recognised and before anything is staged. ``trace``: the carrier of the trace the
        request was accepted in (``spillway.tracing.outgoing``), kept in the record (only a
        well-formed one) for the run to join it."""
        validate_model_name(model)
        if version is not None:
            validate_version(version)
        own = self.areas(tenant)
        source = None if input_location is None else self.objects.input_place(input_location, own)
        rid = request_id(tenant, client_key)
        output = self.objects.output_folder(rid, output_location, own)
        digest = request_digest(model, version, body, header_length)
        existing = self.find(rid)
        if existing is not None:
            return replayed(existing, digest), True
        staged = b"" if source is not None else stage_request(body, header_length)
        if source is not None:
            self.objects.check_input(source)
        now = self.clock()
        if admit is not None:
            admit(rid, len(staged), now)
        if source is None:
            self.objects.stage(rid, staged)
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
            trace=trace,
        )
        if start is not None:
            token = uuid.uuid4().hex[:12]
            record = record.model_copy(
                update={
                    "state": "running",
                    "owner": EXECUTION_OWNER + token,
                    "attempts": 1,
                    "execution": execution_arn(start.machine, execution_name(rid, token)),
                }
            )
        item = {**to_item(record), **({} if start else dynamo.item({"pending": PENDING_PARTITION}))}
        written = dynamo.conditional(
            self.client("dynamodb").put_item,
            TableName=self.table,
            Item=item,
            # An expired record DynamoDB's TTL has not deleted yet may be replaced.
            ConditionExpression="attribute_not_exists(id) OR expires_at < :now",
            ExpressionAttributeValues=dynamo.item({":now": now}),
        )
        if written is None:
            found = self.find(rid)
            if found is None:
                raise UnavailableError("the request record could not be written")
            return replayed(found, digest), True
        if start is not None:
            return self._started(record, start), False
        self.queue.send(rid, record.scope)
        return record, False

    # --- the consumers' side ----------------------------------------------------------

    def receive(self, count: int, wait_s: float) -> list[Message]:
        """Up to ``count`` (≤ 10) deliveries, long-polling up to ``wait_s`` seconds."""
        return self.queue.receive(count, wait_s)

    def delete(self, message: Message) -> None:
        """Remove a delivery from the queue (``AsyncQueue.delete``)."""
        self.queue.delete(message)

    def claim(self, message: Message, owner: str) -> Job | None:
        """Take the request for this delivery: a ``Job``, or None when there is nothing to
        run (it is done, expired or unknown: the delivery is deleted; or another consumer
        holds a live lease: the delivery comes back when it ends)."""
        now = self.clock()
        record = self.find(message.id) if len(message.id) == 32 else None
        if record is None or self.lifecycle.is_settled(record):
            self.delete(message)
            return None
        token = uuid.uuid4().hex[:12]
        answer = self._update(
            message.id,
            "SET #s = :running, lease_until = :lease, #o = :owner, updated_at = :now "
            "ADD attempts :one",
            _CLAIMABLE,
            running="running",
            queued="queued",
            lease=self.lifecycle.lease_until(now),
            owner=f"{owner}/{token}",
            now=now,
            one=1,
        )
        if answer is None:  # held by a live lease (or finished meanwhile)
            wait = self.lifecycle.redelivery_in(record, now)
            if wait is not None:
                self.queue.show_in(message, wait)
            return None
        return Job(from_item(answer["Attributes"]), message, token)

    def read_input(self, job: Job) -> tuple[bytes, int | None]:
        """The request body and its header length (``AsyncObjects.read_input``)."""
        return self.read_record_input(job.record)

    def read_record_input(self, record: AsyncRecord) -> tuple[bytes, int | None]:
        """``read_input`` of a record (an execution's steps have no delivery)."""
        return self.objects.read_input(record)

    def settle(self, job: Job, reply: Reply) -> State | None:
        """Record the outcome of a run: success, a client error (final), or a server
        error (retried until the last delivery, then final and dead-lettered). The state
        it reached, or None when it will be retried (or another attempt had already
        finished it)."""
        outcome = self.lifecycle.outcome(reply.status, job.message.receive_count)
        if outcome == "retry":
            self._release(job, reply)
            return None
        state = self._finish(job, final_state(reply.status), reply)
        if outcome == "dead_letter" and state is not None:
            self.queue.dead_letter(job.message, reply)
        return state

    def start_execution(self, record: AsyncRecord, machine: str) -> None:
        """``states:StartExecution`` of the execution ``record.execution`` names, with the
        input its states read (``{"id", "tenant_scope", "trace"}``; ``trace`` the record's
        carrier, ``{}`` without one, so each state's Lambda joins the request's trace).

        The name is this attempt's own (``records.execution_name``), so
        ``ExecutionAlreadyExists`` can only mean this very start already happened: a retry
        of it after a lost answer finds the execution started (StartExecution answers
        that error for a name whose execution has ended, whatever the input:
        ``spillway.aws.limits.SFN_EXECUTION_NAME_REUSE_DAYS``), never a failure."""
        from spillway.aws.errors import ClientError, error_code

        name = str(record.execution).rsplit(":", 1)[-1]
        document = json.dumps(
            {"id": record.id, "tenant_scope": record.scope, "trace": record.trace or {}}
        )
        try:
            self.client("stepfunctions").start_execution(
                stateMachineArn=machine, name=name, input=document
            )
        except ClientError as exc:
            if error_code(exc) != "ExecutionAlreadyExists":
                raise

    def _started(self, record: AsyncRecord, start: Starter) -> AsyncRecord:
        """Start the execution of a recorded request; a start that fails settles the
        record (503, the platform's fault) so it never waits for a run that never was,
        with a write the router may make (``PutItem``, on its own record only, still
        running: an execution that did start after all may have settled it)."""
        try:
            self.start_execution(record, start.machine)
        except Exception as exc:  # every failure to start is the platform's, never the client's
            reason = UnavailableError(f"the request could not be started ({type(exc).__name__})")
            code, message = replies.error_of(replies.failure_reply(reason))
            failed = record.model_copy(
                update={"state": "failed", "status": reason.status, "code": code,
                        "error": message, "updated_at": self.clock()}
            )  # fmt: skip
            written = dynamo.conditional(
                self.client("dynamodb").put_item,
                TableName=self.table,
                Item=to_item(failed),
                ConditionExpression="#o = :owner AND #s = :running",
                ExpressionAttributeNames=attribute_names("#o", "#s"),
                ExpressionAttributeValues=dynamo.item(
                    {":owner": str(record.owner), ":running": "running"}
                ),
            )
            if written is None:  # its execution ran after all and settled the record
                return self.find(record.id) or record
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
        return self._finish(self._execution_job(record), final_state(reply.status), reply)

    def _finish(self, job: Job, state: State, reply: Reply) -> State | None:
        """Settle the record of ``job``'s claim (if it still holds it) as ``state``."""
        fields: dict[str, Any] = {"done": state, "status": reply.status}
        sets = ["#s = :done", "#st = :status", "updated_at = :now"]
        if state == "succeeded":
            recorded = replies.result_fields(reply)
            fields.update(
                result=self.objects.write_result(job.record, job.token, reply),
                ctype=recorded["content_type"],
            )
            sets += ["#r = :result", "content_type = :ctype"]
            if "header_length" in recorded:
                sets.append("header_length = :hl")
                fields["hl"] = recorded["header_length"]
            if "result_version" in recorded:
                sets.append("result_version = :rv")
                fields["rv"] = recorded["result_version"]
        else:
            fields["code"], fields["error"] = replies.error_of(reply)
            sets += ["code = :code", "#e = :error"]
        update = "SET " + ", ".join(sets) + " REMOVE pending, lease_until"
        written = self._update(
            job.record.id, update, _OWNED,
            now=self.clock(), owner=str(job.record.owner), running="running", **fields,
        )  # fmt: skip
        if written is None:
            self.delete(job.message)  # another attempt owns it now, or finished it
            return None
        if state == "succeeded" or reply.status < 500:
            self.delete(job.message)
        self.queue.notify(job.record.id, state, reply.status)
        return state

    def _release(self, job: Job, reply: Reply) -> None:
        """A failed attempt that will be retried: back to ``queued`` with its error, and
        the delivery visible again after a short backoff."""
        code, message = replies.error_of(reply)
        self._update(
            job.record.id,
            "SET #s = :queued, code = :code, #e = :error, updated_at = :now",
            _OWNED,
            queued="queued",
            running="running",
            owner=str(job.record.owner),
            code=code,
            error=message,
            now=self.clock(),
        )
        self.queue.show_in(job.message, self.lifecycle.retry_in(job.message.receive_count))

    # --- the drain check's side -------------------------------------------------------

    def reconcile_pending(self, *, queue_empty: bool, limit: int = 100) -> int:
        """Fail the pending requests whose message is gone (``Lifecycle.is_lost``); how
        many were failed.

        Such a record is failed as the server's fault (500 ``delivery_lost``), once: the
        write is conditional on the attempt count read, so a consumer that claims it
        meanwhile wins. A failed record leaves the pending index, and a tenant's in-flight
        quota frees its place at the next read of it. Failing rather than sending again
        keeps the drain function off the queue's send side and never runs a request
        twice; the client sees the failure and may submit again."""
        now = self.clock()
        failed = 0
        for record in list(self.pending(limit)):
            lost = self.lifecycle.is_lost(record, now, queue_empty=queue_empty)
            if lost and self._fail_lost(record, now):
                failed += 1
        return failed

    def _fail_lost(self, record: AsyncRecord, now: float) -> bool:
        """Record a lost request as failed unless a consumer touched it since it was read."""
        message = (
            "the request's message was lost after "
            f"{record.attempts} of {self.settings.max_attempts} deliveries; submit it again"
        )
        written = self._update(
            record.id,
            "SET #s = :failed, #st = :status, code = :code, #e = :error, "
            "updated_at = :now REMOVE pending, lease_until",
            "attribute_exists(pending) AND attempts = :attempts AND "
            "(#s = :queued OR lease_until < :now)",
            failed="failed",
            queued="queued",
            status=500,
            code="delivery_lost",
            error=message,
            now=now,
            attempts=record.attempts,
        )
        if written is None:
            return False
        self.queue.notify(record.id, "failed", 500)
        return True
