"""What the four Lambda handlers (``functions/*/handler.py``) share of Powertools' shape.

Each handler builds its settings at init and wraps its one adapter call in Powertools'
``Logger`` (``inject_lambda_context``, the correlation id API Gateway's request id),
``Metrics`` (``log_metrics``, the cold-start metric; EMF lines on stdout, which Lambda
sends to CloudWatch, so no permission is needed) and, only where the function's tracing
setting is on, ``Tracer``: ``traced`` imports it (and aws-xray-sdk) only then, so a cold
start without tracing does not pay for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from spillway.tracing import configure as configure_tracing
from spillway.tracing import flush as flush_traces

NAMESPACE = "Spillway"
"""CloudWatch namespace of the functions' metrics (the templates'
``POWERTOOLS_METRICS_NAMESPACE``; set in code so that a missing variable changes nothing)."""
API_GATEWAY_REQUEST_ID = "requestContext.requestId"
"""Where REST (v1) and HTTP API (v2) events carry API Gateway's request id, the log
lines' correlation id; other events (direct invoke, SQS, schedules) have none."""

LambdaHandler = Callable[[dict[str, Any], Any], dict[str, Any]]
"""An event and the Lambda context → the function's answer."""


def traced(on: bool, service: str) -> Callable[[LambdaHandler], LambdaHandler]:
    """A decorator: Powertools' ``Tracer(service).capture_lambda_handler`` when ``on``,
    else the handler unchanged (and the tracer never imported). When the environment
    asks for OpenTelemetry (``spillway.tracing``: an OTLP endpoint, on AWS the ADOT
    layer's collector), the process's spans are set up here and flushed before each
    invocation returns: Lambda freezes the environment after it, so a span left in the
    buffer would wait for the next invocation, or be lost."""
    exporting = configure_tracing(service)

    def wrap(handler: LambdaHandler) -> LambdaHandler:
        inner = handler
        if on:
            from aws_lambda_powertools.tracing import Tracer

            inner = Tracer(service=service).capture_lambda_handler(handler)
        if not exporting:
            return inner

        @functools.wraps(handler)
        def flushed(event: dict[str, Any], context: Any) -> dict[str, Any]:
            try:
                return inner(event, context)
            finally:
                flush_traces()

        return flushed

    return wrap


API_GATEWAY_TIMEOUT_S = 29
"""API Gateway's integration timeout, and the timeout both template forms give the
functions behind it (the router and the WebSocket function)."""


def remaining_ms(context: object) -> float | None:
    """What is left of the invocation in ms, as the Lambda context counts it; ``None``
    without a Lambda context."""
    remaining = getattr(context, "get_remaining_time_in_millis", None)
    if not callable(remaining):
        return None
    return float(remaining())
