"""Async mode: accept an infer request at once (202) and answer it later, once.

A request asks for it with ``"mode": "async"`` in its parameters, the header
``x-spillway-mode: async`` or ``Prefer: respond-async``. The router stages it with
``spillway.async_inference.AsyncStore`` (S3, a DynamoDB record, an SQS message) and
answers ``202 {"id", "state", "status_url"}`` with ``Location: /v1/results/{id}``; the
GPU service consumes the queue when its batchers have room, the CPU fallback when the
oldest request has waited too long. ``GET /v1/results/{id}`` answers 202 with the state
while pending, 200 with the ordinary V2 response, or the request's error.

A request may name its input as ``"input_location": "s3://…"`` (a V2 body of up to
1 GiB, beyond any synchronous limit) and its result's place as ``"output_location"``,
both under locations the operator allows. An ``Idempotency-Key`` makes a retried
submission find the request it already made.
"""

from __future__ import annotations

from typing import Any

from functions.router.facts import Request
from spillway.async_inference import AsyncStore
from spillway.errors import InvalidInputError, ModeUnavailableError, UnavailableError
from spillway.wire import Reply, json_reply

RESULTS_PREFIX = "/v1/results/"


def _location(parameters: dict[str, Any], key: str) -> str | None:
    value = parameters.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidInputError(f"{key} must be an s3:// URL")
    return value


class AsyncFront:
    """The router's side of async inference."""

    def __init__(self, store: AsyncStore) -> None:
        self.store = store

    def submit(self, request: Request) -> Reply:
        """Accept the request: 202 with its id and where to poll."""
        target = request.target
        if target.operation != "infer" or target.model is None:
            raise ModeUnavailableError("only infer requests can run asynchronously")
        parameters = (request.header or {}).get("parameters") or {}
        try:
            record, replayed = self.store.submit(
                tenant=request.facts.tenant,
                model=target.model,
                version=target.version,
                body=request.call.body,
                header_length=request.header_length,
                client_key=request.idempotency_key,
                input_location=_location(parameters, "input_location"),
                output_location=_location(parameters, "output_location"),
            )
        except (InvalidInputError, ModeUnavailableError):
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
        body = {"id": record.id, "state": record.state, "status_url": status_url}
        return json_reply(202, body, headers)

    def result(self, path: str, tenant: str | None) -> Reply:
        """``GET /v1/results/{id}`` for the caller's own request."""
        return self.store.result_reply(path.removeprefix(RESULTS_PREFIX).rstrip("/"), tenant)
