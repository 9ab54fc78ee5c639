"""The templates keep to AWS's current terms, in both deploy forms, evaluated offline.

GIVEN every stack as docs/deploy.md deploys it (``tests.unit.stacks``: the infrastructure
stacks both application forms import, template.yaml for SAM, serverless.yml for the
Serverless Framework; ``SPILLWAY_SLS_PACKAGED`` adds what ``serverless package`` wrote)
THEN GPU hosts boot Amazon Linux 2023 GPU AMIs, AL2 being out of support since 2026-06-30
(ECS: the AL2023 GPU SSM parameter; Batch: ``ECS_AL2023_NVIDIA``); every security group
states inline all it may reach (a group without inline egress keeps EC2's allow-all rule)
and the ALB reaches the GPU targets' ports only; the gRPC door and its private name exist
only with a certificate; each WebSocket deployment's ID follows what it deploys;
docs/deploy.md shows the idle cost ``python -m infra.idle_cost`` computes, with a price
line for every resource type that bills at idle; a routing rule on a body size the router
can never receive is refused.
"""

from __future__ import annotations

import os
import re
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra import prices
from infra.checks import ws_deployment
from infra.checks.cfn_eval import Stack, load_cfn
from infra.idle_cost import model, report
from infra.idle_cost.deployment import SHAPES, Shape
from spillway.policy.rules import PolicyError, parse_policy
from spillway.protocol.wire import SYNC_BODY_BYTES
from tests.unit.stacks import ROOT, deploy, serverless_config

TEMPLATE_FILES = [
    "template.yaml",
    "serverless.yml",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "infra").glob("*.y*ml")),
]
CERTIFICATE = "arn:aws:acm:us-east-1:123456789012:certificate/0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b"
GRPC_NAME = "gpu.internal.example"


@cache
def _cfn_templates() -> dict[str, dict[str, Any]]:
    """Every CloudFormation template of the repository by path (serverless.yml's resources
    are infra/serverless-resources.yml)."""
    templates = {
        path: load_cfn(ROOT / path)
        for path in TEMPLATE_FILES
        if path.endswith(".yaml") and path != "infra/serverless-extensions.yml"
    }
    resources = yaml.safe_load((ROOT / "infra/serverless-resources.yml").read_text())
    templates["infra/serverless-resources.yml"] = {"Resources": resources}
    return templates


# --- 1. Amazon Linux 2023 GPU AMIs -------------------------------------------------------
# ECS: https://docs.aws.amazon.com/AmazonECS/latest/developerguide/retrieve-ecs-optimized_AMI.html
# Batch: https://docs.aws.amazon.com/batch/latest/userguide/ecs-migration-2023.html
AL2_AMI = re.compile(r"amazon-linux-2(?!023)|\b(?:ECS|EKS)_AL2(?!023)\w*|amzn2-ami")
AL2023_GPU_PARAMETER = "/aws/service/ecs/optimized-ami/amazon-linux-2023/gpu/recommended/image_id"


@pytest.mark.parametrize("path", TEMPLATE_FILES)
def test_no_template_names_an_amazon_linux_2_ami(path: str) -> None:
    # GIVEN a template of either form WHEN it is read THEN no AL2 AMI or image type remains
    text = (ROOT / path).read_text(encoding="utf-8")
    assert [m.group(0) for m in AL2_AMI.finditer(text)] == []


def test_gpu_hosts_boot_the_al2023_gpu_images() -> None:
    d = deploy()
    # GIVEN the GPU service's stack THEN its AMI is the ECS-optimized AL2023 GPU one
    assert d.gpu.template["Parameters"]["GpuAmiId"]["Default"] == AL2023_GPU_PARAMETER
    # AND every Batch compute environment asks Batch for its AL2023 GPU image
    environments = [
        d.batch.resolve(r["Properties"]["ComputeResources"]["Ec2Configuration"])
        for r in d.batch.resources.values()
        if r["Type"] == "AWS::Batch::ComputeEnvironment"
    ]
    assert environments == [[{"ImageType": "ECS_AL2023_NVIDIA"}]] * 2


@pytest.mark.parametrize(("stack", "logical"), [("gpu", "LaunchTemplate"),
                                                ("batch", "LaunchTemplate")])  # fmt: skip
