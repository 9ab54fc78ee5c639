"""Async inference under one tenancy model, through the router with two real tenants
(two API keys mapped to two tenants), on the moto server: every place a request names
lies in its caller's own area, results go to keys the server chooses, a missing input is
the client's mistake once, an ``Idempotency-Key`` is bound to its request, and each
tenant's work in flight is bounded and consumed fairly."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from werkzeug.test import Client, TestResponse

from gpu_service.async_consumer import AsyncConsumer
from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore
from spillway.aws.clients import aws_client
from spillway.fallback.async_drain import run_message
from spillway.protocol.messages import stage_request
from spillway.protocol.replies import infer_reply
from spillway.router.settings import RouterSettings
from spillway.router.wiring import Overrides, create_app
from spillway.state.table import DynamoStateStore, create_table
from spillway_cli.local.async_resources import create_async_resources

KEYS = {"acme": "key-acme", "globex": "key-globex"}
IMAGE = {"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": [0.0] * 64}
LABEL = {"name": "label", "shape": [1], "datatype": "INT64", "data": [7]}
RESULT = json.dumps({"model_name": "digits", "outputs": [LABEL]}).encode()


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Tenants:
    """The router over one async store and one state table; two tenants' API keys."""

    store: AsyncStore
    router: Client
    clock: Clock
    areas: dict[str, str] = field(default_factory=dict)

    def post(self, who: str, body: dict[str, Any], **headers: str) -> TestResponse:
        event = {"requestContext": {"identity": {"apiKeyId": KEYS[who]}}}
        return self.router.post(
            "/v2/models/digits/infer",
            json=body,
            headers={"prefer": "respond-async", **headers},
            environ_overrides={"serverless.event": event},
        )

    def get(self, who: str, rid: str) -> TestResponse:
        event = {"requestContext": {"identity": {"apiKeyId": KEYS[who]}}}
        return self.router.get(f"/v1/results/{rid}", environ_overrides={"serverless.event": event})

    def put(self, url: str, data: bytes) -> None:
        bucket, _, key = url.removeprefix("s3://").partition("/")
        self.store.client("s3").put_object(Bucket=bucket, Key=key, Body=data)

    def read(self, url: str) -> bytes:
        bucket, _, key = url.removeprefix("s3://").partition("/")
        body: bytes = self.store.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
        return body


def _tenants(tmp_path: Path, **limits: Any) -> Tenants:
    suffix = uuid.uuid4().hex[:8]
    made = create_async_resources(
        f"async-{suffix}", lease_s=30, names=(f"t-{suffix}", f"q-{suffix}", f"dlq-{suffix}")
    )
    settings = AsyncSettings.model_validate({**made.model_dump(), **limits})
    clock = Clock()
    store = AsyncStore(settings, clock=clock)
    create_table(aws_client("dynamodb"), f"state-{suffix}")
    state = DynamoStateStore(f"state-{suffix}", lambda: aws_client("dynamodb"))
    router_settings = RouterSettings(
        gpu_url=None,
        metrics_log=tmp_path / "metrics.log",
        identity_tenants={key: tenant for tenant, key in KEYS.items()},
    )
    app = create_app(router_settings, Overrides(async_store=store, state=state))
    tenants = Tenants(store, Client(app), clock)
    for who in KEYS:  # each tenant learns its area from a receipt
        answer = tenants.post(who, {"inputs": [IMAGE]})
        assert answer.status_code == 202, answer.data
        tenants.areas[who] = json.loads(answer.data)["areas"][0]
    for message in store.receive(10, 0):  # those two are done with
        job = store.claim(message, "setup")
        assert job is not None
        store.settle(job, infer_reply(RESULT, None, 1))
    clock.now += settings.quota_recheck_s + 1  # and no longer count for the quota
    return tenants


@pytest.fixture
def tenants(aws_env: str, tmp_path: Path) -> Tenants:
    return _tenants(tmp_path)


