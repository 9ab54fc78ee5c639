"""The README and its reference pages stay true: every setting of every deployable is in
its configuration table (docs/configuration.md), every error code a client can see in the
errors table (docs/errors.md), and the README links both."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from batch_job.settings import JobsSettings
from gpu_service.settings import GpuSettings
from spillway.async_inference.settings import AsyncSettings
from spillway.fallback.settings import CpuSettings
from spillway.protocol.errors import DuplicateIdError, JobNotFoundError, SpillwayError
from spillway.router.settings import RouterSettings
from spillway.streams.settings import StreamSettings
from spillway.tenancy.proof import ProofSettings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
ERRORS = ROOT / "docs" / "errors.md"


@pytest.mark.parametrize(
    ("settings", "prefix"),
    [
        (GpuSettings, "GPU_"),
        (RouterSettings, "ROUTER_"),
        (CpuSettings, "CPU_"),
        (JobsSettings, "JOBS_"),
        (AsyncSettings, "ASYNC_"),
        (StreamSettings, "WS_"),
        (ProofSettings, "SCOPE_PROOF_"),
    ],
)
def test_every_setting_is_documented(settings: type[BaseModel], prefix: str) -> None:
    text = CONFIGURATION.read_text()
    missing = [
        f"{prefix}{name.upper()}"
        for name in settings.model_fields
        if f"| `{prefix}{name.upper()}` |" not in text
    ]
    assert missing == []


def test_the_readme_links_the_reference_tables() -> None:
    text = README.read_text()
    assert "(docs/configuration.md)" in text
    assert "(docs/errors.md)" in text


def test_readme_shows_the_two_commands() -> None:
    text = README.read_text()
    assert "make demo" in text
    assert "make test" in text


_CODE = re.compile(r'^\s+code(?:: [A-Za-z\[\]]+)? = "([a-z_]+)"$', re.MULTILINE)


def _codes() -> set[str]:
    """Every stable code an error class of the production code declares (read from the
    source, so the answer does not depend on which modules a test run imported)."""
    files = [
        f
        for d in ("spillway", "batch_job", "functions", "gpu_service")
        for f in (ROOT / d).rglob("*.py")
    ]
    return {code for f in files for code in _CODE.findall(f.read_text())}


def test_every_error_code_is_in_the_errors_table() -> None:
    # GIVEN every stable code the error classes declare
    codes = _codes()
    assert {SpillwayError.code, JobNotFoundError.code, DuplicateIdError.code} <= codes
    errors_table = ERRORS.read_text().split("# Errors", 1)[1].split("\n## ", 1)[0]
    # THEN each has its row in the errors table
    missing = sorted(c for c in codes if f"`{c}`" not in errors_table)
    assert missing == []


def test_the_documented_payload_limit_is_the_code_s() -> None:
    # GIVEN the synchronous body limit the router and the CPU fallback enforce by default
    limit = RouterSettings.model_fields["max_body_bytes"].default
    assert CpuSettings.model_fields["max_payload_bytes"].default == limit
    figure = f"{limit:,}"
    # THEN every text that states the router's limit states that figure, never "6 MiB"
    for path in (README, CONFIGURATION, ROOT / "docs" / "deploy.md", ROOT / "template.yaml"):
        text = path.read_text()
        assert figure in text or str(limit) in text, path.name
        assert "router at 6 MiB" not in text
        assert "router accepts 6 MiB" not in text
        assert "`ROUTER_MAX_BODY_BYTES` (6 MiB)" not in text


def test_tenants_reach_both_template_forms_live() -> None:
    # GIVEN the live configuration (the identity map) the doors read from the state table
    for name in ("template.yaml", "serverless.yml"):
        text = (ROOT / name).read_text()
        # THEN both forms point the router and the WebSocket function (ROUTER_STATE_TABLE),
        # the jobs and the CPU functions at it, and none carries a map in its environment
        # (4 KB in all; each new tenant would be a deploy)
        assert text.count("ROUTER_STATE_TABLE:") == 2, name
        assert "JOBS_CONFIG_TABLE:" in text, name
        assert "CPU_CONFIG_TABLE:" in text, name
        assert "IDENTITY_TENANTS:" not in text, name
