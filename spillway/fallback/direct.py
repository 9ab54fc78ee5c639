"""The direct-invoke path of the CPU fallback (what the router's ``lambda:Invoke`` sends).

The event and the answer are ``spillway.protocol.messages.DirectInvokeEvent`` and
``DirectInvokeAnswer``: the router builds and reads the same schemas. A body over the
6 MB payload limit is answered with 413 ``payload_too_large``; every error is an answer
with its status, ``{"error", "code"}`` body and headers (``Retry-After`` included) from
the one core mapping, never an exception. The request's trace arrives as
``traceparent``/``tracestate`` in the event's ``headers`` (as on HTTP): the
``spillway.cpu.infer`` span continues it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from spillway import tracing
from spillway.fallback.service import CpuService
from spillway.protocol.messages import DirectInvokeAnswer, DirectInvokeEvent, parse_message
from spillway.protocol.replies import Reply, guarded, infer_reply, json_reply

log = logging.getLogger("spillway.cpu_infer")
CPU_SPAN = "spillway.cpu.infer"
"""The span of one request the CPU function serves (its direct invoke, or HTTP)."""


def handle_direct(service: CpuService, event: dict[str, Any]) -> dict[str, Any]:
    """Serve one direct-invoke event; errors become answers, not exceptions."""
    arrived = time.monotonic()
    reply = guarded(
        log,
        lambda: serve_event(service, parse_message(DirectInvokeEvent, event, "event"), arrived),
        via="direct_invoke",
    )
    return DirectInvokeAnswer.of(reply).dump()


def serve_event(service: CpuService, event: DirectInvokeEvent, arrived: float) -> Reply:
    """The reply to one validated event."""
    if event.operation == "metadata":
        return json_reply(200, service.metadata(event.model, event.version))
    if event.operation == "config":
        return json_reply(200, service.config(event.model, event.version))
    if event.operation == "ready":
        service.check_ready(event.model, event.version)
        return json_reply(200, {"ready": True})
    body, length = event.raw_body(), event.header_length()
    attributes = {"spillway.model": event.model, "spillway.version": event.version}
    with (
        tracing.carry(event.headers),
        tracing.span("spillway.cpu.infer", kind="server", attributes=attributes) as span,
    ):
        result = service.infer(
            event.model,
            event.version,
            body,
            length,
            arrived=arrived,
            tenant_scope=event.tenant_scope,
        )
        span.set("spillway.served_version", result.version)
    return infer_reply(result.body, result.header_length, result.version)
