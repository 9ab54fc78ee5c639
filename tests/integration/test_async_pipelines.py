"""Async requests for a long pipeline run as a Step Functions execution, end to end on
127.0.0.1, with two real tenants (two API keys mapped to two tenants).

The router (``ASYNC_STATE_MACHINES`` names the topics machine) starts an execution
through boto3's Step Functions client, pointed at ``LocalStepFunctions``; the execution
runs the checked-in definition with the local interpreter, whose states invoke the CPU
fallback through Lambda's invoke API (``CpuApp`` on 127.0.0.1) as Step Functions invokes
the function; its end settles the async record on the moto server, and
``GET /v1/results/{id}`` answers the V2 response to its own tenant only (another's: 404).
Each execution's steps use its tenant's step-cache entries.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from werkzeug.test import Client, TestResponse

from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore
from spillway.aws.clients import aws_client
from spillway.fallback.app import CpuApp
from spillway.fallback.chain import default_store
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.protocol.codec import decode_response, encode_request
from spillway.router.settings import RouterSettings
from spillway.router.wiring import Overrides, create_app
from spillway_cli.local.async_resources import async_env, create_async_resources
from spillway_cli.local.states import LocalStateMachine, substituted
from spillway_cli.local.step_functions import LocalStepFunctions
from spillway_cli.local.wsgi_server import running
from spillway_cli.statemachines import definition_path, substitutions
from tests.support import link_model

KEYS = {"acme": "key-acme", "globex": "key-globex"}
# What the router's role may do to the async records (template.yaml RouterRole,
# AsyncRecords): a start that fails is settled with these, never with UpdateItem.
ROUTER_RECORD_CALLS = {"GetItem", "PutItem"}
MACHINE = "arn:aws:states:us-east-1:123456789012:stateMachine:spillway-topics"
WAIT_S = 120.0


def _texts(*items: str) -> dict[str, np.ndarray]:
    return {"text": np.array([[t.encode()] for t in items], dtype=np.object_)}


@dataclass
class Stack:
    """The router, the local Step Functions endpoint and the CPU fallback."""

    router: Client
    states: LocalStepFunctions
    store: AsyncStore
    cpu: CpuService
    calls: list[str] = field(default_factory=list)
    """The operations the router's clients made (``service.Operation``)."""

    def submit(self, who: str, text: str, version: str | None = None) -> str:
        body, _ = encode_request(_texts(text), binary=False)
        event = {"requestContext": {"identity": {"apiKeyId": KEYS[who]}}}
        pinned = f"/versions/{version}" if version else ""
        answer = self.router.post(
            f"/v2/models/topics{pinned}/infer",
            data=body,
            headers={"prefer": "respond-async", "content-type": "application/json"},
            environ_overrides={"serverless.event": event},
        )
        assert answer.status_code == 202, answer.data
        rid: str = json.loads(answer.data)["id"]
        return rid

    def finish(self, rid: str) -> str:
        """Wait for the request's execution to end; its status."""
        record = self.store.find(rid)
        assert record is not None
        assert record.execution is not None
        return self.states.wait(record.execution, WAIT_S).status

    def result(self, who: str, rid: str) -> TestResponse:
        event = {"requestContext": {"identity": {"apiKeyId": KEYS[who]}}}
        return self.router.get(f"/v1/results/{rid}", environ_overrides={"serverless.event": event})


