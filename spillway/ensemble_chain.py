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
step runner as every server (``spillway.ensemble_run.advance``), so a retried state
redoes only its own step and overwrites only its own object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from spillway import pipeline
from spillway.codec import decode_response, encode_response
from spillway.ensemble_run import LocalSteps, Outcome, Resolver, advance, drive
from spillway.ensemble_serve import PipelineSet, ServedPipeline, admit, encode
from spillway.errors import InvalidInputError, ModelNotFoundError
from spillway.messages import read_staged_request, stage_request
from spillway.names import MODEL_NAME_PATTERN
from spillway.processing import Tensors
from spillway.wire import TENANT_SCOPE_PATTERN, S3Location

STEP = "pipeline-step"
RESPOND = "pipeline-respond"


class ChainEvent(BaseModel):
    """What a state of a pipeline's state machine sends the CPU fallback."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spillway: Literal["pipeline-step", "pipeline-respond"]
    pipeline: str = Field(pattern=MODEL_NAME_PATTERN.pattern)
    id: str = Field(pattern=r"^[0-9a-f]{32}$")
    """The request's id (as the async path makes them)."""
    step: int | None = Field(default=None, ge=0, le=63)
    """The step to run, by its place in run order (``pipeline-step`` only)."""
    tenant_scope: str | None = Field(default=None, pattern=TENANT_SCOPE_PATTERN)
    """The scope of the tenant whose request this is (``spillway.state_table.scope``),
    when the execution's input names it: its steps use that tenant's cache entries.
    Without it the request's steps use no tenant's entries (only shared steps' cache)."""


@dataclass(frozen=True)
class ChainStore:
    """A chained request's objects under the async location."""

    location: S3Location
    client: Any

    def _key(self, rid: str, *parts: str) -> str:
        return self.location.key(rid, *parts)

    def url(self, key: str) -> str:
        return f"s3://{self.location.bucket}/{key}"

    def _get(self, key: str) -> bytes:
        try:
            body: bytes = self.client.get_object(Bucket=self.location.bucket, Key=key)[
                "Body"
            ].read()
        except self.client.exceptions.NoSuchKey:
            raise InvalidInputError(f"{self.url(key)} does not exist") from None
        return body

    def _put(self, key: str, body: bytes, content_type: str) -> str:
        self.client.put_object(
            Bucket=self.location.bucket, Key=key, Body=body, ContentType=content_type
        )
        return self.url(key)

    def read_request(self, rid: str) -> tuple[bytes, int | None]:
        """The request body and its header length."""
        return read_staged_request(self._get(self._key(rid, "request.v2req")))

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

    def write_result(self, rid: str, encoded: pipeline.Encoded) -> str:
        """The V2 response where the async path keeps a result (staged: the header length
        travels with the body)."""
        body = stage_request(encoded.body, encoded.header_length)
        return self._put(self._key(rid, "result"), body, "application/octet-stream")


def _listed(value: Any) -> list[str]:
    return [part for part in str(value or "").split(",") if part]


def _pipeline(pipelines: PipelineSet, name: str) -> ServedPipeline:
    served = pipelines.find(name, None)
    if served is None:
        raise ModelNotFoundError(f"no pipeline {name!r} is served here")
    return served


def run_step(
    pipelines: PipelineSet, resolve: Resolver, store: ChainStore, event: ChainEvent
) -> dict[str, Any]:
    """Run step ``event.step`` of the pipeline for request ``event.id``; where its state
    went and whether the step was skipped."""
    served = _pipeline(pipelines, event.pipeline)
    steps = served.pipeline.steps
    number = event.step if event.step is not None else -1
    if not 0 <= number < len(steps):
        raise InvalidInputError(f"pipeline {served.name!r} has no step {event.step}")
    if number == 0:
        decoded = pipeline.decode(*store.read_request(event.id))
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
            scope=event.tenant_scope,
        ),
        LocalSteps(resolve),
    )
    state = store.write_state(event.id, number, tensors, outcome)
    return {"state": state, "skipped": steps[number].label in outcome.skipped}


def respond(pipelines: PipelineSet, store: ChainStore, event: ChainEvent) -> dict[str, Any]:
    """Encode the response from the last step's state (the outputs the request asked
    for, as it asked for them) and write it where the async path keeps results."""
    served = _pipeline(pipelines, event.pipeline)
    tensors, outcome = store.read_state(event.id, len(served.pipeline.steps) - 1)
    decoded = pipeline.decode(*store.read_request(event.id))
    outcome.tensors = {n: tensors[n] for n in served.pipeline.output_names if n in tensors}
    version = served.version(None)
    encoded = encode(served, version, admit(served, decoded), outcome)
    return {"result": store.write_result(event.id, encoded), "version": str(version)}
