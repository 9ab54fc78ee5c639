"""The CPU fallback's side of a pipeline's Step Functions form: one state, one call.

A state machine state invokes the function with ``{"spillway": "pipeline-step" |
"pipeline-respond" | "pipeline-failed", "pipeline", "id", "tenant_scope", "step",
"execution"}`` (``spillway.pipelines.chain``; the last two kinds settle the request's
async record; ``execution`` is the execution's input, whose ``trace`` the call
continues). The
answer is what the state keeps; a failure is raised, because that is what Step Functions
retries and catches, and its type names the kind: ``ClientFault`` (the request's own
fault, 4xx: never retried) or ``ServerFault`` (5xx or 429: retried with backoff), its
message the error body (``{"status", "code", "error"}``) that the catch writes to the
request's error record.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from spillway import tracing
from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore
from spillway.aws.clients import aws_client
from spillway.fallback.service import CpuService
from spillway.pipelines.chain import FAILED, RESPOND, STEP, ChainEvent, ChainStore, run_event
from spillway.protocol.errors import NotConfiguredError, SpillwayError
from spillway.protocol.messages import parse_message
from spillway.protocol.s3urls import parse_s3_url

log = logging.getLogger("spillway.cpu_infer.chain")
EVENTS = frozenset({STEP, RESPOND, FAILED})


class ClientFault(Exception):
    """The request cannot run (a 4xx): retrying would fail the same way."""


class ServerFault(Exception):
    """A failure of the service (a 5xx, or 429): worth retrying."""


def is_chain_event(event: dict[str, Any]) -> bool:
    """Whether the event comes from a state of a pipeline's state machine."""
    return event.get("spillway") in EVENTS


@functools.cache
def default_store() -> ChainStore:
    """Requests under ``ASYNC_LOCATION`` (the async path's place), read through S3, and
    their records (settled at the execution's end) when async mode is on."""
    settings = AsyncSettings.from_env()
    if settings.location is None:
        raise NotConfiguredError("pipeline state machines need ASYNC_LOCATION")
    records = AsyncStore(settings) if settings.enabled else None
    return ChainStore(parse_s3_url(settings.location), aws_client("s3"), records)


def handle_chain_event(
    service: CpuService, event: dict[str, Any], store: ChainStore | None = None
) -> dict[str, Any]:
    """Run one state's work in the execution's trace; raise ``ClientFault`` or
    ``ServerFault`` when it fails. Its spans are sent before it returns (Lambda freezes
    the environment after that)."""
    try:
        chain = parse_message(ChainEvent, event, "event")
        with tracing.carry(chain.trace()):
            return run_event(service.pipelines, service.get, store or default_store(), chain)
    except SpillwayError as error:
        body = json.dumps({"status": error.status, "code": error.code, "error": error.message})
        log.info("pipeline state failed", extra={"status": error.status, "code": error.code})
        if error.status >= 500 or error.status == 429:
            raise ServerFault(body) from error
        raise ClientFault(body) from error
    finally:
        tracing.flush()
