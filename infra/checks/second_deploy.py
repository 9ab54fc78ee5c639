"""What the second deploy of each stack would replace, delete or refuse, checked offline.

The first deploy creates everything; every later one is an update, and an update can
replace a resource (a new one is created, the old one deleted: a table's items, a bucket's
objects, a log group's events are gone, and a resource with a fixed name cannot be
replaced at all) or be refused (an export another stack imports cannot change). Three
rules, over every template (template.yaml as the SAM translator turns it into
CloudFormation, the infra/ stacks, and the packaged Serverless template):

1. **A parameter change replaces no stateful or named resource.** CloudFormation replaces
   a resource when a create-only property changes (the resource type's registry schema,
   ``createOnlyProperties``, as cfn-lint ships it, plus the few that the reference pages
   mark "Update requires: Replacement" and the schema does not), and creates or deletes it
   when its ``Condition`` flips. A property depends on a parameter through ``Ref``,
   ``Fn::Sub``, ``Fn::If`` and the conditions behind it, ``Fn::ImportValue`` of a name
   built from it, and through any resource the same change replaces. Identity parameters
   (``IDENTITY_PARAMETERS``: another value is another deployment) are exempt.
2. **A template edit replaces no stateful or named resource by accident.** Each such
   resource's create-only values, as written, are locked in ``stateful.lock.json``; a
   changed value, a vanished (or renamed) resource or an unlocked one fails until the lock
   is regenerated on purpose with ``--update``.
3. **An export another template imports never changes with a non-identity parameter**
   (CloudFormation refuses to update an export in use), and every import names an export.
   The exports and their importers are listed in docs/deploy.md ("The second deploy").

Runs in the infra virtual environment (cfn-lint's schemas); template.yaml is translated
with the SAM CLI's environment (``$SAM_VENV``, default .venv-sam)::

    python -m infra.checks.second_deploy               # check; exit 1 on a finding
    python -m infra.checks.second_deploy --update      # re-lock, rewrite the docs tables
    python -m infra.checks.second_deploy --write-docs  # rewrite the docs tables only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from infra.checks.cfn_eval import NAME_PROPERTIES, load_cfn

ROOT = Path(__file__).resolve().parents[2]
SAM_TEMPLATE = "template.yaml"
SLS_TEMPLATE = "serverless.yml (packaged)"
# Every template a deployment uses: the name it is shown (and locked) under, its path.
TEMPLATES = {
    SAM_TEMPLATE: "template.yaml",
    "infra/network.yaml": "infra/network.yaml",
    "infra/storage.yaml": "infra/storage.yaml",
    "infra/ecs-gpu-service.yaml": "infra/ecs-gpu-service.yaml",
    "infra/batch.yaml": "infra/batch.yaml",
    "infra/observability.yaml": "infra/observability.yaml",
    SLS_TEMPLATE: ".serverless/cloudformation-template-update-stack.json",
}
LOCK = "infra/checks/stateful.lock.json"
DOCS = "docs/deploy.md"
UPDATE_COMMAND = ".venv-infra/bin/python -m infra.checks.second_deploy --update"
DOCS_COMMAND = ".venv-infra/bin/python -m infra.checks.second_deploy --write-docs"

# Parameters whose value names the deployment rather than configures it: a new value is a
# new deployment (its resources, names and exports are new on purpose), never an in-place
# change of a running one.
IDENTITY_PARAMETERS = {
    "Stage": "the API stage's name: another stage is another deployment of the API",
    "NetworkStack": "the network stack this one imports from: another value is another network",
    "StorageStack": "the storage stack this one imports from (key, buckets, async queue)",
    "GpuStack": "the GPU-service stack this one imports from (URL, security group)",
    "BatchStack": "the Batch stack this one imports from (job queue and definition)",
    "VpcCidr": (
        "the network's address range, fixed at creation: another range is another network "
        "stack (deploy it under a new name and point NetworkStack at it); CloudFormation "
        "refuses the change in place while the VPC's exports are imported"
    ),
}

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

_SUB_NAME = re.compile(r"\$\{(?!!)([^}]+)\}")
_MISSING = object()


# --- what an expression depends on ------------------------------------------------------


@dataclass
class Refs:
    """The parameters, resources and conditions an expression names."""

    parameters: set[str] = field(default_factory=set)
    resources: set[str] = field(default_factory=set)
    conditions: set[str] = field(default_factory=set)


def references(expression: Any, template: Mapping[str, Any]) -> Refs:
    """What ``expression`` names directly: ``Ref``, ``Fn::GetAtt``, ``Fn::Sub`` variables
    (its own variable map aside), ``Fn::If`` and ``Condition`` (pseudo parameters aside)."""
    refs = Refs()
    _collect(expression, template, refs, frozenset())
    return refs


def _collect(node: Any, template: Mapping[str, Any], refs: Refs, local: frozenset[str]) -> None:
    if isinstance(node, list):
        for item in node:
            _collect(item, template, refs, local)
        return
    if not isinstance(node, dict):
        return
    if len(node) == 1:
        ((key, value),) = node.items()
        if key == "Ref" and isinstance(value, str):
            _name(value, template, refs, local)
            return
        if key == "Fn::GetAtt":
            target = value.split(".", 1)[0] if isinstance(value, str) else value[0]
            _name(str(target), template, refs, local)
            return
        if key == "Fn::Sub":
            text, variables = (value, {}) if isinstance(value, str) else (value[0], value[1])
            _collect(list(variables.values()), template, refs, local)
            for name in _SUB_NAME.findall(text):
                _name(name.split(".", 1)[0], template, refs, local | set(variables))
            return
        if key == "Fn::If" and isinstance(value, list) and isinstance(value[0], str):
            refs.conditions.add(value[0])
            _collect(value[1:], template, refs, local)
            return
        if key == "Condition" and isinstance(value, str):  # inside Conditions
            refs.conditions.add(value)
            return
    for value in node.values():
        _collect(value, template, refs, local)


def _name(name: str, template: Mapping[str, Any], refs: Refs, local: frozenset[str]) -> None:
    if name in local:
        return
    if name in template.get("Parameters", {}):
        refs.parameters.add(name)
    elif name in template.get("Resources", {}):
        refs.resources.add(name)


def condition_parameters(name: str, template: Mapping[str, Any]) -> set[str]:
    """The parameters a condition depends on, through the conditions it names."""
    found: set[str] = set()
    pending, seen = [name], set()
    while pending:
        condition = pending.pop()
        if condition in seen:
            continue
        seen.add(condition)
        refs = references(template.get("Conditions", {}).get(condition), template)
        found |= refs.parameters
        pending += refs.conditions
    return found


def parameters_in(expression: Any, template: Mapping[str, Any]) -> set[str]:
    """Every parameter ``expression`` depends on, directly or through conditions."""
    refs = references(expression, template)
    found = set(refs.parameters)
    for condition in refs.conditions:
        found |= condition_parameters(condition, template)
    return found


# --- create-only properties ---------------------------------------------------------------


@cache
def create_only(kind: str) -> tuple[str, ...]:
    """The properties (``A`` or ``A/B``) whose change replaces a resource of ``kind``."""
    # Imported here: the pure parts of this module also serve environments without cfn-lint.
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
            return _MISSING
        node = node[part]
    return node


def is_intrinsic(node: Mapping[str, Any]) -> bool:
    """Whether a one-key mapping is an intrinsic function (``Ref``, ``Fn::…``)."""
    return len(node) == 1 and next(iter(node)).startswith(("Fn::", "Ref"))


# --- templates --------------------------------------------------------------------------


def load_templates(root: Path, translated: Path | None = None) -> dict[str, dict[str, Any]]:
    """Every template of ``TEMPLATES`` under ``root``; template.yaml as translated."""
    templates: dict[str, dict[str, Any]] = {}
    for name, relative in TEMPLATES.items():
        path = root / relative
        if not path.exists():
            hint = " (scripts/check_infra.sh packages it)" if name == SLS_TEMPLATE else ""
            raise SystemExit(f"second_deploy: {path} is missing{hint}")
        if name == SAM_TEMPLATE:
            templates[name] = _translated(path, translated)
        elif path.suffix == ".json":
            templates[name] = json.loads(path.read_text(encoding="utf-8"))
        else:
            templates[name] = load_cfn(path)
    return templates


def _translated(template: Path, translated: Path | None) -> dict[str, Any]:
    """template.yaml as plain CloudFormation (the SAM translator, in the SAM environment)."""
    if translated is not None:
        data: dict[str, Any] = json.loads(translated.read_text(encoding="utf-8"))
        return data
    python = Path(os.environ.get("SAM_VENV", ROOT / ".venv-sam")) / "bin" / "python"
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "template.json"
        # Run from the repository: the state machines' DefinitionUri paths are relative.
        result = subprocess.run(  # noqa: S603 - our own module, in our own environment
            [str(python), "-m", "infra.checks.translate_sam", str(template.resolve()), str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
            env={**os.environ, "AWS_DEFAULT_REGION": "us-east-1", "SAM_CLI_TELEMETRY": "0"},
        )  # fmt: skip
        if result.returncode != 0:
            raise SystemExit(f"second_deploy: translating {template} failed:\n{result.stderr}")
        data = json.loads(out.read_text(encoding="utf-8"))
    return data


def resources(template: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The template's resources by logical ID."""
    found: dict[str, dict[str, Any]] = template.get("Resources", {})
    return found