def _named(**parameters: str) -> dict[str, Any]:
    return {"inputs": [], "parameters": parameters}


def _code(answer: TestResponse) -> tuple[int, str]:
    return answer.status_code, json.loads(answer.data).get("code", "")


def _settle_all(store: AsyncStore) -> list[str]:
    """Run every queued request as a consumer would (its input read); the states."""
    states = []
    for message in store.receive(10, 0):
        job = store.claim(message, "gpu")
        assert job is not None
        store.read_input(job)
        states.append(str(store.settle(job, infer_reply(RESULT, None, 1))))
    return states


def test_a_tenant_cannot_name_another_tenants_object_as_input(tenants: Tenants) -> None:
    # GIVEN acme's private input in its own area (and an object outside every area)
    secret = tenants.areas["acme"] + "private/x.json"
    tenants.put(secret, json.dumps({"inputs": [IMAGE]}).encode())
    bucket = tenants.store.location.bucket
    # WHEN globex names it (or the model repository, or the old shared inputs/ prefix)
    stolen = tenants.post("globex", _named(input_location=secret))
    elsewhere = [
        tenants.post("globex", _named(input_location=url))
        for url in (
            f"s3://{bucket}/repository/digits/1/model.onnx",
            f"s3://{bucket}/async/inputs/shared.json",
            f"s3://other-bucket/{secret.split('/', 3)[3]}",
        )
    ]
    # THEN each is 403 outside_tenant_area, and the answer names globex's own area
    assert _code(stolen) == (403, "outside_tenant_area")
    assert tenants.areas["globex"] in json.loads(stolen.data)["error"]
    assert [_code(a) for a in elsewhere] == [(403, "outside_tenant_area")] * 3
    # AND acme may name it: its request runs on it
    own = tenants.post("acme", _named(input_location=secret))
    assert own.status_code == 202, own.data
    assert _settle_all(tenants.store) == ["succeeded"]


def test_results_go_to_server_chosen_keys_in_the_callers_area(tenants: Tenants) -> None:
    # GIVEN acme's input object and a finished request of acme's
    acme_input = tenants.areas["acme"] + "in/x.json"
    original = json.dumps({"inputs": [IMAGE]}).encode()
    tenants.put(acme_input, original)
    first = tenants.post("acme", _named(input_location=acme_input))
    acme_id = json.loads(first.data)["id"]
    _settle_all(tenants.store)
    acme_result = tenants.get("acme", acme_id).data
    # WHEN globex names acme's input object, or acme's area, as its output
    overwrite = tenants.post("globex", {"inputs": [IMAGE], "parameters": {
        "output_location": acme_input}})  # fmt: skip
    into_area = tenants.post("globex", {"inputs": [IMAGE], "parameters": {
        "output_location": tenants.areas["acme"]}})  # fmt: skip
    # THEN both are refused, and acme's input and result are as they were
    assert [_code(overwrite), _code(into_area)] == [(403, "outside_tenant_area")] * 2
    assert tenants.store.receive(10, 0) == []
    assert tenants.read(acme_input) == original
    assert tenants.get("acme", acme_id).data == acme_result
    # AND globex's own output folder gets its result under <folder>/<id>/, a key of the
    # server's choosing, even when it names its own object as the "output"
    own_object = tenants.areas["globex"] + "out/keep.json"
    tenants.put(own_object, b"keep")
    mine = tenants.post("globex", {"inputs": [IMAGE], "parameters": {
        "output_location": own_object}})  # fmt: skip
    assert mine.status_code == 202, mine.data
    rid = json.loads(mine.data)["id"]
    assert _settle_all(tenants.store) == ["succeeded"]
    record = tenants.store.find(rid)
    assert record is not None
    assert record.result is not None
    assert record.result.startswith(f"{own_object}/{rid}/result-")
    assert tenants.read(own_object) == b"keep"
    assert tenants.get("globex", rid).data == RESULT


