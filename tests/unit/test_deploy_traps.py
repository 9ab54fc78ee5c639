"""No template trips over account-level settings or leaves a stack that cannot go away.

GIVEN the templates at their defaults, resolved as CloudFormation resolves them
THEN no function reserves concurrency (a fresh account's quota can be far below the sum
plus the 100 Lambda keeps unreserved) but each can, by parameter; the SAM stack leaves the
account's API Gateway CloudWatch role alone unless asked; the ALB's deletion protection
is a parameter, off by default; SAM creates the one stage it is given and no stray
``Stage``; the Serverless API is REGIONAL like SAM's; docs/deploy.md names the quotas.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from infra.checks.cfn_eval import Exports, Stack, load_cfn
from tests.unit.async_calls import gpu_task_env, sam_function_env, sls_function_env
from tests.unit.stacks import ROOT, deploy, serverless_config, serverless_template
from tests.unit.test_templates import FUNCTIONS, SLS_LOGICAL

SAM_PYTHON = ROOT / ".venv-sam/bin/python"
RESERVED = {
    "RouterFunction": ("RouterReservedConcurrency", "routerReservedConcurrency"),
    "CpuInferFunction": ("CpuReservedConcurrency", "cpuReservedConcurrency"),
    "JobsFunction": ("JobsReservedConcurrency", "jobsReservedConcurrency"),
    "WebSocketFunction": ("WebSocketReservedConcurrency", "websocketReservedConcurrency"),
}


def _reserved(stack: Stack, function: str) -> list[Any]:
    """The function's ReservedConcurrentExecutions as deployed ([] when absent)."""
    value = stack.resources[function]["Properties"].get("ReservedConcurrentExecutions")
    resolved: list[Any] = stack.resolve([value]) if value is not None else []
    return resolved


@pytest.mark.parametrize("function", FUNCTIONS)
def test_no_function_reserves_concurrency_unless_asked(function: str) -> None:
    sam, (parameter, param) = deploy().sam, RESERVED[function]
    sls_key = FUNCTIONS[function]
    # GIVEN the defaults THEN neither template reserves concurrency
    assert _reserved(sam, function) == []
    assert serverless_config()["functions"][sls_key].get("reservedConcurrency") is None
    # WHEN a deployer sets the parameter THEN that reservation is made
    assert [int(v) for v in _reserved(sam.with_parameters(**{parameter: 25}), function)] == [25]
    config = serverless_config(cli={param: 25})
    assert int(config["functions"][sls_key]["reservedConcurrency"]) == 25


def test_packaged_serverless_reserves_nothing() -> None:
    packaged = deploy().packaged
    if packaged is None:
        pytest.skip("set by scripts/check_infra.sh after `serverless package`")
    reservations = {
        logical: packaged.resources[logical]["Properties"].get("ReservedConcurrentExecutions")
        for logical in SLS_LOGICAL.values()
    }
    assert reservations == dict.fromkeys(SLS_LOGICAL.values())


def test_the_account_api_gateway_logs_role_is_left_alone_by_default() -> None:
    sam = deploy().sam
    # GIVEN the default THEN the stack creates no account setting (nor its role)
    assert not sam.included("ApiGatewayAccount")
    assert not sam.included("ApiGatewayLogsRole")
    # WHEN asked THEN it sets it
    assert sam.with_parameters(CreateApiGatewayLogsRole="true").included("ApiGatewayAccount")


def test_both_apis_stages_wait_for_the_account_logs_role_when_it_is_set() -> None:
    # GIVEN the stack sets the account's logs role THEN each API names the setting, so
    # CloudFormation creates the APIs (and their stages with access logs) after it
    sam = deploy().sam.with_parameters(CreateApiGatewayLogsRole="true")
    account = sam.properties("ApiGatewayAccount")
    assert account
    for api in ("Api", "WebSocketApi"):
        assert "logs to CloudWatch" in str(sam.properties(api)["Description"]), api


def _deletion_protection(stack: Stack) -> str:
    attributes = stack.properties("LoadBalancer")["LoadBalancerAttributes"]
    values = [a["Value"] for a in attributes if a["Key"] == "deletion_protection.enabled"]
    assert len(values) == 1
    return str(values[0])


def test_alb_deletion_protection_is_a_parameter_off_by_default() -> None:
    gpu = deploy().gpu
    assert _deletion_protection(gpu) == "false"
    assert _deletion_protection(gpu.with_parameters(AlbDeletionProtection="true")) == "true"


