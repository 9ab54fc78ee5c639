"""The CPU-fallback Lambda's entry point: ``functions.cpu_infer.handler.handler``.

Models load from ``CPU_REPOSITORY`` (a folder packaged with the function, or
``s3://bucket/prefix`` fetched into /tmp): at init under provisioned concurrency or
SnapStart, so a request finds them warm; when a request first needs them in an instance
initialised on demand, so its cold start waits for that model alone (``CPU_PRELOAD``).
An adapter in Powertools' shape: Logger, Metrics and (with ``CPU_TRACING`` on) Tracer
around the one event adapter, ``spillway.fallback.events``, which serves the router's
direct invoke, API Gateway REST v1 / HTTP API v2 events (through the WSGI application
with serverless-wsgi), the async queue's SQS batches with the scheduled drain check,
and the states of a pipeline's state machine.
"""

from __future__ import annotations

import functools
from typing import Any

import serverless_wsgi
from aws_lambda_powertools.logging import Logger
from aws_lambda_powertools.metrics import Metrics

from spillway.fallback.app import CpuApp
from spillway.fallback.events import CpuEvents
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.powertools import API_GATEWAY_REQUEST_ID, NAMESPACE, traced
from spillway.state.table import open_state_store
from spillway.tenancy.directory import LiveConfigCache, apply_log_level

SERVICE = "spillway-cpu-infer"

settings = CpuSettings()
# The parent of the fallback's own loggers (``spillway.cpu_infer.*``).
logger = Logger(service="spillway.cpu_infer", level=settings.log_level)
metrics = Metrics(namespace=NAMESPACE, service=SERVICE)
service = CpuService.load(settings)
app = CpuApp(service)
# The live configuration's log level (``spillway config log-level``), read at init and
# every CPU_CONFIG_TTL_S; the fallback looks up no tenants (the router vouches for them).
live = LiveConfigCache(
    open_state_store(settings.config_table),
    ttl_s=settings.config_ttl_s,
    listeners=[lambda config: apply_log_level(config, logger)],
)
live.poll()
events = CpuEvents(service, proxy=functools.partial(serverless_wsgi.handle_request, app))


@traced(settings.tracing, SERVICE)
@metrics.log_metrics(capture_cold_start_metric=True)
@logger.inject_lambda_context(correlation_id_path=API_GATEWAY_REQUEST_ID)
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Serve a direct-invoke, an API Gateway, an async queue, a drain-check or a
    pipeline-state event."""
    live.poll()
    return events.answer(event, context)
