"""Every change that reaches an aliased function publishes a new version.

GIVEN template.yaml and the SAM translator of .venv-sam
WHEN ``infra.checks.alias_versions`` translates it once per change
THEN today's template passes: a literal edit and every parameter that reaches an aliased
function publish a new version of it (a new logical ID, or a changed create-only
description), each moved value within the parameter's constraints; the template as it
was before (no ``AutoPublishAliasAllProperties``, no ``VersionDescription``) fails: a
Timeout edit and a LogLevel change publish nothing. The description fits Lambda's 256
characters at the longest values the parameters allow.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from infra.checks.cfn_eval import load_cfn
from tests.unit.stacks import ROOT

SAM_PYTHON = ROOT / ".venv-sam/bin/python"
ALIASED = ("RouterFunction", "CpuInferFunction")
_ROW = re.compile(r"^(\w+Function)\s+(.+?)\s{2,}(.+?)\s{2,}(\S+) -> (\S+)\s+(publishes|STALE)$")

Rows = dict[tuple[str, str], tuple[str, str, str, str]]

pytestmark = pytest.mark.skipif(
    not SAM_PYTHON.exists(), reason="make check-infra installs the SAM CLI into .venv-sam"
)


def _check(template: Path, *options: str) -> tuple[int, Rows]:
    """Run the check; its exit status and rows by (function, change)."""
    result = subprocess.run(
        [str(SAM_PYTHON), "-m", "infra.checks.alias_versions", str(template), *options],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "AWS_DEFAULT_REGION": "us-east-1", "SAM_CLI_TELEMETRY": "0"},
    )  # fmt: skip
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    rows: Rows = {}
    for line in result.stdout.splitlines():
        match = _ROW.match(line)
        if match:
            function, change, values, before, after, verdict = match.groups()
            rows[(str(function), str(change))] = (values, before, after, verdict)
    return result.returncode, rows


@pytest.fixture(scope="module")
def today() -> tuple[int, Rows]:
    return _check(ROOT / "template.yaml")


def test_template_passes_and_a_literal_edit_publishes(today: tuple[int, Rows]) -> None:
    code, rows = today
    # THEN the check passes, and a Timeout one second longer is a new version of each
    assert code == 0
    for function in ALIASED:
        _, before, after, verdict = rows[(function, "(edit) Timeout")]
        assert verdict == "publishes"
        assert before != after
        assert before.startswith(f"{function}Version")
    assert not [key for key, row in rows.items() if row[3] == "STALE"]


def test_every_reaching_parameter_is_found_and_moved_within_its_constraints(
    today: tuple[int, Rows],
) -> None:
    _, rows = today
    router = {change for function, change in rows if function == "RouterFunction"}
    cpu = {change for function, change in rows if function == "CpuInferFunction"}
    # THEN the parameters of the environment, Globals, VpcConfig and MemorySize are found
    assert {"LogLevel", "Tracing", "RouterMemorySize", "GpuStack", "NetworkStack"} <= router
    assert {"LogLevel", "CpuMemorySize", "CpuEphemeralStorageMiB", "ModelsPrefix"} <= cpu
    # (TraceSample through Globals and the Layers condition: docs/deploy.md, tracing)
    assert {"TraceSample"} <= router & cpu
    # …but not those of properties no version holds (reserved, provisioned concurrency)
    assert not {"RouterReservedConcurrency", "RouterProvisionedConcurrency"} & router
    # AND each is moved to a value it allows (AllowedValues, MinValue/MaxValue)
    assert rows[("RouterFunction", "LogLevel")][0] == "INFO -> DEBUG"
    assert rows[("RouterFunction", "RouterMemorySize")][0] == "512 -> 513"
    assert rows[("RouterFunction", "Tracing")][0] == "false -> true"
    assert rows[("RouterFunction", "TraceSample")][0] == "0 -> 0.001"
    # AND each publishes a new version
    parameters = [row for key, row in rows.items() if not key[1].startswith("(edit)")]
    assert len(parameters) >= 20
    assert {row[3] for row in parameters} == {"publishes"}


def test_the_template_before_the_fix_fails(tmp_path: Path) -> None:
    # GIVEN template.yaml as it was: no AutoPublishAliasAllProperties, no description
    source = (ROOT / "template.yaml").read_text(encoding="utf-8")
    before = re.sub(r"(?m)^\s*AutoPublishAliasAllProperties:.*\n", "", source)
    before = re.sub(r"(?m)^      VersionDescription: !Sub >-\n(        .*\n)+", "", before)
    assert before != source
    copy = tmp_path / "template.yaml"
    copy.write_text(before, encoding="utf-8")
    # WHEN the check runs on it
    code, rows = _check(copy)
    # THEN it fails: neither a Timeout edit nor a LogLevel change moves the alias
    assert code == 1
    for function in ALIASED:
        assert rows[(function, "(edit) Timeout")][3] == "STALE"
        assert rows[(function, "LogLevel")][3] == "STALE"


def test_the_version_description_fits_at_the_longest_values() -> None:
    # GIVEN each aliased function's VersionDescription and the parameters' bounds
    source = load_cfn(ROOT / "template.yaml")
    declared = source["Parameters"]
    # The SSM-typed parameters hold the storage stack's numbers, at most its bounds.
    storage = load_cfn(ROOT / "infra/storage.yaml")
    bounds = storage["Parameters"]
    ssm_longest = {
        "AsyncTtlSeconds": max(
            len(str(row["Seconds"])) for row in storage["Mappings"]["AsyncRetention"].values()
        ),
        "AsyncLeaseSeconds": len(str(bounds["AsyncLeaseSeconds"]["MaxValue"])),
        "AsyncMaxAttempts": len(str(bounds["AsyncMaxAttempts"]["MaxValue"])),
    }

    def longest(name: str) -> int:
        spec = declared[name]
        if "AllowedValues" in spec:
            return max(len(str(v)) for v in spec["AllowedValues"])
        if spec["Type"] == "Number":
            return len(str(spec["MaxValue"]))
        if spec["Type"].startswith("AWS::SSM::Parameter::Value"):
            return ssm_longest[name]  # a new one: name its bound in the storage stack
        if "MaxLength" in spec:
            return int(spec["MaxLength"])
        bound = re.search(r"\{0,(\d+)\}\$$", spec["AllowedPattern"])
        assert bound, name
        return 1 + int(bound.group(1))

    for function in ALIASED:
        text = source["Resources"][function]["Properties"]["VersionDescription"]["Fn::Sub"]
        names = re.findall(r"\$\{(\w+)\}", text)
        worst = len(re.sub(r"\$\{\w+\}", "", text)) + sum(longest(n) for n in names)
        # THEN it fits Lambda's 256 characters (a longer one fails the deploy)
        assert worst <= 256, (function, worst)
