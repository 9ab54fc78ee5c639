"""The CPU-fallback Lambda's entry point: ``functions.cpu_infer.handler.handler``.

Models load at init, from ``CPU_REPOSITORY`` (a folder packaged with the function, or
``s3://bucket/prefix`` fetched into /tmp), so provisioned concurrency finds them warm.
Two event shapes are served: the direct-invoke event of ``functions.cpu_infer.direct``
(what the router's ``lambda:Invoke`` sends), and API Gateway REST v1 / HTTP API v2
events (served through the WSGI application with serverless-wsgi).
"""

from __future__ import annotations

from typing import Any

import serverless_wsgi
from aws_lambda_powertools.logging import Logger

from functions.cpu_infer.app import CpuApp
from functions.cpu_infer.direct import handle_direct
from functions.cpu_infer.service import CpuService
from functions.cpu_infer.settings import CpuSettings

settings = CpuSettings()
logger = Logger(service="spillway.cpu_infer", level=settings.log_level)
service = CpuService.load(settings)
app = CpuApp(service)


def is_api_gateway(event: dict[str, Any]) -> bool:
    """Whether the event came from API Gateway (REST v1 or HTTP API v2)."""
    return "requestContext" in event and ("httpMethod" in event or "rawPath" in event)


@logger.inject_lambda_context
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Serve a direct-invoke or an API Gateway event."""
    if is_api_gateway(event):
        response: dict[str, Any] = serverless_wsgi.handle_request(app, event, context)
        return response
    return handle_direct(service, event)
