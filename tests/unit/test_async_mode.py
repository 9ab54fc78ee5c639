"""Async mode's parts that need no AWS: how a request asks for it, what a deployment
without it answers, how the GPU consumer lowers a request's priority, the fair order of
deliveries across tenants, and the per-tenant budget of batch-mode staging."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from werkzeug.test import Client

from gpu_service.async_consumer import as_background
from spillway.async_inference.queue import Message, fair_order, message_of
from spillway.async_inference.settings import AsyncSettings
from spillway.policy.facts import read_hints
from spillway.protocol.framing import read_json_header
from spillway.router.batch_mode import JobsApiSubmitter, staging_quota
from spillway.router.settings import RouterSettings
from spillway.router.wiring import Overrides, create_app
from spillway.state.table import scope
from tests.memory_store import MemoryStateStore
from tests.unit.test_router import make_stack
from tests.unit.test_router_staging import STAGING, JobsApi, MemoryS3

BODY = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}


@pytest.mark.parametrize(
    ("parameters", "headers", "mode"),
    [
        ({"mode": "async"}, {}, "async"),
        ({}, {"x-spillway-mode": "async"}, "async"),
        ({}, {"prefer": "respond-async, wait=10"}, "async"),
        ({"mode": "realtime"}, {"prefer": "respond-async"}, "realtime"),
        ({}, {}, None),
    ],
)
def test_how_a_request_asks_for_async(
    parameters: dict[str, str], headers: dict[str, str], mode: str | None
) -> None:
    assert read_hints(parameters, headers).mode == mode


def test_a_deployment_without_async_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TABLE", "QUEUE_URL", "LOCATION"):
        monkeypatch.delenv(f"ASYNC_{name}", raising=False)
    settings = RouterSettings(gpu_url=None, metrics_log=Path("/dev/null"))
    client = Client(create_app(settings, Overrides(backends={})))
    answer = client.post("/v2/models/digits/infer", json=BODY, headers={"prefer": "respond-async"})
    assert answer.status_code == 400
    assert json.loads(answer.data)["code"] == "mode_unavailable"
    assert client.get("/v1/results/" + "0" * 32).status_code == 404


@pytest.mark.parametrize("binary", [False, True])
def test_background_work_runs_at_the_lowest_priority(binary: bool) -> None:
    header = json.dumps({**BODY, "parameters": {"priority": 1, "timeout": 5}}).encode()
    tensor = b"\x00\x00\x80\x3f"
    body, length = (header + tensor, len(header)) if binary else (header, None)
    lowered, new_length = as_background(body, length, 3)
    parsed = read_json_header(lowered, new_length)
    assert parsed["parameters"] == {"priority": 3, "timeout": 5}
    assert parsed["inputs"] == BODY["inputs"]
    if binary:
        assert new_length is not None
        assert lowered[new_length:] == tensor
    else:
        assert new_length is None


# --- fair consumption and the batch staging quota ----------------------------------------


def _messages(*scopes: str) -> list[Message]:
    return [Message(f"{i:032x}", f"r{i}", 1, scope) for i, scope in enumerate(scopes)]


def test_fair_order_takes_the_tenant_with_the_fewest_running_first() -> None:
    # GIVEN a burst of acme's deliveries with one of globex's last
    burst = _messages("acme", "acme", "acme", "acme", "globex")
    # WHEN nothing runs, THEN globex's comes second, not fifth
    assert [m.scope for m in fair_order(burst, {})] == ["acme", "globex", "acme", "acme", "acme"]
    # AND when acme already runs two, globex's comes first; acme's keep their order
    order = fair_order(burst, {"acme": 2})
    assert [m.receipt for m in order] == ["r4", "r0", "r1", "r2", "r3"]


def test_a_delivery_names_its_tenants_scope() -> None:
    raw = {"Body": json.dumps({"id": "ab" * 16, "scope": "5c0pe"}), "ReceiptHandle": "h",
           "Attributes": {"ApproximateReceiveCount": "2"}}  # fmt: skip
    assert message_of(raw) == Message("ab" * 16, "h", 2, "5c0pe")
    assert message_of({"body": json.dumps({"id": "x"})}).scope == ""


class _Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def test_batch_staging_is_bounded_per_tenant_within_its_window() -> None:
    # GIVEN a router whose tenants may each stage two batch requests per hour
    s3, api, clock = MemoryS3(), JobsApi(), _Clock()
    settings = AsyncSettings(tenant_max_batch_staged=2, staging_window_s=3600)
    quota = replace(staging_quota(settings, MemoryStateStore()), clock=clock)
    submitter = JobsApiSubmitter(api, STAGING, s3=s3, quota=quota)
    stack = make_stack(submitter=submitter, trust_tenant_hints=True)

    def batch(tenant: str) -> Any:
        return stack.post(headers={"x-spillway-mode": "batch", "x-spillway-tenant": tenant})

    # WHEN acme sends three, then globex one
    acme = [batch("acme") for _ in range(3)]
    globex = batch("globex")
    # THEN acme's third is 429 quota_exceeded with Retry-After, and nothing of it is staged
    assert [a.status_code for a in acme] == [202, 202, 429]
    assert acme[2].json["code"] == "quota_exceeded"
    assert int(acme[2].headers["retry-after"]) >= 1
    assert globex.status_code == 202
    # AND each tenant's requests lie in its own area of the staging prefix
    areas = {key.split("/")[1] for _, key in s3.objects}
    assert areas == {scope("acme"), scope("globex")}
    assert len(s3.objects) == 3
    # WHEN the window has passed, acme may stage again
    clock.now += 3601
    assert batch("acme").status_code == 202
