"""With ``MinTasks=0`` the GPU service starts its first task when GPU-bound requests arrive.

GIVEN the GPU stack deployed with ``MinTasks=0``: no task runs, so no ``TaskQueueDepth`` or
``TaskBusyFraction`` exists and target tracking has nothing to act on
WHEN the router serves a request its policy sent to the GPU tier from the CPU fallback
(the EMF line comes from the router's own accounting code, not from names in this test)
THEN an alarm's query selects that line, a minute with such requests breaches it, and its
action — a step policy on the service's scalable target — takes the desired count from 0
to at least 1; target tracking still scales the service once tasks report.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from infra.checks.cfn_eval import Stack
from tests.unit.router_metrics import emitted, in_alarm, parse_query, selects
from tests.unit.stacks import deploy


def gpu_stack(min_tasks: int) -> Stack:
    return deploy().gpu.with_parameters(MinTasks=min_tasks)


def _policies(stack: Stack, kind: str) -> dict[str, dict[str, Any]]:
    """Scaling policies of ``kind`` on the service's scalable target, by their Ref."""
    return {
        stack.ref(logical): stack.properties(logical)
        for logical, resource in stack.resources.items()
        if resource["Type"] == "AWS::ApplicationAutoScaling::ScalingPolicy"
        and stack.included(logical)
        and resource["Properties"]["PolicyType"] == kind
        and resource["Properties"]["ScalingTargetId"] == {"Ref": "ScalableTarget"}
    }


def scale_out_alarms(stack: Stack) -> list[dict[str, Any]]:
    """Alarms whose action is a step scaling policy of the service."""
    steps = _policies(stack, "StepScaling")
    alarms = []
    for logical, resource in stack.resources.items():
        if resource["Type"] == "AWS::CloudWatch::Alarm" and stack.included(logical):
            alarm = stack.properties(logical)
            if any(action in steps for action in alarm.get("AlarmActions", [])):
                alarms.append(alarm)
    return alarms


def apply_steps(config: dict[str, Any], breach: float, capacity: int, low: int, high: int) -> int:
    """Application Auto Scaling's step adjustment for a metric ``breach`` above threshold."""
    for step in config["StepAdjustments"]:
        lower = float(step.get("MetricIntervalLowerBound", -math.inf))
        upper = float(step.get("MetricIntervalUpperBound", math.inf))
        if lower <= breach < upper:
            adjustment = int(step["ScalingAdjustment"])
            kind = config["AdjustmentType"]
            wanted = adjustment if kind == "ExactCapacity" else capacity + adjustment
            return max(low, min(high, wanted))
    return capacity


def the_scale_out_alarm(stack: Stack) -> dict[str, Any]:
    alarms = scale_out_alarms(stack)
    assert len(alarms) == 1, f"{len(alarms)} alarms scale the service out by a step policy"
    return alarms[0]


def _query(alarm: dict[str, Any]) -> Any:
    returned = [m for m in alarm["Metrics"] if m.get("ReturnData", True)]
    assert len(returned) == 1
    return parse_query(returned[0]["Expression"])


def test_the_alarm_selects_what_the_router_emits_for_a_gpu_fallback() -> None:
    alarm = the_scale_out_alarm(gpu_stack(0))
    query = _query(alarm)
    fallback = emitted(backend="cpu", fallback=True)
    # THEN the query's series is the router's count of GPU-bound requests the CPU served
    assert selects(query, fallback)
    assert query.function == "SUM"
    assert fallback.metrics[query.metric] == 1
    # AND requests that needed no GPU task add nothing to it
    for other in (emitted(backend="cpu", rule="serverless-requested"), emitted(backend="gpu")):
        assert not selects(query, other) or other.metrics[query.metric] == 0
    # AND it is not a metric of the GPU tasks themselves (absent at zero)
    assert query.metric not in ("TaskQueueDepth", "TaskBusyFraction")


def test_gpu_bound_requests_take_the_service_from_zero_to_a_task() -> None:
    stack = gpu_stack(0)
    target = stack.properties("ScalableTarget")
    alarm = the_scale_out_alarm(stack)
    query = _query(alarm)
    # GIVEN three GPU-bound requests in one minute, served by the CPU fallback
    minute = [emitted(backend="cpu", fallback=True, model=m) for m in ("digits", "a", "b")]
    value = sum(line.metrics[query.metric] for line in minute if selects(query, line))
    threshold = float(alarm["Threshold"])
    # THEN the alarm fires on that one minute
    assert int(alarm["Metrics"][0]["Period"]) <= 60
    assert in_alarm(alarm, [None, None, value])
    # AND its step policy takes the desired count from 0 to at least one task
    (policy,) = (p for ref, p in _policies(stack, "StepScaling").items()
                 if ref in alarm["AlarmActions"])  # fmt: skip
    low, high = int(target["MinCapacity"]), int(target["MaxCapacity"])
    assert low == 0
    config = policy["StepScalingPolicyConfiguration"]
    assert apply_steps(config, value - threshold, 0, low, high) >= 1
    # AND minutes without traffic (no datapoint at all) scale nothing out
    assert not in_alarm(alarm, [None, None, None])


@pytest.mark.parametrize("min_tasks", [0, 1])
def test_target_tracking_still_scales_above_zero(min_tasks: int) -> None:
    stack = gpu_stack(min_tasks)
    tracked = {
        p["TargetTrackingScalingPolicyConfiguration"]["CustomizedMetricSpecification"]["MetricName"]
        for p in _policies(stack, "TargetTrackingScaling").values()
    }
    assert tracked == {"TaskQueueDepth", "TaskBusyFraction"}


def test_a_dedicated_tier_has_no_scale_from_zero_alarm() -> None:
    # GIVEN the default MinTasks=1 THEN nothing but target tracking scales the service
    assert scale_out_alarms(gpu_stack(1)) == []
