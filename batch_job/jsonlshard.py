"""Running one JSON Lines shard as a pipeline: read and prepare, run, write.

Each record is prepared on its own (``OnnxModel.prepare``) by a reader thread, runs in a
batch of ``batch_size`` rows on the calling thread (``OnnxModel.run``), and is encoded by
a writer thread. ONNX Runtime releases the GIL while it computes, so parsing, tokenising
and JSON encoding overlap with the runs instead of adding to them; bounded queues keep at
most a few batches in memory. Outputs and errors are written in input order.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, TextIO

from batch_job.records import RecordError, RecordInputError, output_lines, split_record, to_tensors
from batch_job.shard import BatchModel, OnBatch, ShardCounts, Tally, run_isolated
from spillway.errors import SpillwayError
from spillway.processing import Prepared, Tensors

Item = tuple[str | None, int, "Prepared | SpillwayError"]
"""A record on its way: id (if readable), line number, and its request or its error."""
Done = tuple[str | None, int, "Tensors | SpillwayError"]
_AHEAD = 2  # prepared batches waiting for the model
_END = None


class _Pipeline:
    def __init__(
        self, model: BatchModel, outputs: TextIO, errors: TextIO, limit: int, tally: Tally
    ) -> None:
        self.model = model
        self.specs = {t.name: t for t in model.config.input}
        self.outputs = outputs
        self.errors = errors
        self.limit = limit
        self.tally = tally
        self.batches: queue.Queue[list[Item] | None] = queue.Queue(maxsize=_AHEAD)
        self.stop = threading.Event()
        self.written: Future[tuple[int, int]] | None = None

    # --- reader thread -----------------------------------------------------------------

    def read(self, lines: BinaryIO) -> None:
        """Parse and prepare every record; hand over a batch whenever one is full."""
        items: list[Item] = []
        ready = 0
        for number, raw in enumerate(lines, 1):
            if self.stop.is_set():
                return
            if not raw.strip():
                continue
            items.append(self._prepare(raw, number))
            ready += isinstance(items[-1][2], Prepared)  # every record is one row
            if ready >= self.limit:
                self._hand_over(items)
                items, ready = [], 0
        if items:
            self._hand_over(items)
        self._hand_over(_END)

    def _prepare(self, raw: bytes, number: int) -> Item:
        self.tally.counts.records += 1
        record_id: str | None = None
        try:
            record_id, data = split_record(raw)
            inputs = to_tensors(data, self.specs, self.model.batching)
            return record_id, number, self.model.prepare(inputs)
        except SpillwayError as exc:
            if isinstance(exc, RecordInputError):
                record_id = exc.record_id
            return record_id, number, exc

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
        for rid, number, result in done:
            if isinstance(result, SpillwayError):
                self.errors.write(RecordError.of(result, rid, line=number).to_json() + "\n")
        return len(ok), len(done) - len(ok)


def process_jsonl(
    model: BatchModel,
    source: Path,
    outputs: TextIO,
    errors: TextIO,
    batch_size: int,
    on_batch: OnBatch,
) -> ShardCounts:
    """Run every record of a JSON Lines file; outputs and errors go to the two files."""
    tally = Tally(on_batch)
    pipeline = _Pipeline(model, outputs, errors, batch_size if model.batching else 1, tally)
    with (
        source.open("rb") as lines,
        ThreadPoolExecutor(max_workers=2, thread_name_prefix="jsonl") as threads,
    ):
        reader = threads.submit(pipeline.read, lines)
        try:
            pipeline.run(reader, threads)
        finally:
            pipeline.stop.set()  # a failed run must not leave the reader blocked
    tally.report()
    return tally.counts
