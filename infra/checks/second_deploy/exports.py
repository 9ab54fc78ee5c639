"""Rule 3: an export another template imports never changes with a non-identity parameter.

CloudFormation refuses to update an export while a stack imports it. Every export of every
template is linked to the templates whose ``Fn::ImportValue`` names it (an import no
template exports is a finding too); an imported export must then not move, nor vanish with
its condition, when a non-identity parameter changes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from infra.checks.cfn_refs import condition_parameters, parameters_in, references
from infra.checks.second_deploy import Report
from infra.checks.second_deploy.replacement import IDENTITY_PARAMETERS, Replacements


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
