"""``spillway jobs``: run over local folders, exit codes, submit --local --wait on moto."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from spillway.state.table import scope
from spillway_cli.jobs_cli import jobs_app
from tests.integration.test_jobs_support import (
    digits_images,
    get_lines,
    jobs_settings,
    new_bucket,
    put_jsonl,
    record,
)

runner = CliRunner()


def test_run_over_local_folders_then_rerun_skips(models_dir: Path, tmp_path: Path) -> None:
    # GIVEN a folder with one .npy input of 50 digits
    (tmp_path / "in").mkdir()
    np.save(tmp_path / "in" / "batch.npy", digits_images(models_dir)[:50])
    argv = ["run", "--repository", str(models_dir), "--model", "digits"]
    argv += ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")]
    env = {"JOBS_PROVIDERS": '["CPUExecutionProvider"]', "JOBS_WORK_DIR": str(tmp_path)}
    # WHEN the container command runs, then runs again
    first = runner.invoke(jobs_app, argv, env=env)
    second = runner.invoke(jobs_app, argv, env=env)
    # THEN the first commits the shard and the second finds it committed
    assert first.exit_code == 0, first.output
    assert "committed 1, already committed 0, failed 0 shards; 50 records" in first.output
    assert second.exit_code == 0, second.output
    assert "committed 0, already committed 1, failed 0 shards" in second.output
    manifest = json.loads((tmp_path / "out" / "_committed" / "part-00000.json").read_text())
    assert (manifest["records"], manifest["outputs"], manifest["batch_size"]) == (50, 50, 64)


def test_configuration_errors_exit_3_so_batch_does_not_retry(
    models_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"id": "a", "data": {}}\n')
    argv = ["run", "--repository", str(models_dir), "--input", str(tmp_path / "in")]
    argv += ["--output", str(tmp_path / "out")]
    missing = runner.invoke(jobs_app, [*argv, "--model", "no-such-model"])
    assert missing.exit_code == 3
    assert "model_not_found" in missing.output
    too_big = runner.invoke(jobs_app, [*argv, "--model", "digits", "--batch-size", "65"])
    assert too_big.exit_code == 3
    assert "batch_too_large" in too_big.output


def test_submit_local_wait_produces_the_outputs(
    aws_env: str, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN the CLI configured for the moto Batch queue and a prefix of 12 digits records
    settings = jobs_settings(aws_env, models_dir)
    for name in ("repository", "job_queue", "job_definition", "table"):
        monkeypatch.setenv(f"JOBS_{name.upper()}", str(getattr(settings, name)))
    monkeypatch.setenv("JOBS_PROVIDERS", '["CPUExecutionProvider"]')
    bucket = new_bucket()
    images = digits_images(models_dir)
    put_jsonl(bucket, "in/a.jsonl", [record(f"r{i}", image=images[i].tolist()) for i in range(12)])
    # WHEN submitted as a single (non-array) job, run here and waited for
    argv = ["submit", "--model", "digits", "--input", f"s3://{bucket}/in/"]
    argv += ["--output", f"s3://{bucket}/out/", "--shards", "1", "--local", "--wait"]
    result = runner.invoke(jobs_app, argv)
    # THEN it ends SUCCEEDED with every record out
    assert result.exit_code == 0, result.output
    assert '"state": "SUCCEEDED"' in result.output
    assert "the job: exit 0" in result.output
    assert [o["id"] for o in get_lines(bucket, "out/part-00000.jsonl")] == [
        f"r{i}" for i in range(12)
    ]
    # AND `status` reports the same
    job_id = json.loads(result.output[: result.output.index("\n}") + 2])["job"]["job_id"]
    status = runner.invoke(jobs_app, ["status", job_id])
    assert status.exit_code == 0, status.output
    assert json.loads(status.output)["records"] == 12


def test_submit_as_a_tenant_keeps_to_its_areas(
    aws_env: str, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN the CLI configured with the tenants' root, and tenant A's input
    settings = jobs_settings(aws_env, models_dir)
    for name in ("repository", "job_queue", "job_definition", "table"):
        monkeypatch.setenv(f"JOBS_{name.upper()}", str(getattr(settings, name)))
    bucket = new_bucket()
    monkeypatch.setenv("JOBS_TENANTS_ROOT", f"s3://{bucket}/tenants")
    a, b = (f"s3://{bucket}/tenants/{scope(t)}/" for t in ("tenant-a", "tenant-b"))
    images = digits_images(models_dir)
    key = a.split("/", 3)[3] + "in/a.jsonl"
    put_jsonl(bucket, key, [record(f"r{i}", image=images[i].tolist()) for i in range(3)])
    base = ["submit", "--model", "digits", "--input", f"{a}in/"]
    # WHEN tenant B submits over A's input, then A over its own
    refused = runner.invoke(jobs_app, [*base, "--output", f"{b}out/", "--tenant", "tenant-b"])
    accepted = runner.invoke(jobs_app, [*base, "--output", f"{a}out/", "--tenant", "tenant-a"])
    # THEN B's is refused as outside its area; A's job writes to a folder of its own
    assert refused.exit_code == 3
    assert "error (outside_tenant_area)" in refused.output
    assert accepted.exit_code == 0, accepted.output
    job = json.loads(accepted.output)["job"]
    assert job["output"] == f"{a}out/{job['job_id']}/"
    # AND only A's tenant (or the operator, without --tenant) sees it
    other = runner.invoke(jobs_app, ["status", job["job_id"], "--tenant", "tenant-b"])
    mine = runner.invoke(jobs_app, ["status", job["job_id"], "--tenant", "tenant-a"])
    operator = runner.invoke(jobs_app, ["status", job["job_id"]])
    assert (other.exit_code, mine.exit_code, operator.exit_code) == (1, 0, 0)
    assert "error (job_not_found)" in other.output
