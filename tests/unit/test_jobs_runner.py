"""Planning, commit and resume over a local folder store with a fake model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from batch_job.errors import JobConflictError
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
from batch_job.runner import JobRunner
from batch_job.settings import JobsSettings
from batch_job.storage import LocalStore, split_location
from spillway.errors import BatchTooLargeError, InvalidInputError
from spillway.repository import LocalRepository
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


def _runner(tmp_path: Path, model: FakeModel | None = None, batch: int | None = 4) -> JobRunner:
    spec = RunSpec("fake", str(tmp_path / "in"), str(tmp_path / "out"), 1, batch)
    where = Locations.of(spec)
    plan = plan_shards(where.input, "", spec.input, "fake", 1)
    settings = JobsSettings(progress_bar=False, work_dir=tmp_path)
    return JobRunner(spec, settings, plan, model or FakeModel(), where)


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


def test_batch_size_above_the_model_limit_is_refused(tmp_path: Path) -> None:
    _inputs(tmp_path / "in", shards=1)
    with pytest.raises(BatchTooLargeError):
        _runner(tmp_path, FakeModel(fake_config(max_batch_size=4)), batch=5)


def test_plan_takes_one_shard_per_input_file_in_key_order(tmp_path: Path) -> None:
    # GIVEN inputs among files that are not inputs
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    for name in ("b.jsonl", "a.ndjson", "sub/c.npy", "_SUCCESS.jsonl", ".x.jsonl", "d.txt"):
        (root / name).write_text("{}\n")
    (root / "empty.jsonl").write_text("")
    # WHEN planned
    plan = plan_shards(LocalStore(root), "", str(root), "fake", 2)
    # THEN only the inputs count, sorted by key, with their format
    assert [(s.index, s.key, s.format) for s in plan.shards] == [
        (0, "a.ndjson", "jsonl"),
        (1, "b.jsonl", "jsonl"),
        (2, "sub/c.npy", "npy"),
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


@pytest.mark.parametrize("bad", ["s3://", "s3:///key", "s3://b/../x", "http://b/x", "b/x"])
def test_unsafe_locations_are_refused(bad: str) -> None:
    with pytest.raises(InvalidInputError):
        split_location(bad)


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
