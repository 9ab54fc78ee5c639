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
import subprocess
from pathlib import Path
from typing import Any

import pytest

from infra.checks.cfn_eval import Stack
from tests.unit.stacks import ROOT, deploy, serverless_config
from tests.unit.test_templates import FUNCTIONS, SLS_LOGICAL

SAM_PYTHON = ROOT / ".venv-sam/bin/python"
RESERVED = {
    "RouterFunction": ("RouterReservedConcurrency", "routerReservedConcurrency"),
    "CpuInferFunction": ("CpuReservedConcurrency", "cpuReservedConcurrency"),
    "JobsFunction": ("JobsReservedConcurrency", "jobsReservedConcurrency"),
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
    stages = [r["Properties"]["StageName"] for r in resources if r["Type"].endswith("::Stage")]
    deployments = [r["Properties"] for r in resources if r["Type"].endswith("::Deployment")]
    # THEN one stage, the Stage parameter's; no deployment makes a stage of its own
    assert stages == [{"Ref": "Stage"}]
    assert deployments
    assert [d for d in deployments if "StageName" in d] == []


def test_deploy_guide_names_the_quotas_to_request() -> None:
    text = (ROOT / "docs/deploy.md").read_text(encoding="utf-8")
    for code in ("L-B99A9384", "L-DB2E81BA", "L-3819A6DF"):  # Lambda; G/VT on-demand, Spot
        assert code in text
