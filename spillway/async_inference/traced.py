"""An asynchronous request's run as a span of the trace it was accepted in.

The router keeps the carrier of its route span in the request's record (``trace``); a
worker that claims the record runs it inside ``running``: the record's trace is current
(``spillway.tracing.carry``) and a ``spillway.async.run`` span (kind consumer) holds the
run, so the spans of the path it takes (the GPU service's batches, the CPU fallback's
engine) join the request's one trace. Both workers, the GPU service's consumer and the
CPU fallback's drain, use it. With tracing off the carrier is still passed on as it came.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from spillway import tracing
from spillway.async_inference.records import AsyncRecord
from spillway.async_inference.replies import error_of
from spillway.protocol.replies import Reply

RUN_SPAN = "spillway.async.run"


def queue_wait_ms(record: AsyncRecord) -> int:
    """How long the request waited for this run: from its acceptance to its claim (the
    claim sets ``updated_at``), in milliseconds."""
    return max(0, round((record.updated_at - record.created_at) * 1000))


@contextmanager
def running(record: AsyncRecord, worker: str) -> Iterator[tracing.Span_]:
    """Within the block the record's trace is current and its run's span is open; the
    span says which model, tenant scope, request and attempt, and the queue wait."""
    attributes = {
        "spillway.model": record.model,
        "spillway.version": record.version,
        "spillway.tenant_scope": record.scope,
        "spillway.request_id": record.id,
        "spillway.attempt": record.attempts,
        "spillway.queue_wait_ms": queue_wait_ms(record),
        "spillway.worker": worker,
    }
    with (
        tracing.carry(record.trace),
        tracing.span(RUN_SPAN, kind="consumer", attributes=attributes) as span,
    ):
        yield span


def settled(span: tracing.Span_, state: str | None, reply: Reply) -> None:
    """The run's outcome on its span: the state the record reached (``retry``: it will
    run again) and the status; a server error marks the span failed."""
    span.set("spillway.async.state", state or "retry")
    span.set("http.response.status_code", reply.status)
    if reply.status >= 400:
        span.set("spillway.error_code", error_of(reply)[0])
    if reply.status >= 500:
        span.fail(f"status {reply.status}")