# --- exports ----------------------------------------------------------------------------


@dataclass
class Export:
    """An output with an ``Export``, and the templates that import it."""

    template: str
    output: str
    name: str  # the exported name, ``<stack>-`` for this template's stack name
    value: Any
    condition: str | None
    importers: set[str] = field(default_factory=set)

    @property
    def suffix(self) -> str | None:
        """What follows ``<stack>-`` (None for a literal name)."""
        return self.name.removeprefix("<stack>-") if self.name.startswith("<stack>-") else None


def exports(templates: Mapping[str, Mapping[str, Any]]) -> list[Export]:
    """Every export of every template, with the templates importing it."""
    found = []
    for label, template in templates.items():
        for output, spec in template.get("Outputs", {}).items():
            if "Export" not in spec:
                continue
            name = spec["Export"]["Name"]
            text = name.get("Fn::Sub") if isinstance(name, dict) else name
            if not isinstance(text, str):
                raise SystemExit(f"second_deploy: {label} {output}: unreadable export name")
            shown = text.replace("${AWS::StackName}", "<stack>")
            found.append(Export(label, output, shown, spec.get("Value"), spec.get("Condition")))
    return found


def imports(template: Any) -> Iterator[Any]:
    """The argument of every ``Fn::ImportValue`` in ``template``."""
    if isinstance(template, dict):
        for key, value in template.items():
            if key == "Fn::ImportValue":
                yield value
            else:
                yield from imports(value)
    elif isinstance(template, list):
        for item in template:
            yield from imports(item)