def _dlq_count(store: AsyncStore) -> int:
    url = str(store.queue_url).replace("/q-", "/dlq-")
    attributes = aws_client("sqs").get_queue_attributes(QueueUrl=url, AttributeNames=["All"])
    return int(attributes["Attributes"]["ApproximateNumberOfMessages"])


class _NeverRun:
    def infer(self, *args: Any) -> Any:
        raise AssertionError("a request without its input must not reach the model")


def test_a_missing_input_is_the_clients_mistake_at_submit_and_once_later(
    aws_env: str, tmp_path: Path
) -> None:
    tenants = _tenants(tmp_path, max_input_bytes=4096)
    area = tenants.areas["acme"]
    # WHEN acme names an input that is not there, or one too large
    tenants.put(area + "big.json", b" " * 4097)
    missing = tenants.post("acme", _named(input_location=area + "nothing.json"))
    large = tenants.post("acme", _named(input_location=area + "big.json"))
    # THEN 400 input_not_found and 413, and nothing is queued
    assert _code(missing) == (400, "input_not_found")
    assert _code(large) == (413, "payload_too_large")
    assert tenants.store.receive(10, 0) == []
    # WHEN an input that was there at submission is gone when a consumer takes it
    tenants.put(area + "gone.json", json.dumps({"inputs": [IMAGE]}).encode())
    accepted = tenants.post("acme", _named(input_location=area + "gone.json"))
    assert accepted.status_code == 202
    rid = json.loads(accepted.data)["id"]
    tenants.store.client("s3").delete_object(
        Bucket=tenants.store.location.bucket, Key=(area + "gone.json").split("/", 3)[3]
    )
    (message,) = tenants.store.receive(10, 0)
    done = run_message(_NeverRun(), tenants.store, message)  # type: ignore[arg-type]
    # THEN it failed once as the client's 400: no retry, nothing dead-lettered
    assert done is True
    reply = tenants.get("acme", rid)
    assert _code(reply) == (400, "input_not_found")
    record = tenants.store.find(rid)
    assert record is not None
    assert (record.state, record.attempts) == ("failed", 1)
    assert tenants.store.receive(10, 0) == []
    assert _dlq_count(tenants.store) == 0


def test_an_idempotency_key_is_bound_to_its_request(tenants: Tenants) -> None:
    body = {"inputs": [IMAGE]}
    other = {"inputs": [{**IMAGE, "data": [1.0] * 64}]}
    first = tenants.post("acme", body, **{"idempotency-key": "order-1"})
    again = tenants.post("acme", body, **{"idempotency-key": "order-1"})
    changed = tenants.post("acme", other, **{"idempotency-key": "order-1"})
    event = {"requestContext": {"identity": {"apiKeyId": KEYS["acme"]}}}
    model = tenants.router.post(
        "/v2/models/other-model/infer", json=body,
        headers={"prefer": "respond-async", "idempotency-key": "order-1"},
        environ_overrides={"serverless.event": event},
    )  # fmt: skip
    theirs = tenants.post("globex", other, **{"idempotency-key": "order-1"})
    # THEN the same request replays its receipt; another one under the key is 409
    assert (first.status_code, again.status_code) == (202, 202)
    assert json.loads(again.data)["id"] == json.loads(first.data)["id"]
    assert again.headers.get("idempotent-replayed") == "true"
    assert _code(changed) == (409, "idempotency_conflict")
    assert _code(model) == (409, "idempotency_conflict")
    # AND another tenant's same key is a request of its own
    assert theirs.status_code == 202
    assert json.loads(theirs.data)["id"] != json.loads(first.data)["id"]
    assert "idempotent-replayed" not in theirs.headers


