"""Async ``topics`` requests on the local stack as ``spillway up`` starts it: the router
starts each as an execution on the stack's Step Functions endpoint, whose states invoke
the CPU fallback through Lambda's invoke API; ``GET /v1/results/{id}`` answers the
pipeline's response to its own tenant only.

The stack's router authenticates nobody (every caller is the anonymous tenant), so the
two real tenants (two API keys mapped to two tenants) call a second router built from the
very environment the stack gives its own, behind an API Gateway-shaped server (the key's
id in ``requestContext.identity``), as the deployed router receives them."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import pytest
import serverless_wsgi

from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore
from spillway.protocol.codec import decode_response
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway_cli.local.lambda_http import wsgi_app
from spillway_cli.local.names import REGION
from spillway_cli.local.stack import LocalStack
from spillway_cli.local.wsgi_server import running
from tests.fakes import eventually

KEYS = {"acme": "e2e-key-acme", "globex": "e2e-key-globex"}
TEXTS = {
    "acme": "The central bank raised interest rates again to fight inflation.",
    "globex": "The striker scored twice in the final minutes of the match.",
}
WAIT_S = 180.0


def _call(
    url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        data = None if body is None else json.dumps(body).encode()
        sent = {"content-type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=sent)
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        conn.close()


def _infer(text: str) -> dict[str, Any]:
    return {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}


def _scores(headers: dict[str, str], raw: bytes) -> np.ndarray:
    length = headers.get("inference-header-content-length")
    _, outputs = decode_response(raw, int(length) if length else None)
    return outputs["scores"]


@pytest.fixture(scope="module")
def tenants_router(stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A router with the stack's own router environment, two API keys mapped to two
    tenants, behind an API Gateway-shaped server; its URL."""
    mp = pytest.MonkeyPatch()
    metrics = tmp_path_factory.mktemp("tenants-router") / "metrics.jsonl"
    for name, value in {**stack.aws_env(), **stack.router_env()}.items():
        mp.setenv(name, value)
    mp.setenv("ROUTER_METRICS_LOG", str(metrics))
    mp.setenv("ROUTER_IDENTITY_TENANTS", json.dumps({k: t for t, k in KEYS.items()}))
    router = create_app(RouterSettings.from_env())

    def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
        answer: dict[str, Any] = serverless_wsgi.handle_request(router, event, context)
        return answer

    try:
        with running(wsgi_app(handler)) as url:
            yield url
    finally:
        mp.undo()


def test_async_topics_runs_as_an_execution_of_the_stacks_state_machine(
    stack: LocalStack, tenants_router: str
) -> None:
    store = AsyncStore(AsyncSettings.from_env(stack.aws_env()))
    stack_router = stack.url("router")
    # WHEN acme and globex each submit an async topics request, and so does the stack's
    # own router's (anonymous) caller
    submitted: dict[str, tuple[str, str]] = {}
    for who, text in TEXTS.items():
        status, _, raw = _call(
            tenants_router,
            "POST",
            "/v2/models/topics/infer",
            _infer(text),
            {"x-api-key": KEYS[who], "prefer": "respond-async"},
        )
        assert status == 202, raw
        submitted[who] = (tenants_router, json.loads(raw)["id"])
    status, _, raw = _call(
        stack_router,
        "POST",
        "/v2/models/topics/infer",
        _infer(TEXTS["acme"]),
        {**stack.router_headers, "prefer": "respond-async"},
    )
    assert status == 202, raw
    submitted["anonymous"] = (stack_router, json.loads(raw)["id"])
    texts = {**TEXTS, "anonymous": TEXTS["acme"]}
    caller = {"acme": {"x-api-key": KEYS["acme"]}, "globex": {"x-api-key": KEYS["globex"]}}
    caller["anonymous"] = dict(stack.router_headers)
    # THEN each ran as an execution on the stack's Step Functions endpoint that succeeded
    sfn = _states_client(stack)
    for who, (_, rid) in submitted.items():
        record = store.find(rid)
        assert record is not None
        assert record.execution is not None, f"{who}'s request was queued, not started"
        described = eventually(
            partial(_ended, sfn, record.execution),
            f"{who}'s execution ends",
            timeout_s=WAIT_S,
        )
        # (named by the request id and its attempt: a name stays taken long after the
        # request's record expires)
        assert described["status"] == "SUCCEEDED"
        assert described["name"] == record.execution.rsplit(":", 1)[-1]
        assert described["name"].startswith(f"{rid}-")
    # AND each caller's result URL answers 200 with the pipeline's answer, equal to the
    # synchronous one
    for who, (url, rid) in submitted.items():
        status, headers, raw = eventually(
            partial(_settled, url, rid, caller[who]),
            f"{who}'s result is there",
            timeout_s=WAIT_S,
        )
        assert status == 200, raw
        assert headers["x-spillway-model-version"] == "1"
        sync_status, sync_headers, sync_raw = _call(
            stack_router,
            "POST",
            "/v2/models/topics/infer",
            _infer(texts[who]),
            stack.router_headers,
        )
        assert sync_status == 200, sync_raw
        np.testing.assert_allclose(
            _scores(headers, raw), _scores(sync_headers, sync_raw), atol=1e-4
        )
    # AND no caller sees another's result (the same store behind both routers)
    for who, (_, rid) in submitted.items():
        for other, (url, _) in submitted.items():
            if other != who:
                status, _, raw = _call(url, "GET", f"/v1/results/{rid}", None, caller[other])
                assert status == 404, (who, other, raw)


def _states_client(stack: LocalStack) -> Any:
    import boto3

    return boto3.client("stepfunctions", region_name=REGION, endpoint_url=stack.url("states"))


def _ended(sfn: Any, arn: str) -> dict[str, Any] | None:
    described: dict[str, Any] = sfn.describe_execution(executionArn=arn)
    return None if described["status"] == "RUNNING" else described


def _settled(
    url: str, rid: str, headers: dict[str, str]
) -> tuple[int, dict[str, str], bytes] | None:
    answer = _call(url, "GET", f"/v1/results/{rid}", None, headers)
    return None if answer[0] == 202 else answer


def test_under_serverless_offline_async_topics_runs_as_an_execution(
    offline_stack: LocalStack,
) -> None:
    stack = offline_stack
    router = stack.url("router")
    text = TEXTS["globex"]
    # WHEN the API key's caller submits an async topics request to the offline router
    status, _, raw = _call(
        router,
        "POST",
        "/v2/models/topics/infer",
        _infer(text),
        {**stack.router_headers, "prefer": "respond-async"},
    )
    assert status == 202, raw
    rid = json.loads(raw)["id"]
    # THEN serverless.yml's router started it on the stack's Step Functions endpoint …
    record = AsyncStore(AsyncSettings.from_env(stack.aws_env())).find(rid)
    assert record is not None
    assert record.execution is not None, "the request was queued, not started"
    described = eventually(
        partial(_ended, _states_client(stack), record.execution),
        "the execution ends",
        timeout_s=WAIT_S,
    )
    assert described["status"] == "SUCCEEDED"
    # … and its result is the synchronous answer
    status, headers, raw = eventually(
        partial(_settled, router, rid, stack.router_headers), "the result", timeout_s=WAIT_S
    )
    assert status == 200, raw
    sync = _call(router, "POST", "/v2/models/topics/infer", _infer(text), stack.router_headers)
    assert sync[0] == 200, sync[2]
    np.testing.assert_allclose(_scores(headers, raw), _scores(sync[1], sync[2]), atol=1e-4)