def test_user_data_uses_nothing_al2023_lacks(stack: str, logical: str) -> None:
    # GIVEN a GPU host's user data THEN it only writes the ECS agent's config and folders:
    # no yum or amazon-linux-extras (AL2023 has dnf and no extras)
    user_data = str(getattr(deploy(), stack).properties(logical)["LaunchTemplateData"]["UserData"])
    assert "/etc/ecs/ecs.config" in user_data
    assert re.findall(r"\b(yum|amazon-linux-extras)\b", user_data) == []


# --- 2. inline egress ------------------------------------------------------------------------
# A group created without SecurityGroupEgress keeps EC2's allow-all egress rule; separate
# AWS::EC2::SecurityGroupEgress resources only add to it:
# https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-resource-ec2-securitygroup.html
WIDE_OPEN_ALLOWED: dict[str, str] = {}
"""Groups allowed all protocols to 0.0.0.0/0, with why (none)."""


def _gpu_variants() -> list[Stack]:
    gpu = deploy().gpu
    return [gpu, gpu.with_parameters(GrpcCertificateArn=CERTIFICATE, GrpcDomainName=GRPC_NAME)]


@pytest.mark.parametrize("path", sorted(_cfn_templates()))
def test_every_security_group_lists_its_egress_inline(path: str) -> None:
    resources = _cfn_templates()[path]["Resources"]
    groups = {k: r for k, r in resources.items() if r["Type"] == "AWS::EC2::SecurityGroup"}
    # GIVEN a template THEN every group it creates has inline egress (no allow-all default)
    for logical, group in groups.items():
        egress = group["Properties"].get("SecurityGroupEgress")
        assert egress, f"{path}: {logical} keeps EC2's allow-all egress"
        # AND no rule opens every protocol to the internet unless said why
        for rule in egress:
            wide = rule.get("CidrIp") == "0.0.0.0/0" and str(rule.get("IpProtocol")) == "-1"
            assert not wide or logical in WIDE_OPEN_ALLOWED, f"{path}: {logical} {rule}"
    # AND a standalone egress rule only adds to a group that states its own
    for logical, resource in resources.items():
        if resource["Type"] == "AWS::EC2::SecurityGroupEgress":
            assert resource["Properties"]["GroupId"]["Ref"] in groups, f"{path}: {logical}"


def _rule_key(rule: dict[str, Any], peer: str) -> tuple[str, int, int, str]:
    return str(rule["IpProtocol"]), int(rule["FromPort"]), int(rule["ToPort"]), str(rule[peer])


@pytest.mark.parametrize("gpu", _gpu_variants(), ids=["http", "grpc"])
def test_no_rule_is_both_inline_and_standalone(gpu: Stack) -> None:
    # A rule written twice is one rule in EC2: CloudFormation ignores the duplicate, and
    # deleting either copy revokes both (cloudformation-coverage-roadmap#1534); moving a
    # rule between the two forms on an existing stack loses it the same way.
    for logical, resource in gpu.resources.items():
        kind = resource["Type"]
        if kind not in ("AWS::EC2::SecurityGroupEgress", "AWS::EC2::SecurityGroupIngress"):
            continue
        if not gpu.included(logical):
            continue
        rule = gpu.properties(logical)
        inbound = kind.endswith("Ingress")
        peer = "SourceSecurityGroupId" if inbound else "DestinationSecurityGroupId"
        groups = {gpu.ref(g): g for g, r in gpu.resources.items()
                  if r["Type"] == "AWS::EC2::SecurityGroup"}  # fmt: skip
        group = groups[rule["GroupId"]]
        direction = "SecurityGroupIngress" if inbound else "SecurityGroupEgress"
        inline = gpu.properties(group).get(direction, [])
        keys = {_rule_key(r, peer) for r in inline if peer in r}
        assert _rule_key(rule, peer) not in keys, f"{logical} repeats a rule of {group}"


LOOPBACK = "127.0.0.1/32"
"""An inline rule to the loopback reaches nothing: CloudFormation's way to drop EC2's
allow-all default from a group whose real destinations are standalone rules."""


def _egress(gpu: Stack, group: str) -> list[tuple[str, int, int, str]]:
    """What ``group`` may reach: its inline rules (but the loopback) and standalone ones."""
    inline = gpu.properties(group)["SecurityGroupEgress"]
    standalone = [gpu.properties(k) for k, r in gpu.resources.items()
                  if r["Type"] == "AWS::EC2::SecurityGroupEgress" and gpu.included(k)
                  and gpu.properties(k)["GroupId"] == gpu.ref(group)]  # fmt: skip
    return sorted(
        (str(r["IpProtocol"]), int(r["FromPort"]), int(r["ToPort"]),
         r.get("DestinationSecurityGroupId") or r["CidrIp"])
        for r in [*inline, *standalone] if r.get("CidrIp") != LOOPBACK
    )  # fmt: skip


