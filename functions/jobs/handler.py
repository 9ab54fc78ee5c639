"""The jobs Lambda's entry point: ``functions.jobs.handler.handler``.

An adapter in Powertools' shape: settings (``JOBS_*``) and the service at init, then
Logger, Metrics and (with ``JOBS_TRACING`` on) Tracer around the one event adapter,
``batch_job.api.answer``: ``POST /v1/jobs`` and ``GET /v1/jobs/{id}`` from API Gateway
(REST v1 proxy, HTTP API v2, or the router's batch-mode ``lambda:Invoke``) and the
nightly EventBridge scheduled event. OpenTelemetry spans (``spillway.tracing``) go to the
OTLP endpoint when one is set, flushed at the end of each invocation. Nothing here
imports onnxruntime.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.logging import Logger
from aws_lambda_powertools.metrics import Metrics

from batch_job.api import answer, authenticator, live_config
from batch_job.service import JobService
from batch_job.settings import JobsSettings
from spillway import tracing
from spillway.powertools import API_GATEWAY_REQUEST_ID, NAMESPACE, traced
from spillway.tenancy.directory import apply_log_level

SERVICE = "spillway-jobs"

settings = JobsSettings()
tracing.configure(SERVICE)  # on when an OTLP endpoint is set (the ADOT layer's)
# The parent of the API's own logger (``spillway.jobs.api``): its lines get the context too.
logger = Logger(service="spillway.jobs")
metrics = Metrics(namespace=NAMESPACE, service=SERVICE)
jobs = JobService(settings)
# The live configuration (identity map, log level), read at init and every JOBS_CONFIG_TTL_S.
live = live_config(settings)
live.subscribe(lambda config: apply_log_level(config, logger))
live.poll()
callers = authenticator(settings, live)


@traced(settings.tracing, SERVICE)
@metrics.log_metrics(capture_cold_start_metric=True)
@logger.inject_lambda_context(correlation_id_path=API_GATEWAY_REQUEST_ID)
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Serve one API Gateway or scheduled event; its spans are sent before it returns
    (Lambda freezes the environment after that)."""
    try:
        live.poll()
        return answer(event, jobs, callers)
    finally:
        tracing.flush()
