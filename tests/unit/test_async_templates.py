"""Async inference as the templates deploy it: every component finds the same stores,
the stores are shaped as the code uses them, the CPU fallback drains only on demand.

GIVEN every stack resolved as CloudFormation would (``tests.unit.stacks``)
THEN the router and the CPU function of both application templates and the GPU task get
``ASYNC_*`` variables from which ``AsyncSettings`` is enabled and names the storage
stack's table, queue and prefix, with the lease, attempts and retention the queue, the
table and the bucket's lifecycle rule really have; the event source mapping starts
disabled with partial batch responses and is the one the drain check finds and
switches; the drain check's schedule sends the event the handler expects; the results
route reaches the router; a message in the async DLQ raises an alarm.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpu_service.settings import GpuSettings
from infra.checks.cfn_eval import Stack, arn
from spillway.async_inference.records import AsyncRecord
from spillway.async_inference.settings import AsyncSettings
from spillway.fallback.async_drain import DRAIN_CHECK
from spillway.router.async_mode import RESULTS_PREFIX
from spillway_cli.local.async_resources import async_env
from spillway_cli.local.layout import Ports
from spillway_cli.local.sam_env import env_vars_document, load_template, local_values
from spillway_cli.local.stack import LocalStack
from tests.unit.async_calls import (
    Call,
    applications,
    gpu_task_env,
    lambda_api_of,
    record_calls,
)
from tests.unit.router_metrics import in_alarm
from tests.unit.stacks import deploy, serverless_config

D = deploy()
STORAGE = D.storage
APPS = applications(D)
COMPONENTS = {
    **{f"{app.label}:router": app.router_env for app in APPS},
    **{f"{app.label}:cpu": app.cpu_env for app in APPS},
    "gpu-task": gpu_task_env(D.gpu),
}
DAY = 86_400


def _async_rule() -> dict[str, Any]:
    rules = STORAGE.properties("JobsBucket")["LifecycleConfiguration"]["Rules"]
    (rule,) = [r for r in rules if r.get("Prefix") == "async/"]
    return dict(rule)


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_every_component_finds_the_storage_stacks_async_stores(component: str) -> None:
    # WHEN the component builds its settings from its deployed environment
    settings = AsyncSettings.from_env(COMPONENTS[component])
    # THEN async mode is on, over the storage stack's table, queue and prefix
    assert settings.enabled
    assert settings.table == STORAGE.ref("AsyncTable")
    assert settings.queue_url == STORAGE.ref("AsyncQueue")
    assert settings.location == f"s3://{STORAGE.ref('JobsBucket')}/async"
    # AND its lease, attempts and retention are the queue's and the bucket rule's
    queue = STORAGE.properties("AsyncQueue")
    assert settings.lease_s == int(queue["VisibilityTimeout"]) == 60
    assert settings.max_attempts == int(queue["RedrivePolicy"]["maxReceiveCount"]) == 3
    assert settings.ttl_s == int(queue["MessageRetentionPeriod"]) == DAY
    assert settings.ttl_s == int(_async_rule()["ExpirationInDays"]) * DAY
    # AND no topic by default; the drain age is the application's parameter
    assert settings.topic_arn is None
    assert settings.drain_age_s == 120


def test_the_gpu_task_consumes_the_queue() -> None:
    env = gpu_task_env(D.gpu)
    assert (
        int(env["GPU_ASYNC_CONCURRENCY"]) == GpuSettings.model_fields["async_concurrency"].default
    )
    assert int(env["GPU_ASYNC_CONCURRENCY"]) > 0


def test_the_stores_are_shaped_as_the_code_uses_them() -> None:
    key = STORAGE.get_att("Key", "Arn")
    table = STORAGE.properties("AsyncTable")
    # THEN the table is keyed by id with the sparse pending index the drain check reads,
    # expires on the records' expires_at, and is backed up and encrypted like the others
    assert table["KeySchema"] == [{"AttributeName": "id", "KeyType": "HASH"}]
    (index,) = table["GlobalSecondaryIndexes"]
    assert index["IndexName"] == "pending"
    assert [k["AttributeName"] for k in index["KeySchema"]] == ["pending", "created_at"]
    assert index["Projection"] == {"ProjectionType": "KEYS_ONLY"}
    assert table["TimeToLiveSpecification"] == {"AttributeName": "expires_at", "Enabled": True}
    assert "expires_at" in AsyncRecord.model_fields
    assert table["BillingMode"] == "PAY_PER_REQUEST"
    assert table["PointInTimeRecoverySpecification"]["PointInTimeRecoveryEnabled"] is True
    assert table["SSESpecification"]["KMSMasterKeyId"] == key
    # AND both queues are encrypted with the storage key, the DLQ the queue's redrive target
    queue, dead_letters = (
        STORAGE.properties("AsyncQueue"),
        STORAGE.properties("AsyncDeadLetterQueue"),
    )
    assert queue["KmsMasterKeyId"] == dead_letters["KmsMasterKeyId"] == key
    assert queue["RedrivePolicy"]["deadLetterTargetArn"] == STORAGE.get_att(
        "AsyncDeadLetterQueue", "Arn"
    )
    assert dead_letters["MessageRetentionPeriod"] == 1_209_600
    # AND bodies and results under the location's prefix expire, old versions a day later
    rule = _async_rule()
    assert rule["Status"] == "Enabled"
    assert rule["NoncurrentVersionExpiration"] == {"NoncurrentDays": 1}


@pytest.mark.parametrize("retention", ["1", "7", "14"])
def test_the_retention_parameter_moves_every_expiry_together(retention: str) -> None:
    storage = STORAGE.with_parameters(AsyncRetentionDays=retention)
    seconds = int(storage.properties("AsyncTtlParameter")["Value"])  # ASYNC_TTL_S
    assert seconds == int(retention) * DAY
    assert int(storage.properties("AsyncQueue")["MessageRetentionPeriod"]) == seconds
    rules = storage.properties("JobsBucket")["LifecycleConfiguration"]["Rules"]
    assert [int(r["ExpirationInDays"]) for r in rules if r.get("Prefix") == "async/"] == [
        int(retention)
    ]


@pytest.mark.parametrize("app", APPS, ids=[a.label for a in APPS])
def test_the_cpu_function_drains_through_a_mapping_the_drain_check_switches(app: Any) -> None:
    mapping = app.stack.properties("AsyncDrainMapping")
    # THEN the mapping starts disabled, one message per invocation, partial batch replies,
    # a small concurrency, on the storage stack's queue and the unqualified function
    assert mapping["Enabled"] is False
    assert mapping["BatchSize"] == 1
    assert mapping["FunctionResponseTypes"] == ["ReportBatchItemFailures"]
    assert int(mapping["ScalingConfig"]["MaximumConcurrency"]) == 2
    assert mapping["EventSourceArn"] == STORAGE.get_att("AsyncQueue", "Arn")
    function = app.stack.ref(app.cpu_function)
    assert mapping["FunctionName"] == function
    # AND the queue's visibility timeout covers the function's timeout (SQS's requirement)
    timeouts = {
        "CpuInferFunction": D.sam.resources["CpuInferFunction"]["Properties"]["Timeout"],
        "CpuInferLambdaFunction": serverless_config()["functions"]["cpuInfer"]["timeout"],
    }
    assert int(STORAGE.properties("AsyncQueue")["VisibilityTimeout"]) >= int(
        timeouts[app.cpu_function]
    )
    # WHEN the drain check runs with the function's name and no old backlog
    envs = {"router": app.router_env, "cpu": app.cpu_env, "gpu": gpu_task_env(D.gpu)}
    api = lambda_api_of(app.stack)
    calls = record_calls(STORAGE, envs, function, api)
    # THEN it found this mapping and disabled it
    assert api.state == "Disabled"
    uuid = app.stack.ref("AsyncDrainMapping")
    expected = Call(
        "lambda:UpdateEventSourceMapping", arn("lambda", f"event-source-mapping:{uuid}")
    )
    assert expected in calls["cpu"]


def _sam_drain_event() -> dict[str, Any]:
    events = D.sam.resources["CpuInferFunction"]["Properties"]["Events"]
    return dict(D.sam.resolve(events["AsyncDrainCheck"]["Properties"]))


def _dead_letter_sources(stack: Stack) -> list[str]:
    policy = stack.properties("ScheduleDeadLetterQueuePolicy")["PolicyDocument"]
    (statement,) = policy["Statement"]
    sources = statement["Condition"]["ArnEquals"]["aws:SourceArn"]
    return sources if isinstance(sources, list) else [sources]


def test_the_drain_check_fires_every_minute_with_the_event_the_handler_knows() -> None:
    # GIVEN the schedule of each template
    sam = _sam_drain_event()
    (sls,) = [
        e["eventBridge"]
        for e in serverless_config()["functions"]["cpuInfer"]["events"]
        if "eventBridge" in e
    ]
    # THEN both send {"spillway": "async-drain-check"} every minute
    assert sam["Schedule"] == sls["schedule"] == "rate(1 minute)"
    assert json.loads(sam["Input"]) == sls["input"] == {"spillway": DRAIN_CHECK}
    # AND an undeliverable check lands in the schedule DLQ, which lets that rule send
    for stack, name, target in (
        (D.sam, sam["Name"], sam["DeadLetterConfig"]["Arn"]),
        (D.sls, sls["name"], D.sls.resolve(sls["deadLetterQueueArn"])),
    ):
        assert target == stack.get_att("ScheduleDeadLetterQueue", "Arn")
        assert arn("events", f"rule/{name}") in _dead_letter_sources(stack)


def test_results_are_routed_to_the_router() -> None:
    path = RESULTS_PREFIX + "{id}"
    sam = D.sam.resources["RouterFunction"]["Properties"]["Events"]
    assert {(e["Properties"]["Path"], e["Properties"]["Method"]) for e in sam.values()} >= {
        (path, "GET")
    }
    sls = [e["http"] for e in serverless_config()["functions"]["router"]["events"] if "http" in e]
    assert any(
        h["path"] == path and h["method"] == "get" and h["authorizer"] == "aws_iam" for h in sls
    )


def test_a_request_in_the_async_dead_letter_queue_raises_an_alarm() -> None:
    observability = D.observability
    queue = STORAGE.get_att("AsyncDeadLetterQueue", "QueueName")
    alarms = [
        observability.properties(logical)
        for logical, resource in observability.resources.items()
        if resource["Type"] == "AWS::CloudWatch::Alarm"
    ]
    (alarm,) = [
        a for a in alarms if {"Name": "QueueName", "Value": queue} in a.get("Dimensions", [])
    ]
    assert (alarm["Namespace"], alarm["MetricName"]) == (
        "AWS/SQS",
        "ApproximateNumberOfMessagesVisible",
    )
    assert observability.ref("AlarmTopic") in alarm["AlarmActions"]
    assert in_alarm(alarm, [1])
    assert not in_alarm(alarm, [0])
    assert not in_alarm(alarm, [None])


def test_sam_local_gets_the_local_stacks_async_variables(tmp_path: Any) -> None:
    # GIVEN a local stack that has created its async resources (and one that has not)
    started = LocalStack(tmp_path, tmp_path, Ports(5000, 8000, 8081, 8082, 8080))
    started.async_vars = async_env(
        AsyncSettings(
            table="spillway-async",
            queue_url="http://127.0.0.1:5000/123456789012/spillway-async",
            location="s3://spillway-data/async",
            lease_s=10,
            drain_age_s=5,
        )
    )
    fresh = LocalStack(tmp_path, tmp_path, Ports(5000, 8000, 8081, 8082, 8080))
    for stack, enabled in ((started, True), (fresh, False)):
        document = env_vars_document(local_values(stack), load_template())
        # THEN the router and the CPU function are on exactly when the stack has them
        for function in ("RouterFunction", "CpuInferFunction"):
            settings = AsyncSettings.from_env(document[function])
            assert settings.enabled is enabled
            if enabled:
                assert settings.table == "spillway-async"
                assert settings.lease_s == 10


@pytest.mark.parametrize("app", APPS, ids=[app.label for app in APPS])
def test_the_router_runs_topics_as_its_state_machines_executions(app: Any) -> None:
    # WHEN the router builds its async settings from its deployed environment
    router = AsyncSettings.from_env(app.router_env)
    # THEN an async topics request is started as an execution of that stack's machine
    assert router.state_machines == {"topics": app.stack.ref("TopicsPipelineStateMachine")}
    # AND the consumers need no machine: they never start one
    assert AsyncSettings.from_env(app.cpu_env).state_machines == {}