@pytest.mark.parametrize("gpu", _gpu_variants(), ids=["http", "grpc"])
def test_the_alb_reaches_the_gpu_targets_ports_and_nothing_else(gpu: Stack) -> None:
    alb, task = gpu.ref("AlbSecurityGroup"), gpu.ref("TaskSecurityGroup")
    targets = sorted(
        int(gpu.properties(logical)["Port"])
        for logical, r in gpu.resources.items()
        if r["Type"] == "AWS::ElasticLoadBalancingV2::TargetGroup" and gpu.included(logical)
    )
    # WHEN the ALB's group is created THEN it reaches the targets' ports on the tasks' group
    assert _egress(gpu, "AlbSecurityGroup") == [("tcp", port, port, task) for port in targets]
    # AND its inline egress replaced EC2's allow-all rule with one that reaches nothing
    inline = gpu.properties("AlbSecurityGroup")["SecurityGroupEgress"]
    assert [(r["IpProtocol"], r["CidrIp"]) for r in inline] == [("-1", LOOPBACK)]
    # AND the tasks' group admits exactly those ports, from the ALB's group alone
    ingress = [*gpu.properties("TaskSecurityGroup")["SecurityGroupIngress"],
               *(gpu.properties(k) for k, r in gpu.resources.items()
                 if r["Type"] == "AWS::EC2::SecurityGroupIngress" and gpu.included(k)
                 and gpu.properties(k)["GroupId"] == task)]  # fmt: skip
    assert sorted((int(r["FromPort"]), r["SourceSecurityGroupId"]) for r in ingress) == [
        (port, alb) for port in targets
    ]


# Security group and rule descriptions: a-z, A-Z, 0-9, spaces and ._-:/()#,@[]+=;{}!$*
# https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_UserIdGroupPair.html
# https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_IpRange.html
EC2_DESCRIPTION = re.compile(r"^[a-zA-Z0-9 ._\-:/()#,@\[\]+=;{}!$*]{0,255}$")
_SG_TYPES = ("AWS::EC2::SecurityGroup", "AWS::EC2::SecurityGroupIngress",
             "AWS::EC2::SecurityGroupEgress")  # fmt: skip


def _descriptions(value: Any) -> list[Any]:
    if isinstance(value, dict):
        found = [v for k, v in value.items() if k in ("Description", "GroupDescription")]
        return found + [d for v in value.values() for d in _descriptions(v)]
    if isinstance(value, list):
        return [d for v in value for d in _descriptions(v)]
    return []


@pytest.mark.parametrize("path", sorted(_cfn_templates()))
def test_security_group_descriptions_use_ec2s_characters(path: str) -> None:
    resources = _cfn_templates()[path]["Resources"]
    texts = [d for r in resources.values() if r["Type"] in _SG_TYPES
             for d in _descriptions(r.get("Properties", {}))]  # fmt: skip
    # GIVEN a template's security groups and rules THEN EC2 accepts every description
    # (an apostrophe, as in "service's", fails the stack at creation)
    assert [t for t in texts if not isinstance(t, str) or not EC2_DESCRIPTION.match(t)] == []


def test_both_forms_put_their_vpc_functions_in_the_gpu_stacks_client_group() -> None:
    d = deploy()
    client = d.gpu.ref("ClientSecurityGroup")
    sam = {
        logical: d.sam.properties(logical)["VpcConfig"]["SecurityGroupIds"]
        for logical, r in d.sam.resources.items()
        if r["Type"] == "AWS::Serverless::Function" and "VpcConfig" in r["Properties"]
    }
    sls = {
        key: d.sls.resolve(function["vpc"]["securityGroupIds"])
        for key, function in serverless_config()["functions"].items()
        if "vpc" in function
    }
    # GIVEN either form THEN its functions in the VPC use the group whose egress is inline
    assert set(sam) == {"RouterFunction", "WebSocketFunction"}
    assert set(sls) == {"router", "websocket"}
    assert {str(g) for g in [*sam.values(), *sls.values()]} == {str([client])}


# --- 3. the gRPC door and its private name -------------------------------------------------
GRPC_DNS = ("GrpcHostedZone", "GrpcRecord")


