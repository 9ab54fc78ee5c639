"""A pipeline run one step per call, its tensors kept in S3 between calls: the work of
each state of a pipeline's Step Functions form (``infra/statemachines/``).

A long pipeline, or one whose steps should each have their own function's time budget
and retries, runs as a state machine: one Task state per step, then a ``respond`` state.
Every state invokes the CPU fallback with a ``ChainEvent`` naming the pipeline, the
request id and the step. The request and its tensors live under the async location
(``ASYNC_LOCATION``, the async path's layout):

* ``<location>/<id>/request.v2req`` — the request, staged as the async path stages it;
* ``<location>/<id>/steps/<k>`` — the pipeline's tensors after step ``k`` (in run order),
  with the steps skipped or taken from the cache so far;
* ``<location>/<id>/result`` — the V2 response, where an async result goes.

Each call reads what the previous one wrote and runs exactly one step through the same
step runner as every server (``spillway.pipelines.runner.advance``), so a retried state
redoes only its own step and overwrites only its own object.

An async request the router started as an execution has a record
(``spillway.async_inference``): its steps read the request through the record (a staged
body or the caller's own ``input_location``), run under the record's tenant scope, and
the execution's end settles it — ``respond`` with the V2 response, ``pipeline-failed``
(the state machine's catch) with the error — so ``GET /v1/results/{id}`` answers it as
it answers every async request.

Each call carries the execution's input, whose ``trace`` (the router's span) the call's
work continues: a ``spillway.pipeline.step`` span per step (its name, index and model),
``spillway.pipeline.respond`` / ``spillway.pipeline.failed`` for the end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from spillway import inference, tracing
from spillway.async_inference.records import EXECUTION_OWNER, AsyncRecord
from spillway.async_inference.store import AsyncStore
from spillway.aws.objects import get_object_or_none
from spillway.models.processing import Tensors
from spillway.pipelines.runner import LocalSteps, Outcome, Resolver, advance, drive
from spillway.pipelines.serving import PipelineSet, ServedPipeline, admit, encode
from spillway.protocol.codec import decode_response, encode_response
from spillway.protocol.errors import InvalidInputError, ModelNotFoundError
from spillway.protocol.messages import read_staged_request, stage_request
from spillway.protocol.names import MODEL_NAME_PATTERN
from spillway.protocol.replies import Reply, infer_reply, json_reply
from spillway.protocol.s3urls import S3Location
from spillway.protocol.wire import TENANT_SCOPE_PATTERN

STEP = "pipeline-step"
RESPOND = "pipeline-respond"
FAILED = "pipeline-failed"
STEP_SPAN = "spillway.pipeline.step"


class ChainEvent(BaseModel):
    """What a state of a pipeline's state machine sends the CPU fallback."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spillway: Literal["pipeline-step", "pipeline-respond", "pipeline-failed"]
    pipeline: str = Field(pattern=MODEL_NAME_PATTERN.pattern)
    id: str = Field(pattern=r"^[0-9a-f]{32}$")
    """The request's id (as the async path makes them)."""
    step: int | None = Field(default=None, ge=0, le=63)
    """The step to run, by its place in run order (``pipeline-step`` only)."""
    tenant_scope: str | None = Field(default=None, pattern=TENANT_SCOPE_PATTERN)
    """The scope of the tenant whose request this is (``spillway.state.table.scope``), as
    the execution's input names it: it must be the scope of the request's record. The
    steps use the tenant cache entries of the record's scope, which the router stored
    (an event's own word proves nothing: anyone allowed to invoke the function could
    write it). A request without a record uses no tenant's entries (only shared
    steps' cache)."""
    error: dict[str, str] | None = None
    """What the state machine caught (``{"Error", "Cause"}``; ``pipeline-failed`` only)."""
    execution: Any = None
    """The execution's input (``$$.Execution.Input``), for its ``trace``: whatever it
    holds, only a well-formed carrier is used (``trace``), never an error."""

    def trace(self) -> dict[str, str]:
        """The trace the execution continues (the router's span), else ``{}``."""
        found = self.execution.get("trace") if isinstance(self.execution, dict) else None
        return tracing.carrier_of(found) if isinstance(found, dict) else {}


