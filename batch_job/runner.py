"""The job container's work: run this child's shards, skip committed ones, commit atomically.

A shard's outputs, errors and manifest are written to local files, uploaded to temporary
keys (``<output>/_tmp/…``), copied to their final keys, and only then is the completion
marker written: the marker is the commit point. A crash anywhere before it leaves the
shard uncommitted, and the next run redoes it from scratch, overwriting whatever the
crashed run left, so every input record ends up exactly once in outputs or errors.
The next shard's input downloads while the current one computes, checked against the
ETag the plan recorded: a resumed job never reads an input that changed under it.

Shard files live in a work folder ``spillway-job-<pid>-…``; a run first removes the
folders of runs whose process is gone (a SIGKILL skips every cleanup).

A run is a ``spillway.batch.job`` span, each shard a ``spillway.batch.shard`` span in it,
of the trace the submitting request named (the job's ``TRACEPARENT``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from batch_job.manifest import ShardManifest
from batch_job.npyshard import process_npy
from batch_job.plan import Locations, Plan, RunSpec, ShardSpec, ensure_plan
from batch_job.progress import Progress
from batch_job.recordshard import process_images, process_jsonl, process_staged
from batch_job.settings import JobsSettings
from batch_job.shard import JobModel, OnBatch, ShardCounts, count_records
from spillway import tracing
from spillway.models.repository import ModelRepository, open_repository
from spillway.protocol.errors import BatchTooLargeError

log = logging.getLogger("spillway.jobs.runner")


@dataclass
class RunResult:
    """Shards this run committed, found committed, and failed (name -> reason)."""

    committed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    records: int = 0
    seconds: float = 0.0


BatchHook = Callable[["JobRunner", int, int], None]
"""Called with the runner after each batch with the records and errors finished since the
last call (local runs and tests inject faults here)."""


def load_model(repository: ModelRepository, settings: JobsSettings, plan: Plan) -> JobModel:
    """The plan's pinned model version (not whatever ``version_policy`` serves today),
    fetched with checksum verification, opened and warmed by the core's loader. A
    pipeline runs each step once per batch of records over its step models."""
    # onnxruntime only in the container: the submission side never imports these.
    from spillway.models.engine import EngineOptions
    from spillway.models.loader import load_version
    from spillway.pipelines.serving import load_pipeline_version

    options = EngineOptions(
        providers=settings.providers, intra_op_threads=settings.intra_op_threads
    )
    config = repository.read_config(plan.model)
    if config.is_pipeline:
        from spillway.pipelines.stepcache import CacheSettings, open_cache
        from spillway.protocol.wire import read_tenant_scope

        cache = open_cache(CacheSettings.from_env())
        return load_pipeline_version(
            repository,
            config,
            plan.model_version,
            settings.cache_dir,
            options,
            cache,
            scope=read_tenant_scope(settings.tenant_scope),  # the job tenant's cache entries
        )
    return load_version(repository, config, plan.model_version, settings.cache_dir, options)


class JobRunner:
    """Runs the shards assigned to this process, one at a time, each committed alone."""

    def __init__(
        self,
        spec: RunSpec,
        settings: JobsSettings,
        plan: Plan,
        model: JobModel,
        where: Locations,
        on_batch: BatchHook | None = None,
    ) -> None:
        self.spec = spec
        self.settings = settings
        self.plan = plan
        self.model = model
        self.in_store = where.input
        self.out_store = where.output
        self.layout = where.layout
        self.batch_size = _batch_size(model, spec.batch_size or settings.batch_size)
        self.run_id = uuid.uuid4().hex
        self._on_batch = on_batch
        self._pending: tuple[ShardSpec, ShardManifest, Future[None]] | None = None

    def wait_for_commit(self) -> None:
        """Block until the commit in flight, if any, is done (its outcome is recorded
        later, in order)."""
        if self._pending is not None:
            wait([self._pending[2]])

    def committed(self, shard: ShardSpec) -> bool:
        """Whether the shard's completion marker exists."""
        return self.out_store.head(self.layout.marker(shard)) is not None

    def run(self, shards: list[ShardSpec]) -> RunResult:
        """Run every uncommitted shard; a failed shard does not stop the others.

        While a shard computes, the next one's input downloads and the previous one
        commits (two I/O threads); commits still complete in shard order.
        """
        result = RunResult()
        todo = [s for s in shards if not self.committed(s)]
        result.skipped = [s.name for s in shards if s not in todo]
        if result.skipped:
            log.info("skipping %d committed shards: %s", len(result.skipped), result.skipped)
        progress = Progress(
            len(todo), self.settings.progress_interval_s, bar=self.settings.progress_bar
        )
        started = time.monotonic()
        work = _make_work_dir(self.settings.work_dir)
        with ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="job-io", initializer=_background
        ) as pool:
            downloads: dict[int, Future[Path]] = {}
            for position, shard in enumerate(todo):
                if position + 1 < len(todo):
                    following = todo[position + 1]
                    downloads[following.index] = pool.submit(self._download, following, work)
                try:
                    with _shard_span(shard) as span:
                        source = downloads.pop(shard.index, None)
                        path = source.result() if source else self._download(shard, work)
                        manifest = self._compute(shard, path, work, progress)
                        span.set("spillway.batch.records", manifest.records)
                        span.set("spillway.batch.errors", manifest.errors)
                except Exception as exc:
                    # One shard's failure must not lose the others; the child exits
                    # non-zero and Batch retries it, skipping what is committed by then.
                    log.exception("shard %s failed", shard.name)
                    self._failed(result, shard, exc, work)
                    continue
                self._settle(result, progress, work)
                self._pending = (shard, manifest, pool.submit(self._commit, shard, work, manifest))
            self._settle(result, progress, work)
        progress.close()
        shutil.rmtree(work, ignore_errors=True)
        result.seconds = time.monotonic() - started
        return result

    def _settle(self, result: RunResult, progress: Progress, work: Path) -> None:
        """Wait for the commit in flight, if any, and record how it went."""
        if self._pending is None:
            return
        shard, manifest, commit = self._pending
        self._pending = None
        try:
            commit.result()
        except Exception as exc:
            log.exception("shard %s failed to commit", shard.name)
            self._failed(result, shard, exc, work)
        else:
            _clean(work, shard)
            result.committed.append(shard.name)
            result.records += manifest.records
            progress.finish_shard()

    def _failed(self, result: RunResult, shard: ShardSpec, error: Exception, work: Path) -> None:
        _clean(work, shard)
        result.failed[shard.name] = f"{type(error).__name__}: {error}"

    def _download(self, shard: ShardSpec, work: Path) -> Path:
        path = work / "in" / shard.name
        if shard.format != "images":
            self.in_store.download(shard.key, path, shard.etag)
            return path
        # A folder of the shard's images, each named by its place; one over the record
        # limit is not downloaded (its record is an error).
        path.mkdir()
        for place, image in enumerate(shard.images):
            if image.size <= self.settings.max_record_bytes:
                self.in_store.download(image.key, path / f"{place:05d}", image.etag)
        return path

    def _compute(
        self, shard: ShardSpec, source: Path, work: Path, progress: Progress
    ) -> ShardManifest:
        """Run a shard's records into local outputs and errors files; its manifest."""
        started_at, started = _now(), time.monotonic()
        total = len(shard.images) if shard.images else count_records(source, shard.format)
        progress.start_shard(shard.name, total)
        stem = work / "out" / shard.name  # every file here is committed as <prefix><name>
        out_path = stem.with_name(f"{shard.name}.jsonl")
        err_path = stem.with_name(f"{shard.name}.errors.jsonl")

        def on_batch(records: int, errors: int) -> None:
            progress.advance(records, errors)
            if self._on_batch is not None:
                self._on_batch(self, records, errors)

        with err_path.open("w", encoding="utf-8") as errors:
            if shard.format == "npy":
                counts = process_npy(self.model, source, stem, errors, self.batch_size, on_batch)
            else:
                with out_path.open("w", encoding="utf-8") as outputs:
                    counts = self._process_records(shard, source, outputs, errors, on_batch)
        if counts.records != counts.outputs + counts.errors:
            raise RuntimeError(f"{shard.name}: {counts} does not add up; not committing")
        files = [self.layout.key(p.name) for p in sorted(stem.parent.glob(f"{shard.name}.*"))]
        return self._manifest(shard, counts, files, started_at, time.monotonic() - started)

    def _process_records(
        self,
        shard: ShardSpec,
        source: Path,
        outputs: TextIO,
        errors: TextIO,
        on_batch: OnBatch,
    ) -> ShardCounts:
        if shard.format == "staged":
            return process_staged(self.model, source, outputs, errors, self.batch_size, on_batch)
        if shard.format == "images":
            files = [source / f"{place:05d}" for place in range(len(shard.images))]
            images = [
                (image.key, path if path.exists() else None, image.size)
                for image, path in zip(shard.images, files, strict=True)
            ]
            return process_images(
                self.model,
                images,
                outputs,
                errors,
                self.batch_size,
                on_batch,
                max_record_bytes=self.settings.max_record_bytes,
            )
        return process_jsonl(
            self.model,
            source,
            outputs,
            errors,
            self.batch_size,
            on_batch,
            max_record_bytes=self.settings.max_record_bytes,
        )

    def _manifest(
        self,
        shard: ShardSpec,
        counts: ShardCounts,
        files: list[str],
        started_at: str,
        seconds: float,
    ) -> ShardManifest:
        attempt = os.environ.get("AWS_BATCH_JOB_ATTEMPT", "")
        return ShardManifest(
            shard=shard.name,
            input=self.in_store.url(shard.key),
            input_etag=shard.etag,
            format=shard.format,
            model=self.plan.model,
            model_version=self.plan.model_version,
            records=counts.records,
            outputs=counts.outputs,
            errors=counts.errors,
            batch_size=self.batch_size,
            batches=counts.batches,
            batch_failures=counts.batch_failures,
            files=files,
            started_at=started_at,
            finished_at=_now(),
            seconds=round(seconds, 3),
            records_per_s=round(counts.records / seconds, 1) if seconds > 0 else 0.0,
            run_id=self.run_id,
            batch_job_id=os.environ.get("AWS_BATCH_JOB_ID"),
            attempt=int(attempt) if attempt.isdigit() else None,
        )

    def _commit(self, shard: ShardSpec, work: Path, manifest: ShardManifest) -> None:
        """Temporary keys, then final keys, then the marker: the commit point."""
        store, layout = self.out_store, self.layout
        body = manifest.model_dump_json(indent=2).encode()
        finals = [*manifest.files, layout.manifest(shard)]
        for key in manifest.files:
            store.upload(work / "out" / key.removeprefix(layout.prefix), layout.temp(key))
        store.put_bytes(layout.temp(finals[-1]), body)
        for key in finals:
            store.copy(layout.temp(key), key)
        store.put_bytes(layout.marker(shard), body)  # the commit point
        store.delete([layout.temp(key) for key in finals])
        log.info(
            "committed %s: %d records, %d outputs, %d errors in %.1f s",
            shard.name,
            manifest.records,
            manifest.outputs,
            manifest.errors,
            manifest.seconds,
        )