@pytest.mark.parametrize(
    ("certificate", "name", "listener", "zone"),
    [("", "", False, False), ("", GRPC_NAME, False, False),
     (CERTIFICATE, "", True, False), (CERTIFICATE, GRPC_NAME, True, True)],
)  # fmt: skip
def test_the_grpc_name_exists_only_with_its_listener(
    certificate: str, name: str, listener: bool, zone: bool
) -> None:
    # GIVEN the GPU stack with or without a certificate and a name
    gpu = deploy().gpu.with_parameters(GrpcCertificateArn=certificate, GrpcDomainName=name)
    # THEN the listener follows the certificate, the zone and record follow both
    assert gpu.included("GrpcListener") is listener
    assert [gpu.included(logical) for logical in GRPC_DNS] == [zone, zone]


def test_the_private_zone_names_the_alb_inside_the_vpc() -> None:
    d = deploy()
    gpu = d.gpu.with_parameters(GrpcCertificateArn=CERTIFICATE, GrpcDomainName=GRPC_NAME)
    zone = gpu.properties("GrpcHostedZone")
    # GIVEN the name THEN a private zone of that name is associated with the stacks' VPC
    assert zone["Name"] == GRPC_NAME
    assert zone["VPCs"] == [{"VPCId": d.network.ref("Vpc"), "VPCRegion": "us-east-1"}]
    # AND its apex is an alias of the internal ALB (raw: the zone ID attribute is AWS's)
    record = gpu.resources["GrpcRecord"]["Properties"]
    assert (gpu.resolve(record["Name"]), record["Type"]) == (GRPC_NAME, "A")
    assert record["HostedZoneId"] == {"Ref": "GrpcHostedZone"}
    assert record["AliasTarget"]["DNSName"] == {"Fn::GetAtt": ["LoadBalancer", "DNSName"]}
    assert record["AliasTarget"]["HostedZoneId"] == {
        "Fn::GetAtt": ["LoadBalancer", "CanonicalHostedZoneID"]
    }
    # AND clients are told to dial that name
    assert gpu.resolve(gpu.template["Outputs"]["GrpcAddress"]["Value"]) == f"{GRPC_NAME}:8001"


def test_the_guides_say_the_grpc_door_is_off_and_how_to_open_it() -> None:
    for guide in ("docs/deploy.md", "docs/gpu-service.md"):
        text = (ROOT / guide).read_text(encoding="utf-8")
        assert "GrpcCertificateArn" in text, guide
        assert "GrpcDomainName" in text, guide
    assert "gRPC door is off by default" in (ROOT / "docs/gpu-service.md").read_text()


# --- 4. WebSocket deployments --------------------------------------------------------------


def test_the_sam_websocket_deployment_id_carries_the_hash_of_what_it_deploys() -> None:
    sam = deploy().sam
    finding = ws_deployment.sam_finding()
    # GIVEN template.yaml THEN its deployment's ID is the hash its content calls for
    assert re.fullmatch(r"WebSocketDeployment[0-9a-f]{8}", str(finding.current))
    assert finding.current == finding.expected
    # AND the stage serves that deployment
    assert sam.properties("WebSocketStage")["DeploymentId"] == sam.ref(finding.expected)


@pytest.mark.parametrize(
    ("logical", "key", "value"),
    [("WebSocketDefaultRoute", "RouteKey", "frame"),
     ("WebSocketIntegration", "TimeoutInMillis", 10000),
     ("WebSocketConnectRoute", "AuthorizationType", "NONE"),
     ("WebSocketStage", "DefaultRouteSettings", {"ThrottlingRateLimit": 1})],
)  # fmt: skip
def test_a_change_to_what_is_deployed_changes_the_id(logical: str, key: str, value: Any) -> None:
    template = load_cfn(ROOT / "template.yaml")
    deployment, part = ws_deployment.sam_deployed_part(template)
    before = ws_deployment.digest(part)
    # WHEN a route, the integration or the stage's route settings change
    template["Resources"][logical]["Properties"][key] = value
    after = ws_deployment.sam_deployed_part(template)
    # THEN the deployment's content hash changes (so would its ID)
    assert after[0] == deployment
    assert ws_deployment.digest(after[1]) != before


def _copy(tmp_path: Path) -> Path:
    for path in (ws_deployment.SAM_TEMPLATE, ws_deployment.SLS_CONFIG,
                 ws_deployment.SLS_EXTENSIONS):  # fmt: skip
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    return tmp_path


