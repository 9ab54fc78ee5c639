"""The router Lambda's entry point: ``functions.router.handler.handler``.

The application is built at init (settings from ``ROUTER_*`` variables), so provisioned
concurrency finds it ready. serverless-wsgi turns API Gateway REST (v1) and HTTP API (v2)
events into WSGI calls and the reply back into the event's response shape. The X-Ray
tracer is created only when ``ROUTER_TRACING`` is true: with tracing off its import never
happens and the cold start does not pay for it.
"""

from __future__ import annotations

from typing import Any

import serverless_wsgi
from aws_lambda_powertools.logging import Logger

from functions.router.settings import RouterSettings
from functions.router.wiring import create_app

settings = RouterSettings.from_env()
logger = Logger(service="spillway.router", level=settings.log_level)
app = create_app(settings)


def _traced(function: Any) -> Any:
    if not settings.tracing:
        return function
    from aws_lambda_powertools.tracing import Tracer

    return Tracer(service="spillway-router").capture_lambda_handler(function)


@_traced
@logger.inject_lambda_context(correlation_id_path="requestContext.requestId")
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Serve one API Gateway event with the router application."""
    response: dict[str, Any] = serverless_wsgi.handle_request(app, event, context)
    return response