def test_a_tenant_past_its_quota_gets_429_and_another_is_not_held_back(
    aws_env: str, tmp_path: Path
) -> None:
    tenants = _tenants(tmp_path, tenant_max_inflight=3, quota_recheck_s=5)
    # WHEN acme posts a burst of 8
    burst = [tenants.post("acme", {"inputs": [IMAGE]}) for _ in range(8)]
    # THEN 3 are accepted and the rest are 429 quota_exceeded with Retry-After
    assert [a.status_code for a in burst] == [202] * 3 + [429] * 5
    assert {json.loads(a.data)["code"] for a in burst[3:]} == {"quota_exceeded"}
    assert all(int(a.headers["retry-after"]) >= 1 for a in burst[3:])
    # AND globex's request is accepted all the same
    assert tenants.post("globex", {"inputs": [IMAGE]}).status_code == 202
    # WHEN acme's requests settle, their places are free again once rechecked
    assert _settle_all(tenants.store) == ["succeeded"] * 4
    tenants.clock.now += 6
    assert tenants.post("acme", {"inputs": [IMAGE]}).status_code == 202


def test_a_tenants_staged_bytes_are_bounded(aws_env: str, tmp_path: Path) -> None:
    tenants = _tenants(tmp_path, tenant_max_staged_bytes=2048)
    body = {"inputs": [{**IMAGE, "data": [0.123456] * 64}]}
    staged = len(stage_request(json.dumps(body).encode(), None))
    assert 2048 // 3 < staged <= 2048 // 2  # two fit, a third does not
    # WHEN acme stages three, and one that could never fit
    answers = [tenants.post("acme", body) for _ in range(3)]
    huge = tenants.post("acme", {"inputs": [{**IMAGE, "data": [0.123456] * 400}]})
    # THEN the third is 429 quota_exceeded, the huge one 413; globex is not held back
    assert [a.status_code for a in answers] == [202, 202, 429]
    assert _code(answers[2]) == (429, "quota_exceeded")
    assert _code(huge) == (413, "payload_too_large")
    assert tenants.post("globex", body).status_code == 202


# --- fair consumption ---------------------------------------------------------------


class _Plane:
    """The data plane as the consumer sees it: no batcher, one model; each infer noted
    (by request body) and answered at once."""

    def __init__(self, until: int) -> None:
        self.registry = SimpleNamespace(
            all_versions=list, entry=lambda name: SimpleNamespace(config=None)
        )
        self.started: list[bytes] = []
        self.until = until
        self.all_started = asyncio.Event()

    async def lookup(self, model: str, timeout_s: float | None = None) -> Any:
        return SimpleNamespace()  # the one model is known

    async def infer(
        self, model: str, version: str | None, body: bytes, length: Any, **_: Any
    ) -> Any:
        self.started.append(body)
        if len(self.started) >= self.until:
            self.all_started.set()
        await asyncio.sleep(0)
        return SimpleNamespace(body=RESULT, header_length=None, version=1)


async def _consume(store: AsyncStore, plane: _Plane, concurrency: int) -> None:
    consumer = AsyncConsumer(plane, store, concurrency=concurrency, poll_wait_s=0.2)  # type: ignore[arg-type]
    consumer.start()
    try:
        await asyncio.wait_for(plane.all_started.wait(), timeout=60)
    finally:
        await consumer.stop(30)


def test_one_tenants_burst_does_not_run_ahead_of_anothers_request(
    aws_env: str, tmp_path: Path
) -> None:
    # GIVEN acme's burst of 12 queued, then globex's single request
    tenants = _tenants(tmp_path)
    acme = {"inputs": [{**IMAGE, "data": [0.25] * 64}]}
    globex = {"inputs": [{**IMAGE, "data": [0.75] * 64}]}
    for _ in range(12):
        assert tenants.post("acme", acme).status_code == 202
    assert tenants.post("globex", globex).status_code == 202
    # WHEN a consumer running two at a time takes them
    plane = _Plane(until=13)
    asyncio.run(_consume(tenants.store, plane, concurrency=2))
    # THEN globex's request starts as soon as a place frees, not after acme's burst
    position = [json.loads(b)["inputs"][0]["data"][0] for b in plane.started].index(0.75)
    assert position <= 3, position