def test_the_serverless_api_is_regional_like_sams() -> None:
    d = deploy()
    sam_type = d.sam.resources["Api"]["Properties"]["EndpointConfiguration"]["Type"]
    assert sam_type == serverless_config()["provider"].get("endpointType") == "REGIONAL"
    if d.packaged is not None:
        apis = [r for r in d.packaged.resources.values() if r["Type"].endswith("::RestApi")]
        assert [a["Properties"]["EndpointConfiguration"]["Types"] for a in apis] == [["REGIONAL"]]


def test_the_sam_api_declares_openapi_3() -> None:
    # SAM adds a "Stage" stage to Swagger 2.0 APIs; OpenApiVersion 3.x stops it.
    props = deploy().sam.resources["Api"]["Properties"]
    assert str(props.get("OpenApiVersion", "2.0")).startswith("3.")


@pytest.fixture(scope="module")
def translated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """template.yaml as the SAM translator turns it into CloudFormation."""
    if not SAM_PYTHON.exists():
        pytest.skip("make check-infra installs the SAM CLI into .venv-sam")
    out = tmp_path_factory.mktemp("sam") / "template.json"
    env = {**os.environ, "AWS_DEFAULT_REGION": "us-east-1", "SAM_CLI_TELEMETRY": "0"}
    result = subprocess.run(
        [str(SAM_PYTHON), "-m", "infra.checks.translate_sam", "template.yaml", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    data: dict[str, Any] = json.loads(Path(out).read_text(encoding="utf-8"))
    return data


def test_sam_creates_only_the_stage_it_is_given(translated: dict[str, Any]) -> None:
    resources = translated["Resources"].values()

    def stages(kind: str) -> list[Any]:
        return [r["Properties"]["StageName"] for r in resources if r["Type"] == kind]

    deployments = [r["Properties"] for r in resources if r["Type"].endswith("::Deployment")]
    # THEN one stage per API (REST and WebSocket), the Stage parameter's; no deployment
    # makes a stage of its own
    assert stages("AWS::ApiGateway::Stage") == [{"Ref": "Stage"}]
    assert stages("AWS::ApiGatewayV2::Stage") == [{"Ref": "Stage"}]
    assert deployments
    assert [d for d in deployments if "StageName" in d] == []


def test_deploy_guide_names_the_quotas_to_request() -> None:
    text = (ROOT / "docs/deploy.md").read_text(encoding="utf-8")
    for code in ("L-B99A9384", "L-DB2E81BA", "L-3819A6DF"):  # Lambda; G/VT on-demand, Spot
        assert code in text


# --- second deploys: what autoscaling owns, and exports that must never change ----------

# Resource types whose Ref changes on an ordinary update (a new revision or version).
REVISIONED = {"AWS::Batch::JobDefinition", "AWS::ECS::TaskDefinition", "AWS::Lambda::Version"}
ASYNC_TUNABLES = {
    "ASYNC_TTL_S": "ttl-seconds",
    "ASYNC_LEASE_S": "lease-seconds",
    "ASYNC_MAX_ATTEMPTS": "max-attempts",
}


def _infra(d: Any) -> list[Stack]:
    return [s for s in d.all() if s is not d.packaged]


def _refs(value: Any) -> set[str]:
    """Every logical name or parameter an expression reads (``Ref``, ``GetAtt``, ``Sub``)."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            if key == "Ref" and isinstance(inner, str):
                found.add(inner)
            elif key == "Fn::GetAtt":
                found.add(str(inner[0] if isinstance(inner, list) else inner.split(".")[0]))
            elif key == "Fn::Sub":
                text, variables = (inner, {}) if isinstance(inner, str) else inner
                names = {m.split(".")[0] for m in re.findall(r"\$\{([^}!]+)\}", text)}
                found |= names - set(variables) | _refs(variables)
            else:
                found |= _refs(inner)
    elif isinstance(value, list):
        for item in value:
            found |= _refs(item)
    return found


def _imports(value: Any, stack: Stack) -> set[str]:
    """The export names an expression imports, resolved."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            if key == "Fn::ImportValue":
                found.add(str(stack.resolve(inner)))
            else:
                found |= _imports(inner, stack)
    elif isinstance(value, list):
        for item in value:
            found |= _imports(item, stack)
    return found


def _exports(stack: Stack) -> dict[str, Any]:
    return {
        str(stack.resolve(o["Export"]["Name"])): o["Value"]
        for o in stack.template.get("Outputs", {}).values()
        if "Export" in o
    }


def test_autoscaling_owns_the_counts_it_scales() -> None:
    # GIVEN every stack THEN no ECS service an Application Auto Scaling target scales sets
    # DesiredCount (each update would reset the count: a rollout stopped every task of a
    # MinTasks=0 service, a service scaled out to 4 dropped to 1), and no Auto Scaling group
    # behind a managed-scaling capacity provider sets DesiredCapacity
    for stack in _infra(deploy()):
        resources = stack.resources
        scaled = {
            name
            for target in resources.values()
            if target["Type"] == "AWS::ApplicationAutoScaling::ScalableTarget"
            for name in _refs(target["Properties"]["ResourceId"])
            if resources.get(name, {}).get("Type") == "AWS::ECS::Service"
        }
        managed = {
            name
            for provider in resources.values()
            if provider["Type"] == "AWS::ECS::CapacityProvider"
            for name in _refs(provider["Properties"]["AutoScalingGroupProvider"])
            if resources.get(name, {}).get("Type") == "AWS::AutoScaling::AutoScalingGroup"
        }
        if stack.name == "spillway-gpu":
            assert scaled == {"Service"}
            assert managed == {"AutoScalingGroup"}
        for name in scaled:
            assert "DesiredCount" not in resources[name]["Properties"], (stack.name, name)
        for name in managed:
            assert "DesiredCapacity" not in resources[name]["Properties"], (stack.name, name)


def test_scale_to_zero_still_scales_from_a_created_service() -> None:
    # GIVEN MinTasks=0 THEN the scalable target may reach 0, the scale-from-zero policy
    # exists, and the service (created with ECS's default of 1 task) sets no count
    gpu = deploy().gpu.with_parameters(MinTasks=0)
    assert int(gpu.properties("ScalableTarget")["MinCapacity"]) == 0
    assert gpu.included("ScaleFromZeroScaling")
    assert gpu.included("GpuDemandAlarm")
    assert "DesiredCount" not in gpu.properties("Service")


def test_no_export_carries_a_tunable_or_a_revision() -> None:
    d = deploy()
    imported = {name for stack in d.all() for name in _imports(stack.template, stack)}
    for stack in _infra(d):
        parameters = set(stack.template.get("Parameters", {}))
        for name, value in _exports(stack).items():
            reads = _refs(value)
            # THEN no stack imports an export that carries a parameter's value (a tunable):
            # CloudFormation refuses to change an export while another stack imports it
            if reads & parameters:
                assert name not in imported, (name, reads & parameters)
            # AND never a Ref that changes on each update (a job definition's revision)
            kinds = {stack.resources[r]["Type"] for r in reads if r in stack.resources}
            assert not kinds & REVISIONED, (name, kinds)


def test_the_async_tunables_follow_the_storage_stack_on_the_next_deploy() -> None:
    # GIVEN the storage stack deployed again with another lease, attempts and retention
    exports = Exports()

    def stack(name: str, path: str, **parameters: Any) -> Stack:
        return exports.publish(Stack(name, load_cfn(ROOT / path), parameters, exports))

    stack("spillway-network", "infra/network.yaml")
    stack("spillway-storage", "infra/storage.yaml", AsyncLeaseSeconds=300,
          AsyncMaxAttempts=5, AsyncRetentionDays="7")  # fmt: skip
    # WHEN the GPU stack and the applications deploy again
    gpu = stack("spillway-gpu", "infra/ecs-gpu-service.yaml", ImageTag="next")
    sam = stack("spillway", "template.yaml")
    sls = Stack("spillway-prod", serverless_template(serverless_config()), {}, exports)
    envs = {
        "gpu": gpu_task_env(gpu),
        "sam router": sam_function_env(sam, "RouterFunction"),
        "sam cpu": sam_function_env(sam, "CpuInferFunction"),
        "sls router": sls_function_env(sls, "router"),
        "sls cpu": sls_function_env(sls, "cpuInfer"),
    }
    # THEN every one of them runs with the new values (no export pinned the old ones)
    for label, env in envs.items():
        values = {name: env[name] for name in ASYNC_TUNABLES}
        assert values == {
            "ASYNC_TTL_S": str(7 * 86_400),
            "ASYNC_LEASE_S": "300",
            "ASYNC_MAX_ATTEMPTS": "5",
        }, label
    # AND the consumers read them as SSM-typed parameters of the storage stack's names
    for template, parameters in ((gpu.template, gpu.template["Parameters"]),
                                 (sam.template, sam.template["Parameters"]),
                                 (sls.template, sls.template["Parameters"])):  # fmt: skip
        for suffix in ASYNC_TUNABLES.values():
            declared = [
                p for p in parameters.values()
                if p.get("Default") == f"/spillway-storage/async/{suffix}"
            ]  # fmt: skip
            assert [p["Type"] for p in declared] == ["AWS::SSM::Parameter::Value<String>"], (
                template.get("Description", "")[:40],
                suffix,
            )
