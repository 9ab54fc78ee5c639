"""One trace from a client through an async request to the worker that runs it, on the
moto server with a real router and the real CPU worker (ONNX Runtime on digits): two
tenants' requests, each sent with its own ``traceparent``, are each run in a
``spillway.async.run`` span of their client's trace, under the router's span; when the
router does not trace, under the client's own span."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from werkzeug.test import Client

from spillway import tracing
from spillway.async_inference.store import AsyncStore
from spillway.async_inference.traced import RUN_SPAN
from spillway.fallback.async_drain import run_message
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.router.settings import RouterSettings
from spillway.router.wiring import Overrides, create_app
from spillway_cli.local.async_resources import create_async_resources
from tests.unit.test_trace_async_fixtures import (
    CLIENT_A,
    CLIENT_B,
    PARENT_A,
    PARENT_B,
    TRACE_A,
    TRACE_B,
    Spans,
    attrs,
    hex_ids,
    spans_fixture,  # noqa: F401 - ``spans``
)

KEYS = {"acme": "key-acme", "globex": "key-globex"}
CLIENTS = {"acme": CLIENT_A, "globex": CLIENT_B}
IMAGE = {"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": [0.5] * 64}


@pytest.fixture
def store(aws_env: str) -> AsyncStore:
    suffix = uuid.uuid4().hex[:8]
    settings = create_async_resources(
        f"async-{suffix}", lease_s=30, names=(f"t-{suffix}", f"q-{suffix}", f"dlq-{suffix}")
    )
    return AsyncStore(settings)


def _submit(router: Client, who: str) -> str:
    event = {"requestContext": {"identity": {"apiKeyId": KEYS[who]}}}
    answer = router.post(
        "/v2/models/digits/infer",
        json={"inputs": [IMAGE]},
        headers={"prefer": "respond-async", **CLIENTS[who]},
        environ_overrides={"serverless.event": event},
    )
    assert answer.status_code == 202, answer.data
    rid: str = json.loads(answer.data)["id"]
    return rid


def _run_all(store: AsyncStore, cpu: CpuService, count: int) -> None:
    done = 0
    for _ in range(20):  # a few polls: moto's queue answers at once
        for message in store.receive(10, 0):
            assert run_message(cpu, store, message)
            done += 1
        if done == count:
            return
    raise AssertionError(f"{done} of {count} deliveries ran")


@pytest.mark.parametrize("router_traces", [True, False])
def test_an_async_request_runs_in_its_clients_trace(
    spans: Spans,
    store: AsyncStore,
    serving_repo: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    router_traces: bool,
) -> None:
    # GIVEN a router over the async store, two tenants' API keys, and the CPU worker
    settings = RouterSettings(
        gpu_url=None,
        metrics_log=tmp_path / "metrics.log",
        identity_tenants={key: tenant for tenant, key in KEYS.items()},
    )
    router = Client(create_app(settings, Overrides(async_store=store)))
    cpu = CpuService.load(CpuSettings(repository=str(serving_repo), models=["digits"]))
    # WHEN each tenant's client submits a request async with its own traceparent (the
    # router tracing, or not: then it only passes the client's carrier on)
    with monkeypatch.context() as off:
        if not router_traces:
            off.setattr(tracing, "_tracer", None)
            off.setattr(tracing, "_otel", None)
        ids = {who: _submit(router, who) for who in KEYS}
    # AND the worker runs what the queue delivers
    _run_all(store, cpu, len(ids))
    # THEN each request succeeded, in a run span of its own client's trace
    runs = {attrs(s)["spillway.request_id"]: s for s in spans.named(RUN_SPAN)}
    assert set(runs) == set(ids.values())
    routes = {hex_ids(s)[0]: s for s in spans.named("spillway.route")}
    expected = {"acme": (TRACE_A, PARENT_A), "globex": (TRACE_B, PARENT_B)}
    for who, (trace, client_span) in expected.items():
        run = runs[ids[who]]
        assert attrs(run)["spillway.async.state"] == "succeeded"
        assert attrs(run)["spillway.model"] == "digits"
        assert attrs(run)["spillway.worker"] == "cpu"
        run_trace, _, parent = hex_ids(run)
        assert run_trace == trace
        record = store.find(ids[who])
        assert record is not None
        assert record.trace is not None
        if router_traces:
            # its parent is the router's span, itself the client's span's child
            route = routes[trace]
            assert parent == hex_ids(route)[1]
            assert hex_ids(route)[2] == client_span
            assert record.trace["traceparent"].split("-")[2] == hex_ids(route)[1]
        else:
            # the record holds the client's carrier as it came; the run is its child
            assert parent == client_span
            assert record.trace == CLIENTS[who]
            assert not routes
        # AND the scope on the span is the record's own (one tenant's, not the other's)
        assert attrs(run)["spillway.tenant_scope"] == record.scope
    assert (
        attrs(runs[ids["acme"]])["spillway.tenant_scope"]
        != attrs(runs[ids["globex"]])["spillway.tenant_scope"]
    )
