"""Total failures and silent autoscaling are visible on the dashboard and alarmed.

GIVEN the observability stack as template.yaml nests it, resolved, and the EMF line the
router writes when every backend of a request failed (``backend="none"``, a 5xx; taken
from the router's accounting code)
THEN a dashboard series plots exactly those requests, and an alarm that notifies the
topic fires on one of them but not on served requests or on a client's own 4xx
AND GIVEN the metrics the GPU service's ADOT sidecar publishes (read from the task
definition's collector configuration)
THEN when tasks run and those metrics stop, an alarm notifies; when the service has
scaled to zero (no tasks, no metrics) or the metrics flow, it does not.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from tests.unit.router_metrics import (
    Query,
    emitted,
    in_alarm,
    parse_query,
    parse_searches,
    selects,
)
from tests.unit.stacks import deploy

OBSERVABILITY = deploy().observability
TOTAL_FAILURE = emitted(backend="none", model="-", status=503)


def _alarms(kind: str = "AWS::CloudWatch::Alarm") -> dict[str, dict[str, Any]]:
    """Alarms of the stack by their name (what ``Ref`` and composite rules use)."""
    return {
        OBSERVABILITY.ref(logical): OBSERVABILITY.properties(logical)
        for logical, resource in OBSERVABILITY.resources.items()
        if resource["Type"] == kind
    }


def _notifies(alarm: dict[str, Any]) -> bool:
    return OBSERVABILITY.ref("AlarmTopic") in alarm.get("AlarmActions", [])


def _dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(OBSERVABILITY.properties("Dashboard")["DashboardBody"])
    return dashboard


def _series(dashboard: dict[str, Any]) -> list[Query]:
    queries = []
    for widget in dashboard["widgets"]:
        for row in widget.get("properties", {}).get("metrics", []):
            for item in row:
                if isinstance(item, dict) and "expression" in item:
                    queries += parse_searches(item["expression"])
    return queries


def test_the_dashboard_plots_requests_no_backend_served() -> None:
    # THEN some series pins backend="none" and counts the router's total failures
    pinned = [
        q for q in _series(_dashboard())
        if q.where.get("backend") == "none" and selects(q, TOTAL_FAILURE)
    ]  # fmt: skip
    assert {q.metric for q in pinned} & {"Requests", "Errors"}
    assert all(TOTAL_FAILURE.metrics[q.metric] == 1 for q in pinned)


def test_the_alarms_widget_lists_every_notifying_alarm() -> None:
    widgets = [w for w in _dashboard()["widgets"] if w["type"] == "alarm"]
    listed = {arn for w in widgets for arn in w["properties"]["alarms"]}
    notifying = {
        OBSERVABILITY.get_att(logical, "Arn")
        for logical, resource in OBSERVABILITY.resources.items()
        if resource["Type"].startswith("AWS::CloudWatch::")
        and resource["Type"].endswith("Alarm")
        and _notifies(OBSERVABILITY.properties(logical))
    }
    assert notifying <= listed


def _query_alarms_selecting(line: Any) -> list[tuple[dict[str, Any], Query]]:
    found = []
    for alarm in _alarms().values():
        for metric in alarm.get("Metrics", []):
            expression = metric.get("Expression", "")
            if metric.get("ReturnData", True) and expression.lstrip().upper().startswith("SELECT"):
                query = parse_query(expression)
                if selects(query, line) and line.metrics[query.metric] > 0:
                    found.append((alarm, query))
    return found


def test_a_request_no_backend_served_raises_an_alarm() -> None:
    # GIVEN an alarm whose query counts the router's total failures
    found = [(a, q) for a, q in _query_alarms_selecting(TOTAL_FAILURE) if _notifies(a)]
    assert found, "no notifying alarm counts requests with backend=none"
    for alarm, query in found:
        # WHEN one such request happens in a period THEN it fires
        assert in_alarm(alarm, [TOTAL_FAILURE.metrics[query.metric]])
        # AND served requests and a client's own error add nothing to its series
        for other in (emitted(backend="gpu"), emitted(backend="cpu", fallback=True),
                      emitted(backend="none", model="-", status=400)):  # fmt: skip
            assert not selects(query, other) or other.metrics[query.metric] == 0
        # AND a quiet period is no alarm
        assert not in_alarm(alarm, [None])


def _collector() -> dict[str, Any]:
    """The ADOT collector configuration of the GPU task, resolved."""
    gpu = deploy().gpu
    task = gpu.resources["TaskDefinition"]["Properties"]
    sidecar = next(c for c in task["ContainerDefinitions"] if c["Name"] == "metrics")
    (content,) = (e["Value"] for e in sidecar["Environment"] if e["Name"] == "AOT_CONFIG_CONTENT")
    config: dict[str, Any] = yaml.safe_load(gpu.resolve(content))
    return config


def _published() -> tuple[str, set[str], dict[str, str]]:
    """Namespace, metric names and dimension values the sidecar publishes."""
    config = _collector()
    emf = config["exporters"]["awsemf"]
    (declaration,) = emf["metric_declarations"]
    scrape = config["receivers"]["prometheus"]["config"]["scrape_configs"][0]
    labels = scrape["static_configs"][0]["labels"]
    (dimensions,) = declaration["dimensions"]
    return (
        emf["namespace"],
        set(declaration["metric_name_selectors"]),
        {name: labels[name] for name in dimensions},
    )


def _dimensions(alarm: dict[str, Any]) -> dict[str, str]:
    return {d["Name"]: d["Value"] for d in alarm.get("Dimensions", [])}


def test_gpu_tasks_without_scaling_metrics_raise_an_alarm() -> None:
    namespace, names, dimensions = _published()
    alarms = _alarms()
    # GIVEN the alarm on the sidecar's own metric, for this service's tasks
    absent = [
        name for name, a in alarms.items()
        if a.get("Namespace") == namespace and a.get("MetricName") in names
        and _dimensions(a) == dimensions
    ]  # fmt: skip
    running = [
        name for name, a in alarms.items()
        if a.get("Namespace") == "ECS/ContainerInsights"
        and a.get("MetricName") == "RunningTaskCount" and _dimensions(a) == dimensions
    ]  # fmt: skip
    assert absent, "no alarm on the sidecar's metric for this service"
    assert running, "no alarm on the service's running tasks"
    rules = [
        c for c in _alarms("AWS::CloudWatch::CompositeAlarm").values()
        if _notifies(c) and set(re.findall(r'ALARM\("([^"]+)"\)', c["AlarmRule"]))
        == {absent[0], running[0]}
    ]  # fmt: skip
    assert len(rules) == 1
    assert " AND " in rules[0]["AlarmRule"]
    assert " OR " not in rules[0]["AlarmRule"]
    metrics, tasks = alarms[absent[0]], alarms[running[0]]
    no_data, five = [None] * 5, int(metrics["EvaluationPeriods"])
    # WHEN tasks run and the sidecar publishes nothing THEN both conditions hold
    assert in_alarm(metrics, no_data)
    assert in_alarm(tasks, [1.0] * five)
    # WHEN the sidecar publishes (4 scrapes a minute) THEN no alarm
    assert not in_alarm(metrics, [4.0] * five)
    # WHEN the service has scaled to zero THEN the task condition does not hold
    assert not in_alarm(tasks, [0.0] * five)
    assert not in_alarm(tasks, no_data)
