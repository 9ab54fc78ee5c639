"""Batch jobs end to end on the moto server: submit, run, read; bad records; kill/resume;
a staged infer request."""

from __future__ import annotations

import io
import signal
from pathlib import Path

import numpy as np
import pytest

from batch_job.plan import RunSpec
from batch_job.runner import run_job
from batch_job.service import JobService
from batch_job.settings import JobsSettings
from spillway.aws.clients import aws_client
from spillway.models.engine import OnnxModel
from spillway.protocol.codec import encode_request
from spillway.protocol.messages import JobRequest, stage_request
from spillway_cli.jobs_cli import LAUNCHER
from spillway_cli.local import procs
from spillway_cli.local.batch import run_local
from tests.fakes import eventually
from tests.integration.test_jobs_support import (
    committed,
    digits_images,
    get_lines,
    get_npy,
    ids_seen,
    jobs_settings,
    load_model,
    new_bucket,
    put_jsonl,
    record,
    snapshot,
)


@pytest.fixture
def settings(aws_env: str, models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> JobsSettings:
    monkeypatch.setenv("JOBS_PROVIDERS", '["CPUExecutionProvider"]')
    return jobs_settings(aws_env, models_dir)


@pytest.fixture(scope="module")
def digits(models_dir: Path) -> OnnxModel:
    return load_model(models_dir, "digits")


@pytest.fixture(scope="module")
def minilm(models_dir: Path) -> OnnxModel:
    return load_model(models_dir, "minilm")


def test_submitted_job_runs_as_array_children_and_matches_the_engine(
    settings: JobsSettings, digits: OnnxModel, models_dir: Path, tmp_path: Path
) -> None:
    # GIVEN two JSON Lines shards (one with bad records) and one .npy shard of digits
    images = digits_images(models_dir)
    bucket = new_bucket()
    good = [record(f"a{i}", image=images[i].tolist()) for i in range(20)]
    bad = ["{not json", record("short", image=[[1.0, 2.0]]), '{"data": {}}']
    put_jsonl(bucket, "in/a.jsonl", good[:10] + bad + good[10:])
    put_jsonl(
        bucket, "in/b.jsonl", [record(f"b{i}", image=images[20 + i].tolist()) for i in range(15)]
    )
    buffer = io.BytesIO()
    np.save(buffer, images[40:70])
    aws_client("s3").put_object(Bucket=bucket, Key="in/c.npy", Body=buffer.getvalue())
    service = JobService(settings)
    request = JobRequest(
        model="digits", input=f"s3://{bucket}/in/", output=f"s3://{bucket}/out/", shards=2
    )

    # WHEN it is submitted to Batch as a 2-child array and the children run locally
    job = service.submit_as_operator(request).job
    assert (job.shards_total, job.array_size) == (3, 2)
    runs = run_local(settings, str(job.batch_job_id), LAUNCHER, tmp_path / "logs")

    # THEN both children succeed and the status adds up every record
    assert [(r.index, r.exit_code) for r in runs] == [(0, 0), (1, 0)], runs
    status = service.status_as_operator(job.job_id)
    assert status.state == "SUCCEEDED"
    assert (status.shards_done, status.records, status.outputs, status.errors) == (3, 68, 65, 3)
    # AND JSON Lines outputs, in input order, equal the engine's own results
    out_a = get_lines(bucket, "out/part-00000.jsonl")
    out_b = get_lines(bucket, "out/part-00001.jsonl")
    assert [o["id"] for o in out_a + out_b] == [f"a{i}" for i in range(20)] + [
        f"b{i}" for i in range(15)
    ]
    expected = digits.infer({"image": images[:35]})
    np.testing.assert_array_equal([o["outputs"]["label"] for o in out_a + out_b], expected["label"])
    np.testing.assert_allclose(
        [o["outputs"]["probabilities"] for o in out_a + out_b],
        expected["probabilities"],
        atol=1e-6,
    )
    # AND the .npy shard's outputs equal the engine's, row for row
    arrays = {
        name: get_npy(bucket, f"out/part-00002.{name}.npy", tmp_path)
        for name in ("rows", "out-label", "out-probabilities")
    }
    np.testing.assert_array_equal(arrays["rows"], np.arange(30))
    reference = digits.infer({"image": images[40:70]})
    np.testing.assert_array_equal(arrays["out-label"], reference["label"])
    np.testing.assert_allclose(arrays["out-probabilities"], reference["probabilities"], atol=1e-6)
    # AND the three bad records are in the errors file with their reasons
    errors = get_lines(bucket, "out/part-00000.errors.jsonl")
    assert [(e["id"], e["code"], e["line"]) for e in errors] == [
        (None, "invalid_input", 11),
        ("short", "invalid_input", 12),
        (None, "invalid_input", 13),
    ]
    assert "shape" in errors[1]["error"]


def test_bad_text_records_land_in_errors_and_the_rest_matches(
    settings: JobsSettings, minilm: OnnxModel, models_dir: Path
) -> None:
    # GIVEN minilm records with an empty text, a number, a list of two and broken JSON
    bucket = new_bucket()
    texts = ["A cat sits on the mat.", "Stock markets fell sharply today.", "ok", "Ünïcödé!"]
    lines = [record(f"t{i}", text=t) for i, t in enumerate(texts)]
    lines[1:1] = [record("empty", text="   "), record("number", text=7)]
    lines += [record("two", text=["a", "b"]), '{"id": "cut", "data": {"text": "x"']
    put_jsonl(bucket, "in/texts.jsonl", lines)

    # WHEN the job runs with batches of 2
    spec = RunSpec("minilm", f"s3://{bucket}/in/", f"s3://{bucket}/out/", batch_size=2)
    result = run_job(spec, settings)

    # THEN the shard commits, the good records match the engine, the bad ones are errors
    assert (result.committed, result.failed) == (["part-00000"], {})
    outputs = get_lines(bucket, "out/part-00000.jsonl")
    assert [o["id"] for o in outputs] == ["t0", "t1", "t2", "t3"]
    alone = [minilm.infer({"text": np.array([[t.encode()]], dtype=object)}) for t in texts]
    for out, ref in zip(outputs, alone, strict=True):
        np.testing.assert_allclose(out["outputs"]["embedding"], ref["embedding"][0], atol=1e-5)
    errors = {e["id"]: e for e in get_lines(bucket, "out/part-00000.errors.jsonl")}
    assert set(errors) == {"empty", "number", "two", None}
    assert errors["empty"]["error"] == "text must not be empty"
    assert {e["code"] for e in errors.values()} == {"invalid_input"}


def test_killed_runner_resumes_with_every_record_exactly_once(
    settings: JobsSettings, models_dir: Path, tmp_path: Path
) -> None:
    # GIVEN three shards of 40 digits records and a runner that pauses after 64 records,
    # i.e. with shard 0 committed and shard 1 at 24 of 40
    images = digits_images(models_dir)
    bucket = new_bucket()
    for shard in range(3):
        rows = [record(f"s{shard}-{i}", image=images[shard * 40 + i].tolist()) for i in range(40)]
        put_jsonl(bucket, f"in/{shard}.jsonl", rows)
    argv = [*LAUNCHER, "run", "--repository", str(models_dir), "--model", "digits"]
    argv += ["--input", f"s3://{bucket}/in/", "--output", f"s3://{bucket}/out/"]
    argv += ["--batch-size", "8"]
    work = tmp_path / "work"
    env = {"SPILLWAY_FAULT_PAUSE_AFTER_RECORDS": "64", "JOBS_PROGRESS_INTERVAL_S": "0.2"}
    env["JOBS_WORK_DIR"] = str(work)
    child = procs.start("job-runner", argv, tmp_path, env)
    try:
        _wait_for_log(child, "fault injection: pausing", 90)
        # WHEN it is killed with SIGKILL in the middle of shard 1
        assert committed(bucket, "out/") == ["part-00000.json"]
        first = snapshot(
            bucket,
            [
                "out/part-00000.jsonl",
                "out/part-00000.errors.jsonl",
                "out/_committed/part-00000.json",
            ],
        )
        # No pause needed before the kill: a rewrite of the committed shard would rewrite
        # its marker, whose run_id (one per runner process) and timestamps would differ.
        child.signal(signal.SIGKILL)
        assert child.proc.wait(10) == -signal.SIGKILL
    finally:
        child.stop()
    assert committed(bucket, "out/") == ["part-00000.json"]
    assert [p.name.startswith("spillway-job-") for p in work.iterdir()] == [True]

    # AND the job runs again
    result = run_job(
        RunSpec("digits", f"s3://{bucket}/in/", f"s3://{bucket}/out/", None, 8),
        settings.model_copy(update={"work_dir": work}),
    )

    # THEN it skips the committed shard, redoes the interrupted one and does the last
    assert (result.skipped, result.committed) == (["part-00000"], ["part-00001", "part-00002"])
    assert committed(bucket, "out/") == [f"part-0000{i}.json" for i in range(3)]
    # AND the committed shard's objects were not touched
    assert snapshot(bucket, list(first)) == first
    # AND every record appears exactly once across outputs and errors
    seen = ids_seen(bucket, "out/", 3)
    assert seen == {f"s{s}-{i}": 1 for s in range(3) for i in range(40)}
    # AND nothing is left under the temporary prefix
    listed = aws_client("s3").list_objects_v2(Bucket=bucket, Prefix="out/_tmp/")
    assert listed.get("KeyCount", 0) == 0
    # AND the killed run's work folder is gone, the rerun's own too
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("binary", [False, True])
def test_a_staged_infer_request_runs_row_by_row_and_matches_the_engine(
    settings: JobsSettings, digits: OnnxModel, models_dir: Path, binary: bool
) -> None:
    # GIVEN 37 digits staged as one batch-mode infer request, as the router stages it
    images = digits_images(models_dir)[:37]
    bucket = new_bucket()
    body, header_length = encode_request({"image": images}, binary=binary)
    aws_client("s3").put_object(
        Bucket=bucket, Key="in/request.v2req", Body=stage_request(body, header_length)
    )

    # WHEN the job runs over it in batches of 8
    spec = RunSpec("digits", f"s3://{bucket}/in/", f"s3://{bucket}/out/", batch_size=8)
    result = run_job(spec, settings)

    # THEN the shard commits one output line per row, ids by row index, in order
    assert (result.committed, result.failed, result.records) == (["part-00000"], {}, 37)
    outputs = get_lines(bucket, "out/part-00000.jsonl")
    assert [o["id"] for o in outputs] == [str(i) for i in range(37)]
    assert get_lines(bucket, "out/part-00000.errors.jsonl") == []
    # AND the outputs equal the engine's own results for the whole request
    expected = digits.infer({"image": images})
    np.testing.assert_array_equal([o["outputs"]["label"] for o in outputs], expected["label"])
    np.testing.assert_allclose(
        [o["outputs"]["probabilities"] for o in outputs], expected["probabilities"], atol=1e-6
    )


def _wait_for_log(child: procs.Child, text: str, timeout_s: float) -> None:
    def logged_or_exited() -> bool:
        if child.proc.poll() is not None and text not in child.log_path.read_text(
            "utf-8", "replace"
        ):
            raise AssertionError(
                f"{text!r} not logged; exit {child.proc.poll()}:\n{child.log_tail()}"
            )
        return text in child.log_path.read_text(errors="replace")

    eventually(
        logged_or_exited, f"{text!r} in the runner's log", timeout_s=timeout_s, interval_s=0.1
    )
