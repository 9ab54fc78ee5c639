"""The tables the second-deploy check generates in docs/deploy.md ("The second deploy").

The identity parameters and why each is one, and every export with what it exports and
who imports it, each between its ``<!-- name:begin -->`` and ``<!-- name:end -->``
markers; the check fails while they differ from what it would write.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from infra.checks.cfn_refs import SUB_NAME, references
from infra.checks.second_deploy import Report
from infra.checks.second_deploy.exports import Export
from infra.checks.second_deploy.replacement import IDENTITY_PARAMETERS
from infra.checks.second_deploy.templates import resources

DOCS = "docs/deploy.md"
DOCS_COMMAND = ".venv-infra/bin/python -m infra.checks.second_deploy --write-docs"


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
            names = [n for n in SUB_NAME.findall(text) if n.split(".", 1)[0] in refs.resources]
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
