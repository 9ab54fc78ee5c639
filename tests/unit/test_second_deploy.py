"""The second deploy replaces no stateful or named resource and changes no export in use.

GIVEN copies of every template (template.yaml, infra/*.yaml, the packaged Serverless
template), the lock and docs/deploy.md
WHEN ``infra.checks.second_deploy`` (in .venv-infra) checks them
THEN today's templates pass, and each of these edits fails with the replacement named:
RouterStateTable's key schema changed, a bucket's logical ID renamed, a table's name
built from LogLevel; a stale exports table fails too. The pure parts (what an expression
depends on, the lock comparison, the docs blocks) are checked in-process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from infra.checks.cfn_eval import load_cfn
from infra.checks.cfn_refs import parameters_in, references
from infra.checks.second_deploy.docs import render_docs
from infra.checks.second_deploy.lock import LOCK, compare_lock
from infra.checks.second_deploy.templates import TEMPLATES
from tests.unit.stacks import ROOT

INFRA_PYTHON = ROOT / ".venv-infra/bin/python"
SAM_PYTHON = ROOT / ".venv-sam/bin/python"
PACKAGED = ROOT / TEMPLATES["serverless.yml (packaged)"]

needs_tools = pytest.mark.skipif(
    not (INFRA_PYTHON.exists() and SAM_PYTHON.exists() and PACKAGED.exists()),
    reason="make check-infra installs .venv-infra and .venv-sam and packages Serverless",
)


def _copy(root: Path) -> Path:
    """The templates, lock and docs under ``root``, as the check reads them."""
    for relative in [*TEMPLATES.values(), LOCK, "docs/deploy.md"]:
        target = root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / relative, target)
    return root


def _check(root: Path | None = None, *extra: str) -> subprocess.CompletedProcess[str]:
    options = ["--root", str(root)] if root else []
    return subprocess.run(
        [str(INFRA_PYTHON), "-m", "infra.checks.second_deploy", *options, *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "SAM_VENV": str(ROOT / ".venv-sam")},
    )  # fmt: skip


def _edit(path: Path, change: Any) -> None:
    """Rewrite a YAML template as JSON (YAML too) after ``change`` edits it in place."""
    template = load_cfn(path)
    change(template)
    path.write_text(json.dumps(template, indent=1), encoding="utf-8")


@needs_tools
def test_todays_templates_pass() -> None:
    result = _check()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no stateful or named resource replaced" in result.stdout


@needs_tools
def test_a_changed_key_schema_would_replace_the_table(tmp_path: Path) -> None:
    root = _copy(tmp_path)

    def rekey(template: dict[str, Any]) -> None:
        properties = template["Resources"]["RouterStateTable"]["Properties"]
        properties["AttributeDefinitions"] = [{"AttributeName": "id", "AttributeType": "S"}]
        properties["KeySchema"] = [{"AttributeName": "id", "KeyType": "HASH"}]

    _edit(root / "template.yaml", rekey)
    result = _check(root)
    assert result.returncode == 1
    assert "would be REPLACED: template.yaml RouterStateTable (KeySchema)" in result.stderr
    # WHEN the replacement is meant and the lock regenerated on purpose
    relock = _check(root, "--update")
    # THEN the update says what it lets through, and the check passes after it
    assert relock.returncode == 0, relock.stderr[-3000:]
    assert "re-locked: would be REPLACED: template.yaml RouterStateTable (KeySchema)" in (
        relock.stdout
    )
    assert _check(root).returncode == 0


@needs_tools
def test_a_renamed_bucket_would_be_deleted(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    storage = root / "infra/storage.yaml"
    _edit(storage, lambda template: None)
    text = storage.read_text(encoding="utf-8")
    storage.write_text(
        text.replace('"ModelsBucket"', '"ModelStore"').replace("${ModelsBucket", "${ModelStore"),
        encoding="utf-8",
    )
    result = _check(root)
    assert result.returncode == 1
    assert (
        "would be DELETED: infra/storage.yaml ModelsBucket (renamed to ModelStore?)"
        in result.stderr
    )


@needs_tools
def test_a_table_named_after_a_parameter_is_replaced_by_that_parameter(tmp_path: Path) -> None:
    root = _copy(tmp_path)

    def name_from_log_level(template: dict[str, Any]) -> None:
        properties = template["Resources"]["RouterStateTable"]["Properties"]
        properties["TableName"] = {"Fn::Sub": "${AWS::StackName}-state-${LogLevel}"}

    _edit(root / "template.yaml", name_from_log_level)
    result = _check(root)
    assert result.returncode == 1
    assert (
        "template.yaml: changing LogLevel, would be REPLACED: RouterStateTable "
        "(TableName; stateful: its items)" in result.stderr
    )
    assert "would be REPLACED: template.yaml RouterStateTable (TableName)" in result.stderr


@needs_tools
def test_a_stale_exports_table_fails(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    docs = root / "docs/deploy.md"
    docs.write_text(docs.read_text(encoding="utf-8").replace("`<stack>-KeyArn`", "`<stack>-Key`"))
    result = _check(root)
    assert result.returncode == 1
    assert "the generated tables in docs/deploy.md are stale" in result.stderr


# --- pure parts ---------------------------------------------------------------------------

TEMPLATE: dict[str, Any] = {
    "Parameters": {"Stage": {}, "LogLevel": {}, "Tracing": {}, "StorageStack": {}},
    "Conditions": {
        "TracingOn": {"Fn::Equals": [{"Ref": "Tracing"}, "true"]},
        "Verbose": {"Fn::And": [{"Condition": "TracingOn"}, {"Fn::Equals": ["a", "b"]}]},
    },
    "Resources": {"Table": {"Type": "AWS::DynamoDB::Table"}},
}


def test_parameters_reach_through_sub_if_conditions_and_imports() -> None:
    expression = {
        "Name": {"Fn::Sub": ["${Stage}-${Local}-${Table.Arn}-${!Literal}", {"Local": "x"}]},
        "Mode": {"Fn::If": ["Verbose", {"Ref": "LogLevel"}, "INFO"]},
        "Queue": {"Fn::ImportValue": {"Fn::Sub": "${StorageStack}-AsyncQueueUrl"}},
        "Region": {"Ref": "AWS::Region"},
    }
    # THEN the Sub's own variables and escapes are not parameters, the condition's are
    assert parameters_in(expression, TEMPLATE) == {"Stage", "LogLevel", "Tracing", "StorageStack"}
    assert references(expression, TEMPLATE).resources == {"Table"}


def test_the_lock_names_replacements_deletions_and_renames() -> None:
    entry = {"type": "AWS::S3::Bucket", "why": "stateful", "condition": None,
             "create_only": {"BucketName": None}}  # fmt: skip
    locked = {"t": {"A": entry, "B": entry}}
    changed = {**entry, "create_only": {"BucketName": "fixed"}}
    current = {"t": {"A": changed, "C": entry}}
    assert compare_lock(locked, current) == [
        "would be REPLACED: t A (BucketName)",
        "would be DELETED: t B (renamed to C?)",
        "not locked: t C (stateful)",
    ]


def test_docs_blocks_are_replaced_between_their_markers() -> None:
    text = "a\n<!-- exports:begin -->\nold\n<!-- exports:end -->\nb\n"
    assert render_docs(text, {"exports": "new"}) == (
        "a\n<!-- exports:begin -->\nnew\n<!-- exports:end -->\nb\n"
    )
    with pytest.raises(SystemExit, match="identity:begin"):
        render_docs(text, {"identity": "x"})
