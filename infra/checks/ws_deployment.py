"""The WebSocket API's deployments change whenever what they deploy changes.

API Gateway serves a WebSocket stage from a deployment, a snapshot of the API: "every time
you update an API, you must redeploy it ... routes, integrations, authorizers"
(https://docs.aws.amazon.com/apigateway/latest/developerguide/apigateway-set-up-websocket-deployment.html).
CloudFormation creates an ``AWS::ApiGatewayV2::Deployment`` once per logical ID and never
again, so a deployment under a fixed ID leaves every later route or integration change off
the stage. The fix, in each deploy form:

* ``template.yaml``: the deployment's logical ID is ``WebSocketDeployment`` and the first 8
  hex digits of the SHA-256 of what it deploys, as written in the template: the API, its
  routes, route responses, integrations, integration responses, authorizers and models,
  and the stage's route settings. A changed part gives a new ID, hence a new deployment;
  CloudFormation creates it, moves the stage to it, then deletes the old one.
* ``serverless.yml``: the Serverless Framework v3 already names its deployment
  ``WebsocketsDeployment<sha256>`` of the WebSocket resources it compiles
  (``lib/plugins/aws/package/compile/events/websockets/lib/deployment.js``), but it hashes
  them before merging ``resources.extensions`` (``merge-custom-provider-resources.js``,
  at ``package:finalize``), so what ``infra/serverless-extensions.yml`` adds to the API,
  its routes and stage (IAM and the API key on ``$connect``) never changes that ID. (With
  serverless 3.40.0: two ``serverless package`` runs of one configuration give the same
  ID, not a new deployment per deploy, and so does a changed extension alone.)
  ``provider.websocketsDescription``, which v3 copies into the API it hashes, ends with
  ``Extensions <8 hex digits>.``: the hash of those extensions, so a changed extension
  changes the framework's deployment too.

    python -m infra.checks.ws_deployment --check   # exit 1 when an ID is stale
    python -m infra.checks.ws_deployment --fix     # rewrite them in place
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infra.checks.cfn_eval import load_cfn

ROOT = Path(__file__).resolve().parents[2]
SAM_TEMPLATE = "template.yaml"
SLS_CONFIG = "serverless.yml"
SLS_EXTENSIONS = "infra/serverless-extensions.yml"
FIX_COMMAND = "python -m infra.checks.ws_deployment --fix"

DEPLOYMENT_STEM = "WebSocketDeployment"
# What a deployment snapshots: the API's own children (each names it in ApiId).
DEPLOYED_TYPES = {
    "AWS::ApiGatewayV2::Route",
    "AWS::ApiGatewayV2::RouteResponse",
    "AWS::ApiGatewayV2::Integration",
    "AWS::ApiGatewayV2::IntegrationResponse",
    "AWS::ApiGatewayV2::Authorizer",
    "AWS::ApiGatewayV2::Model",
}
STAGE_ROUTE_SETTINGS = ("DefaultRouteSettings", "RouteSettings")
_DEPLOYMENT_ID = re.compile(rf"\b{DEPLOYMENT_STEM}(?:[0-9a-f]{{8}})?\b")
# v3's logical IDs of what a websocket event compiles (API, routes, integrations, …).
_SLS_DEPLOYED = re.compile(
    r"^(WebsocketsApi|.+Websockets(Route|RouteResponse|Integration|Authorizer))$"
)
SLS_STAGE = "WebsocketsDeploymentStage"
_SLS_DESCRIPTION = re.compile(
    r"^(?P<lead>[ \t]*websocketsDescription:[ \t]*)(?P<text>.*?)"
    r"(?P<mark> Extensions (?P<hash>[0-9a-f]{8})\.)?[ \t]*$",
    re.MULTILINE,
)


def digest(part: Any) -> str:
    """The first 8 hex digits of the SHA-256 of ``part`` as canonical JSON."""
    text = json.dumps(part, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _route_settings(properties: Mapping[str, Any]) -> dict[str, Any]:
    return {key: properties[key] for key in STAGE_ROUTE_SETTINGS if key in properties}


@dataclass(frozen=True)
class Finding:
    """One deployment ID (or marker) and the value it should have."""

    path: Path
    what: str
    current: str | None
    expected: str

    @property
    def stale(self) -> bool:
        """Whether the file still carries an old value."""
        return self.current != self.expected


def sam_deployed_part(template: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The WebSocket deployment's logical ID and what it deploys, from a SAM template."""
    resources: dict[str, Any] = template["Resources"]
    apis = [
        logical
        for logical, resource in resources.items()
        if resource.get("Type") == "AWS::ApiGatewayV2::Api"
        and resource.get("Properties", {}).get("ProtocolType") == "WEBSOCKET"
    ]
    if len(apis) != 1:
        raise SystemExit(f"expected one WebSocket API in the template, found {apis}")
    (api,) = apis
    part: dict[str, Any] = {api: {"Type": resources[api]["Type"],
                                  "Properties": resources[api]["Properties"]}}  # fmt: skip
    deployments = []
    for logical, resource in resources.items():
        properties = resource.get("Properties", {})
        if properties.get("ApiId") != {"Ref": api}:
            continue
        kind = resource["Type"]
        if kind in DEPLOYED_TYPES:
            part[logical] = {"Type": kind, "Properties": properties}
        elif kind == "AWS::ApiGatewayV2::Stage":
            part[logical] = {"Type": kind, "RouteSettings": _route_settings(properties)}
        elif kind == "AWS::ApiGatewayV2::Deployment":
            deployments.append(logical)
    if len(deployments) != 1:
        raise SystemExit(f"expected one deployment of {api}, found {deployments}")
    return deployments[0], part


