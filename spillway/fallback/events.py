"""The CPU fallback's Lambda events, told apart in one place and answered.

The function receives five kinds of event: the async queue's SQS batches
(``spillway.fallback.async_drain``), the scheduled drain check, the states of a pipeline's
state machine (``spillway.fallback.chain``), API Gateway REST v1 / HTTP API v2 events,
and the router's direct invoke (``spillway.fallback.direct``, the default). ``kind``
names an event's kind; ``CpuEvents.answer`` serves it. The API Gateway transport
(serverless-wsgi over ``CpuApp``) and the AWS clients are injected, so the adapter runs in
tests without the Lambda module's init (which loads every model).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore
from spillway.aws.clients import aws_client
from spillway.fallback.async_drain import DRAIN_CHECK, drain_check, handle_sqs_event
from spillway.fallback.chain import handle_chain_event, is_chain_event
from spillway.fallback.direct import handle_direct
from spillway.fallback.service import CpuService

EventKind = Literal["sqs", "drain-check", "chain", "api-gateway", "direct"]
Proxy = Callable[[dict[str, Any], Any], dict[str, Any]]
"""An API Gateway event and the Lambda context → the proxy response."""


def kind(event: dict[str, Any]) -> EventKind:
    """Which of the function's events this is (anything unrecognised: a direct invoke,
    whose schema then refuses it with a 400 answer)."""
    records = event.get("Records")
    first = records[0] if isinstance(records, list) and records else None
    if isinstance(first, dict) and first.get("eventSource") == "aws:sqs":
        return "sqs"
    if event.get("spillway") == DRAIN_CHECK:
        return "drain-check"
    if is_chain_event(event):
        return "chain"
    if "requestContext" in event and ("httpMethod" in event or "rawPath" in event):
        return "api-gateway"
    return "direct"


@functools.cache
def default_async_store() -> AsyncStore:
    """The async store ``ASYNC_*`` names (made on the first async event)."""
    return AsyncStore(AsyncSettings.from_env())


def default_lambda_client() -> Any:
    """Lambda's control API (the drain check turns the queue's event source on and off)."""
    return aws_client("lambda")


@dataclass(frozen=True)
class CpuEvents:
    """The function's one event adapter over a loaded ``service``."""

    service: CpuService
    proxy: Proxy
    """Serves API Gateway events (the Lambda: serverless-wsgi over ``CpuApp``)."""
    async_store: Callable[[], AsyncStore] = field(default=default_async_store)
    lambda_client: Callable[[], Any] = field(default=default_lambda_client)

    def answer(self, event: dict[str, Any], context: Any) -> dict[str, Any]:
        """The answer to one event; a pipeline state's failure is raised (Step Functions
        retries and catches it), every other error is an answer."""
        match kind(event):
            case "sqs":
                return handle_sqs_event(self.service, self.async_store(), event)
            case "drain-check":
                name = str(getattr(context, "function_name", ""))
                return {"draining": drain_check(self.async_store(), name, self.lambda_client())}
            case "chain":
                return handle_chain_event(self.service, event)
            case "api-gateway":
                return self.proxy(event, context)
            case "direct":
                return handle_direct(self.service, event)
