"""Summarise checkov's JSON report; fail on a failed check, a parsing error or a stale skip.

    python -m infra.checks.checkov_report build/checks/results_json.json TEMPLATE...

Prints passed/failed/skipped counts per framework, every failure, and every skip with
its written reason. A skip declared in a template (``Metadata: checkov: skip``) or a
Dockerfile (``#checkov:skip=ID:reason``) that no check used is reported as stale and
fails the run: a skip outlives the finding it excused only by mistake.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

_DOCKER_SKIP = re.compile(r"^#\s*checkov:skip=([A-Z0-9_]+):(.+)$", re.MULTILINE)


class _CfnLoader(yaml.SafeLoader):
    """YAML loader that accepts CloudFormation's short-form tags (as plain values)."""


def _any_tag(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.ScalarNode):
        return loader.construct_scalar(node)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_mapping(node, deep=True)  # type: ignore[arg-type]


_CfnLoader.add_multi_constructor("!", _any_tag)


def declared_skips(path: Path) -> set[tuple[str, str]]:
    """``(check id, resource logical id)`` of every skip written in a template or Dockerfile."""
    text = path.read_text(encoding="utf-8")
    if path.name.endswith("Dockerfile"):
        return {(check, "") for check, _ in _DOCKER_SKIP.findall(text)}
    template = yaml.load(text, Loader=_CfnLoader) or {}  # noqa: S506 - SafeLoader subclass
    skips: set[tuple[str, str]] = set()
    for name, resource in (template.get("Resources") or {}).items():
        metadata = resource.get("Metadata") or {}
        for skip in (metadata.get("checkov") or {}).get("skip") or []:
            skips.add((skip["id"], name))
    return skips


def load_reports(path: Path) -> list[dict[str, Any]]:
    """checkov writes one object for one framework, a list for several."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, list) else [data]


def main(argv: list[str]) -> int:
    """Print the summary; exit 1 on failures, parsing errors or stale skips."""
    reports = load_reports(Path(argv[0]))
    problems = 0
    used: set[tuple[str, str]] = set()
    for report in reports:
        summary, results = report["summary"], report["results"]
        print(
            f"checkov {report['check_type']}: {summary['passed']} passed, "
            f"{summary['failed']} failed, {summary['skipped']} skipped, "
            f"{summary['parsing_errors']} parsing errors"
        )
        for failed in results.get("failed_checks", []):
            problems += 1
            print(f"  FAILED {failed['check_id']} {failed['resource']} ({failed['file_path']})")
        for error in results.get("parsing_errors", []):
            problems += 1
            print(f"  PARSING ERROR {error}")
        seen: set[tuple[str, str]] = set()
        for skipped in results.get("skipped_checks", []):
            resource = str(skipped["resource"]).rsplit(".", 1)[-1]
            used.add((skipped["check_id"], resource))
            key = (skipped["check_id"], str(skipped["resource"]))
            if key in seen:
                continue
            seen.add(key)
            reason = skipped["check_result"].get("suppress_comment", "")
            print(f"  skip {skipped['check_id']} {skipped['resource']}: {reason}")
    for source in argv[1:]:
        for check, resource in sorted(declared_skips(Path(source))):
            if not any(c == check and (not resource or r.startswith(resource)) for c, r in used):
                problems += 1
                print(f"  STALE skip {check} on {resource or 'the image'} in {source}: unused")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
