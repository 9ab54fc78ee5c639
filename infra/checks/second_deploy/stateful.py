"""Which resources a second deploy must not replace, and which properties replace them.

A resource is protected when replacing it loses data (``HOLDS_DATA``), breaks what holds
on to it (``HELD_BY_OTHERS``, an exported security group) or cannot happen at all (a
fixed physical name, ``PHYSICAL_NAMES``, unless the type publishes revisions under one
name). CloudFormation replaces a resource when one of its create-only properties changes:
the registry schema's ``createOnlyProperties`` as cfn-lint ships them, plus the few the
reference pages mark "Update requires: Replacement" and the schema does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any

from infra.checks.cfn_eval import NAME_PROPERTIES
from infra.checks.cfn_refs import is_intrinsic, references
from infra.checks.second_deploy.templates import resources

# Types whose replacement or deletion loses data.
HOLDS_DATA = {
    "AWS::DynamoDB::Table": "its items",
    "AWS::S3::Bucket": "its objects",
    "AWS::SQS::Queue": "its messages",
    "AWS::Logs::LogGroup": "its log events",
    "AWS::KMS::Key": "everything encrypted with it",
    "AWS::ECR::Repository": "its images",
    "AWS::SecretsManager::Secret": "its secret value",
}
# Types others hold on to: a replacement breaks them; a condition deleting one (with the
# listener or feature it serves) is that feature switched off.
HELD_BY_OTHERS = {
    "AWS::ElasticLoadBalancingV2::TargetGroup": "its ARN (listener, service, alarms) and targets",
}
# The property that names a resource, beyond those infra.checks.cfn_eval resolves names by.
PHYSICAL_NAMES = {
    **NAME_PROPERTIES,
    "AWS::Events::Rule": "Name",
    "AWS::EC2::SecurityGroup": "GroupName",
    "AWS::EC2::LaunchTemplate": "LaunchTemplateName",
    "AWS::ElasticLoadBalancingV2::LoadBalancer": "Name",
    "AWS::ElasticLoadBalancingV2::TargetGroup": "Name",
    "AWS::AutoScaling::AutoScalingGroup": "AutoScalingGroupName",
    "AWS::Batch::ComputeEnvironment": "ComputeEnvironmentName",
    "AWS::CloudWatch::Dashboard": "DashboardName",
    "AWS::Logs::MetricFilter": "FilterName",
    "AWS::IAM::InstanceProfile": "InstanceProfileName",
    "AWS::KMS::Alias": "AliasName",
    "AWS::ECS::CapacityProvider": "Name",
    "AWS::ApiGateway::ApiKey": "Name",
    "AWS::Route53::HostedZone": "Name",
}
# Named, but a replacement publishes a new revision under the same name (no conflict).
REVISIONED = {
    "AWS::Batch::JobDefinition",
    "AWS::ECS::TaskDefinition",
    "AWS::Lambda::LayerVersion",
    "AWS::Lambda::Version",
}
# "Update requires: Replacement" on the reference page, absent from the registry schema's
# createOnlyProperties (https://docs.aws.amazon.com/AWSCloudFormation/latest/
# TemplateReference/aws-resource-dynamodb-table.html: KeySchema, LocalSecondaryIndexes).
REPLACED_ON_UPDATE = {"AWS::DynamoDB::Table": ("KeySchema", "LocalSecondaryIndexes")}

MISSING = object()
"""``value_at``'s answer for a property the template does not set."""


@cache
def create_only(kind: str) -> tuple[str, ...]:
    """The properties (``A`` or ``A/B``) whose change replaces a resource of ``kind``."""
    # Imported here: the pure parts of this check also serve environments without cfn-lint.
    from cfnlint.schema import PROVIDER_SCHEMA_MANAGER, ResourceNotFoundError

    try:
        schema = PROVIDER_SCHEMA_MANAGER.get_resource_schema("us-east-1", kind).schema
    except ResourceNotFoundError:  # a custom or unknown type: nothing known to be create-only
        schema = {}
    paths = [
        pointer.removeprefix("/properties/").split("/*", 1)[0]
        for pointer in schema.get("createOnlyProperties", [])
    ]
    paths += REPLACED_ON_UPDATE.get(kind, ())
    # A nested property whose parent is create-only too adds nothing.
    return tuple(
        path for path in dict.fromkeys(paths)
        if not any(path.startswith(f"{parent}/") for parent in paths)
    )  # fmt: skip


def value_at(properties: Mapping[str, Any], path: str) -> Any:
    """The value at ``A/B`` as written; an intrinsic or list on the way stands for it all."""
    node: Any = properties
    for part in path.split("/"):
        if not isinstance(node, dict) or is_intrinsic(node):
            return node
        if part not in node:
            return MISSING
        node = node[part]
    return node


def exported_resources(template: Mapping[str, Any]) -> set[str]:
    """The resources whose id or attributes the template exports."""
    found: set[str] = set()
    for spec in template.get("Outputs", {}).values():
        if "Export" in spec:
            found |= references(spec.get("Value"), template).resources
    return found


def protection(template: Mapping[str, Any], logical: str, exported: set[str]) -> str | None:
    """Why a replacement must not happen to this resource, or None."""
    resource = resources(template)[logical]
    kind, properties = resource["Type"], resource.get("Properties") or {}
    if kind in HOLDS_DATA:
        return f"stateful: {HOLDS_DATA[kind]}"
    if kind in HELD_BY_OTHERS:
        return f"stateful: {HELD_BY_OTHERS[kind]}"
    if kind == "AWS::EC2::SecurityGroup" and logical in exported:
        return "its id is exported"
    name = PHYSICAL_NAMES.get(kind)
    if name and name in properties and kind not in REVISIONED:
        return f"named ({name})"
    return None


def loses_data_when_deleted(resource: Mapping[str, Any]) -> bool:
    """Whether deleting the resource (a condition turning false) deletes data."""
    retained = resource.get("DeletionPolicy") in ("Retain", "RetainExceptOnCreate", "Snapshot")
    return resource["Type"] in HOLDS_DATA and not retained