def imported_export(argument: Any, candidates: list[Export]) -> list[Export]:
    """The exports an ``Fn::ImportValue`` argument names: ``${XStack}-Suffix`` by suffix,
    a literal name (the Serverless Framework resolves stack names) by its longest suffix."""
    text = argument.get("Fn::Sub") if isinstance(argument, dict) else argument
    if not isinstance(text, str):
        return []
    literal = [e for e in candidates if e.suffix is None and e.name == text]
    if literal or not text:
        return literal
    if text.startswith("${"):
        suffix = text.split("}-", 1)[1] if "}-" in text else ""
        return [e for e in candidates if e.suffix == suffix]
    matching = [e for e in candidates if e.suffix and text.endswith(f"-{e.suffix}")]
    longest = max((len(e.suffix or "") for e in matching), default=0)
    return [e for e in matching if len(e.suffix or "") == longest]


def link_imports(templates: Mapping[str, Mapping[str, Any]], found: list[Export]) -> list[str]:
    """Record who imports each export; an import no template exports is a finding."""
    problems = []
    for label, template in templates.items():
        for argument in imports(template.get("Resources", {})):
            named = imported_export(argument, found)
            if not named:
                problems.append(
                    f"{label}: imports {json.dumps(argument)}, which no template exports"
                )
            for export in named:
                export.importers.add(label)
    return problems