def _shard_span(shard: ShardSpec) -> tracing.Span_:
    """A shard's download and compute (its commit runs on an I/O thread, after it)."""
    attributes = {"spillway.batch.shard": shard.name, "spillway.batch.format": shard.format}
    return tracing.span("spillway.batch.shard", attributes=attributes)


def _batch_size(model: JobModel, requested: int | None) -> int:
    limit = model.config.max_batch_size
    if not model.batching:
        return 1
    if requested is not None and requested > limit:
        raise BatchTooLargeError(f"batch size {requested} exceeds max_batch_size {limit}")
    return requested or limit


def _background() -> None:
    """Run this I/O thread at a lower priority than the model's threads (Linux)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


WORK_PREFIX = "spillway-job-"


def _make_work_dir(base: Path | None) -> Path:
    """A fresh work folder named after this process, once stale ones are gone."""
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    root = base if base is not None else Path(tempfile.gettempdir())
    remove_stale_work_dirs(root)
    # The PID is in the name from the start: no window where a folder has no owner.
    work = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-", dir=root))
    (work / "in").mkdir()
    (work / "out").mkdir()
    return work


def remove_stale_work_dirs(root: Path) -> list[Path]:
    """Remove the work folders under ``root`` whose owning process is gone; the removed."""
    removed = []
    for folder in root.glob(f"{WORK_PREFIX}*"):
        pid = folder.name.removeprefix(WORK_PREFIX).split("-", 1)[0]
        # Folders without a PID (older runners) are left alone: their owner is unknown.
        if not folder.is_dir() or not pid.isdigit() or _alive(int(pid)):
            continue
        log.info("removing the work folder %s of a run that is gone", folder)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    # Our own PID counts as alive: local runs start several runners in one process.
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _clean(work: Path, shard: ShardSpec) -> None:
    source = work / "in" / shard.name
    if source.is_dir():  # an images shard's folder
        shutil.rmtree(source, ignore_errors=True)
    else:
        source.unlink(missing_ok=True)
    for leftover in (work / "out").glob(f"{shard.name}.*"):
        leftover.unlink(missing_ok=True)


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def run_job(
    spec: RunSpec,
    settings: JobsSettings,
    repository: str | None = None,
    on_batch: BatchHook | None = None,
) -> RunResult:
    """Plan (or read the plan), load the model, and run this child's shards, as a
    ``spillway.batch.job`` span of the submitting request's trace (``settings.trace``).

    A process whose tracing nothing set up yet sets it up here (``spillway-batch``) and
    sends its spans before the run returns; one set up already (the CLI's, a test's) is
    left as it is."""
    owned = not tracing.enabled() and tracing.configure("spillway-batch")
    attributes = {
        "spillway.model": spec.model,
        "spillway.tenant_scope": settings.tenant_scope,
        "spillway.batch.array_index": settings.array_index,
        "spillway.batch.array_size": settings.array_size,
        "spillway.batch.job_id": os.environ.get("AWS_BATCH_JOB_ID"),
    }
    try:
        with (
            tracing.carry(settings.trace()),
            tracing.span("spillway.batch.job", kind="consumer", attributes=attributes) as span,
        ):
            result = _run(spec, settings, repository, on_batch)
            span.set("spillway.batch.committed", len(result.committed))
            span.set("spillway.batch.skipped", len(result.skipped))
            span.set("spillway.batch.failed", len(result.failed))
            span.set("spillway.batch.records", result.records)
            if result.failed:
                span.fail(f"{len(result.failed)} shard(s) failed")
            return result
    finally:
        if owned:
            tracing.shutdown()


def _run(
    spec: RunSpec, settings: JobsSettings, repository: str | None, on_batch: BatchHook | None
) -> RunResult:
    repo = open_repository(repository or settings.repository)
    where = Locations.of(spec)
    plan = ensure_plan(spec, repo, where)
    shards = plan.assigned(settings.array_index, settings.array_size)
    log.info(
        "job %s v%d: %d of %d shards for this child (array index %s of %s)",
        plan.model,
        plan.model_version,
        len(shards),
        len(plan.shards),
        settings.array_index,
        settings.array_size,
    )
    if all(where.output.head(where.layout.marker(s)) is not None for s in shards):
        log.info("every shard of this child is committed already")
        return RunResult(skipped=[s.name for s in shards])
    model = load_model(repo, settings, plan)
    return JobRunner(spec, settings, plan, model, where, on_batch).run(shards)
