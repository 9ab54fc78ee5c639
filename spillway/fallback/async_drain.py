"""The CPU fallback as the second consumer of asynchronous requests.

The GPU service takes async work while it has room; when the oldest pending request has
waited longer than ``ASYNC_DRAIN_AGE_S`` (no GPU task, or more work than the GPU tier
can take), the CPU fallback drains the queue too:

* On AWS, an SQS event source mapping on the CPU function delivers the messages
  (``handle_sqs_event``, with partial batch responses). It starts disabled; a scheduled
  event (``{"spillway": "async-drain-check"}``, every minute) runs ``drain_check``, which
  enables it while the oldest pending request is older than the threshold and disables
  it once the backlog is gone. Expired records are no backlog, and a pending record
  whose message is gone (its deliveries used up, or an empty queue) is failed first,
  so a lost message never keeps the CPU function competing for the queue.
* Locally (``spillway serve cpu`` with ``ASYNC_*`` set), ``drain_forever`` runs the same
  check and the same per-message step on a background thread, each batch it receives in
  ``fair_order`` (one request per tenant in turn), as the GPU service does.

Each message runs through ``CpuService.infer``, the synchronous path, inside the trace
the router accepted it in (``spillway.async_inference.traced``), and is settled with
the store's conditional writes, so a request the GPU service also picked up after
a crash still has exactly one visible result.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from spillway import tracing
from spillway.async_inference.queue import Message, fair_order, message_of
from spillway.async_inference.records import owner_scope
from spillway.async_inference.replies import failure_reply
from spillway.async_inference.store import AsyncStore
from spillway.async_inference.traced import running, settled
from spillway.fallback.service import CpuService
from spillway.protocol.replies import Reply, infer_reply

log = logging.getLogger("spillway.cpu_infer.async")
DRAIN_CHECK = "async-drain-check"
OWNER = f"cpu:{socket.gethostname()}:{os.getpid()}"
RECONCILE_EVERY_S = 60.0
"""How often the local drain loop reconciles stale pending records (on AWS: each check)."""


def run_message(service: CpuService, store: AsyncStore, message: Message) -> bool:
    """Run one delivery; True when it is finished with (no redelivery wanted)."""
    job = store.claim(message, OWNER)
    if job is None:
        return True
    reply: Reply
    # The request's trace (the router's span): the engine's spans join it.
    with running(job.record, "cpu") as span:
        try:
            body, length = store.read_input(job)
            # Its tenant's step cache entries, as on the synchronous path: the scope the
            # router stored with the record, trusted as stored.
            record = job.record
            result = service.infer(
                record.model, record.version, body, length, stored_scope=owner_scope(record)
            )
            reply = infer_reply(result.body, result.header_length, result.version)
        except Exception as error:  # noqa: BLE001 - every outcome is recorded
            reply = failure_reply(error)
        state = store.settle(job, reply)
        settled(span, state, reply)
    log.info("async request %s: %s", job.record.id, state or "retry")
    # A retry, or the last failed delivery (left for the dead-letter queue), must not be
    # deleted by the event source mapping.
    return state == "succeeded" or (state == "failed" and reply.status < 500)


def handle_sqs_event(
    service: CpuService, store: AsyncStore, event: dict[str, Any]
) -> dict[str, Any]:
    """An SQS event source batch: the ids of the messages to deliver again. The batch's
    spans are sent before it returns (Lambda freezes the environment after that)."""
    failures: list[dict[str, str]] = []
    try:
        for record in event.get("Records", []):
            try:
                done = run_message(service, store, message_of(record))
            except Exception:
                log.exception("async message %s failed", record.get("messageId"))
                done = False
            if not done:
                failures.append({"itemIdentifier": str(record.get("messageId", ""))})
    finally:
        tracing.flush()
    return {"batchItemFailures": failures}


def should_drain(store: AsyncStore) -> bool:
    """Whether the oldest pending request has waited past ``drain_age_s``."""
    age = store.oldest_pending_age()
    return age is not None and age >= store.settings.drain_age_s


def reconcile(store: AsyncStore) -> int:
    """Fail the pending requests whose message is gone (``AsyncStore.reconcile_pending``),
    so that they stop counting as backlog; how many were failed."""
    failed = store.reconcile_pending(queue_empty=store.queue_is_empty())
    if failed:
        log.warning("async drain check failed %d request(s) whose message was lost", failed)
    return failed


def drain_check(store: AsyncStore, function_name: str, lambda_client: Any) -> bool:
    """Reconcile stale pending requests, then enable this function's SQS event source
    mapping while draining is due and disable it otherwise; whether it is now enabled."""
    reconcile(store)
    wanted = should_drain(store)
    queue_arn = store.client("sqs").get_queue_attributes(
        QueueUrl=store.queue_url, AttributeNames=["QueueArn"]
    )["Attributes"]["QueueArn"]
    mappings = lambda_client.list_event_source_mappings(
        FunctionName=function_name, EventSourceArn=queue_arn
    )["EventSourceMappings"]
    for mapping in mappings:
        enabled = mapping.get("State") in ("Enabled", "Enabling", "Updating")
        if enabled != wanted:
            lambda_client.update_event_source_mapping(UUID=mapping["UUID"], Enabled=wanted)
            log.info("async drain %s", "enabled" if wanted else "disabled")
    return wanted


def drain_forever(
    service: CpuService, store: AsyncStore, stop: threading.Event, interval_s: float = 1.0
) -> None:
    """The local form: check every ``interval_s``; while due, take and run messages."""
    checked = float("-inf")
    while not stop.is_set():
        try:
            if store.clock() - checked >= RECONCILE_EVERY_S:
                reconcile(store)
                checked = store.clock()
            if should_drain(store):
                for message in fair_order(store.receive(10, 1.0), {}):
                    run_message(service, store, message)
                continue
        except Exception:
            log.exception("async drain step failed; retrying")
        stop.wait(interval_s)


def start_local_drain(service: CpuService) -> threading.Event | None:
    """Start ``drain_forever`` on a daemon thread when ``ASYNC_*`` names a queue; the
    event that stops it."""
    from spillway.async_inference.settings import AsyncSettings

    settings = AsyncSettings.from_env()
    if not settings.enabled:
        return None
    tracing.configure("spillway-cpu-async")  # nothing changes where the service configured it
    stop = threading.Event()
    thread = threading.Thread(
        target=drain_forever, args=(service, AsyncStore(settings), stop), daemon=True
    )
    thread.start()
    return stop
