"""What the CLI takes without being told: ``models canary --percent`` without
``--version`` (the canary in force, else the newest version), and ``jobs status`` with the
first characters of a job id (per tenant; ambiguous ones refused)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import boto3
import pytest
from typer.testing import CliRunner

from batch_job.jobstore import JobStore
from spillway.protocol.errors import InvalidInputError
from spillway.state.table import create_table, scope
from spillway_cli.jobs_cli import resolve_job_id
from spillway_cli.main import app
from tests.integration.test_jobs_support import jobs_settings

runner = CliRunner()


def _versions_repo(models_dir: Path, tmp_path: Path, versions: int) -> Path:
    """digits with versions 1..``versions`` (each a copy of v1)."""
    repo = tmp_path / "repo"
    shutil.copytree(
        models_dir / "digits", repo / "digits", ignore=shutil.ignore_patterns("samples")
    )
    for version in range(2, versions + 1):
        shutil.copytree(repo / "digits" / "1", repo / "digits" / str(version))
    return repo


def test_percent_without_version_takes_the_canary_in_force_or_the_newest(
    aws_env: str, models_dir: Path, tmp_path: Path
) -> None:
    # GIVEN a state table and a repository with digits v1..v3
    table = f"router-state-{random.randrange(10**9)}"
    create_table(boto3.client("dynamodb"), table)
    repo = _versions_repo(models_dir, tmp_path, 3)

    def canary(*args: str) -> str:
        result = runner.invoke(app, ["models", "canary", "--model", "digits", *args])
        assert result.exit_code == 0, result.output
        return result.output

    base = ["--table", table]
    # WHEN a first canary is started without --version, then raised to 100 % without it
    first = canary("--percent", "10", "--stable", "1", "--repository", str(repo), *base)
    raised = canary("--percent", "100", *base)
    # THEN the first is the newest version, and --percent alone changes the one in force
    assert "digits: stable v1, canary v3 at 10% (running)" in first
    assert "digits: stable v1, canary v3 at 100% (running)" in raised
    # AND without a canary or a repository it says what to pass, in one line
    canary("--promote", *base)
    refused = runner.invoke(app, ["models", "canary", "--model", "digits", "--percent", "5", *base])
    assert refused.exit_code == 1
    assert refused.output.strip() == (
        "error: digits has no canary: pass --version (or --repository for the newest)"
    )


def test_a_short_job_id_resolves_within_its_tenant(aws_env: str, models_dir: Path) -> None:
    # GIVEN two tenants' jobs whose ids share their first characters
    settings = jobs_settings(aws_env, models_dir)
    store = JobStore(settings.table, boto3.client("dynamodb"))
    head = f"{random.randrange(16**8):08x}"
    a_id, b_id = (f"{head}-{tail}-4000-8000-000000000000" for tail in ("aaaa", "bbbb"))
    store.create({"job_id": a_id, "owner": scope("tenant-a"), "state": "SUBMITTED"})
    store.create({"job_id": b_id, "owner": scope("tenant-b"), "state": "SUBMITTED"})
    # WHEN the shared start is looked up per tenant, as operator, and with one more character
    mine = resolve_job_id(store, head, scope("tenant-a"))
    theirs = resolve_job_id(store, head.upper(), scope("tenant-b"))
    longer = resolve_job_id(store, f"{head}-b", None)
    # THEN each tenant gets its own job, and a prefix of two jobs is refused
    assert (mine, theirs, longer) == (a_id, b_id, b_id)
    with pytest.raises(InvalidInputError, match=f"{head} begins 2 job ids"):
        resolve_job_id(store, head, None)