@pytest.fixture(scope="module")
def repo(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("async-pipelines-repo")
    for name in ("minilm", "topics-head", "topics"):
        link_model(models_dir, root, name)
    return root


@pytest.fixture
def stack(
    aws_env: str, repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Stack]:
    suffix = uuid.uuid4().hex[:8]
    made = create_async_resources(
        f"pipes-{suffix}", names=(f"t-{suffix}", f"q-{suffix}", f"dlq-{suffix}")
    )
    settings = AsyncSettings.model_validate(
        {**made.model_dump(), "state_machines": {"topics": MACHINE}}
    )
    for name, value in async_env(settings).items():  # the CPU function's environment
        monkeypatch.setenv(name, value)
    cpu = CpuService.load(CpuSettings(repository=str(repo)))
    definition = substituted(
        json.loads(definition_path("topics").read_text()),
        substitutions(cpu.settings.function_name, f"pipes-{suffix}"),
    )
    default_store.cache_clear()
    with running(CpuApp(cpu)) as cpu_url:
        monkeypatch.setenv("AWS_ENDPOINT_URL_LAMBDA", cpu_url)
        machine = LocalStateMachine(
            definition,
            functions={},
            s3=aws_client("s3"),
            lambda_client=aws_client("lambda"),
            sleep=lambda _: None,
        )
        states = LocalStepFunctions({MACHINE: machine})
        with running(states) as states_url:
            monkeypatch.setenv("AWS_ENDPOINT_URL_SFN", states_url)
            calls: list[str] = []
            store = AsyncStore(settings, clients=recording(calls))
            router_settings = RouterSettings(
                gpu_url=None,
                metrics_log=tmp_path / "metrics.log",
                identity_tenants={key: tenant for tenant, key in KEYS.items()},
            )
            app = create_app(router_settings, Overrides(async_store=store))
            yield Stack(Client(app), states, store, cpu, calls)
            states.close()
    default_store.cache_clear()


def recording(calls: list[str]) -> Any:
    """A client factory whose clients note each operation they make."""

    def make(service: str) -> Any:
        client = aws_client(service)

        def note(model: Any, **_: Any) -> None:
            calls.append(f"{model.service_model.service_name}.{model.name}")

        client.meta.events.register("before-call", note)
        return client

    return make


def _answer(response: TestResponse) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    length = response.headers.get("inference-header-content-length")
    header, outputs = decode_response(response.data, int(length) if length else None)
    return header.model_dump(), outputs


def test_an_async_pipeline_request_runs_as_an_execution_and_settles_its_record(
    stack: Stack,
) -> None:
    text = "The quarterly earnings beat expectations and the shares rallied."
    # WHEN acme submits an async request for topics
    rid = stack.submit("acme", text)
    # THEN it was started as an execution (never queued) that succeeded …
    assert "stepfunctions.StartExecution" in stack.calls
    assert {
        c.split(".")[1] for c in stack.calls if c.startswith("dynamodb.")
    } <= ROUTER_RECORD_CALLS
    assert stack.store.receive(10, 0) == []
    assert stack.finish(rid) == "SUCCEEDED"
    # … and acme's one result URL answers the V2 response, equal to the synchronous one
    answer = stack.result("acme", rid)
    assert answer.status_code == 200, answer.data
    assert answer.headers["x-spillway-model-version"] == "1"
    header, outputs = _answer(answer)
    body, length = encode_request(_texts(text), binary=False)
    sync = stack.cpu.infer("topics", None, body, length)
    _, expected = decode_response(sync.body, sync.header_length)
    assert header["model_name"] == "topics"
    np.testing.assert_allclose(outputs["scores"], expected["scores"], atol=1e-6)
    # AND another tenant cannot see it
    assert stack.result("globex", rid).status_code == 404
    # AND the record says succeeded, with its result under the server's own key
    record = stack.store.find(rid)
    assert record is not None
    assert record.state == "succeeded"
    assert str(record.result).startswith(f"s3://{stack.store.location.bucket}/async/{rid}/")


def test_each_tenants_execution_uses_its_own_step_cache_entries(stack: Stack) -> None:
    text = "Acme's private memo on the merger talks with the regional bank."
    # GIVEN acme's request for a text has run
    first = stack.submit("acme", text)
    assert stack.finish(first) == "SUCCEEDED"
    # WHEN globex sends the same text, then acme again
    other = stack.submit("globex", text)
    again = stack.submit("acme", text)
    assert {stack.finish(other), stack.finish(again)} == {"SUCCEEDED"}
    # THEN globex's answer was computed (not acme's cache entry), acme's repeat was a hit
    parameters = {
        rid: _answer(stack.result(who, rid))[0].get("parameters") or {}
        for who, rid in (("globex", other), ("acme", again))
    }
    assert "cached_steps" not in parameters[other]
    assert parameters[again]["cached_steps"] == "0:minilm"
    # AND each tenant sees only its own
    assert stack.result("acme", other).status_code == 404
    assert stack.result("globex", again).status_code == 404


def test_a_failed_execution_settles_the_record_with_the_steps_error(stack: Stack) -> None:
    # WHEN globex's request cannot run (an empty text: the request's own fault)
    rid = stack.submit("globex", "   ")
    # THEN the execution failed, and the record holds the step's error, answered once
    assert stack.finish(rid) == "FAILED"
    answer = stack.result("globex", rid)
    assert (answer.status_code, json.loads(answer.data)["code"]) == (400, "invalid_input")
    assert stack.result("acme", rid).status_code == 404
    record = stack.store.find(rid)
    assert record is not None
    assert (record.state, record.status) == ("failed", 400)


def test_a_pinned_version_is_the_executions_version(stack: Stack) -> None:
    # WHEN acme pins version 1 (served), then version 9 (not served)
    served = stack.submit("acme", "Rain is expected across the north tomorrow.", "1")
    missing = stack.submit("acme", "Rain is expected across the north tomorrow.", "9")
    # THEN the first answers as version 1; the second's record holds the 404
    assert stack.finish(served) == "SUCCEEDED"
    assert stack.result("acme", served).headers["x-spillway-model-version"] == "1"
    assert stack.finish(missing) == "FAILED"
    answer = stack.result("acme", missing)
    assert (answer.status_code, json.loads(answer.data)["code"]) == (404, "model_not_found")


def test_an_execution_that_cannot_start_is_a_503_and_a_settled_record(
    stack: Stack, tmp_path: Path
) -> None:
    # GIVEN a router whose settings name a state machine that does not exist
    missing = MACHINE.replace("spillway-topics", "spillway-gone")
    settings = stack.store.settings.model_copy(update={"state_machines": {"topics": missing}})
    calls: list[str] = []
    store = AsyncStore(settings, clients=recording(calls))
    router_settings = RouterSettings(
        gpu_url=None,
        metrics_log=tmp_path / "metrics.log",
        identity_tenants={key: tenant for tenant, key in KEYS.items()},
    )
    broken = Stack(Client(create_app(router_settings, Overrides(async_store=store))),
                   stack.states, store, stack.cpu)  # fmt: skip
    body, _ = encode_request(_texts("Nothing will run this."), binary=False)
    event = {"requestContext": {"identity": {"apiKeyId": KEYS["acme"]}}}
    # WHEN acme submits
    answer = broken.router.post(
        "/v2/models/topics/infer",
        data=body,
        headers={"prefer": "respond-async", "content-type": "application/json"},
        environ_overrides={"serverless.event": event},
    )
    # THEN the platform's failure is a 503 with its code, nothing was queued, and no
    # record is left waiting for a run that never started
    assert (answer.status_code, json.loads(answer.data)["code"]) == (503, "unavailable")
    assert store.receive(10, 0) == []
    states = {
        item["state"]["S"]
        for item in aws_client("dynamodb").scan(TableName=str(settings.table))["Items"]
    }
    assert states == {"failed"}
    # AND the router settled it with the writes its role may make
    assert {c.split(".")[1] for c in calls if c.startswith("dynamodb.")} == ROUTER_RECORD_CALLS
