"""Async mode: accept an infer request at once (202) and answer it later, once.

A request asks for it with ``"mode": "async"`` in its parameters, the header
``x-spillway-mode: async`` or ``Prefer: respond-async``. The router stages it with
``spillway.async_inference.store.AsyncStore`` (S3, a DynamoDB record, an SQS message) and
answers ``202 {"id", "state", "status_url", "areas"}`` with ``Location:
/v1/results/{id}``; the GPU service consumes the queue when its batchers have room, the
CPU fallback when the oldest request has waited too long. ``GET /v1/results/{id}``
answers 202 with the state while pending, 200 with the ordinary V2 response, or the
request's error.

A request may name its input as ``"input_location": "s3://…"`` (a V2 body of up to
``ASYNC_MAX_INPUT_BYTES``, beyond any synchronous limit) and a folder for its result as
``"output_location"``, both inside the caller's own areas (``areas`` in every receipt;
403 ``outside_tenant_area`` elsewhere). An ``Idempotency-Key`` makes a retried
submission find the request it already made (409 for another request under it).

A pipeline that ``ASYNC_STATE_MACHINES`` names runs as an execution of its Step Functions
state machine instead: the router starts it (named by the request id and the attempt, so
a retried start finds the same execution and a key used again after its record expired
starts a new one) with the request's id and its caller's tenant scope, and the
execution's end settles the record, answered at the same ``/v1/results/{id}``.

Each tenant may have ``ASYNC_TENANT_MAX_INFLIGHT`` requests queued or running and
``ASYNC_TENANT_MAX_STAGED_BYTES`` of bodies staged for them (429 ``quota_exceeded``
with Retry-After past either), counted in a ledger in the router's state table: a
request counts until a read of its record finds it settled or gone.

The request's trace goes with it: the record keeps the carrier of the route span it was
accepted in (``trace``), and the worker that runs it, or each state of its execution,
continues that trace (``spillway.async_inference.traced``).
"""

from __future__ import annotations

from dataclasses import dataclass

from spillway import tracing
from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore
from spillway.policy.facts import Request
from spillway.protocol.errors import (
    InvalidInputError,
    ModeUnavailableError,
    PayloadTooLargeError,
    SpillwayError,
    UnavailableError,
)
from spillway.protocol.replies import Reply, json_reply
from spillway.state.quotas import QuotaLedger, QuotaLimits
from spillway.state.table import StateStore, scope

RESULTS_PREFIX = "/v1/results/"


def _location(parameters: dict[str, object], key: str) -> str | None:
    value = parameters.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidInputError(f"{key} must be an s3:// URL")
    return value


def inflight_ledger(settings: AsyncSettings, state: StateStore) -> QuotaLedger:
    """The per-tenant ledger of async requests in flight (count and staged bytes)."""
    limits = QuotaLimits(settings.tenant_max_inflight, settings.tenant_max_staged_bytes)
    return QuotaLedger(state, "async", limits, "async requests in flight")


class AsyncFront:
    """The router's side of async inference; ``quota``: the in-flight ledger (None: no
    per-tenant quota, for a router without a state table)."""

    def __init__(self, store: AsyncStore, quota: QuotaLedger | None = None) -> None:
        self.store = store
        self.quota = quota

    def submit(self, request: Request) -> Reply:
        """Accept the request: 202 with its id, where to poll and the caller's areas (its
        record keeps the current trace's carrier)."""
        target = request.target
        if target.operation != "infer" or target.model is None:
            raise ModeUnavailableError("only infer requests can run asynchronously")
        parameters = (request.header or {}).get("parameters") or {}
        tenant = request.facts.tenant
        try:
            record, replayed = self.store.submit(
                tenant=tenant,
                model=target.model,
                version=target.version,
                body=request.call.body,
                header_length=request.header_length,
                client_key=request.idempotency_key,
                input_location=_location(parameters, "input_location"),
                output_location=_location(parameters, "output_location"),
                admit=(lambda rid, size, now: self._admit(tenant, rid, size, now)),
                start=self._starter(target.model),
                trace=tracing.outgoing(),
            )
        except SpillwayError:
            raise
        except Exception as exc:  # an AWS error: the platform's fault, never the client's
            if type(exc).__module__.startswith("botocore"):
                raise UnavailableError(
                    f"the request could not be queued ({type(exc).__name__})"
                ) from exc
            raise
        status_url = RESULTS_PREFIX + record.id
        headers = [("location", status_url), ("x-spillway-backend", "async")]
        if replayed:
            headers.append(("idempotent-replayed", "true"))
        body = {
            "id": record.id,
            "state": record.state,
            "status_url": status_url,
            "areas": self.store.areas(tenant),
        }
        return json_reply(202, body, headers)

    def _starter(self, model: str) -> ExecutionStarter | None:
        """How a request for ``model`` runs: as an execution of the state machine
        ``ASYNC_STATE_MACHINES`` names for it, else (None) through the queue."""
        machine = self.store.settings.state_machines.get(model)
        return None if machine is None else ExecutionStarter(machine)

    def _admit(self, tenant: str | None, rid: str, size: int, now: float) -> None:
        """Count the request against its tenant's quota (429 past it)."""
        if self.quota is None:
            return
        if size > self.quota.limits.bytes:
            raise PayloadTooLargeError(
                f"the request body ({size} bytes staged) exceeds a tenant's staging quota "
                f"({self.quota.limits.bytes} bytes); name it as input_location instead"
            )
        recheck = self.store.settings.quota_recheck_s

        def probe(name: str, when: float) -> float | None:
            return when + recheck if self.store.still_pending(name) else None

        self.quota.charge(scope(tenant), rid, size, now, now + recheck, probe)

    def result(self, path: str, tenant: str | None) -> Reply:
        """``GET /v1/results/{id}`` for the caller's own request."""
        return self.store.result_reply(path.removeprefix(RESULTS_PREFIX).rstrip("/"), tenant)


@dataclass
class ExecutionStarter:
    """The state machine a request runs as an execution of (``states:StartExecution``,
    the only Step Functions call the router's role may make, on that machine alone); the
    store starts one execution per attempt, named ``<id>-<attempt>``
    (``records.execution_name``)."""

    machine: str