# --- rule 1: what each parameter change replaces --------------------------------------------


@dataclass(frozen=True)
class Change:
    """A resource a parameter change replaces, creates or deletes, and why."""

    resource: str
    action: str  # "replaced" or "created/deleted"
    cause: str  # the property, or the condition


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


def changes_for(template: Mapping[str, Any], parameter: str) -> dict[str, Change]:
    """Every resource a change of ``parameter`` replaces (create-only properties, through
    the resources it replaces in turn) or creates/deletes (its condition)."""
    found: dict[str, Change] = {}
    for logical, resource in resources(template).items():
        condition = resource.get("Condition")
        if condition and parameter in condition_parameters(condition, template):
            found[logical] = Change(logical, "created/deleted", f"Condition {condition}")
    growing = True
    while growing:
        growing = False
        for logical, resource in resources(template).items():
            if logical in found:
                continue
            cause = _replacing_property(template, resource, parameter, found)
            if cause:
                found[logical] = Change(logical, "replaced", cause)
                growing = True
    return found


def _replacing_property(
    template: Mapping[str, Any], resource: Mapping[str, Any], parameter: str,
    replaced: Mapping[str, Change],
) -> str | None:  # fmt: skip
    properties = resource.get("Properties") or {}
    for path in create_only(resource["Type"]):
        value = value_at(properties, path)
        if value is _MISSING:
            continue
        if parameter in parameters_in(value, template):
            return path
        via = sorted(references(value, template).resources & set(replaced))
        if via:
            return f"{path} <- {via[0]}"
    return None


Replacements = dict[str, dict[str, dict[str, Change]]]


def replacements(templates: Mapping[str, Mapping[str, Any]]) -> Replacements:
    """Per template and parameter, what a change of that parameter replaces."""
    return {
        label: {p: changes_for(template, p) for p in template.get("Parameters", {})}
        for label, template in templates.items()
    }


@dataclass
class Report:
    """What the check found: problems fail it, the rest is printed."""

    problems: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def check_parameters(
    templates: Mapping[str, Mapping[str, Any]], replaced: Replacements, report: Report
) -> None:
    """Rule 1: per template and parameter, what a change replaces; a stateful or named
    resource only by an identity parameter, data deleted by a condition never."""
    for label, template in templates.items():
        exported, quiet = exported_resources(template), 0
        for parameter, changes in replaced[label].items():
            if not changes:
                quiet += 1
                continue
            shown = ", ".join(f"{c.resource} ({c.cause})" for c in changes.values())
            report.lines.append(f"  {label} {parameter}: {len(changes)} -> {shown}")
            if parameter in IDENTITY_PARAMETERS:
                continue
            for change in changes.values():
                resource = resources(template)[change.resource]
                if change.action == "replaced":
                    why = protection(template, change.resource, exported)
                    verdict = "REPLACED"
                else:
                    why = "deletes its data" if loses_data_when_deleted(resource) else None
                    verdict = "DELETED"
                if why:
                    report.problems.append(
                        f"{label}: changing {parameter}, would be {verdict}: "
                        f"{change.resource} ({change.cause}; {why})"
                    )
        report.lines.append(f"  {label}: {quiet} parameters replace nothing")


def check_exports(
    templates: Mapping[str, Mapping[str, Any]], found: list[Export], replaced: Replacements,
    report: Report,
) -> None:  # fmt: skip
    """Rule 3: an imported export changes with identity parameters only."""
    for export in found:
        if not export.importers:
            continue
        template = templates[export.template]
        refs = references(export.value, template)
        for parameter, changes in replaced[export.template].items():
            if parameter in IDENTITY_PARAMETERS:
                continue
            moved = parameter in parameters_in(export.value, template) or refs.resources & set(
                changes
            )
            dropped = export.condition and parameter in condition_parameters(
                export.condition, template
            )
            if moved or dropped:
                report.problems.append(
                    f"{export.template}: changing {parameter} changes export {export.name}, "
                    f"imported by {', '.join(sorted(export.importers))}: CloudFormation "
                    "refuses to update an export in use"
                )


