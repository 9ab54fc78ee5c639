"""The CPU fallback's one event adapter (``spillway.fallback.events``): each kind of event
the function receives reaches its own path; no model is loaded (the paths exercised
here answer before the service is asked for one)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from spillway.fallback.chain import ClientFault
from spillway.fallback.events import CpuEvents, EventKind, kind
from spillway.fallback.service import CpuService
from spillway.pipelines.chain import FAILED, RESPOND, STEP

EVENTS = Path(__file__).resolve().parents[2] / "events" / "cpu_infer"
NO_MODELS = cast(CpuService, SimpleNamespace())  # no path below may reach the service
SQS_RECORD = {
    "messageId": "m-1",
    "receiptHandle": "r-1",
    "body": json.dumps({"id": "a-1", "scope": "-"}),
    "attributes": {"ApproximateReceiveCount": "1"},
    "eventSource": "aws:sqs",
}


def _file(name: str) -> dict[str, Any]:
    event: dict[str, Any] = json.loads((EVENTS / name).read_text())
    return event


class FakeStore:
    """The async store's side of the drain check and of a delivery (whose claim fails)."""

    settings = SimpleNamespace(drain_age_s=60.0)
    queue_url = "https://sqs.us-east-1.amazonaws.com/123456789012/spillway-async"

    def __init__(self, oldest_age_s: float | None) -> None:
        self.oldest_age_s = oldest_age_s

    def reconcile_pending(self, queue_empty: bool) -> int:
        return 0

    def queue_is_empty(self) -> bool:
        return False

    def oldest_pending_age(self) -> float | None:
        return self.oldest_age_s

    def client(self, name: str) -> FakeStore:
        assert name == "sqs"
        return self

    def get_queue_attributes(self, **_: Any) -> dict[str, Any]:
        return {"Attributes": {"QueueArn": "arn:aws:sqs:us-east-1:123456789012:spillway-async"}}

    def claim(self, message: Any, owner: str) -> None:
        raise RuntimeError("the table is unreachable")


class FakeLambda:
    """Lambda's control API over one disabled event source mapping."""

    def __init__(self) -> None:
        self.listed_for: list[str] = []
        self.updates: list[tuple[str, bool]] = []

    def list_event_source_mappings(self, FunctionName: str, **_: Any) -> dict[str, Any]:
        self.listed_for.append(FunctionName)
        return {"EventSourceMappings": [{"UUID": "esm-1", "State": "Disabled"}]}

    def update_event_source_mapping(self, UUID: str, Enabled: bool) -> None:
        self.updates.append((UUID, Enabled))


def _events(store: FakeStore | None = None, control: FakeLambda | None = None) -> CpuEvents:
    def proxy(event: dict[str, Any], context: Any) -> dict[str, Any]:
        return {"statusCode": 299, "body": event.get("rawPath") or event.get("path")}

    return CpuEvents(
        NO_MODELS,
        proxy=proxy,
        async_store=lambda: cast(Any, store),
        lambda_client=lambda: control,
    )


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (_file("infer-direct.json"), "direct"),
        (_file("metadata-direct.json"), "direct"),
        (_file("infer-rest-v1.json"), "api-gateway"),
        (_file("infer-http-v2.json"), "api-gateway"),
        ({"Records": [SQS_RECORD]}, "sqs"),
        ({"Records": [{"eventSource": "aws:s3"}]}, "direct"),
        ({"Records": ["not a record"]}, "direct"),
        ({"Records": []}, "direct"),
        ({"spillway": "async-drain-check"}, "drain-check"),
        ({"spillway": STEP}, "chain"),
        ({"spillway": RESPOND}, "chain"),
        ({"spillway": FAILED}, "chain"),
        ({"spillway": "something else"}, "direct"),
        ({"requestContext": {}}, "direct"),
    ],
)
def test_each_event_is_told_apart(event: dict[str, Any], expected: EventKind) -> None:
    assert kind(event) == expected


def test_api_gateway_events_go_to_the_proxy() -> None:
    # GIVEN an HTTP API v2 event WHEN the adapter answers it THEN the proxy served it
    answer = _events().answer(_file("infer-http-v2.json"), None)
    assert answer == {"statusCode": 299, "body": "/v2/models/digits/infer"}


def test_an_unrecognised_event_is_a_direct_invoke_refused_with_400() -> None:
    answer = _events().answer({"operation": "nonsense"}, None)
    assert answer["statusCode"] == 400
    assert json.loads(answer["body"])["code"] == "invalid_input"


def test_a_failed_delivery_is_reported_for_redelivery() -> None:
    # GIVEN an SQS batch whose message cannot be claimed (the store fails)
    answer = _events(FakeStore(None)).answer({"Records": [SQS_RECORD]}, None)
    # THEN the message is named for redelivery
    assert answer == {"batchItemFailures": [{"itemIdentifier": "m-1"}]}


def test_the_drain_check_turns_this_functions_mapping_on_for_an_old_backlog() -> None:
    # GIVEN a pending request older than the drain age, and this function's context
    control = FakeLambda()
    context = SimpleNamespace(function_name="spillway-cpu-infer")
    # WHEN the scheduled drain check arrives
    answer = _events(FakeStore(120.0), control).answer({"spillway": "async-drain-check"}, context)
    # THEN the function's own event source mapping is enabled
    assert answer == {"draining": True}
    assert control.listed_for == ["spillway-cpu-infer"]
    assert control.updates == [("esm-1", True)]


def test_a_pipeline_state_failure_is_raised_for_step_functions() -> None:
    # GIVEN a pipeline state's event without its fields WHEN it arrives
    # THEN the chain path raises the client's fault (Step Functions catches it)
    with pytest.raises(ClientFault) as raised:
        _events().answer({"spillway": STEP}, None)
    assert json.loads(str(raised.value))["status"] == 400
