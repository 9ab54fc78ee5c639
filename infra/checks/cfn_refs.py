"""What a CloudFormation expression depends on, read statically from the template.

``infra.checks.cfn_eval`` evaluates an expression for fixed parameter values; this module
asks the other question: which parameters, resources and conditions an expression names
(``Ref``, ``Fn::GetAtt``, ``Fn::Sub`` variables, ``Fn::If`` and ``Condition``), and so
which parameters a change could reach it through. The second-deploy check
(``infra.checks.second_deploy``) and the alias check (``infra.checks.alias_versions``)
both follow parameters with it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SUB_NAME = re.compile(r"\$\{(?!!)([^}]+)\}")
"""A ``Fn::Sub`` variable (``${Name}`` or ``${Name.Attribute}``; ``${!Literal}`` is none)."""


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
            for name in SUB_NAME.findall(text):
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


def is_intrinsic(node: Mapping[str, Any]) -> bool:
    """Whether a one-key mapping is an intrinsic function (``Ref``, ``Fn::…``)."""
    return len(node) == 1 and next(iter(node)).startswith(("Fn::", "Ref"))