# --- rule 2: the lock -----------------------------------------------------------------------


def lock_entries(templates: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each stateful or named resource's type, reason and create-only values as written."""
    locked: dict[str, dict[str, Any]] = {}
    for label, template in templates.items():
        exported = exported_resources(template)
        entries = {}
        for logical, resource in resources(template).items():
            why = protection(template, logical, exported)
            if why is None:
                continue
            properties = resource.get("Properties") or {}
            values = {path: value_at(properties, path) for path in create_only(resource["Type"])}
            entries[logical] = {
                "type": resource["Type"],
                "why": why,
                "condition": resource.get("Condition"),
                "create_only": {p: None if v is _MISSING else v for p, v in values.items()},
            }
        locked[label] = dict(sorted(entries.items()))
    return locked


def compare_lock(
    locked: Mapping[str, Mapping[str, Any]], current: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    """What the current templates would replace or delete relative to the lock."""
    problems = []
    for label in current:
        before, now = locked.get(label, {}), current[label]
        for logical, entry in before.items():
            if logical not in now:
                renamed = [
                    other for other, e in now.items()
                    if other not in before and e["type"] == entry["type"]
                    and e["create_only"] == entry["create_only"]
                ]  # fmt: skip
                hint = f"renamed to {renamed[0]}?" if renamed else "gone from the template"
                problems.append(f"would be DELETED: {label} {logical} ({hint})")
                continue
            problems += _changed(label, logical, entry, now[logical])
        for logical in now.keys() - before.keys():
            problems.append(f"not locked: {label} {logical} ({now[logical]['why']})")
    return problems


def _changed(
    label: str, logical: str, before: Mapping[str, Any], now: Mapping[str, Any]
) -> list[str]:
    if before["type"] != now["type"]:
        return [f"would be REPLACED: {label} {logical} (Type)"]
    problems = [
        f"would be REPLACED: {label} {logical} ({path})"
        for path in sorted(before["create_only"].keys() | now["create_only"].keys())
        if before["create_only"].get(path) != now["create_only"].get(path)
    ]
    if before["condition"] != now["condition"]:
        problems.append(f"would be DELETED: {label} {logical} (Condition {now['condition']})")
    return problems


# --- the generated tables in docs/deploy.md ----------------------------------------------


def exports_table(found: list[Export], templates: Mapping[str, Mapping[str, Any]]) -> str:
    """The generated Markdown table of exports, what they export and who imports them."""
    rows = ["| export | from | exports | imported by |", "|---|---|---|---|"]
    for export in sorted(found, key=lambda e: (e.template, e.name)):
        what = ", ".join(sorted(_what(export.value, templates[export.template])))
        importers = ", ".join(f"`{name}`" for name in sorted(export.importers)) or "—"
        rows.append(f"| `{export.name}` | `{export.template}` | {what} | {importers} |")
    return "\n".join(rows)


def _what(value: Any, template: Mapping[str, Any]) -> set[str]:
    """``Resource`` (Ref), ``Resource.Attribute`` (GetAtt, Sub), parameters, or the name
    the value spells out; a version (its logical ID changes with every hash) by function."""
    refs = references(value, template)
    shown = {f"`{p}` (parameter)" for p in refs.parameters}
    for node in _walk(value):
        if node.get("Ref") in refs.resources:
            resource = resources(template)[node["Ref"]]
            if resource["Type"] == "AWS::Lambda::Version":
                shown.add(f"`{resource['Properties']['FunctionName']['Ref']}`'s latest version")
            else:
                shown.add(f"`{node['Ref']}`")
        elif "Fn::GetAtt" in node:
            target = node["Fn::GetAtt"]
            shown.add(f"`{target if isinstance(target, str) else '.'.join(target)}`")
        elif "Fn::Sub" in node:
            text = node["Fn::Sub"] if isinstance(node["Fn::Sub"], str) else node["Fn::Sub"][0]
            names = [n for n in _SUB_NAME.findall(text) if n.split(".", 1)[0] in refs.resources]
            shown |= {f"`{name}`" for name in names}
            if not names and not refs.parameters:
                shown.add(f"the name `{text.replace('${AWS::StackName}', '<stack>')}`")
    return shown or {f"`{json.dumps(value)}`"}


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item)


def identity_table() -> str:
    """The generated Markdown table of identity parameters and why each is one."""
    rows = ["| parameter | why another value is another deployment |", "|---|---|"]
    rows += [f"| `{name}` | {why} |" for name, why in IDENTITY_PARAMETERS.items()]
    return "\n".join(rows)


def render_docs(text: str, blocks: Mapping[str, str]) -> str:
    """docs/deploy.md with each ``<!-- name:begin -->`` … ``<!-- name:end -->`` block
    replaced by its generated table."""
    for name, table in blocks.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        if begin not in text or end not in text:
            raise SystemExit(f"second_deploy: {DOCS} lacks the {begin} / {end} markers")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{table}\n{end}{tail}"
    return text


# --- the command ------------------------------------------------------------------------


def run(root: Path, *, update: bool, write_docs: bool, translated: Path | None) -> Report:
    """Check (or regenerate) everything under ``root``."""
    templates = load_templates(root, translated)
    report = Report()
    found = exports(templates)
    report.problems += link_imports(templates, found)
    replaced = replacements(templates)
    check_parameters(templates, replaced, report)
    check_exports(templates, found, replaced, report)
    check_lock(root / LOCK, lock_entries(templates), report, update=update)
    blocks = {"identity": identity_table(), "exports": exports_table(found, templates)}
    check_docs(root / DOCS, blocks, report, write=update or write_docs)
    imported = sum(1 for e in found if e.importers)
    report.lines.append(f"  exports: {len(found)} ({imported} imported by another template)")
    return report


def check_lock(path: Path, current: dict[str, Any], report: Report, *, update: bool) -> None:
    """Rule 2 against the lock at ``path``, or (``update``) re-lock, saying what it accepts."""
    if not path.exists() and not update:
        report.problems.append(f"{LOCK} is missing: create it with {UPDATE_COMMAND}")
        return
    locked = json.loads(path.read_text(encoding="utf-8"))["resources"] if path.exists() else {}
    changes = compare_lock(locked, current)
    if not update:
        report.problems += changes
        return
    report.lines += [f"  re-locked: {change}" for change in changes]
    body = {"generated_by": UPDATE_COMMAND, "resources": current}
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    report.lines.append(f"  locked {sum(map(len, current.values()))} resources -> {LOCK}")


def check_docs(path: Path, blocks: Mapping[str, str], report: Report, *, write: bool) -> None:
    """The generated tables in docs/deploy.md are current (or, ``write``, made so)."""
    docs = path.read_text(encoding="utf-8")
    wanted = render_docs(docs, blocks)
    if wanted == docs:
        return
    if write:
        path.write_text(wanted, encoding="utf-8")
        report.lines.append(f"  generated tables rewritten in {DOCS}")
    else:
        report.problems.append(f"the generated tables in {DOCS} are stale: run {DOCS_COMMAND}")


def main(argv: list[str] | None = None) -> int:
    """Print what each parameter change replaces; exit 1 on a finding."""
    parser = argparse.ArgumentParser(prog="python -m infra.checks.second_deploy")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (or a copy)")
    parser.add_argument("--translated", type=Path, help="template.yaml already translated")
    parser.add_argument("--update", action="store_true", help="re-lock on purpose, rewrite docs")
    parser.add_argument("--write-docs", action="store_true", help="rewrite the docs tables")
    args = parser.parse_args(argv)
    report = run(args.root, update=args.update, write_docs=args.write_docs,
                 translated=args.translated)  # fmt: skip
    print("what a parameter change replaces (resource (cause)):")
    print("\n".join(report.lines))
    if report.problems:
        print(f"\nsecond deploy: {len(report.problems)} problems", file=sys.stderr)
        print("\n".join(f"  {p}" for p in report.problems), file=sys.stderr)
        print(
            f"\nIf a replacement is intended (the data may go), re-lock on purpose: "
            f"{UPDATE_COMMAND}",
            file=sys.stderr,
        )
        return 1
    print("\nsecond deploy: no stateful or named resource replaced, no export in use changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