def sam_finding(root: Path = ROOT) -> Finding:
    """The SAM WebSocket deployment's ID and the one its content calls for."""
    path = root / SAM_TEMPLATE
    current, part = sam_deployed_part(load_cfn(path))
    return Finding(path, "the WebSocket deployment's logical ID", current,
                   f"{DEPLOYMENT_STEM}{digest(part)}")  # fmt: skip


def sls_extensions_part(extensions: Mapping[str, Any]) -> dict[str, Any]:
    """What ``resources.extensions`` adds to the WebSocket resources v3 hashes."""
    part: dict[str, Any] = {
        logical: extension
        for logical, extension in extensions.items()
        if _SLS_DEPLOYED.match(logical)
    }
    stage = extensions.get(SLS_STAGE, {}).get("Properties", {})
    if settings := _route_settings(stage):
        part[SLS_STAGE] = {"RouteSettings": settings}
    return part


def sls_finding(root: Path = ROOT) -> Finding:
    """The hash ``websocketsDescription`` carries and the one the extensions call for."""
    config = root / SLS_CONFIG
    loaded = yaml.safe_load((root / SLS_EXTENSIONS).read_text(encoding="utf-8")) or {}
    expected = digest(sls_extensions_part(loaded))
    match = _SLS_DESCRIPTION.search(config.read_text(encoding="utf-8"))
    if match is None:
        raise SystemExit(f"{config}: provider.websocketsDescription is missing")
    return Finding(config, "the hash of the WebSocket extensions in websocketsDescription",
                   match.group("hash"), expected)  # fmt: skip


def fix_sam(finding: Finding) -> None:
    """Rename the deployment and every reference to it (the stage's DeploymentId …)."""
    text = finding.path.read_text(encoding="utf-8")
    finding.path.write_text(_DEPLOYMENT_ID.sub(finding.expected, text), encoding="utf-8")


def fix_sls(finding: Finding) -> None:
    """Rewrite the hash at the end of ``websocketsDescription``."""
    text = finding.path.read_text(encoding="utf-8")

    def marked(match: re.Match[str]) -> str:
        return f"{match.group('lead')}{match.group('text')} Extensions {finding.expected}."

    finding.path.write_text(_SLS_DESCRIPTION.sub(marked, text, count=1), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """``--check`` (exit 1 on a stale ID) or ``--fix``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="fail when an ID is stale")
    mode.add_argument("--fix", action="store_true", help="rewrite stale IDs in place")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (tests)")
    args = parser.parse_args(argv)
    findings = [(sam_finding(args.root), fix_sam), (sls_finding(args.root), fix_sls)]
    stale = [(finding, fix) for finding, fix in findings if finding.stale]
    for finding, fix in stale:
        if args.fix:
            fix(finding)
            print(f"{finding.path.name}: {finding.what}: {finding.current} -> {finding.expected}")
        else:
            stale_line = (f"{finding.path.name}: {finding.what} is {finding.current}, its "
                          f"content calls for {finding.expected}: run `{FIX_COMMAND}`")  # fmt: skip
            print(stale_line, file=sys.stderr)
    if args.check and stale:
        return 1
    if not stale:
        print("WebSocket deployments: up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
