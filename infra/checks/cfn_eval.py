"""Evaluate CloudFormation templates offline, the way CloudFormation resolves them.

Linters check a template's shape; they cannot say which ARN ``!Sub ${Group.Arn}:x``
becomes, or whether an alarm watches the metric a service really emits. This module
resolves intrinsic functions (``Ref``, ``Fn::GetAtt``, ``Fn::Sub``, ``Fn::Join``,
``Fn::ImportValue``, ``Fn::If`` …) for a fixed account, region and partition, with the
return values AWS documents for each resource type (a log group's ``Arn`` ends in ``:*``,
a bucket's is ``arn:aws:s3:::NAME``, an SQS queue's ``Ref`` is its URL …), so tests can
compare what a deployed stack would really contain. Stacks are linked by their exports,
as ``Fn::ImportValue`` is at deploy time.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ACCOUNT = "123456789012"
REGION = "us-east-1"
PARTITION = "aws"
URL_SUFFIX = "amazonaws.com"
PSEUDO = {
    "AWS::AccountId": ACCOUNT,
    "AWS::Region": REGION,
    "AWS::Partition": PARTITION,
    "AWS::URLSuffix": URL_SUFFIX,
}


class _NoValue:
    """``Ref: AWS::NoValue``: the property (or list item) disappears."""


NO_VALUE = _NoValue()


class _CfnLoader(yaml.SafeLoader):
    """Safe YAML loader that turns CloudFormation short tags into their long form."""


def _tag(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    name = "Ref" if suffix == "Ref" else f"Fn::{suffix}"
    if isinstance(node, yaml.ScalarNode):
        value: Any = loader.construct_scalar(node)
        if suffix == "GetAtt":
            value = value.split(".", 1)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)  # type: ignore[arg-type]
    return {name: value}


_CfnLoader.add_multi_constructor("!", _tag)


def load_cfn(path: Path) -> dict[str, Any]:
    """A CloudFormation/SAM YAML template with intrinsic functions in long form."""
    data: dict[str, Any] = yaml.load(path.read_text(encoding="utf-8"), Loader=_CfnLoader)  # noqa: S506
    return data


def _suffix(*parts: str) -> str:
    """The random-looking suffix CloudFormation appends to generated names (stable here)."""
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:12].upper()


def arn(service: str, resource: str, *, region: str = REGION, account: str = ACCOUNT) -> str:
    """``arn:aws:<service>:<region>:<account>:<resource>``."""
    return f"arn:{PARTITION}:{service}:{region}:{account}:{resource}"


# --- what Ref and Fn::GetAtt return, per resource type ---------------------------------

# The property that names a resource, where the template may set it.
NAME_PROPERTIES = {
    "AWS::Logs::LogGroup": "LogGroupName",
    "AWS::S3::Bucket": "BucketName",
    "AWS::DynamoDB::Table": "TableName",
    "AWS::SQS::Queue": "QueueName",
    "AWS::SSM::Parameter": "Name",
    "AWS::Lambda::Function": "FunctionName",
    "AWS::Serverless::Function": "FunctionName",
    "AWS::StepFunctions::StateMachine": "StateMachineName",
    "AWS::Serverless::StateMachine": "Name",
    "AWS::ECR::Repository": "RepositoryName",
    "AWS::SecretsManager::Secret": "Name",
    "AWS::Batch::JobQueue": "JobQueueName",
    "AWS::Batch::JobDefinition": "JobDefinitionName",
    "AWS::ECS::Cluster": "ClusterName",
    "AWS::ECS::Service": "ServiceName",
    "AWS::SNS::Topic": "TopicName",
    "AWS::IAM::Role": "RoleName",
    "AWS::CloudWatch::Alarm": "AlarmName",
    "AWS::CloudWatch::CompositeAlarm": "AlarmName",
    "AWS::ApplicationAutoScaling::ScalingPolicy": "PolicyName",
}
# Generated names that AWS requires in lower case.
_LOWER_CASE = {"AWS::S3::Bucket", "AWS::ECR::Repository"}


@dataclass(frozen=True)
class Identity:
    """What a resource resolves to: its ``Ref``, its attributes, and the ARNs IAM sees."""

    ref: str
    attributes: Mapping[str, str] = field(default_factory=dict)
    # ARNs a request on this resource is authorised against (for IAM checks)…
    arns: tuple[str, ...] = ()
    # …and prefixes under which its sub-resources live (objects of a bucket, versions of a
    # function), any ARN beginning with one being one of its own.
    children: tuple[str, ...] = ()


# The documented Ref/GetAtt values of each resource type the stacks use (name, logical ID).
_IDENTITIES: dict[str, Callable[[str, str], Identity]] = {
    "AWS::Logs::LogGroup": lambda name, logical: Identity(
        name,
        {"Arn": arn("logs", f"log-group:{name}:*")},
        arns=(
            arn("logs", f"log-group:{name}"),
            arn("logs", f"log-group:{name}:log-stream:"),
            arn("logs", f"log-group:{name}:log-stream:sample"),
        ),
    ),
    "AWS::S3::Bucket": lambda name, logical: Identity(
        name,
        {"Arn": f"arn:{PARTITION}:s3:::{name}", "DomainName": f"{name}.s3.{URL_SUFFIX}"},
        arns=(f"arn:{PARTITION}:s3:::{name}",),
        children=(f"arn:{PARTITION}:s3:::{name}/",),
    ),
    "AWS::DynamoDB::Table": lambda name, logical: Identity(
        name,
        {"Arn": arn("dynamodb", f"table/{name}")},
        arns=(arn("dynamodb", f"table/{name}"),),
        children=(arn("dynamodb", f"table/{name}/"),),
    ),
    "AWS::SQS::Queue": lambda name, logical: Identity(
        f"https://sqs.{REGION}.{URL_SUFFIX}/{ACCOUNT}/{name}",
        {
            "Arn": arn("sqs", name),
            "QueueName": name,
            "QueueUrl": f"https://sqs.{REGION}.{URL_SUFFIX}/{ACCOUNT}/{name}",
        },
        arns=(arn("sqs", name),),
    ),
    "AWS::SSM::Parameter": lambda name, logical: Identity(
        name, {}, arns=(arn("ssm", "parameter" + ("" if name.startswith("/") else "/") + name),)
    ),
    "AWS::ApiGateway::RestApi": lambda name, logical: _rest_api(logical),
    "AWS::Serverless::Api": lambda name, logical: _rest_api(logical),
    # A WebSocket API's Ref is its ID too; its stages' @connections live under it.
    "AWS::ApiGatewayV2::Api": lambda name, logical: _rest_api(logical),
    "AWS::Lambda::Function": lambda name, logical: _function(name),
    "AWS::Serverless::Function": lambda name, logical: _function(name),
    # Ref is the ARN; its executions are execution:NAME:EXECUTION.
    "AWS::StepFunctions::StateMachine": lambda name, logical: _state_machine(name),
    "AWS::Serverless::StateMachine": lambda name, logical: _state_machine(name),
    # Ref is the mapping's UUID; IAM names it event-source-mapping:UUID.
    "AWS::Lambda::EventSourceMapping": lambda name, logical: Identity(
        _key_id(name), arns=(arn("lambda", f"event-source-mapping:{_key_id(name)}"),)
    ),
    "AWS::KMS::Key": lambda name, logical: Identity(
        _key_id(logical),
        {"Arn": arn("kms", f"key/{_key_id(logical)}"), "KeyId": _key_id(logical)},
        arns=(arn("kms", f"key/{_key_id(logical)}"),),
    ),
    "AWS::ECR::Repository": lambda name, logical: Identity(
        name,
        {
            "Arn": arn("ecr", f"repository/{name}"),
            "RepositoryUri": f"{ACCOUNT}.dkr.ecr.{REGION}.{URL_SUFFIX}/{name}",
        },
        arns=(arn("ecr", f"repository/{name}"),),
    ),
    "AWS::SecretsManager::Secret": lambda name, logical: Identity(
        arn("secretsmanager", f"secret:{name}-AbC123"),
        arns=(arn("secretsmanager", f"secret:{name}-AbC123"),),
    ),
    "AWS::Batch::JobQueue": lambda name, logical: Identity(
        arn("batch", f"job-queue/{name}"),
        {"JobQueueArn": arn("batch", f"job-queue/{name}")},
        arns=(arn("batch", f"job-queue/{name}"),),
    ),
    "AWS::Batch::JobDefinition": lambda name, logical: Identity(
        arn("batch", f"job-definition/{name}:1"),
        arns=(arn("batch", f"job-definition/{name}"),),
        children=(arn("batch", f"job-definition/{name}:"),),
    ),
    "AWS::SNS::Topic": lambda name, logical: Identity(
        arn("sns", name),
        {"TopicName": name, "TopicArn": arn("sns", name)},
        arns=(arn("sns", name),),
    ),
    "AWS::IAM::Role": lambda name, logical: Identity(
        name, {"Arn": f"arn:{PARTITION}:iam::{ACCOUNT}:role/{name}", "RoleId": _suffix(name)}
    ),
    "AWS::IAM::InstanceProfile": lambda name, logical: Identity(
        name, {"Arn": f"arn:{PARTITION}:iam::{ACCOUNT}:instance-profile/{name}"}
    ),
    "AWS::ECS::Cluster": lambda name, logical: Identity(
        name, {"Arn": arn("ecs", f"cluster/{name}")}
    ),
    "AWS::ECS::Service": lambda name, logical: Identity(
        arn("ecs", f"service/cluster/{name}"), {"Name": name}
    ),
    "AWS::CloudWatch::Alarm": lambda name, logical: Identity(
        name, {"Arn": arn("cloudwatch", f"alarm:{name}")}
    ),
    "AWS::CloudWatch::CompositeAlarm": lambda name, logical: Identity(
        name, {"Arn": arn("cloudwatch", f"alarm:{name}")}
    ),
    "AWS::ElasticLoadBalancingV2::LoadBalancer": lambda name, logical: Identity(
        arn("elasticloadbalancing", f"loadbalancer/app/{name[:20]}/{_suffix(name)}"),
        {
            "LoadBalancerFullName": f"app/{name[:20]}/{_suffix(name)}",
            "DNSName": f"internal-{name[:20]}.{REGION}.elb.{URL_SUFFIX}",
        },
    ),
    "AWS::ElasticLoadBalancingV2::TargetGroup": lambda name, logical: Identity(
        arn("elasticloadbalancing", f"targetgroup/{name[:20]}/{_suffix(name)}"),
        {"TargetGroupFullName": f"targetgroup/{name[:20]}/{_suffix(name)}"},
    ),
    "AWS::ApplicationAutoScaling::ScalingPolicy": lambda name, logical: Identity(
        arn("autoscaling", f"scalingPolicy:{_suffix(name)}:resource/ecs:policyName/{name}")
    ),
}


def _identity(kind: str, name: str, logical: str) -> Identity:
    """What ``Ref`` and ``Fn::GetAtt`` of a resource of ``kind`` return (``Ref`` alone,
    the name, for types no check needs more of)."""
    build = _IDENTITIES.get(kind)
    return build(name, logical) if build else Identity(name)


def _rest_api(logical: str) -> Identity:
    """A REST API: its ID, and its stages and routes (``execute-api``) as children."""
    api_id = _suffix(logical)[:10].lower()
    return Identity(api_id, {"RootResourceId": _suffix(logical, "root")[:10].lower()},
                    children=(arn("execute-api", f"{api_id}/"),))  # fmt: skip


def _function(name: str) -> Identity:
    function_arn = arn("lambda", f"function:{name}")
    return Identity(
        name, {"Arn": function_arn}, arns=(function_arn,), children=(f"{function_arn}:",)
    )


def _state_machine(name: str) -> Identity:
    machine = arn("states", f"stateMachine:{name}")
    return Identity(
        machine,
        {"Arn": machine, "Name": name},
        arns=(machine,),
        children=(arn("states", f"execution:{name}:"),),
    )


def _key_id(logical: str) -> str:
    digest = hashlib.sha256(logical.encode()).hexdigest()
    return f"{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


# --- a stack -----------------------------------------------------------------------------

SSM_PREFIX = "ssm:"
"""How ``Exports`` keys a parameter-store value a stack wrote (``ssm:<name>``)."""
_SUB_VARIABLE = re.compile(r"\$\{([^}]*)\}")


@dataclass
class Stack:
    """A template deployed under ``name`` with ``parameters``, importing ``exports``."""

    name: str
    template: dict[str, Any]
    parameters: Mapping[str, Any] = field(default_factory=dict)
    exports: Mapping[str, tuple[Stack, Any]] = field(default_factory=dict)

    @property
    def resources(self) -> dict[str, Any]:
        """The template's resources by logical ID."""
        resources: dict[str, Any] = self.template.get("Resources", {})
        return resources

    def with_parameters(self, **overrides: Any) -> Stack:
        """The same template deployed with some parameters changed."""
        return Stack(self.name, self.template, {**self.parameters, **overrides}, self.exports)

    def properties(self, logical: str) -> dict[str, Any]:
        """A resource's properties as deployed (intrinsics resolved)."""
        resolved: dict[str, Any] = self.resolve(self.resources[logical].get("Properties", {}))
        return resolved

    def parameter(self, name: str) -> Any:
        """A parameter's value: the override, else the template's default."""
        declared = self.template.get("Parameters", {})[name]
        if name in self.parameters:
            value = self.parameters[name]
        elif "Default" in declared:
            value = declared["Default"]
        else:
            raise KeyError(f"{self.name}: parameter {name} has no default and no value")
        if declared.get("Type") == "CommaDelimitedList" and isinstance(value, str):
            return value.split(",")
        if str(declared.get("Type", "")).startswith("AWS::SSM::Parameter::Value<"):
            # CloudFormation reads the parameter store at each create and update: a value a
            # deployed stack wrote there (its AWS::SSM::Parameter) is what this one gets.
            published = self.exports.get(f"{SSM_PREFIX}{value}")
            if published is not None:
                producer, expression = published
                return str(producer.resolve(expression))
        return value if isinstance(value, list) else str(value)

    def condition(self, name: str) -> bool:
        """A condition's value at these parameters."""
        return bool(self._condition(self.template["Conditions"][name]))

    def _condition(self, expression: Any) -> Any:
        if isinstance(expression, dict) and len(expression) == 1:
            (function, args), = expression.items()  # fmt: skip
            if function == "Fn::Equals":
                left, right = (self.resolve(arg) for arg in args)
                return str(left) == str(right)
            if function == "Fn::Not":
                return not self._condition(args[0])
            if function == "Fn::And":
                return all(self._condition(arg) for arg in args)
            if function == "Fn::Or":
                return any(self._condition(arg) for arg in args)
            if function == "Condition":
                return self.condition(args)
        return self.resolve(expression)

    def included(self, logical: str) -> bool:
        """Whether a resource exists at these parameters (its ``Condition`` holds)."""
        condition = self.resources[logical].get("Condition")
        return condition is None or self.condition(condition)

    def physical_name(self, logical: str) -> str:
        """The resource's name: the one the template sets, else a generated one."""
        resource = self.resources[logical]
        kind = resource["Type"]
        prop = NAME_PROPERTIES.get(kind)
        given = (resource.get("Properties") or {}).get(prop) if prop else None
        if given is not None:
            return str(self.resolve(given))
        generated = f"{self.name}-{logical}-{_suffix(self.name, logical)}"
        return generated.lower() if kind in _LOWER_CASE else generated

    def identity(self, logical: str) -> Identity:
        """What ``Ref`` and ``Fn::GetAtt`` return for a resource of this stack."""
        if logical not in self.resources:
            raise KeyError(f"{self.name}: no resource {logical}")
        kind = self.resources[logical]["Type"]
        return _identity(kind, self.physical_name(logical), logical)

    def ref(self, name: str) -> Any:
        """``Ref``: a pseudo parameter, a parameter, or a resource's ``Ref`` value."""
        if name == "AWS::StackName":
            return self.name
        if name == "AWS::NoValue":
            return NO_VALUE
        if name in PSEUDO:
            return PSEUDO[name]
        if name in self.template.get("Parameters", {}):
            return self.parameter(name)
        if "." in name:  # SAM's <Function>.Alias / <Function>.Version
            logical, what = name.split(".", 1)
            function_arn = self.identity(logical).attributes["Arn"]
            return f"{function_arn}:live" if what == "Alias" else f"{function_arn}:1"
        return self.identity(name).ref

    def get_att(self, logical: str, attribute: str) -> str:
        """``Fn::GetAtt``."""
        attributes = self.identity(logical).attributes
        if attribute not in attributes:
            raise KeyError(f"{self.name}: {logical} has no modelled attribute {attribute}")
        return attributes[attribute]

    def resolve(self, value: Any) -> Any:
        """``value`` with every intrinsic function evaluated."""
        if isinstance(value, list):
            items = [self.resolve(item) for item in value]
            return [item for item in items if item is not NO_VALUE]
        if not isinstance(value, dict):
            return value
        if len(value) == 1:
            (key, args), = value.items()  # fmt: skip
            if key == "Ref" or key.startswith("Fn::"):
                return self._function(key, args)
        resolved = {key: self.resolve(item) for key, item in value.items()}
        return {key: item for key, item in resolved.items() if item is not NO_VALUE}

    def _function(self, key: str, args: Any) -> Any:
        if key == "Ref":
            return self.ref(args)
        if key == "Fn::GetAtt":
            logical, attribute = args if isinstance(args, list) else args.split(".", 1)
            return self.get_att(logical, attribute)
        if key == "Fn::Sub":
            return self._sub(args)
        if key == "Fn::Join":
            separator, items = args
            return separator.join(str(item) for item in self.resolve(items))
        if key == "Fn::Split":
            separator, text = args
            return str(self.resolve(text)).split(separator)
        if key == "Fn::Select":
            index, items = args
            return self.resolve(items)[int(self.resolve(index))]
        if key == "Fn::ImportValue":
            name = self.resolve(args)
            if name not in self.exports:
                raise KeyError(f"{self.name}: no deployed stack exports {name}")
            producer, expression = self.exports[name]
            return producer.resolve(expression)
        if key == "Fn::If":
            condition, yes, no = args
            return self.resolve(yes if self.condition(condition) else no)
        if key == "Fn::FindInMap":
            mapping, top, second = (str(self.resolve(arg)) for arg in args)
            return self.template["Mappings"][mapping][top][second]
        if key == "Fn::GetAZs":
            return [f"{REGION}a", f"{REGION}b", f"{REGION}c"]
        if key == "Fn::Base64":
            return self.resolve(args)
        if key in ("Fn::Equals", "Fn::Not", "Fn::And", "Fn::Or"):
            return self._condition({key: args})
        raise NotImplementedError(f"{self.name}: {key} is not modelled")

    def _sub(self, args: Any) -> str:
        text, variables = (args, {}) if isinstance(args, str) else args
        values = {name: self.resolve(expression) for name, expression in variables.items()}

        def one(match: re.Match[str]) -> str:
            name = match.group(1)
            if name.startswith("!"):
                return "${" + name[1:] + "}"
            if name in values:
                return str(values[name])
            if "." in name and name.split(".", 1)[0] in self.resources:
                logical, attribute = name.split(".", 1)
                return self.get_att(logical, attribute)
            return str(self.ref(name))

        return _SUB_VARIABLE.sub(one, text)

    def outputs(self) -> dict[str, Any]:
        """Export name → (unresolved) value of every exported output."""
        exported: dict[str, Any] = {}
        for output in self.template.get("Outputs", {}).values():
            if "Export" in output:
                exported[self.resolve(output["Export"]["Name"])] = output["Value"]
        return exported


class Exports(dict[str, tuple[Stack, Any]]):
    """Every export of the stacks deployed so far: what ``Fn::ImportValue`` reads, resolved
    by its producer when a consumer asks."""

    def publish(self, stack: Stack) -> Stack:
        """Add ``stack``'s exports for the stacks deployed after it."""
        for name, expression in stack.outputs().items():
            self[name] = (stack, expression)
        for logical, resource in stack.resources.items():
            if resource.get("Type") == "AWS::SSM::Parameter" and stack.included(logical):
                props = resource["Properties"]
                self[f"{SSM_PREFIX}{stack.resolve(props['Name'])}"] = (stack, props["Value"])
        return stack
