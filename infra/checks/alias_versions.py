"""Every change that reaches an aliased function publishes a new version, checked offline.

A function with ``AutoPublishAlias`` is invoked through its alias (``live``): API
Gateway, the router and the schedules call the version the alias points at, not
``$LATEST``. CloudFormation publishes a new ``AWS::Lambda::Version`` when that resource
is new (its logical ID changed) or replaced (a create-only property changed:
``Description``, ``CodeSha256``; the resource schema's ``createOnlyProperties``). The SAM
translator names the version by a hash (``_construct_version`` in
samtranslator/model/sam_resources.py):

* by default, of ``Code`` (parameter references resolved), ``Environment`` and
  ``MemorySize`` *as written*: a changed ``Timeout`` or a changed parameter value reaches
  ``$LATEST`` and never the alias (serverless-application-model#1640, #3820);
* with ``AutoPublishAliasAllProperties: true``, of every property as written: a literal
  edit publishes, a parameter value still does not (#3820);
* ``AutoPublishCodeSha256`` replaces the hash by its first ten characters and must
  resolve to one string (``!Sub`` does not): no way to cover several parameters.

So template.yaml gives each aliased function a ``VersionDescription`` that is a ``!Sub``
of every parameter value reaching it: the translator copies it to the version as its
``Description``, which CloudFormation resolves, and a changed value replaces the version.
The check translates template.yaml once per change and compares each aliased function's
version as CloudFormation would see it (logical ID and resolved description): every
parameter its versioned properties reference (``Ref``, ``Fn::Sub`` variables,
``Fn::ImportValue`` of a name built from one, the conditions of an ``Fn::If``;
``Globals`` merged), moved to another value it allows (``AllowedValues``,
``MinValue``/``MaxValue``, ``AllowedPattern``, lengths), and a literal edit (``Timeout``
one second longer). A row ``publishes`` (a new version, the alias follows) or is
``STALE`` (the alias would keep the old configuration): the check fails on any.

Runs in the SAM CLI's virtual environment, like ``infra.checks.translate_sam``::

    .venv-sam/bin/python -m infra.checks.alias_versions template.yaml
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import logging
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from samcli.yamlhelper import yaml_parse
from samtranslator.intrinsics.resolver import IntrinsicsResolver
from samtranslator.parser.parser import Parser
from samtranslator.translator.translator import Translator

from infra.checks.cfn_refs import is_intrinsic, parameters_in
from infra.checks.translate_sam import packaged

# Properties of AWS::Serverless::Function that no published version holds: a change to
# them must not publish one (Lambda refuses a version of an unchanged function: "A version
# for this Lambda function exists"), so their parameters are listed, not required.
UNVERSIONED = {
    "ReservedConcurrentExecutions": "function-level: PutFunctionConcurrency, not a version",
    "ProvisionedConcurrencyConfig": "set on the alias, not the version",
    "Events": "event sources and permissions, outside the function",
    "EventInvokeConfig": "a separate AWS::Lambda::EventInvokeConfig on the alias",
    "DeploymentPreference": "CodeDeploy's traffic shifting on the alias",
    "Tags": "function-level tags",
    "AutoPublishAlias": "the alias itself",
    "AutoPublishAliasAllProperties": "how the version is hashed",
    "AutoPublishCodeSha256": "how the version is hashed",
    "VersionDescription": "the version's description, not what it runs",
    "VersionDeletionPolicy": "what happens to old versions",
    "FunctionUrlConfig": "a separate AWS::Lambda::Url",
}
LITERAL_EDIT = "Timeout"
PUBLISHES, STALE = "publishes", "STALE"
# Values tried for a parameter with an AllowedPattern, after small edits of its default.
_SAMPLES = ("x", "1", "arn:aws:sns:us-east-1:123456789012:spillway-check")


@dataclass(frozen=True)
class Row:
    """One change to one aliased function and what it did to the version."""

    function: str
    change: str  # a parameter's name, or the literal edit
    values: str  # "old -> new"
    before: str
    after: str

    @property
    def verdict(self) -> str:
        """publishes, or STALE."""
        return PUBLISHES if self.after != self.before else STALE


# --- translating -------------------------------------------------------------------------


def translate(source: dict[str, Any], values: Mapping[str, str]) -> dict[str, Any]:
    """Plain CloudFormation for ``source`` deployed with ``values`` (strings, as
    CloudFormation hands parameters to the transform)."""
    translator = Translator(managed_policy_map={}, sam_parser=Parser())
    output: dict[str, Any] = translator.translate(
        sam_template=packaged(source),
        parameter_values=dict(values),
        passthrough_metadata=True,
        get_managed_policy_map=lambda: {},
    )
    return output


def versions(
    output: Mapping[str, Any], functions: list[str], values: Mapping[str, str]
) -> dict[str, str]:
    """Each function's AWS::Lambda::Version as CloudFormation tells versions apart: its
    logical ID and its create-only ``Description`` with the parameter values in."""
    resolver = IntrinsicsResolver({k: v for k, v in values.items() if not k.startswith("AWS::")})
    found = {}
    for logical, resource in output["Resources"].items():
        if resource["Type"] != "AWS::Lambda::Version":
            continue
        target = resource["Properties"]["FunctionName"].get("Ref")
        if target in functions:
            described = resolver.resolve_parameter_refs(
                copy.deepcopy(resource["Properties"].get("Description", ""))
            )
            text = described.get("Fn::Sub", described) if isinstance(described, dict) else described
            digest = hashlib.sha256(str(text).encode()).hexdigest()[:8]
            found[target] = f"{logical}~{digest}" if text else logical
    return found


# --- what reaches a function --------------------------------------------------------------


def aliased_functions(source: Mapping[str, Any]) -> list[str]:
    """The SAM functions with ``AutoPublishAlias`` (theirs or Globals')."""
    global_alias = source.get("Globals", {}).get("Function", {}).get("AutoPublishAlias")
    return [
        name
        for name, resource in source["Resources"].items()
        if resource.get("Type") == "AWS::Serverless::Function"
        and (resource.get("Properties", {}).get("AutoPublishAlias") or global_alias)
    ]


def merged_properties(source: Mapping[str, Any], function: str) -> dict[str, Any]:
    """The function's properties with ``Globals.Function`` merged in as SAM merges them
    (maps merged, lists concatenated, the function's scalars winning)."""
    globals_ = source.get("Globals", {}).get("Function", {})
    local = source["Resources"][function].get("Properties", {})
    merged: dict[str, Any] = _merge(copy.deepcopy(globals_), local)
    return merged


def _merge(base: Any, local: Any) -> Any:
    if isinstance(base, dict) and isinstance(local, dict) and not is_intrinsic(local):
        merged = dict(base)
        for key, value in local.items():
            merged[key] = _merge(base[key], value) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(local, list):
        return base + local
    return local


def reaching_parameters(source: Mapping[str, Any], function: str) -> tuple[set[str], set[str]]:
    """The parameters a function's versioned properties reference, and those only its
    unversioned ones (``UNVERSIONED``) do."""
    properties = merged_properties(source, function)
    versioned = {k: v for k, v in properties.items() if k not in UNVERSIONED}
    other = {k: v for k, v in properties.items() if k in UNVERSIONED}
    found = parameters_in(versioned, source)
    return found, parameters_in(other, source) - found


# --- another allowed value ---------------------------------------------------------------


def default_value(name: str, declared: Mapping[str, Any]) -> str:
    """The parameter's default as CloudFormation passes it (a string), else a valid one."""
    if "Default" in declared:
        return _text(declared["Default"])
    return alternative(name, declared, "")


def alternative(name: str, declared: Mapping[str, Any], current: str) -> str:
    """A value other than ``current`` the parameter's constraints allow."""
    allowed = [_text(v) for v in declared.get("AllowedValues", [])]
    if allowed:
        candidates = allowed
    elif declared.get("Type") == "Number":
        candidates = _numbers(declared, current)
    else:
        edits = (current + "x", current + "1", "x" + current, current[:-1] + "x" + current[-1:])
        candidates = [*edits, *_SAMPLES]
    for value in candidates:
        if value != current and _allowed(declared, value):
            return value
    raise SystemExit(f"alias_versions: no other value found that {name} allows")


def _numbers(declared: Mapping[str, Any], current: str) -> list[str]:
    number = float(current) if current else float(declared.get("MinValue", 0))
    step = 1 if number == int(number) else 0.1
    return [_text(round(number + step, 6)), _text(round(number - step, 6))]


def _allowed(declared: Mapping[str, Any], value: str) -> bool:
    if declared.get("Type") == "Number":
        number = float(value)
        low, high = declared.get("MinValue"), declared.get("MaxValue")
        return (low is None or number >= float(low)) and (high is None or number <= float(high))
    pattern = declared.get("AllowedPattern")
    if pattern and not re.fullmatch(pattern, value):
        return False
    return int(declared.get("MinLength", 0)) <= len(value) <= int(declared.get("MaxLength", 4096))


def _text(value: Any) -> str:
    if isinstance(value, float) and value == int(value):
        return str(int(value))
    return str(value).lower() if isinstance(value, bool) else str(value)


# --- the check ---------------------------------------------------------------------------


class Versions:
    """Versions per set of parameter values and template."""

    def __init__(self, source: dict[str, Any], functions: list[str]) -> None:
        self.source, self.functions = source, functions
        declared = source.get("Parameters", {})
        self.defaults = {name: default_value(name, spec) for name, spec in declared.items()}
        self._seen: dict[tuple[Any, ...], dict[str, str]] = {}

    def of(
        self, overrides: Mapping[str, str], source: dict[str, Any] | None = None
    ) -> dict[str, str]:
        """Each aliased function's version for these values (and this template)."""
        key = tuple(sorted(overrides.items()))
        if source is None and key in self._seen:  # each function asks for the same ones
            return self._seen[key]
        values = {**self.defaults, **overrides}
        template = source if source is not None else self.source
        found = versions(translate(template, values), self.functions, values)
        if source is None:
            self._seen[key] = found
        return found


def parameter_rows(versions_: Versions, function: str, parameters: set[str]) -> list[Row]:
    """A row per parameter reaching ``function``: moved to another allowed value."""
    base = versions_.of({})
    rows = []
    for name in sorted(parameters):
        declared = versions_.source["Parameters"][name]
        old = versions_.defaults[name]
        new = alternative(name, declared, old)
        after = versions_.of({name: new})
        rows.append(Row(function, name, f"{old} -> {new}", base[function], after[function]))
    return rows


def literal_row(versions_: Versions, function: str) -> Row:
    """The function's ``Timeout`` one second longer, as an edit of the template."""
    edited = copy.deepcopy(versions_.source)
    properties = edited["Resources"][function].setdefault("Properties", {})
    current = merged_properties(edited, function).get(LITERAL_EDIT, 3)
    if not isinstance(current, int):
        raise SystemExit(f"alias_versions: {function}'s {LITERAL_EDIT} is not a literal")
    properties[LITERAL_EDIT] = current + 1
    base, after = versions_.of({}), versions_.of({}, edited)
    return Row(
        function, f"(edit) {LITERAL_EDIT}", f"{current} -> {current + 1}",
        base[function], after[function],
    )  # fmt: skip


def check(template: Path) -> tuple[list[Row], dict[str, set[str]]]:
    """Rows for every aliased function, and the parameters only unversioned props use."""
    source = yaml_parse(template.read_text(encoding="utf-8"))
    functions = aliased_functions(source)
    versions_ = Versions(source, functions)
    rows, unversioned = [], {}
    for function in functions:
        reaching, unversioned[function] = reaching_parameters(source, function)
        rows += parameter_rows(versions_, function, reaching)
        rows.append(literal_row(versions_, function))
    return rows, unversioned


def table(rows: list[Row]) -> str:
    """The rows as an aligned text table."""
    header = ("function", "change", "values", "version before -> after", "verdict")
    cells = [(r.function, r.change, r.values, f"{r.before} -> {r.after}", r.verdict) for r in rows]
    widths = [max(len(str(c[i])) for c in [header, *cells]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True))
             for row in [header, *cells]]  # fmt: skip
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table; exit 1 on a STALE row."""
    parser = argparse.ArgumentParser(prog="python -m infra.checks.alias_versions")
    parser.add_argument("template", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    # The translator's feature-toggle and metrics notices are not findings.
    logging.disable(logging.WARNING)
    rows, unversioned = check(args.template)
    print(table(rows))
    for function, names in unversioned.items():
        if names:
            print(f"{function}: not in a version (by design): {', '.join(sorted(names))}")
    counts = {v: sum(r.verdict == v for r in rows) for v in (PUBLISHES, STALE)}
    print(", ".join(f"{n} {v}" for v, n in counts.items()))
    bad = [r for r in rows if r.verdict == STALE]
    for row in bad:
        print(f"alias_versions: {row.function}: changing {row.change} ({row.values}) "
              f"publishes no new version: its alias keeps the old configuration",
              file=sys.stderr)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
