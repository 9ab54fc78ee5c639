"""The CPU-fallback Lambda's entry point: ``functions.cpu_infer.handler.handler``.

Models load at init, from ``CPU_REPOSITORY`` (a folder packaged with the function, or
``s3://bucket/prefix`` fetched into /tmp), so provisioned concurrency finds them warm.
Served: the direct-invoke event of ``spillway.fallback.direct`` (what the router's
``lambda:Invoke`` sends), API Gateway REST v1 / HTTP API v2 events (through the WSGI
application with serverless-wsgi), the async queue's SQS batches with the scheduled
drain check (``spillway.fallback.async_drain``), and the states of a pipeline's state
machine (``spillway.fallback.chain``).
"""

from __future__ import annotations

import functools
from typing import Any

import serverless_wsgi
from aws_lambda_powertools.logging import Logger

from spillway.async_inference import AsyncSettings, AsyncStore
from spillway.fallback.app import CpuApp
from spillway.fallback.async_drain import DRAIN_CHECK, drain_check, handle_sqs_event
from spillway.fallback.chain import handle_chain_event, is_chain_event
from spillway.fallback.direct import handle_direct
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings

settings = CpuSettings()
logger = Logger(service="spillway.cpu_infer", level=settings.log_level)
service = CpuService.load(settings)
app = CpuApp(service)


def is_api_gateway(event: dict[str, Any]) -> bool:
    """Whether the event came from API Gateway (REST v1 or HTTP API v2)."""
    return "requestContext" in event and ("httpMethod" in event or "rawPath" in event)


@functools.cache
def async_store() -> AsyncStore:
    """The async store ``ASYNC_*`` names (made on the first async event)."""
    return AsyncStore(AsyncSettings.from_env())


def is_sqs(event: dict[str, Any]) -> bool:
    """Whether the event is a batch from the async queue's event source mapping."""
    records = event.get("Records")
    return (
        isinstance(records, list) and bool(records) and records[0].get("eventSource") == "aws:sqs"
    )


@logger.inject_lambda_context
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Serve a direct-invoke, an API Gateway, an async queue or a drain-check event."""
    if is_sqs(event):
        return handle_sqs_event(service, async_store(), event)
    if event.get("spillway") == DRAIN_CHECK:
        from spillway.models.repository import aws_client

        name = str(getattr(context, "function_name", ""))
        return {"draining": drain_check(async_store(), name, aws_client("lambda"))}
    if is_chain_event(event):  # a state of a pipeline's state machine
        return handle_chain_event(service, event)
    if is_api_gateway(event):
        response: dict[str, Any] = serverless_wsgi.handle_request(app, event, context)
        return response
    return handle_direct(service, event)
