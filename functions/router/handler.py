"""The router Lambda's entry point: ``functions.router.handler.handler``.

The application is built at init (settings from ``ROUTER_*`` variables), so provisioned
concurrency finds it ready. serverless-wsgi turns API Gateway REST (v1) and HTTP API (v2)
events into WSGI calls and the reply back into the event's response shape. An adapter in
Powertools' shape: Logger, Metrics and Tracer around that one call; the X-Ray tracer is
created only when ``ROUTER_TRACING`` is true: with tracing off its import never happens
and the cold start does not pay for it.

A response that would not fit Lambda's 6 MB synchronous payload (API Gateway would turn
it into a bare 502) is replaced by a 413 that names the offline path for large outputs.
"""

from __future__ import annotations

from typing import Any

import serverless_wsgi
from aws_lambda_powertools.logging import Logger
from aws_lambda_powertools.metrics import Metrics

from spillway.powertools import API_GATEWAY_REQUEST_ID, NAMESPACE, traced
from spillway.protocol.replies import error_reply
from spillway.protocol.wire import EVENT_ENVELOPE_BYTES, LAMBDA_PAYLOAD_BYTES, body_over_limit
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway.tenancy.directory import apply_log_level

# The longest body text a proxy response may carry (base64 for a binary body).
RESPONSE_BODY_LIMIT = LAMBDA_PAYLOAD_BYTES - EVENT_ENVELOPE_BYTES

SERVICE = "spillway-router"

settings = RouterSettings.from_env()
# The parent of the router's own loggers (``spillway.router.*``).
logger = Logger(service="spillway.router", level=settings.log_level)
metrics = Metrics(namespace=NAMESPACE, service=SERVICE)
app = create_app(settings)
if app.live is not None:  # read at init; its log level set on this logger too
    app.live.subscribe(lambda config: apply_log_level(config, logger))
    app.live.poll()


@traced(settings.tracing, SERVICE)
@metrics.log_metrics(capture_cold_start_metric=True)
@logger.inject_lambda_context(correlation_id_path=API_GATEWAY_REQUEST_ID)
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Serve one API Gateway event with the router application."""
    if app.live is not None:
        app.live.poll()
    response: dict[str, Any] = serverless_wsgi.handle_request(app, event, context)
    return within_payload_limit(response)


def within_payload_limit(response: dict[str, Any]) -> dict[str, Any]:
    """The response, or a 413 in its place when its body (as sent: base64 for binary)
    would not fit Lambda's synchronous payload."""
    sent = len(response.get("body") or "")
    if sent <= RESPONSE_BODY_LIMIT:
        return response
    error = body_over_limit(sent, RESPONSE_BODY_LIMIT, "response body (as sent)")
    logger.warning("response replaced", extra={"code": error.code, "reason": error.message})
    reply = error_reply(error)
    return {
        "statusCode": reply.status,
        "headers": dict(reply.headers),
        "body": reply.body.decode(),
        "isBase64Encoded": False,
    }
