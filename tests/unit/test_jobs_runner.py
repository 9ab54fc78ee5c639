"""Planning, commit and resume over a local folder store with a fake model."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from batch_job.plan import (
    Locations,
    Plan,
    RunSpec,
    ShardSpec,
    check_disjoint,
    ensure_plan,
    plan_shards,
)
from batch_job.progress import Progress
from batch_job.runner import BatchHook, JobRunner, remove_stale_work_dirs
from batch_job.settings import JobsSettings
from batch_job.storage import LocalStore, S3Store, open_location
from spillway.models.repository import LocalRepository
from spillway.protocol.codec import encode_request
from spillway.protocol.errors import BatchTooLargeError, InvalidInputError, JobConflictError
from spillway.protocol.messages import stage_request
from tests.unit.test_jobs_fakes import FakeModel, fake_config, line


class CrashBeforeMarker(LocalStore):
    """A store whose completion markers cannot be written: a crash at the commit point."""

    def put_bytes(self, key: str, data: bytes) -> None:
        if "/_committed/" in f"/{key}":
            raise OSError("disk gone")
        super().put_bytes(key, data)


def _inputs(root: Path, shards: int = 3, per_shard: int = 6) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        lines = [line(f"s{s}-{i}", [i, s]) for i in range(per_shard)]
        lines.insert(2, "{broken")
        (root / f"{s}.jsonl").write_text("\n".join(lines) + "\n")


def _runner(
    tmp_path: Path,
    model: FakeModel | None = None,
    batch: int | None = 4,
    on_batch: BatchHook | None = None,
) -> JobRunner:
    spec = RunSpec("fake", str(tmp_path / "in"), str(tmp_path / "out"), 1, batch)
    where = Locations.of(spec)
    plan = plan_shards(where.input, "", spec.input, "fake", 1)
    settings = JobsSettings(progress_bar=False, work_dir=tmp_path)
    return JobRunner(spec, settings, plan, model or FakeModel(), where, on_batch)


def _seen(out: Path, shards: int) -> list[str]:
    ids = []
    for s in range(shards):
        for name in (f"part-{s:05d}.jsonl", f"part-{s:05d}.errors.jsonl"):
            ids += [json.loads(x)["id"] or "?" for x in (out / name).read_text().splitlines()]
    return ids


def test_a_run_commits_every_shard_with_outputs_errors_and_manifest(tmp_path: Path) -> None:
    # GIVEN three shards of 6 good records and one broken line each
    _inputs(tmp_path / "in")
    # WHEN the job runs
    result = _runner(tmp_path).run(list(_runner(tmp_path).plan.shards))
    # THEN every shard is committed and its marker holds the manifest
    assert (result.committed, result.failed, result.records) == (
        ["part-00000", "part-00001", "part-00002"],
        {},
        21,
    )
    out = tmp_path / "out"
    marker = json.loads((out / "_committed" / "part-00001.json").read_text())
    assert marker == json.loads((out / "part-00001.manifest.json").read_text())
    assert (marker["records"], marker["outputs"], marker["errors"]) == (7, 6, 1)
    assert (marker["model"], marker["model_version"], marker["batch_size"]) == ("fake", 1, 4)
    # AND each record is in outputs or errors exactly once; no temporary keys remain
    assert sorted(_seen(out, 3)) == sorted(
        ["?"] * 3 + [f"s{s}-{i}" for s in range(3) for i in range(6)]
    )
    assert not [p for p in (out / "_tmp").rglob("*") if p.is_file()]


def test_a_crash_before_the_marker_leaves_the_shard_uncommitted_and_a_rerun_fixes_it(
    tmp_path: Path,
) -> None:
    # GIVEN a run whose commit dies just before writing the markers
    _inputs(tmp_path / "in", shards=2)
    crashing = _runner(tmp_path)
    crashing.out_store = CrashBeforeMarker(tmp_path / "out")
    first = crashing.run(list(crashing.plan.shards))
    # THEN both shards failed, their final objects exist but count for nothing
    assert set(first.failed) == {"part-00000", "part-00001"}
    assert (tmp_path / "out" / "part-00000.jsonl").is_file()
    assert not (tmp_path / "out" / "_committed").exists()
    # WHEN the job runs again
    rerun = _runner(tmp_path)
    second = rerun.run(list(rerun.plan.shards))
    # THEN both are committed from scratch and nothing is duplicated
    assert second.committed == ["part-00000", "part-00001"]
    ids = _seen(tmp_path / "out", 2)
    assert sorted(ids) == sorted(["?"] * 2 + [f"s{s}-{i}" for s in range(2) for i in range(6)])


def test_committed_shards_are_skipped_untouched(tmp_path: Path) -> None:
    # GIVEN a finished job
    _inputs(tmp_path / "in", shards=2)
    runner = _runner(tmp_path)
    runner.run(list(runner.plan.shards))
    out = tmp_path / "out"
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("part-*")}
    # WHEN it runs again
    model = FakeModel()
    again = _runner(tmp_path, model).run(list(runner.plan.shards))
    # THEN nothing ran and no object changed
    assert (again.skipped, again.committed, model.runs) == (["part-00000", "part-00001"], [], [])
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("part-*")} == before


def test_a_resumed_shard_whose_input_changed_fails_and_committed_shards_stay(
    tmp_path: Path,
) -> None:
    # GIVEN a job whose first run committed shard 0 only, its plan frozen
    _inputs(tmp_path / "in", shards=2)
    runner = _runner(tmp_path)
    shards = list(runner.plan.shards)
    assert runner.run(shards[:1]).committed == ["part-00000"]
    out = tmp_path / "out"
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    # AND shard 1's input is then replaced by another file
    replacement = tmp_path / "new.jsonl"
    replacement.write_text(line("other", [1, 1]) + "\n")
    replacement.replace(tmp_path / "in" / "1.jsonl")
    # WHEN the job is resumed with the same plan
    model = FakeModel()
    result = _runner(tmp_path, model).run(shards)
    # THEN shard 1 fails, saying its input changed; nothing of it ran or was written
    assert (result.skipped, result.committed) == (["part-00000"], [])
    assert list(result.failed) == ["part-00001"]
    assert result.failed["part-00001"].startswith("InputChangedError: ")
    assert "1.jsonl changed since the job was planned" in result.failed["part-00001"]
    assert model.runs == []
    # AND the committed shard's objects are untouched
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    assert after == before


def _dead_pid() -> int:
    """The PID of a process that has exited."""
    argv = [sys.executable, "-c", "import os; print(os.getpid())"]
    child = subprocess.run(argv, capture_output=True, text=True, check=True)
    return int(child.stdout)


def test_work_folders_of_gone_runs_are_removed_at_the_next_start(tmp_path: Path) -> None:
    # GIVEN the work folder of a killed run, one of a live process, and an unknown one
    work = tmp_path / "work"
    dead = work / f"spillway-job-{_dead_pid()}-x1"
    live = work / f"spillway-job-{os.getppid()}-x2"
    unknown = work / "spillway-job-abc"
    for folder in (dead, live, unknown):
        (folder / "in").mkdir(parents=True)
        (folder / "in" / "part-00000").write_bytes(b"x" * 1000)
    # WHEN a run starts with that work dir
    _inputs(tmp_path / "in", shards=1)
    spec = RunSpec("fake", str(tmp_path / "in"), str(tmp_path / "out"), 1, 4)
    where = Locations.of(spec)
    plan = plan_shards(where.input, "", spec.input, "fake", 1)
    settings = JobsSettings(progress_bar=False, work_dir=work)
    result = JobRunner(spec, settings, plan, FakeModel(), where).run(list(plan.shards))
    # THEN the dead run's folder is gone, the others stay, and the run left none of its own
    assert result.committed == ["part-00000"]
    assert sorted(p.name for p in work.iterdir()) == sorted([live.name, unknown.name])
    # AND a sweep of what is left removes nothing
    assert remove_stale_work_dirs(work) == []


def test_batch_size_above_the_model_limit_is_refused(tmp_path: Path) -> None:
    _inputs(tmp_path / "in", shards=1)
    with pytest.raises(BatchTooLargeError):
        _runner(tmp_path, FakeModel(fake_config(max_batch_size=4)), batch=5)


def test_plan_takes_one_shard_per_input_file_in_key_order(tmp_path: Path) -> None:
    # GIVEN inputs among files that are not inputs
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    names = ("b.jsonl", "a.ndjson", "sub/c.npy", "e.v2req", "_SUCCESS.jsonl", ".x.jsonl", "d.txt")
    for name in names:
        (root / name).write_text("{}\n")
    (root / "empty.jsonl").write_text("")
    # WHEN planned
    plan = plan_shards(LocalStore(root), "", str(root), "fake", 2)
    # THEN only the inputs count, sorted by key, with their format
    assert [(s.index, s.key, s.format) for s in plan.shards] == [
        (0, "a.ndjson", "jsonl"),
        (1, "b.jsonl", "jsonl"),
        (2, "e.v2req", "staged"),
        (3, "sub/c.npy", "npy"),
    ]


def test_array_children_share_shards_round_robin() -> None:
    shards = tuple(ShardSpec(index=i, key=f"{i}.jsonl", format="jsonl", size=1) for i in range(5))
    plan = Plan(input="s3://b/in/", model="m", model_version=1, shards=shards, created_at="t")
    assert [s.index for s in plan.assigned(1, 2)] == [1, 3]
    assert [s.index for s in plan.assigned(4, None)] == [4]
    assert [s.index for s in plan.assigned(None, None)] == [0, 1, 2, 3, 4]
    with pytest.raises(InvalidInputError):
        plan.assigned(2, 2)


def test_an_output_prefix_holding_another_job_is_refused(tmp_path: Path) -> None:
    # GIVEN a job over in/ committed to out/
    _inputs(tmp_path / "in", shards=1)
    repo_root = tmp_path / "repo"
    for model in ("fake", "other"):
        (repo_root / model / "1").mkdir(parents=True)
        (repo_root / model / "1" / "SHA256SUMS").write_text("")
    spec = RunSpec("fake", str(tmp_path / "in"), str(tmp_path / "out"), 1)
    ensure_plan(spec, LocalRepository(repo_root), Locations.of(spec))
    # WHEN another model's job names the same output prefix
    other = RunSpec("other", spec.input, spec.output, 1)
    # THEN it is a conflict
    with pytest.raises(JobConflictError):
        ensure_plan(other, LocalRepository(repo_root), Locations.of(other))


@pytest.mark.parametrize(
    ("a", "b"),
    [("s3://b/in/", "s3://b/in/out/"), ("s3://b/x", "s3://b/x/"), ("s3://b/", "s3://b/o")],
)
def test_input_and_output_must_not_nest(a: str, b: str) -> None:
    with pytest.raises(InvalidInputError):
        check_disjoint(a, b)


@pytest.mark.parametrize(
    "bad", ["s3://", "s3:///key", "s3://b/x", "s3://Bucket/x", "s3://bucket\\x", "http://bucket/x"]
)
def test_bad_locations_are_refused(bad: str) -> None:
    with pytest.raises(InvalidInputError):
        open_location(bad, client=object())


@pytest.mark.parametrize(
    ("location", "prefix"),
    [
        ("s3://bucket", ""),
        ("s3://bucket/", ""),
        ("s3://bucket/in", "in/"),
        ("s3://bucket/a/b/", "a/b/"),
    ],
)
def test_an_s3_prefix_is_a_folder(location: str, prefix: str) -> None:
    store, got = open_location(location, client=object())
    assert isinstance(store, S3Store)
    assert (store.bucket, got) == ("bucket", prefix)


def test_a_staged_request_shard_commits_its_rows_as_json_lines(tmp_path: Path) -> None:
    # GIVEN an input prefix holding one staged infer request of 5 rows (binary)
    (tmp_path / "in").mkdir()
    x = np.stack([np.arange(5, dtype=np.float32), np.full(5, 0.5, np.float32)], axis=1)
    staged = stage_request(*encode_request({"x": x}, binary=True))
    (tmp_path / "in" / "request.v2req").write_bytes(staged)
    # WHEN the job runs
    runner = _runner(tmp_path, batch=2)
    result = runner.run(list(runner.plan.shards))
    # THEN the shard is committed with one output line per row, ids by row index
    assert (result.committed, result.records) == (["part-00000"], 5)
    out = tmp_path / "out"
    lines = [json.loads(x) for x in (out / "part-00000.jsonl").read_text().splitlines()]
    assert [(o["id"], o["outputs"]["y"]) for o in lines] == [(str(i), [i + 0.5]) for i in range(5)]
    assert (out / "part-00000.errors.jsonl").read_text() == ""
    marker = json.loads((out / "_committed" / "part-00000.json").read_text())
    assert (marker["format"], marker["records"], marker["batches"]) == ("staged", 5, 3)


def test_the_batch_hook_sees_every_record_with_earlier_shards_committed(tmp_path: Path) -> None:
    # GIVEN two shards of 7 records (one broken) and a hook that records what it is told
    _inputs(tmp_path / "in", shards=2)
    calls: list[tuple[int, int, list[str]]] = []

    def hook(runner: JobRunner, records: int, errors: int) -> None:
        runner.wait_for_commit()
        committed = sorted(p.name for p in (tmp_path / "out" / "_committed").glob("*.json"))
        calls.append((records, errors, committed))

    # WHEN the job runs with it
    runner = _runner(tmp_path, on_batch=hook)
    runner.run(list(runner.plan.shards))
    # THEN it was called after each batch, the counts add up to every record and error
    assert sum(r for r, _, _ in calls) == 14
    assert sum(e for _, e, _ in calls) == 2
    # AND once it waited, the shard before the current one was committed
    assert calls[-1][2] == ["part-00000.json"]


def test_progress_logs_at_the_interval_and_at_each_shard(caplog: pytest.LogCaptureFixture) -> None:
    # GIVEN progress with a 10 s interval on a fake clock
    now = [0.0]
    progress = Progress(2, 10.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="spillway.jobs.progress")
    progress.start_shard("part-00000", 100)
    # WHEN records finish before and after the interval, then the shard ends
    now[0] = 5.0
    progress.advance(40, 1)
    assert caplog.messages == []
    now[0] = 10.0
    progress.advance(60, 2)
    progress.finish_shard()
    # THEN one line came at the interval and one at the shard's end, with done/total
    assert len(caplog.messages) == 2
    assert (
        "0/2 shards done; part-00000 100/100 records; 100 records, 3 errors" in caplog.messages[0]
    )
    assert caplog.messages[1].startswith("progress: 1/2 shards done")
    assert progress.rate() == pytest.approx(10.0)