@dataclass(frozen=True)
class ChainStore:
    """A chained request's objects under the async location."""

    location: S3Location
    client: Any
    records: AsyncStore | None = None
    """The async records (None: executions started without one, whose result is written
    to ``<location>/<id>/result`` alone)."""

    def _key(self, rid: str, *parts: str) -> str:
        return self.location.key(rid, *parts)

    def url(self, key: str) -> str:
        return f"s3://{self.location.bucket}/{key}"

    def _get(self, key: str) -> bytes:
        body = get_object_or_none(self.client, self.location.bucket, key)
        if body is None:
            raise InvalidInputError(f"{self.url(key)} does not exist")
        return body

    def _put(self, key: str, body: bytes, content_type: str) -> str:
        self.client.put_object(
            Bucket=self.location.bucket, Key=key, Body=body, ContentType=content_type
        )
        return self.url(key)

    def read_request(self, rid: str, tenant_scope: str | None) -> tuple[bytes, int | None]:
        """The request body and its header length: through its record when there is one
        (whose owner must be the execution's tenant)."""
        if self.records is None:
            return read_staged_request(self._get(self._key(rid, "request.v2req")))
        return self.records.read_record_input(self._record(rid, tenant_scope))

    def requested_version(self, rid: str, tenant_scope: str | None) -> str | None:
        """The version the request pinned (from its record; None: the default one)."""
        return None if self.records is None else self._record(rid, tenant_scope).version

    def cache_scope(self, rid: str, tenant_scope: str | None) -> str | None:
        """Whose step cache entries the request's steps use: its record's scope, as the
        router stored it (no record: no tenant's)."""
        return None if self.records is None else self._record(rid, tenant_scope).scope

    def _record(self, rid: str, tenant_scope: str | None) -> AsyncRecord:
        assert self.records is not None  # noqa: S101 - the callers check
        record = self.records.find(rid)
        if record is None or not str(record.owner or "").startswith(EXECUTION_OWNER):
            raise InvalidInputError(f"request {rid} has no execution record (or it expired)")
        if record.scope != tenant_scope:
            raise InvalidInputError(f"request {rid} is not the execution's tenant's")
        return record

    def read_state(self, rid: str, step: int) -> tuple[Tensors, Outcome]:
        """The pipeline's tensors after ``step``, and what was skipped or cached."""
        body, length = read_staged_request(self._get(self._key(rid, "steps", str(step))))
        response, tensors = decode_response(body, length)
        notes = response.parameters or {}
        return tensors, Outcome(
            {},
            _listed(notes.get("skipped_steps")),
            _listed(notes.get("cached_steps")),
        )

    def write_state(self, rid: str, step: int, tensors: Tensors, outcome: Outcome) -> str:
        notes = {
            "skipped_steps": ",".join(outcome.skipped),
            "cached_steps": ",".join(outcome.cached),
        }
        body, length = encode_response(
            "pipeline-state", None, rid, tensors, binary=set(tensors), parameters=notes
        )
        key = self._key(rid, "steps", str(step))
        return self._put(key, stage_request(body, length), "application/octet-stream")

    def write_result(self, rid: str, encoded: inference.Encoded) -> str:
        """The V2 response where the async path keeps a result (staged: the header length
        travels with the body)."""
        body = stage_request(encoded.body, encoded.header_length)
        return self._put(self._key(rid, "result"), body, "application/octet-stream")


def _listed(value: Any) -> list[str]:
    return [part for part in str(value or "").split(",") if part]


def _pipeline(pipelines: PipelineSet, name: str, version: str | None = None) -> ServedPipeline:
    served = pipelines.find(name, version)
    if served is None:
        raise ModelNotFoundError(f"no pipeline {name!r} is served here")
    return served


def run_step(
    pipelines: PipelineSet, resolve: Resolver, store: ChainStore, event: ChainEvent
) -> dict[str, Any]:
    """Run step ``event.step`` of the pipeline for request ``event.id``; where its state
    went and whether the step was skipped."""
    requested = store.requested_version(event.id, event.tenant_scope)
    served = _pipeline(pipelines, event.pipeline, requested)
    steps = served.pipeline.steps
    number = event.step if event.step is not None else -1
    if not 0 <= number < len(steps):
        raise InvalidInputError(f"pipeline {served.name!r} has no step {event.step}")
    step = steps[number]
    attributes = {"spillway.step.name": step.label, "spillway.step.index": number,
                  "spillway.model": step.model, "spillway.pipeline": served.name,
                  "spillway.request_id": event.id}  # fmt: skip
    with tracing.span(STEP_SPAN, kind="consumer", attributes=attributes) as span:
        answer = _step(pipelines, resolve, store, event, served, number)
        span.set("spillway.step.skipped", answer["skipped"])
    return answer


