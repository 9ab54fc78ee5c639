"""Rule 1: a parameter change replaces no stateful or named resource.

Per template and parameter, every resource a change of that parameter replaces (a
create-only property that depends on it, directly, through conditions, or through a
resource the same change replaces) or creates and deletes (its ``Condition`` flips).
Identity parameters are exempt: another value is another deployment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infra.checks.cfn_refs import condition_parameters, parameters_in, references
from infra.checks.second_deploy import Report
from infra.checks.second_deploy.stateful import (
    MISSING,
    create_only,
    exported_resources,
    loses_data_when_deleted,
    protection,
    value_at,
)
from infra.checks.second_deploy.templates import resources

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


@dataclass(frozen=True)
class Change:
    """A resource a parameter change replaces, creates or deletes, and why."""

    resource: str
    action: str  # "replaced" or "created/deleted"
    cause: str  # the property, or the condition


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
        if value is MISSING:
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
