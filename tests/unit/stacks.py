"""Every Spillway stack as docs/deploy.md deploys it, evaluated offline.

The infrastructure stacks take their default names and parameters (the GPU image tag is
the one given value), the SAM application nests the observability stack with the values
template.yaml passes it, and the Serverless application is ``serverless.yml`` for stage
``prod`` with the resources the framework adds itself (a log group and a function per
function, and for ``websocket`` events the WebSocket API, its stage and routes, named as
v3 names them, with ``resources.extensions``' properties on the WebSocket ones).
``SPILLWAY_SLS_PACKAGED`` adds the CloudFormation that ``serverless package`` really wrote.
Intrinsics resolve through ``infra.checks.cfn_eval``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from infra.checks.cfn_eval import Exports, Stack, load_cfn
from tests.unit.test_templates import STAGE, SlsResolver

ROOT = Path(__file__).resolve().parents[2]
IMAGE_TAG = "3f2a9c1d0b7e"
CPU_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/spillway-cpu@sha256:" + "0" * 64
SAM_STACK = "spillway"
SLS_STACK = f"spillway-{STAGE}"


@dataclass(frozen=True)
class Deployment:
    """The stacks of one deployment, in deployment order."""

    network: Stack
    storage: Stack
    gpu: Stack
    batch: Stack
    sam: Stack
    observability: Stack
    sls: Stack
    packaged: Stack | None

    def all(self) -> list[Stack]:
        """Every stack, the packaged Serverless one included when present."""
        stacks = [self.network, self.storage, self.gpu, self.batch, self.sam]
        stacks += [self.observability, self.sls]
        return stacks + ([self.packaged] if self.packaged is not None else [])


def _function_key(key: str) -> str:
    """The framework's logical-ID stem of a function key (``cpuInfer`` → ``CpuInfer``)."""
    return key[0].upper() + key[1:].replace("-", "Dash").replace("_", "Underscore")


def serverless_config(cli: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """serverless.yml with its variables resolved for stage ``prod``."""
    raw = yaml.safe_load((ROOT / "serverless.yml").read_text(encoding="utf-8"))
    resolver = SlsResolver(raw, cli={"cpuImageUri": CPU_IMAGE, **(cli or {})})
    config: dict[str, Any] = resolver.resolve({k: v for k, v in raw.items() if k != "params"})
    return config


def websocket_route_logical_id(route: str) -> str:
    """v3's logical ID of a WebSocket route (``$connect`` → ``SconnectWebsocketsRoute``)."""
    return route.replace("$", "S").replace("/", "Slash").replace("-", "Dash") + "WebsocketsRoute"


def _websocket_resources(config: Mapping[str, Any]) -> dict[str, Any]:
    """The WebSocket API v3 makes for ``websocket`` events: API, stage and routes, each
    with the properties ``resources.extensions`` adds."""
    routes = [
        event["websocket"]["route"]
        for function in config["functions"].values()
        for event in function.get("events", [])
        if "websocket" in event
    ]
    if not routes:
        return {}
    provider = config["provider"]
    resources: dict[str, Any] = {
        "WebsocketsApi": {
            "Type": "AWS::ApiGatewayV2::Api",
            "Properties": {
                "Name": provider["websocketsApiName"],
                "ProtocolType": "WEBSOCKET",
                "RouteSelectionExpression": provider["websocketsApiRouteSelectionExpression"],
            },
        },
        "WebsocketsDeploymentStage": {
            "Type": "AWS::ApiGatewayV2::Stage",
            "Properties": {"ApiId": {"Ref": "WebsocketsApi"}, "StageName": provider["stage"]},
        },
    }
    for route in routes:
        resources[websocket_route_logical_id(route)] = {
            "Type": "AWS::ApiGatewayV2::Route",
            "Properties": {
                "ApiId": {"Ref": "WebsocketsApi"},
                "RouteKey": route,
                "AuthorizationType": "NONE",
            },
        }
    for logical, extension in config["resources"].get("extensions", {}).items():
        if logical in resources:
            resources[logical]["Properties"].update(extension.get("Properties", {}))
    return resources


def serverless_template(config: Mapping[str, Any]) -> dict[str, Any]:
    """The CloudFormation the framework generates, as far as these checks need it: the
    configuration's resources plus each function's log group and function, and the
    WebSocket API of ``websocket`` events."""
    resources = dict(config["resources"]["Resources"])
    for key, function in config["functions"].items():
        stem = _function_key(key)
        resources[f"{stem}LogGroup"] = {
            "Type": "AWS::Logs::LogGroup",
            "Properties": {"LogGroupName": f"/aws/lambda/{function['name']}"},
        }
        resources[f"{stem}LambdaFunction"] = {
            "Type": "AWS::Lambda::Function",
            "Properties": {"FunctionName": function["name"]},
        }
    resources.update(_websocket_resources(config))
    return {
        "Parameters": config["resources"].get("Parameters", {}),
        "Conditions": config["resources"].get("Conditions", {}),
        "Resources": resources,
    }


def _nested_parameters(sam: Stack, logical: str) -> dict[str, Any]:
    """The parameters the SAM template passes to a nested application."""
    parameters = sam.resources[logical]["Properties"]["Parameters"]
    return {name: sam.resolve(value) for name, value in parameters.items()}


@cache
def deploy() -> Deployment:
    """Deploy every stack (offline); cached, as templates do not change during a run."""
    exports = Exports()

    def stack(name: str, path: str, **parameters: Any) -> Stack:
        return exports.publish(Stack(name, load_cfn(ROOT / path), parameters, exports))

    network = stack("spillway-network", "infra/network.yaml")
    storage = stack("spillway-storage", "infra/storage.yaml")
    gpu = stack("spillway-gpu", "infra/ecs-gpu-service.yaml", ImageTag=IMAGE_TAG)
    batch = stack("spillway-batch", "infra/batch.yaml", ImageTag=IMAGE_TAG)
    sam = stack(SAM_STACK, "template.yaml")
    observability = Stack(
        f"{SAM_STACK}-Observability-1A2B3C4D",
        load_cfn(ROOT / "infra/observability.yaml"),
        _nested_parameters(sam, "Observability"),
        exports,
    )
    sls = Stack(SLS_STACK, serverless_template(serverless_config()), {}, exports)
    packaged_path = os.environ.get("SPILLWAY_SLS_PACKAGED")
    packaged = None
    if packaged_path:
        template = json.loads(Path(packaged_path).read_text(encoding="utf-8"))
        packaged = Stack(SLS_STACK, template, {}, exports)
    return Deployment(network, storage, gpu, batch, sam, observability, sls, packaged)