def _step(
    pipelines: PipelineSet,
    resolve: Resolver,
    store: ChainStore,
    event: ChainEvent,
    served: ServedPipeline,
    number: int,
) -> dict[str, Any]:
    """``run_step``'s work, within its span."""
    steps = served.pipeline.steps
    if number == 0:
        decoded = inference.decode(*store.read_request(event.id, event.tenant_scope))
        tensors, outcome = dict(admit(served, decoded).decoded.arrays), Outcome({})
    else:
        tensors, outcome = store.read_state(event.id, number - 1)
    drive(
        advance(
            steps[number],
            [tensors],
            [outcome],
            pipelines.cache,
            served.stats,
            scope=store.cache_scope(event.id, event.tenant_scope),
        ),
        LocalSteps(resolve),
    )
    state = store.write_state(event.id, number, tensors, outcome)
    return {"state": state, "skipped": steps[number].label in outcome.skipped}


def respond(pipelines: PipelineSet, store: ChainStore, event: ChainEvent) -> dict[str, Any]:
    """Encode the response from the last step's state (the outputs the request asked
    for, as it asked for them) and settle the request's record with it (without a
    record: write it where the async path keeps results)."""
    requested = store.requested_version(event.id, event.tenant_scope)
    served = _pipeline(pipelines, event.pipeline, requested)
    tensors, outcome = store.read_state(event.id, len(served.pipeline.steps) - 1)
    decoded = inference.decode(*store.read_request(event.id, event.tenant_scope))
    outcome.tensors = {n: tensors[n] for n in served.pipeline.output_names if n in tensors}
    version = served.version(requested)
    encoded = encode(served, version, admit(served, decoded), outcome)
    if store.records is None:
        return {"result": store.write_result(event.id, encoded), "version": str(version)}
    store.records.settle_execution(
        event.id, infer_reply(encoded.body, encoded.header_length, encoded.version)
    )
    return {"result": store.records.result_url(event.id), "version": str(version)}


def failure_of(error: dict[str, str] | None) -> Reply:
    """The reply a caught failure stands for: the step's own error body (a
    ``ClientFault`` / ``ServerFault`` carries ``{"status", "code", "error"}``), else
    (Lambda's or Step Functions' own errors) 503 ``pipeline_failed``."""
    name = str((error or {}).get("Error", "States.Unknown"))[:64]
    try:
        cause = json.loads(str((error or {}).get("Cause", "")))
        body = json.loads(str(cause.get("errorMessage", "")))
        status, code, message = int(body["status"]), str(body["code"]), str(body["error"])
    except (ValueError, TypeError, KeyError, AttributeError):
        status, code, message = 503, "pipeline_failed", f"a step of the pipeline failed ({name})"
    if not 400 <= status <= 599:
        status, code = 503, "pipeline_failed"
    return json_reply(status, {"code": code[:64], "error": message[:1000]})


def fail(store: ChainStore, event: ChainEvent) -> dict[str, Any]:
    """Settle the request's record with what the state machine caught (the end of a
    failed execution); the state and status recorded."""
    if store.records is None:
        raise InvalidInputError("a failed execution is settled through async records")
    reply = failure_of(event.error)
    state = store.records.settle_execution(event.id, reply)
    return {"state": state or "settled", "status": reply.status}


def run_event(
    pipelines: PipelineSet, resolve: Resolver, store: ChainStore, event: ChainEvent
) -> dict[str, Any]:
    """One state's work: a step, the response, or the settling of a failure, each a span
    of the trace that is current (the execution's: ``ChainEvent.trace``)."""
    if event.spillway == STEP:
        return run_step(pipelines, resolve, store, event)
    attributes = {"spillway.pipeline": event.pipeline, "spillway.request_id": event.id}
    if event.spillway == RESPOND:
        with tracing.span("spillway.pipeline.respond", kind="consumer", attributes=attributes):
            return respond(pipelines, store, event)
    with tracing.span("spillway.pipeline.failed", kind="consumer", attributes=attributes):
        return fail(store, event)
