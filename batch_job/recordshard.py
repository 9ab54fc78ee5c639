"""Running a shard of records as a pipeline: read and prepare, run, write.

Records come from a JSON Lines file (one per line), a staged infer request (one per
row) or a shard's image files (one per image); all take this one path. A reader thread
prepares each batch's records in one call (``OnnxModel.prepare_many``: one tokenising
pass for all their texts, each record's error its own), the batch runs on the calling
thread (``OnnxModel.run``), and a writer thread encodes it. ONNX Runtime releases the GIL
while it computes, so parsing, tokenising and JSON encoding overlap with the runs instead
of adding to them; bounded queues keep at most a few batches in memory. Outputs and
errors are written in input order.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Literal, TextIO

from batch_job.records import (
    MAX_RECORD_BYTES,
    Parsed,
    RecordError,
    image_input,
    image_records,
    jsonl_records,
    output_lines,
    staged_records,
    unique_ids,
)
from batch_job.shard import JobModel, OnBatch, ShardCounts, Tally, run_isolated
from spillway.models.processing import Prepared, Tensors
from spillway.protocol.errors import SpillwayError

Item = tuple[str | None, int | None, "Prepared | SpillwayError"]
"""A record on its way: id (if readable), place, and its prepared request or its error."""
Done = tuple[str | None, int | None, "Tensors | SpillwayError"]
Place = Literal["line", "row"]
_AHEAD = 2  # prepared batches waiting for the model
_END = None


class _Pipeline:
    def __init__(
        self,
        model: JobModel,
        outputs: TextIO,
        errors: TextIO,
        limit: int,
        tally: Tally,
        place: Place | None,
    ) -> None:
        self.model = model
        self.outputs = outputs
        self.errors = errors
        self.limit = limit
        self.tally = tally
        self.place = place
        self.batches: queue.Queue[list[Item] | None] = queue.Queue(maxsize=_AHEAD)
        self.stop = threading.Event()
        self.written: Future[tuple[int, int]] | None = None

    # --- reader thread -----------------------------------------------------------------

    def read(self, records: Iterable[Parsed]) -> None:
        """Prepare the records a batch at a time; hand each batch over when it is full."""
        parsed: list[Parsed] = []
        ready = 0
        for record in records:
            if self.stop.is_set():
                return
            self.tally.counts.records += 1
            parsed.append(record)
            ready += not isinstance(record[2], SpillwayError)  # every record is one row
            if ready >= self.limit:
                self._hand_over(self._prepare(parsed))
                parsed, ready = [], 0
        if parsed:
            self._hand_over(self._prepare(parsed))
        self._hand_over(_END)

    def _prepare(self, parsed: list[Parsed]) -> list[Item]:
        tensors = [p for _, _, p in parsed if not isinstance(p, SpillwayError)]
        prepared = iter(self.model.prepare_many(tensors))
        return [
            (rid, place, p if isinstance(p, SpillwayError) else next(prepared))
            for rid, place, p in parsed
        ]

    def _hand_over(self, items: list[Item] | None) -> None:
        while not self.stop.is_set():
            try:
                self.batches.put(items, timeout=0.1)
                return
            except queue.Full:
                continue

    # --- calling thread ----------------------------------------------------------------

    def run(self, reader: Future[None], writer: ThreadPoolExecutor) -> None:
        """Run batches as the reader hands them over, until it is done."""
        while True:
            try:
                items = self.batches.get(timeout=0.1)
            except queue.Empty:
                if reader.done():
                    reader.result()  # re-raises what stopped the reader
                    raise RuntimeError("the reader ended without finishing") from None
                continue
            if items is _END:
                break
            done = self._run(items)
            self.settle()
            self.written = writer.submit(self._write, done)
        self.settle()

    def _run(self, items: list[Item]) -> list[Done]:
        prepared = [p for _, _, p in items if isinstance(p, Prepared)]
        results: list[Tensors | SpillwayError] = []
        if prepared:
            results, failed = run_isolated(self.model, prepared)
            self.tally.counts.batches += 1
            self.tally.counts.batch_failures += int(failed)
        ran = iter(results)
        return [(rid, n, next(ran) if isinstance(p, Prepared) else p) for rid, n, p in items]

    def settle(self) -> None:
        """Wait for the batch being written; count it and report progress."""
        if self.written is not None:
            outputs, errors = self.written.result()
            self.written = None
            self.tally.counts.outputs += outputs
            self.tally.counts.errors += errors
            self.tally.report()

    # --- writer thread -----------------------------------------------------------------

    def _write(self, done: list[Done]) -> tuple[int, int]:
        ok = [(rid, r) for rid, _, r in done if not isinstance(r, SpillwayError)]
        lines = output_lines([str(rid) for rid, _ in ok], [r for _, r in ok], self.model.batching)
        self.outputs.writelines(f"{line}\n" for line in lines)
        for rid, place, result in done:
            if isinstance(result, SpillwayError):
                where = {} if place is None or self.place is None else {self.place: place}
                self.errors.write(RecordError.of(result, rid, **where).to_json() + "\n")
        return len(ok), len(done) - len(ok)


def process_records(
    model: JobModel,
    records: Iterable[Parsed],
    place: Place | None,
    outputs: TextIO,
    errors: TextIO,
    batch_size: int,
    on_batch: OnBatch,
) -> ShardCounts:
    """Run every record; outputs and errors (placed by ``line`` or ``row``, or by id alone
    when ``place`` is ``None``) go to the two files; a repeated id is an error.
    ``records`` is consumed on a reader thread."""
    tally = Tally(on_batch)
    limit = batch_size if model.batching else 1
    pipeline = _Pipeline(model, outputs, errors, limit, tally, place)
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="records") as threads:
        reader = threads.submit(pipeline.read, unique_ids(records))
        try:
            pipeline.run(reader, threads)
        finally:
            pipeline.stop.set()  # a failed run must not leave the reader blocked
    tally.report()
    return tally.counts


def process_jsonl(
    model: JobModel,
    source: Path,
    outputs: TextIO,
    errors: TextIO,
    batch_size: int,
    on_batch: OnBatch,
    *,
    max_record_bytes: int = MAX_RECORD_BYTES,
) -> ShardCounts:
    """Run every record of a JSON Lines file; errors carry the record's line number. A
    line over ``max_record_bytes`` is an error record and is never read whole."""
    specs = {t.name: t for t in model.config.input}
    with source.open("rb") as lines:
        records = jsonl_records(lines, specs, model.batching, max_record_bytes)
        return process_records(model, records, "line", outputs, errors, batch_size, on_batch)


def process_staged(
    model: JobModel,
    source: Path,
    outputs: TextIO,
    errors: TextIO,
    batch_size: int,
    on_batch: OnBatch,
) -> ShardCounts:
    """Run every row of a staged infer request as a record ``"<row>"``; errors carry the
    row. The request is decoded on the reader thread."""
    records = staged_records(source.read_bytes(), model.batching)
    return process_records(model, records, "row", outputs, errors, batch_size, on_batch)


def process_images(
    model: JobModel,
    images: Iterable[tuple[str, Path | None, int]],
    outputs: TextIO,
    errors: TextIO,
    batch_size: int,
    on_batch: OnBatch,
    *,
    max_record_bytes: int = MAX_RECORD_BYTES,
) -> ShardCounts:
    """Run every image ``(key, file, size)`` as a record whose id is its key, its bytes
    the model's one BYTES input; errors carry the key."""
    spec = image_input(model.config.input)
    records = image_records(images, spec, model.batching, max_record_bytes)
    return process_records(model, records, None, outputs, errors, batch_size, on_batch)
