"""The greedy-tenant family: two real tenants (two API keys the router maps to two
tenants, as API Gateway hands them over) against the router on 127.0.0.1, the moto
server and the GPU service consuming the async queue.

A hostile tenant names the other's objects, reuses its idempotency keys with other
payloads, names inputs that are not there and floods the queue; the other tenant's data,
results and turn stay its own. Bounded in time: a burst of 40, one GPU service start."""

from __future__ import annotations

import http.client
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import serverless_wsgi

from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore
from spillway.aws.clients import aws_client
from spillway.router.settings import RouterSettings
from spillway.router.wiring import Overrides, create_app
from spillway.state.table import DynamoStateStore, create_table
from spillway_cli.local.async_resources import async_env, create_async_resources
from spillway_cli.local.lambda_http import wsgi_app
from spillway_cli.local.wsgi_server import running
from tests.fakes import eventually
from tests.support import gpu_service, link_model

KEYS = {"acme": "key-acme", "mallory": "key-mallory"}
CAP = 8
BURST = 40


def _image(value: float) -> dict[str, Any]:
    tensor = {"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": [value] * 64}
    return {"inputs": [tensor]}


@dataclass
class Platform:
    """The router (behind an API Gateway-shaped server) over one async store."""

    url: str
    store: AsyncStore

    def call(
        self, who: str, method: str, path: str, body: Any = None, **headers: str
    ) -> tuple[int, dict[str, str], Any]:
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            sent = {"x-api-key": KEYS[who], "content-type": "application/json", **headers}
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers=sent)
            answer = conn.getresponse()
            raw = answer.read()
            found = {k.lower(): v for k, v in answer.getheaders()}
            return answer.status, found, json.loads(raw) if raw else None
        finally:
            conn.close()

    def submit(self, who: str, body: Any, **headers: str) -> tuple[int, dict[str, str], Any]:
        return self.call(
            who, "POST", "/v2/models/digits/infer", body, prefer="respond-async", **headers
        )

    def put(self, url: str, data: bytes) -> None:
        bucket, _, key = url.removeprefix("s3://").partition("/")
        aws_client("s3").put_object(Bucket=bucket, Key=key, Body=data)


@pytest.fixture
def platform(aws_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Platform]:
    suffix = uuid.uuid4().hex[:8]
    made = create_async_resources(
        f"async-{suffix}", lease_s=10, names=(f"t-{suffix}", f"q-{suffix}", f"dlq-{suffix}")
    )
    settings = AsyncSettings.model_validate({**made.model_dump(), "tenant_max_inflight": CAP})
    for key, value in async_env(settings).items():
        monkeypatch.setenv(key, value)
    create_table(aws_client("dynamodb"), f"state-{suffix}")
    state = DynamoStateStore(f"state-{suffix}", lambda: aws_client("dynamodb"))
    store = AsyncStore(settings)
    router = create_app(
        RouterSettings(
            gpu_url=None,
            metrics_log=tmp_path / "metrics.log",
            identity_tenants={key: tenant for tenant, key in KEYS.items()},
        ),
        Overrides(async_store=store, state=state),
    )

    def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
        answer: dict[str, Any] = serverless_wsgi.handle_request(router, event, context)
        return answer

    with running(wsgi_app(handler)) as url:
        yield Platform(url, store)


def _named(url: str) -> dict[str, Any]:
    return {"inputs": [], "parameters": {"input_location": url}}


def _into(url: str) -> dict[str, Any]:
    return {**_image(1.0), "parameters": {"output_location": url}}


def test_a_hostile_tenant_reaches_nothing_of_anothers(platform: Platform) -> None:
    # GIVEN acme's private input in its area, and a request of acme's over it
    status, _, receipt = platform.submit("acme", _image(0.0))
    assert status == 202
    secret = receipt["areas"][0] + "secret.json"
    platform.put(secret, json.dumps(_image(0.5)).encode())
    status, _, mine = platform.submit("acme", _named(secret), **{"idempotency-key": "k-1"})
    assert status == 202
    # WHEN mallory names acme's input, writes onto it or into the model repository,
    # polls acme's request, names an input that is not there, and acme's key is reused
    # with another payload
    repository = f"s3://{platform.store.location.bucket}/repository/zz-injected/"
    tries = {
        "read": platform.submit("mallory", _named(secret)),
        "overwrite": platform.submit("mallory", _into(secret)),
        "repository": platform.submit("mallory", _into(repository)),
        "poll": platform.call("mallory", "GET", f"/v1/results/{mine['id']}"),
    }
    _, _, own = platform.submit("mallory", _image(1.0))
    missing = platform.submit("mallory", _named(own["areas"][0] + "nothing.json"))
    replay = platform.submit("acme", _image(1.0), **{"idempotency-key": "k-1"})
    # THEN every one is a 4xx with a stable code
    found = {name: (answer[0], (answer[2] or {}).get("code")) for name, answer in tries.items()}
    assert found == {
        "read": (403, "outside_tenant_area"),
        "overwrite": (403, "outside_tenant_area"),
        "repository": (403, "outside_tenant_area"),
        "poll": (404, "not_found"),
    }
    assert (missing[0], missing[2]["code"]) == (400, "input_not_found")
    assert (replay[0], replay[2]["code"]) == (409, "idempotency_conflict")


def test_a_greedy_tenants_burst_neither_floods_the_queue_nor_runs_ahead(
    platform: Platform, models_dir: Path, tmp_path: Path
) -> None:
    # GIVEN mallory's burst of 40 async requests, then acme's single one
    burst = [platform.submit("mallory", _image(1.0)) for _ in range(BURST)]
    status, _, acme = platform.submit("acme", _image(0.0))
    # THEN mallory gets its quota's worth in, the rest 429 quota_exceeded + Retry-After
    accepted = [answer[2]["id"] for answer in burst if answer[0] == 202]
    refused = [answer for answer in burst if answer[0] != 202]
    assert len(accepted) == CAP
    assert {(a[0], a[2]["code"]) for a in refused} == {(429, "quota_exceeded")}
    assert all(int(a[1]["retry-after"]) >= 1 for a in refused)
    assert status == 202
    # WHEN a GPU service running one request at a time consumes the queue
    repo = tmp_path / "repo"
    link_model(models_dir, repo, "digits")
    with gpu_service(repo, tmp_path / "logs", async_concurrency="1"):

        def settled() -> list[Any] | None:
            records = [platform.store.find(rid) for rid in [*accepted, acme["id"]]]
            done = all(r is not None and r.state == "succeeded" for r in records)
            return records if done else None

        records = eventually(settled, "every accepted request", timeout_s=120)
    # THEN acme's request was the first or second to finish, not the ninth
    order = sorted(records, key=lambda r: r.updated_at)
    assert [r.id for r in order].index(acme["id"]) <= 1
    status, _, _ = platform.call("acme", "GET", f"/v1/results/{acme['id']}")
    assert status == 200
