"""Rule 2: a template edit replaces no stateful or named resource by accident.

Each protected resource's type, reason, condition and create-only values, as written, are
locked in ``stateful.lock.json``. A changed value or type, a flipped condition, a vanished
(or renamed) resource and an unlocked one are findings until the lock is regenerated on
purpose (``--update``), which prints what it accepts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from infra.checks.second_deploy import Report
from infra.checks.second_deploy.stateful import (
    MISSING,
    create_only,
    exported_resources,
    protection,
    value_at,
)
from infra.checks.second_deploy.templates import resources

LOCK = "infra/checks/stateful.lock.json"
UPDATE_COMMAND = ".venv-infra/bin/python -m infra.checks.second_deploy --update"


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
                "create_only": {p: None if v is MISSING else v for p, v in values.items()},
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