def test_check_names_the_fix_and_fix_makes_check_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _copy(tmp_path)
    template = root / ws_deployment.SAM_TEMPLATE
    extensions = root / ws_deployment.SLS_EXTENSIONS
    # GIVEN a route changed in SAM and an extension changed for Serverless
    text = template.read_text().replace("RouteKey: $default", "RouteKey: frame")
    template.write_text(text)
    extensions.write_text(extensions.read_text().replace("ApiKeyRequired: true",
                                                         "ApiKeyRequired: false"))  # fmt: skip
    # WHEN checked THEN it fails and says the command that fixes it, for both forms
    assert ws_deployment.main(["--check", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.count(ws_deployment.FIX_COMMAND) == 2
    # WHEN fixed THEN the IDs (the stage's reference too) follow and the check passes
    assert ws_deployment.main(["--fix", "--root", str(root)]) == 0
    assert ws_deployment.main(["--check", "--root", str(root)]) == 0
    fixed = load_cfn(template)["Resources"]
    deployment = ws_deployment.sam_finding(root).current
    assert fixed["WebSocketStage"]["Properties"]["DeploymentId"] == {"Ref": deployment}
    assert deployment != ws_deployment.sam_finding().current


def test_the_serverless_description_carries_the_extensions_hash() -> None:
    # GIVEN serverless.yml THEN its WebSocket description ends with the extensions' hash,
    # which v3 hashes into its deployment's ID (it merges the extensions after hashing)
    finding = ws_deployment.sls_finding()
    assert finding.current == finding.expected
    description = serverless_config()["provider"]["websocketsDescription"]
    assert description.endswith(f" Extensions {finding.expected}.")


def test_the_packaged_serverless_stage_serves_a_deployment_named_by_content() -> None:
    packaged = os.environ.get("SPILLWAY_SLS_PACKAGED")
    if not packaged:
        pytest.skip("set by scripts/check_infra.sh after `serverless package`")
    resources = deploy().packaged.template["Resources"]  # type: ignore[union-attr]
    deployments = [k for k, r in resources.items() if r["Type"] == "AWS::ApiGatewayV2::Deployment"]
    # GIVEN what `serverless package` wrote THEN one deployment, named by v3's content hash
    (deployment,) = deployments
    assert re.fullmatch(r"WebsocketsDeployment[0-9A-Za-z]{20,}", deployment), deployment
    stage = resources["WebsocketsDeploymentStage"]["Properties"]
    assert stage["DeploymentId"] == {"Ref": deployment}
    # AND the API it hashed carries the extensions' hash
    finding = ws_deployment.sls_finding()
    api = resources["WebsocketsApi"]["Properties"]
    assert api["Description"].endswith(f" Extensions {finding.expected}.")


# --- 5. idle cost ----------------------------------------------------------------------------
BILLED_AT_IDLE = {
    "AWS::EC2::NatGateway",
    "AWS::EC2::EIP",
    "AWS::ElasticLoadBalancingV2::LoadBalancer",
    "AWS::AutoScaling::AutoScalingGroup",
    "AWS::ECS::Cluster",
    "AWS::KMS::Key",
    "AWS::SecretsManager::Secret",
    "AWS::Route53::HostedZone",
    "AWS::CloudWatch::Dashboard",
    "AWS::CloudWatch::Alarm",
    "AWS::CloudWatch::CompositeAlarm",
    "AWS::Logs::LogGroup",
    "AWS::ECR::Repository",
    "AWS::S3::Bucket",
    "AWS::DynamoDB::Table",
}
"""Types that cost money while nothing happens (by the hour, by the month, at rest)."""


@cache
def _resource_types() -> frozenset[str]:
    types = {
        r["Type"] for template in _cfn_templates().values() for r in template["Resources"].values()
    }
    for generated in ("build/checks/template.translated.json",
                      ".serverless/cloudformation-template-update-stack.json"):  # fmt: skip
        if (ROOT / generated).exists():  # after `make check-infra`
            types |= {r["Type"] for r in load_cfn(ROOT / generated)["Resources"].values()}
    return frozenset(types)


def _priced_types() -> set[str]:
    return {t for shape in SHAPES for line in model.lines(shape) for t in line.types}


def test_the_deploy_guide_shows_the_generators_idle_cost() -> None:
    text = (ROOT / "docs/deploy.md").read_text(encoding="utf-8")
    # GIVEN docs/deploy.md THEN between its markers is exactly what the generator writes
    assert report.replace_between_markers(text, report.render()) == text
    assert text.count(report.BEGIN) == text.count(report.END) == 1


def test_every_resource_type_is_priced_or_free_at_idle() -> None:
    priced, free = _priced_types(), set(model.FREE_AT_IDLE)
    # GIVEN every type the templates (and what SAM and v3 generate) use
    # THEN each has a price line or a reason it costs nothing at idle, not both
    assert sorted(_resource_types() - priced - free) == []
    assert priced & free == set()
    assert all(model.FREE_AT_IDLE.values())
    # AND every type known to bill at idle that the templates use has a price line
    assert sorted((BILLED_AT_IDLE & _resource_types()) - priced) == []


def test_every_price_names_its_page_and_the_day_it_was_taken() -> None:
    constants = [v for v in vars(prices).values() if isinstance(v, prices.Price)]
    constants += list(prices.EC2_ON_DEMAND_HOUR.values())
    assert len(constants) > 20
    assert {p.page.startswith("https://aws.amazon.com/") and "pricing" in p.page
            for p in constants} == {True}  # fmt: skip
    assert prices.TAKEN_ON.year >= 2026
    assert prices.REGION == "us-east-1"


def test_idle_cost_counts_what_the_recount_found() -> None:
    # GIVEN the default shapes WHEN their idle lines are computed
    on = {line.item: line for line in model.lines(Shape("SAM", 1))}
    off = {line.item: line for line in model.lines(Shape("Serverless", 0))}

    def usd(column: dict[str, model.Line], start: str) -> float:
        (line,) = [line for item, line in column.items() if item.startswith(start)]
        return round(line.usd, 2)

    # THEN what the first table missed is there: the NAT gateway's address, Container
    # Insights, detailed monitoring, both secrets and the per-minute drain check
    assert usd(on, "public IPv4 address") == usd(off, "public IPv4 address") == 3.65
    assert usd(on, "Container Insights") > usd(off, "Container Insights") > 0
    assert usd(on, "its EC2 detailed monitoring") == 2.10
    assert usd(off, "its EC2 detailed monitoring") == 0
    assert usd(on, "Secrets Manager secret") == 0.80
    assert usd(off, "scheduled invocations") > 0.10
    # AND the GPU instance is the difference between the shapes
    assert usd(on, "GPU instance") == 734.38
    assert usd(off, "GPU instance") == 0


# --- 6. size rules the router can never see --------------------------------------------------


def _policy(bounds: str) -> str:
    first = f"{{name: big-bodies, match: {{payload_bytes: {bounds}}}, route: gpu}}"
    return f"rules:\n  - {first}\n  - {{name: default, route: gpu}}"


def test_the_example_policy_has_no_size_rule_past_the_cap() -> None:
    policy = parse_policy((ROOT / "policies/example.yaml").read_text(), "example")
    sized = [rule for rule in policy.rules if rule.match.payload_bytes is not None]
    # GIVEN the example THEN its size rules can match a body the router takes
    assert sized
    assert all(r.match.payload_bytes.admits_whole_number(0, SYNC_BODY_BYTES) for r in sized)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "bounds", ["{gt: 5000000}", f"{{ge: {SYNC_BODY_BYTES + 1}}}", f"{{gt: {SYNC_BODY_BYTES}}}",
               "{lt: 0}", "{gt: 10, lt: 11}", "{ge: 10.5, le: 10.9}"],
)  # fmt: skip
def test_a_size_rule_no_body_can_meet_is_refused(bounds: str) -> None:
    # WHEN a policy bounds payload_bytes where no body the router takes lies
    with pytest.raises(PolicyError) as refused:
        parse_policy(_policy(bounds), "policy.yaml")
    # THEN it is refused, naming the rule and the router's cap
    assert "'big-bodies'" in str(refused.value)
    assert f"{SYNC_BODY_BYTES:,}" in str(refused.value)


@pytest.mark.parametrize(
    "bounds", [f"{{ge: {SYNC_BODY_BYTES}}}", f"{{gt: {SYNC_BODY_BYTES - 1}}}",
               "{gt: 1048576}", "{le: 0}", "{gt: 10, lt: 12}", "{ge: 10.5, le: 11}"],
)  # fmt: skip
def test_a_size_rule_some_body_can_meet_is_kept(bounds: str) -> None:
    policy = parse_policy(_policy(bounds), "policy.yaml")
    assert policy.rules[0].match.payload_bytes is not None
