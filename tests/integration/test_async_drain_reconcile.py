"""The CPU drain check against stale pending records, on the moto server.

A record whose message is gone must not keep the drain enabled: an expired record is
ignored, a record whose deliveries are used up (its message went to the dead-letter queue)
or whose message is nowhere in the queue is failed once as the server's fault, and the
tenant's in-flight quota is free again.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore
from spillway.fallback.async_drain import drain_check, should_drain
from spillway.protocol.errors import QuotaExceededError
from spillway.router.async_mode import inflight_ledger
from spillway.state.table import scope
from spillway_cli.local.async_resources import create_async_resources
from tests.memory_store import MemoryStateStore

DRAIN_AGE_S = 120.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class FakeLambda:
    """The Lambda API's event source mappings of the CPU function: one, disabled."""

    def __init__(self, queue_arn: str) -> None:
        self.queue_arn = queue_arn
        self.enabled = False

    def list_event_source_mappings(self, FunctionName: str, EventSourceArn: str) -> Any:
        assert EventSourceArn == self.queue_arn
        state = "Enabled" if self.enabled else "Disabled"
        return {"EventSourceMappings": [{"UUID": "drain", "State": state}]}

    def update_event_source_mapping(self, UUID: str, Enabled: bool) -> Any:
        self.enabled = Enabled
        return {}


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _settings(suffix: str, **overrides: Any) -> AsyncSettings:
    base = create_async_resources(
        f"async-{suffix}", lease_s=30, names=(f"t-{suffix}", f"q-{suffix}", f"dlq-{suffix}")
    )
    return base.model_copy(update={"drain_age_s": DRAIN_AGE_S, **overrides})


@pytest.fixture
def store(aws_env: str, clock: Clock) -> AsyncStore:
    return AsyncStore(_settings(uuid.uuid4().hex[:8]), clock=clock)


BODY = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})


def _submit(store: AsyncStore, tenant: str = "alice") -> str:
    record, _ = store.submit(
        tenant=tenant, model="digits", version=None, body=BODY.encode(), header_length=None
    )
    return record.id


def _lose_messages(store: AsyncStore) -> None:
    """The queue forgets every message (a failed send, a purge, retention)."""
    store.client("sqs").purge_queue(QueueUrl=store.queue_url)


def _lambda(store: AsyncStore) -> FakeLambda:
    arn = store.client("sqs").get_queue_attributes(
        QueueUrl=store.queue_url, AttributeNames=["QueueArn"]
    )["Attributes"]["QueueArn"]
    return FakeLambda(arn)


def test_an_expired_pending_record_does_not_enable_the_drain(aws_env: str, clock: Clock) -> None:
    # GIVEN a store with a one-minute TTL and a request nobody ran, now expired
    store = AsyncStore(_settings(uuid.uuid4().hex[:8], ttl_s=60), clock=clock)
    _submit(store)
    clock.now += 3600
    # WHEN the drain check runs (DynamoDB's TTL has not deleted the record yet)
    # THEN the expired record counts for nothing
    assert store.oldest_pending_age() is None
    assert not drain_check(store, "cpu", _lambda(store))


def test_an_expired_record_older_than_a_live_one_is_skipped(aws_env: str, clock: Clock) -> None:
    store = AsyncStore(_settings(uuid.uuid4().hex[:8], ttl_s=300), clock=clock)
    _submit(store)
    clock.now += 200
    _submit(store)
    clock.now += 150  # the first has expired, the second waited 150 s
    assert store.oldest_pending_age() == pytest.approx(150)


def test_a_record_whose_deliveries_are_used_up_is_failed_once(
    store: AsyncStore, clock: Clock
) -> None:
    # GIVEN a request whose every delivery was claimed by a consumer that then crashed
    rid = _submit(store)
    for _ in range(store.settings.max_attempts):
        (message,) = store.receive(10, 0)
        assert store.claim(message, "gpu-crashed") is not None
        clock.now += store.settings.lease_s + 1
        store.client("sqs").change_message_visibility(
            QueueUrl=store.queue_url, ReceiptHandle=message.receipt, VisibilityTimeout=0
        )
    clock.now += DRAIN_AGE_S
    # WHEN the drain check runs
    lambda_api = _lambda(store)
    enabled = drain_check(store, "cpu", lambda_api)
    # THEN the request is failed as the server's fault, and the drain stays off
    assert not enabled
    record = store.find(rid)
    assert record is not None
    assert (record.state, record.status, record.code) == ("failed", 500, "delivery_lost")
    reply = store.result_reply(rid, "alice")
    assert reply.status == 500
    # AND a second check changes nothing (recorded once)
    assert store.reconcile_pending(queue_empty=False) == 0
    assert store.find(rid) == record


def test_a_record_whose_message_is_gone_is_failed_and_frees_its_quota(
    store: AsyncStore, clock: Clock, aws_env: str
) -> None:
    # GIVEN alice at her in-flight quota of 2 and bob with one request, every message lost
    state = MemoryStateStore()
    ledger = inflight_ledger(store.settings.model_copy(update={"tenant_max_inflight": 2}), state)

    def admit(tenant: str, rid: str) -> None:
        recheck = store.settings.quota_recheck_s
        ledger.charge(
            scope(tenant), rid, 0, clock.now, clock.now + recheck,
            lambda name, when: when + recheck if store.still_pending(name) else None,
        )  # fmt: skip

    alice = [_submit(store, "alice") for _ in range(2)]
    for rid in alice:
        admit("alice", rid)
    bob = _submit(store, "bob")
    with pytest.raises(QuotaExceededError):
        admit("alice", uuid.uuid4().hex)
    _lose_messages(store)
    clock.now += DRAIN_AGE_S + 600
    # WHEN the drain check runs
    assert not drain_check(store, "cpu", _lambda(store))
    # THEN all three are failed, each owner sees it, nothing is pending
    for rid, tenant in [*((r, "alice") for r in alice), (bob, "bob")]:
        reply = store.result_reply(rid, tenant)
        assert (reply.status, json.loads(reply.body)["code"]) == (500, "delivery_lost")
    assert store.oldest_pending_age() is None
    # AND alice may submit again: her quota was released
    admit("alice", uuid.uuid4().hex)


def test_a_young_record_or_one_with_its_message_queued_is_left_alone(
    store: AsyncStore, clock: Clock
) -> None:
    # GIVEN an old request whose message waits in the queue (nobody consumes: GPU down)
    rid = _submit(store)
    clock.now += DRAIN_AGE_S + 600
    # WHEN the drain check runs THEN the drain is enabled for it and the record is intact
    assert drain_check(store, "cpu", _lambda(store))
    record = store.find(rid)
    assert record is not None
    assert record.state == "queued"
    # AND a request just submitted whose message is gone is not failed yet
    young = _submit(store)
    _lose_messages(store)
    assert should_drain(store)  # the old one (its message lost too) counts until reconciled
    store.reconcile_pending(queue_empty=True)
    young_record = store.find(young)
    assert young_record is not None
    assert young_record.state == "queued"
