"""Async inference's store on the moto server: one visible result per request whatever
SQS redelivers, retries then the dead-letter queue for a server fault, a client error
failing at once, caller-scoped results, expiry, and the sparse pending index."""

from __future__ import annotations

import json
import uuid

import pytest

from spillway.async_inference.queue import Message
from spillway.async_inference.records import AsyncRecord
from spillway.async_inference.store import AsyncStore
from spillway.aws.clients import aws_client
from spillway.protocol.errors import (
    IdempotencyConflictError,
    InferenceError,
    InputNotFoundError,
    InvalidInputError,
    OutsideTenantAreaError,
    RouteNotFoundError,
)
from spillway.protocol.replies import error_reply, infer_reply, json_reply
from spillway.state.table import scope
from spillway_cli.local.async_resources import create_async_resources


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(aws_env: str, clock: Clock) -> AsyncStore:
    suffix = uuid.uuid4().hex[:8]
    settings = create_async_resources(
        f"async-{suffix}",
        lease_s=30,
        names=(f"t-{suffix}", f"q-{suffix}", f"dlq-{suffix}"),
    )
    return AsyncStore(settings, clock=clock)


BODY = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})


def _submit(store: AsyncStore, tenant: str = "alice", **kw: object) -> str:
    record, replayed = store.submit(
        tenant=tenant, model="digits", version=None, body=BODY.encode(), header_length=None,
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    assert not replayed
    return record.id


def _one(store: AsyncStore) -> Message:
    (message,) = store.receive(10, 0)
    return message


def _dlq_count(store: AsyncStore) -> int:
    sqs = aws_client("sqs")
    url = store.queue_url.rsplit("/", 1)[0] + "/dlq-" + store.queue_url.rsplit("-", 1)[-1]
    attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    return int(attributes["ApproximateNumberOfMessages"])


def test_a_request_has_one_result_whatever_is_redelivered(store: AsyncStore, clock: Clock) -> None:
    # GIVEN a request, claimed by a consumer that then stalls past its lease
    rid = _submit(store)
    assert json.loads(store.result_reply(rid, "alice").body)["state"] == "queued"
    first = store.claim(_one(store), "gpu-a")
    assert first is not None
    assert json.loads(store.result_reply(rid, "alice").body)["state"] == "running"
    # WHEN the delivery comes back while the lease holds, nobody else takes it
    redelivered = Message(rid, first.message.receipt, 2)
    assert store.claim(redelivered, "cpu") is None
    assert store.receive(10, 0) == []  # hidden until the lease ends
    # AND after the lease another consumer takes it over and finishes
    clock.now += 31
    second = store.claim(redelivered, "cpu")
    assert second is not None
    assert second.record.attempts == 2
    done = infer_reply(b'{"outputs":[{"name":"y","data":[2]}]}', None, 1)
    assert store.settle(second, done) == "succeeded"
    # THEN the stalled first consumer's late answer changes nothing
    late = infer_reply(b'{"outputs":[{"name":"y","data":[999]}]}', None, 1)
    assert store.settle(first, late) is None
    reply = store.result_reply(rid, "alice")
    assert reply.status == 200
    assert json.loads(reply.body)["outputs"][0]["data"] == [2]
    assert ("x-spillway-model-version", "1") in reply.headers
    # AND a later delivery of a finished request is simply dropped
    assert store.claim(Message(rid, "gone", 3), "gpu-b") is None


def test_a_server_fault_is_retried_then_failed_and_dead_lettered(
    store: AsyncStore, clock: Clock
) -> None:
    rid = _submit(store)
    fault = error_reply(InferenceError("the model crashed"))
    states = []
    for attempt in range(1, 4):
        (delivery,) = store.receive(10, 0)
        assert delivery.receive_count == attempt
        job = store.claim(delivery, "gpu")
        assert job is not None
        states.append(store.settle(job, fault))
        if states[-1] is None:  # skip the release's backoff
            store.client("sqs").change_message_visibility(
                QueueUrl=store.queue_url, ReceiptHandle=delivery.receipt, VisibilityTimeout=0
            )
    # THEN two retries, then a final failure recorded with its error
    assert states == [None, None, "failed"]
    reply = store.result_reply(rid, "alice")
    assert reply.status == 500
    assert json.loads(reply.body)["code"] == "inference_failed"
    # AND the message has moved to the dead-letter queue
    assert store.receive(10, 0) == []
    assert _dlq_count(store) == 1


def test_a_client_error_fails_at_once(store: AsyncStore) -> None:
    rid = _submit(store)
    job = store.claim(_one(store), "gpu")
    assert job is not None
    assert store.settle(job, error_reply(InvalidInputError("bad shape"))) == "failed"
    reply = store.result_reply(rid, "alice")
    assert (reply.status, json.loads(reply.body)["code"]) == (400, "invalid_input")
    assert store.receive(10, 0) == []
    assert _dlq_count(store) == 0


def test_results_belong_to_their_caller_and_expire(store: AsyncStore, clock: Clock) -> None:
    rid = _submit(store, tenant="alice")
    with pytest.raises(RouteNotFoundError):
        store.result_reply(rid, "mallory")
    with pytest.raises(RouteNotFoundError):
        store.result_reply("../../etc", "alice")
    job = store.claim(_one(store), "gpu")
    assert job is not None
    store.settle(job, json_reply(200, {"outputs": []}))
    assert store.result_reply(rid, "alice").status == 200
    # WHEN its time is up, it is gone for readers at once, and purged with its objects
    clock.now += store.settings.ttl_s + 1
    with pytest.raises(RouteNotFoundError):
        store.result_reply(rid, "alice")
    assert store.purge_expired() == 1
    listed = store.client("s3").list_objects_v2(Bucket=store.location.bucket)
    assert listed.get("KeyCount", 0) == 0


def test_an_idempotency_key_finds_the_request_already_made(store: AsyncStore) -> None:
    def submit(tenant: str, body: bytes) -> tuple[AsyncRecord, bool]:
        return store.submit(tenant=tenant, model="digits", version=None, body=body,
                            header_length=None, client_key="k1")  # fmt: skip

    first, replayed = submit("alice", BODY.encode())
    again, replayed_again = submit("alice", BODY.encode())
    other, _ = submit("bob", BODY.encode())
    assert (replayed, replayed_again) == (False, True)
    assert again.id == first.id != other.id
    # AND the same key with another payload is a conflict, not the first request's answer
    with pytest.raises(IdempotencyConflictError):
        submit("alice", b"{}")
    # AND an unauthenticated caller's key never meets a tenant named "anonymous"
    assert submit(None, BODY.encode())[0].id != submit("anonymous", BODY.encode())[0].id  # type: ignore[arg-type]
    assert len(store.receive(10, 0)) == 4  # one message per request, none for the replay
    # AND once the record has expired (before DynamoDB's TTL removes it) the key is free
    store.clock.now += store.settings.ttl_s + 1  # type: ignore[attr-defined]
    renewed, replayed_late = submit("alice", BODY.encode())
    assert (renewed.id, replayed_late) == (first.id, False)


def test_input_locations_are_limited_to_the_callers_area(store: AsyncStore) -> None:
    (area,) = store.areas("alice")
    assert area == f"s3://{store.location.bucket}/async/inputs/{scope('alice')}/"
    for outside in (
        "s3://someone-elses-bucket/secret.json",
        f"s3://{store.location.bucket}/async/other/x",
        f"s3://{store.location.bucket}/async/inputs/big.json",
        f"{store.areas('bob')[0]}big.json",
    ):
        with pytest.raises(OutsideTenantAreaError):
            _submit(store, input_location=outside)
    with pytest.raises(InvalidInputError):  # the area itself is no object
        _submit(store, input_location=area)
    with pytest.raises(InputNotFoundError):
        _submit(store, input_location=f"{area}big.json")
    key = f"async/inputs/{scope('alice')}/big.json"
    store.client("s3").put_object(Bucket=store.location.bucket, Key=key, Body=BODY.encode())
    rid = _submit(store, input_location=f"s3://{store.location.bucket}/{key}")
    job = store.claim(_one(store), "gpu")
    assert job is not None
    assert job.record.id == rid
    assert store.read_input(job) == (BODY.encode(), None)


def test_the_oldest_pending_age_comes_from_the_pending_index(
    store: AsyncStore, clock: Clock
) -> None:
    assert store.oldest_pending_age() is None
    first = _submit(store)
    clock.now += 7
    _submit(store)
    clock.now += 3
    assert store.oldest_pending_age() == pytest.approx(10)
    for message in store.receive(10, 0):
        job = store.claim(message, "gpu")
        assert job is not None
        if job.record.id == first:
            store.settle(job, json_reply(200, {"outputs": []}))
    assert store.oldest_pending_age() == pytest.approx(3)
